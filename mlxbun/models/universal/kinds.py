"""The kinds a descriptor row chooses from: one enum per branch point of the universal graph.

Each member's comment says what the graph does for it; `schema.py` turns a
row's strings into these members, and `dense.py` dispatches on them through
tables that `exhaustive` checks at import, so no forward path has an
"unknown kind" branch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from enum import Enum
from typing import Any

try:
    from enum import StrEnum
except ImportError:  # Python 3.10 (mlxbun supports it): the same str-valued enum, by hand
    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return self.value


class QKV(StrEnum):
    SEPARATE = "separate"  # q_proj, k_proj, v_proj
    FUSED = "fused"  # one projection split [q | k | v] (phi3, lille-130m)
    FUSED_NEOX = "fused_neox"  # one projection, per-head interleaved q/k/v (gpt_neox)
    FUSED_GROUPED = "fused_grouped"  # one projection, kv-group major: per KV head its H/KV query
    # heads, then its key, then its value (internlm2's wqkv)


class HeadDim(StrEnum):
    OR_SPLIT = "or_split"  # head_dim field, else hidden // heads
    SPLIT = "split"  # hidden // heads
    FIELD = "field"  # the head_dim field


class QKNormKind(StrEnum):
    RMS = "rms"
    GEMMA_RMS = "gemma_rms"
    FUNCTIONAL_RMS = "functional_rms"  # parameter-free rms_norm (nanochat)
    LAYERNORM_2D = "layernorm2d"  # cohere: one LayerNorm weight per head
    LAYERNORM_PER_HEAD = "layernorm_per_head"  # stablelm: a LayerNorm module per head


class QKNormAt(StrEnum):
    FLAT = "flat"  # on the projections, before the head reshape (olmo2: width heads * head_dim)
    HEADS = "heads"  # after the reshape to [B, L, heads, head_dim]
    HEADS_TRANSPOSED = "heads_transposed"  # after the transpose to [B, heads, L, head_dim]
    AFTER_ROPE = "after_rope"  # on the rotated queries / keys


class AttnScale(StrEnum):
    HEAD_DIM = "head_dim"  # head_dim**-0.5
    QPAS_INV_SQRT = "qpas_inv_sqrt"  # 1.0 / (query_pre_attn_scalar ** 0.5)
    QPAS_POW = "qpas_pow"  # query_pre_attn_scalar ** -0.5
    SQRT_INV = "sqrt_inv"  # math.sqrt(1 / head_dim)
    ATTENTION_MULTIPLIER = "attention_multiplier"  # the field itself
    INV_SQRT = "inv_sqrt"  # 1 / math.sqrt(head_dim) (gpt_oss)


class AttnKind(StrEnum):
    SDPA = "sdpa"
    SOFTCAP = "softcap"  # eager attention with tanh-capped scores (gemma2)
    SDPA_F32_IF_F16 = "sdpa_f32_if_f16"  # cohere2: float16 queries run in float32
    SDPA_Q_F32 = "sdpa_q_f32"  # phi: queries in float32, output cast to the values' dtype
    SDPA_QK_F32 = "sdpa_qk_f32"  # stablelm: queries and keys in float32


class AttnOutGate(StrEnum):
    """A gate on the attention output (the heads concatenated, before o_proj)."""

    SIGMOID = "sigmoid"  # o * sigmoid(gate_proj(x)), gate_proj Linear(D, H * hd) (afmoe)
    HEAD_SIGMOID = "head_sigmoid"  # per head: o[B, L, H, hd] * sigmoid(g_proj(x))[..., None],
    # g_proj Linear(D, H) (step3p5)
    HEAD_SIGMOID_F32 = "head_sigmoid_f32"  # per head: o * sigmoid(g_proj(x) in float32) cast to o's
    # dtype, [..., None]; g_proj Linear(D, H) with the attention's bias (spark2_5)
    HEAD_SOFTPLUS = "head_softplus"  # per head: o[B, L, H, hd] * softplus(g_proj(x) in float32),
    # cast to o's dtype, [..., None]; g_proj Linear(D, H) (laguna)
    QUERY_SIGMOID = "query_sigmoid"  # o * sigmoid(gate), the gate the second half of each head of
    # q_proj (Linear(D, 2 * H * hd), per head [q | gate]); no gate module (qwen3_next, qwen3_5)


class QueryScale(StrEnum):
    LLAMA4 = "llama4"  # ministral3: position-dependent query scale


class RopeKind(StrEnum):
    INITIALIZE = "initialize"  # rope_utils.initialize_rope (scaling dict selects the class)
    PHI3 = "phi3"  # phi3.py builds its rope by hand (su/longrope, linear)
    NEMOTRON = "nemotron"  # nn.RoPE with a linear scale
    HUNYUAN_ALPHA = "hunyuan_alpha"  # NTK-alpha scaled base
    NANOCHAT = "nanochat"  # negated exp-built frequencies, a function not a child module
    SU_SCALED = "su_scaled"  # phimoe: nn.RoPE when rope_scaling is null, else SuScaledRoPE with
    # the dict's short/long factors and mscales (whatever its type)
    LAYER_TYPE_PARAMS = "layer_type_params"  # mellum: rope_parameters[layer_types[i]] gives the
    # base and rope_type; default / linear: plain nn.RoPE (no scaling), else initialize_rope
    PER_LAYER_LISTS = "per_layer_lists"  # step3p5: rope_theta a number or a per-layer list,
    # dims int(hd * partial_rotary_factors[i]), rope_scaling only on yarn_only_types layers
    LAYER_TYPE_PARTIAL = "layer_type_partial"  # laguna: (rope_parameters or {}).get(layer_types[i])
    # or {}: base its rope_theta (10000.0), dims int(hd * its partial_rotary_factor, else the
    # partial_rotary_factor field, else 1), initialize_rope with the rest (rope_type default if unset)
    LAYER_TYPE_PLAIN = "layer_type_plain"  # spark2_5: rope_parameters[layer_types[i]]: nn.RoPE of
    # int(hd * its partial_rotary_factor (1.0)) dims, base float(its rope_theta (10000.0)); no scaling


class NopeRule(StrEnum):
    NO_ROPE_LAYERS = "no_rope_layers"  # smollm3: the per-layer no_rope_layers flags
    GLOBAL_LAYERS = "global_layers"  # cohere2, exaone4: rope only on sliding layers
    SLIDING_OR_ALL = "sliding_or_all"  # exaone_moe: rope on sliding layers; on every layer when
    # no layer slides (the rope child exists only where it runs)
    ALL = "all"  # no layer ropes (nemotron_h's attention); no rope field read
    NOPE_TYPE = "nope_type"  # no layer ropes when position_embedding_type is "nope"
    # (granitemoehybrid)
    ZERO_THETA = "zero_theta"  # muse_glimmer: rope (at rope_theta) iff layer_rope_theta[i] is nonzero


class MlpKind(StrEnum):
    GATED = "gated"  # down(act(gate(x)) * up(x))
    GATED_FUSED = "gated_fused"  # one gate_up projection, split in two
    PLAIN = "plain"  # down(act(up(x)))


class Act(StrEnum):
    SILU = "silu"  # compiled swiglu
    SILU_EAGER = "silu_eager"  # nn.silu(gate) * x, not fused (olmo_hybrid's MLP)
    GELU = "gelu"
    GELU_APPROX = "gelu_approx"  # tanh approximation
    RELU_SQUARED = "relu_squared"  # nemotron's compiled relu(x)**2
    RELU2 = "relu2"  # nn.relu2 (nanochat)
    XIELU = "xielu"  # apertus: the XieLU module (it has parameters)


GATED_ACTS = (Act.SILU, Act.GELU, Act.GELU_APPROX, Act.SILU_EAGER)
FUSED_ACTS = (Act.SILU,)
PLAIN_ACTS = (Act.GELU, Act.GELU_APPROX, Act.RELU_SQUARED, Act.RELU2, Act.XIELU)


class MlpSize(StrEnum):
    FOUR_X_HIDDEN = "4x_hidden"  # gpt_neox: 4 * hidden_size
    LFM2 = "lfm2"  # block_ff_dim; if block_auto_adjust_ff_dim: int(2 * ff / 3), times
    # block_ffn_dim_multiplier (int) when set, rounded up to a multiple of block_multiple_of
    LILLE = "lille"  # 256 * round(int(8 * hidden / 3) / 256)
    HALF_INTERMEDIATE = "half_intermediate"  # qwen: intermediate_size // 2
    SCALED_HIDDEN = "scaled_hidden"  # afm7: int(hidden_dim * hidden_dim_scale_factor)
    MAKE_DIVISIBLE = "make_divisible"  # openelm, per layer: int(make_divisible(ffn_multipliers[i] *
    # hidden, ffn_dim_divisor)) (LayerSpec.width; the model-wide width is layer 0's)


class NormKind(StrEnum):
    RMS = "rms"
    GEMMA_RMS = "gemma_rms"  # x * (1 + weight)
    LAYERNORM = "layernorm"
    LAYERNORM1P = "layernorm1p"  # nemotron: weight + 1
    FUNCTIONAL_RMS = "functional_rms"  # parameter-free, eps 1e-5 (nanochat)
    OFFSET_RMS = "offset_rms"  # plamo3: x * (weight + offset), the offset per slot from norm.offsets
    # (a NormSlot value or "final"; 1.0 where it names none)


class NormSlot(StrEnum):
    """The four places a block can hold a norm; values are `NormNames` field names."""

    PRE_ATTN = "pre_attn"
    POST_ATTN = "post_attn"
    PRE_MLP = "pre_mlp"
    POST_MLP = "post_mlp"


class BlockKind(StrEnum):
    PRE = "pre"  # x + attn(norm(x)); h + mlp(norm(h))
    SANDWICH = "sandwich"  # x + norm(attn(norm(x))); h + norm(mlp(norm(h)))
    POST = "post"  # x + norm(attn(x)); h + norm(mlp(h))


# Slots in module-tree order (the order mlx-lm's __init__ assigns them).
BLOCK_SLOTS: Mapping[BlockKind, tuple[NormSlot, ...]] = {
    BlockKind.PRE: (NormSlot.PRE_ATTN, NormSlot.PRE_MLP),
    BlockKind.SANDWICH: tuple(NormSlot),
    BlockKind.POST: (NormSlot.POST_ATTN, NormSlot.POST_MLP),
}


class ParallelMlpNorm(StrEnum):
    SHARED = "shared"  # the MLP reads the attention's normed input (cohere, phi, stablelm)
    OWN = "own"  # the MLP has its own pre-norm (gpt_neox)


class ParallelSum(StrEnum):
    ATTN_FF_X = "attn_ff_x"  # attn + ff + x
    X_ATTN_FF = "x_attn_ff"  # x + attn + ff


class Residual(StrEnum):
    PLAIN = "plain"  # x + r
    SCALED = "scaled"  # x + r * residual_scale
    CLIP_F16 = "clip_f16"  # gemma3: float16 adds in float32, clipped to the float16 range


class ResidualScale(StrEnum):
    MINICPM_DEPTH = "minicpm_depth"  # scale_depth / num_hidden_layers ** 0.5


class EmbedScale(StrEnum):
    SQRT_HIDDEN = "sqrt_hidden"  # h * hidden_size ** 0.5
    SQRT_HIDDEN_BF16 = "sqrt_hidden_bf16"  # the factor rounded to bfloat16 first (gemma3)
    SQRT_HIDDEN_MUP = "sqrt_hidden_mup"  # afmoe: h * math.sqrt(hidden_size) iff mup_enabled


class TieRule(StrEnum):
    CHECKPOINT = "checkpoint"  # tied iff the checkpoint has no head weight (gemma3_text)


class TiedOp(StrEnum):
    AS_LINEAR = "as_linear"  # embed.as_linear(h)
    MATMUL = "matmul"  # h @ embed.weight.T


class PreDivide(StrEnum):
    WIDTH_RATIO = "width_ratio"  # minicpm: h / (hidden_size / dim_model_base), untied only


class PostOp(StrEnum):
    DIV = "div"
    MUL = "mul"
    TIED_MUL_RATIO = "tied_mul_ratio"  # falcon_h1: a tied head's logits * (by / POST_OVER's field),
    # the Python ratio; an untied head is not scaled (its multiplier is folded into the weights)


POST_OVER = {PostOp.TIED_MUL_RATIO: "embedding_multiplier"}  # the field a ratio divides by


class FinalSoftcap(StrEnum):
    NONE = "none"
    FIELD = "field"  # gemma2: tanh(x / c) * c with c = final_logit_softcapping (None: no cap)
    COMPILED = "compiled"  # nanochat: the compiled 15 * tanh(x / 15)


COMPILED_SOFTCAP = 15.0  # the cap of nanochat's compiled softcap


class LayerKinds(StrEnum):
    ALL_FULL = "all_full"
    LAYER_TYPES = "layer_types"  # sliding iff layer_types[i] == "sliding_attention"
    LAYER_TYPES_OLMO3 = "layer_types_olmo3"  # sliding iff layer_types[i] != "full_attention"
    PERIOD = "period"  # every period-th layer global (gemma3, cohere2)
    EXAONE = "exaone"  # pattern string of L (local) and G (global), repeated
    LAYER_TYPES_OR_EVEN = "layer_types_or_even"  # step3p5: sliding iff layer_types[i] ==
    # "sliding_attention" (the list may be longer); without layer_types, the even layers
    HYBRID_PATTERN = "hybrid_pattern"  # mimo_v2_flash: sliding iff hybrid_layer_pattern[i] == 1;
    # both kinds present (mlx-lm takes each mask from the first layer of its kind)


class KVShare(StrEnum):
    """Cross-layer KV sharing: layers that take another layer's key/value projections."""

    CLA = "cla"  # hunyuan: with use_cla, layer i projects k/v iff i % cla_share_factor == 0; the
    # others have no k_proj / v_proj and take the last projecting layer's k_proj(x), v_proj(x) of
    # this forward's tokens (pre-reshape), then rope / norm them and fill their OWN cache; the
    # attention and the block return (output, kv projections), as mlx-lm's do


class MakeCache(StrEnum):
    DEFAULT = "default"  # make_prompt_cache's default: a KVCache per layer
    ROTATING_SLIDING = "rotating_sliding"  # the file's make_cache: RotatingKVCache on sliding layers


# ----------------------------------------------------------------- mixture of experts


class RouterKind(StrEnum):
    """How a router turns gate logits into (chosen experts, their weights); `moe.py`'s `_ROUTE`."""

    SOFTMAX_TOPK = "softmax_topk"  # softmax(precise) over all experts, top-k, optional renorm
    # (qwen*_moe, olmoe, deepseek, hunyuan, mellum)
    TOPK_SOFTMAX = "topk_softmax"  # top-k of the logits, precise softmax over those k (mixtral)
    TOPK_SOFTMAX_F32 = "topk_softmax_f32"  # top-k of the logits, softmax of them in float32 (granitemoe)
    NOAUX_TC = "noaux_tc"  # compiled: sigmoid(f32) + correction bias, grouped top-k, renorm, scale
    # (deepseek-v3 style: glm4_moe, dots1)
    GROUPED_SCORE = "grouped_score"  # compiled: softmax or sigmoid (f32) scores, optional correction
    # bias, grouped top-k (last k), renorm by sum + 1e-20, scale, cast to the logits' dtype (bailing_moe)
    SPARSEMIXER = "sparsemixer"  # phimoe: k rounds of argmax, each weighted by a precise softmax
    # over the logits within 2 * jitter_eps (relative) of the round's max; the chosen masked -inf
    F32_ACT_TOPK = "f32_act_topk"  # ernie4_5_moe: softmax or sigmoid (GateAct) of the float32
    # logits, top-k, renormalized by max(sum, 1e-12)
    SIGMOID_CORRECTED = "sigmoid_corrected"  # minimax: sigmoid of the logits + correction bias
    # for the choice, top-k of the plain sigmoid renormalized by sum + 1e-20, cast to x's dtype
    SIGMOID_EPS = "sigmoid_eps"  # compiled: sigmoid(f32) + router bias, top-k, renorm by
    # (sum + 1e-20) with no k > 1 guard, scale (step3p5)
    SIGMOID_BIASED = "sigmoid_biased"  # sigmoid(f32); top-k of sigmoid + expert bias; the k
    # sigmoid scores, optional renorm (no k > 1 guard), cast to the input's dtype (Klear)
    CAPPED_SCORE = "capped_score"  # laguna: float32 logits, tanh softcap when softcap > 0, score
    # (ScoreFunc), + correction bias for the choice, top-k, the k scores renormalized by their sum
    SIGMOID_SCALED = "sigmoid_scaled"  # lfm2_moe: sigmoid of the logits (their dtype); top-k
    # (select) of it, or of its float32 + the expert bias when there is one; the k sigmoid scores,
    # optional renorm by sum + 1e-6, times scaling, cast to the input's dtype
    SCORED_GROUPED = "scored_grouped"  # uncompiled: sigmoid or softmax (the score_func field) in
    # f32, + expert bias, grouped top-k if n_group > 1, renorm if k > 1, scale (afmoe)
    SOFTMAX_GROUP_GREEDY = "softmax_group_greedy"  # deepseek_v2: precise softmax; group_limited_greedy
    # zeroes the n_group - topk_group groups with the lowest max; top-k, times scaling (no renorm)
    SOFTMAX_GROUPED = "softmax_grouped"  # mistral4, compiled: softmax(f32), grouped (top-2 sums) if
    # n_group > 1, top-k, renorm by (sum + 1e-20) with no k > 1 guard, times scaling


# The numbers each router kind reads, by the name its routing function uses; a row maps each
# to a ModelArgs field (or a literal) in `RouterKnobs.params`, checked when the row is built.
ROUTER_PARAMS: Mapping[RouterKind, tuple[str, ...]] = {
    RouterKind.SOFTMAX_TOPK: (),
    RouterKind.TOPK_SOFTMAX: (),
    RouterKind.TOPK_SOFTMAX_F32: (),
    RouterKind.NOAUX_TC: ("scaling", "n_group", "topk_group"),  # routed_scaling_factor, ...
    RouterKind.GROUPED_SCORE: ("scaling", "n_group", "topk_group", "score"),  # score: "sigmoid" or
    # anything else (softmax), bailing_moe's score_function
    RouterKind.SPARSEMIXER: ("jitter_eps",),  # router_jitter_noise
    RouterKind.F32_ACT_TOPK: ("act",),  # moe_gate_act: a GateAct value (ROUTER_PARAM_KINDS)
    RouterKind.SIGMOID_CORRECTED: (),
    RouterKind.SIGMOID_EPS: ("scaling",),  # moe_router_scaling_factor
    RouterKind.SIGMOID_BIASED: (),
    RouterKind.SIGMOID_SCALED: ("scaling",),  # routed_scaling_factor
    RouterKind.SCORED_GROUPED: ("score_func", "scaling", "n_group", "topk_group"),  # afmoe:
    # score_func ("sigmoid", anything else softmax), route_scale, n_group, topk_group
    RouterKind.CAPPED_SCORE: ("softcap", "score_fn"),  # moe_router_logit_softcapping,
    # moe_router_score_func (a ScoreFunc: ROUTER_PARAM_KINDS)
    RouterKind.SOFTMAX_GROUP_GREEDY: ("method", "scaling", "n_group", "topk_group"),  # topk_method
    # (a TopkMethod: ROUTER_PARAM_KINDS), routed_scaling_factor, n_group, topk_group
    RouterKind.SOFTMAX_GROUPED: ("scaling", "n_group", "topk_group"),
}

# the router kinds that add a per-expert correction bias to the scores they choose by (where
# RouterKnobs.corrected says it exists; RouterKnobs.bias_at says which module holds it)
CORRECTED_ROUTERS = (RouterKind.NOAUX_TC, RouterKind.GROUPED_SCORE, RouterKind.SIGMOID_CORRECTED,
                     RouterKind.SIGMOID_BIASED, RouterKind.SCORED_GROUPED, RouterKind.SIGMOID_EPS,
                     RouterKind.CAPPED_SCORE, RouterKind.SIGMOID_SCALED)


class BiasAt(StrEnum):
    """Which module holds a corrected router's per-expert bias (`MoENames.correction_bias`)."""

    ROUTER = "router"  # the router module (deepseek-v3 style MoEGate: glm4_moe, dots1)
    BLOCK = "block"  # the MoE block itself, beside the gate (minimax; Klear, afmoe: `expert_bias`)


class TopkMethod(StrEnum):
    """softmax_group_greedy: deepseek_v2's topk_method (any value but group_limited_greedy is greedy)."""

    GREEDY = "greedy"  # HF's default
    GREADY = "gready"  # mlx-lm's default spelling (greedy)
    GROUP_LIMITED_GREEDY = "group_limited_greedy"


class GateAct(StrEnum):
    """f32_act_topk: the activation over the float32 gate logits (ernie's moe_gate_act)."""

    SOFTMAX = "softmax"  # nn.Softmax: mx.softmax(x, axis=-1), not precise
    SIGMOID = "sigmoid"  # nn.Sigmoid


class ScoreFunc(StrEnum):
    """capped_score: the scores of the float32 (capped) logits (laguna's moe_router_score_func)."""

    SIGMOID = "sigmoid"  # mx.sigmoid
    SQRTSOFTPLUS = "sqrtsoftplus"  # mx.sqrt(nn.softplus(logits))


# Router numbers that are a kind rather than a number: resolved into the enum member, a config
# value outside it refused naming the field (mlx-lm raises ValueError there).
ROUTER_PARAM_KINDS: Mapping[str, type[StrEnum]] = {"act": GateAct, "score_fn": ScoreFunc,
                                                   "method": TopkMethod}


class TopKSelect(StrEnum):
    """The top-k op (the index order it leaves is the order the expert outputs are summed in)."""

    NEG_FIRST = "neg_first"  # argpartition(-s, kth=k - 1)[..., :k]
    LAST = "last"  # argpartition(s, kth=-k)[..., -k:]


class TopKRenorm(StrEnum):
    """noaux_tc: how the k weights are renormalized (when norm_topk says so)."""

    SUM = "sum"  # w / w.sum(-1) (glm4_moe, dots1)
    SUM_EPS = "sum_eps"  # w / (w.sum(-1) + 1e-20) (exaone_moe)


class GateKind(StrEnum):
    """Where the router's projection lives (its parameter paths are mlx-lm's)."""

    LINEAR = "linear"  # a Linear child of the MoE block (`gate`); routing in a parameter-free
    # `router` module that mlx-lm's tree does not have (taps see routing there)
    WEIGHT = "weight"  # the router module holds a raw `weight` [E, D]: logits = x @ weight.T
    NESTED = "nested"  # the router module holds a Linear child (granitemoe router.layer)
    WRAPPED = "wrapped"  # a module at `gate` holding the Linear `gate_inner` and returning its
    # logits (hunyuan's Gate); routing in a parameter-free `router` child, as LINEAR


class GroupGuard(StrEnum):
    """noaux_tc: when the grouped masking runs."""

    N_GROUP_GT_1 = "n_group_gt_1"  # if n_group > 1 (glm4_moe)
    K_NONZERO = "k_nonzero"  # if n_group - topk_group != 0 (dots1)
    # as N_GROUP_GT_1; ungrouped, the top k by argsort(s)[..., -k:] (mlx-vlm's deepseek_v3 copy in
    # kimi_vl: the experts summed in ascending score order)
    N_GROUP_GT_1_ARGSORT = "n_group_gt_1_argsort"


class Combine(StrEnum):
    """How the k expert outputs y [.., k, D] and weights s [.., k] are summed."""

    SUM = "sum"  # (y * s[..., None]).sum(axis=-2)
    SUM_CAST = "sum_cast"  # (y * s[..., None]).sum(axis=-2).astype(y.dtype)
    F32_SUM_CAST = "f32_sum_cast"  # (y * s[..., None].astype(float32)).sum(axis=-2).astype(y.dtype)
    SUM_CAST_COMPILED = "sum_cast_compiled"  # SUM_CAST in a shapeless mx.compile (bailing_moe)
    SUM_CAST_INPUT = "sum_cast_input"  # (y * s[..., None]).sum(axis=-2).astype(x.dtype), x the
    # block's input (laguna)


class ExpertKind(StrEnum):
    GLU = "glu"  # SwitchGLU: down(swiglu(gate(x), up(x))) per expert
    MLP_RELU2 = "mlp_relu2"  # SwitchMLP: down(relu2(up(x))) per expert, the names' up_proj /
    # down_proj its fc1 / fc2 (nemotron_h)
    MLP_GELU_APPROX = "mlp_gelu_approx"  # SwitchMLP: fc2(gelu_approx(fc1(x))) per expert, with mlx-lm's
    # SwitchMLP default activation nn.GELU(approx="precise") (phixtral)
    GLU_OAI = "glu_oai"  # gpt_oss: SwitchGLU with SwigluOAI, (clip(up, -l, l) + 1) * g * sigmoid(a * g),
    # g = min(gate, l); mlx-lm's constants a = 1.702, l = 7.0 (config swiglu_* not read)
    GLU_CLIPPED = "glu_clipped"  # SwitchGLU with mlx-vlm's clipped_silu: clip(g * sigmoid(g), -100, 100)
    # * up (its deepseek_v3 copy in kimi_vl, towers/kimi_vl_text.py)


class SharedKind(StrEnum):
    PLAIN = "plain"  # y + shared(x) (deepseek's shared_experts)
    SIGMOID_GATED = "sigmoid_gated"  # y + sigmoid(shared_gate(x)) * shared(x) (qwen2_moe)
    COEFFICIENT = "coefficient"  # c = softmax(coefficient(x), precise), coefficient Linear(D, 2)
    # with bias; y * c[..., :1] + shared(x) * c[..., 1:] (Klear)
    ROUTED_SCALED = "routed_scaled"  # y * <SharedKnobs.scale field> + shared(x) (laguna)


class SharedWhen(StrEnum):
    """When the shared expert exists, read from SharedKnobs.when (a field)."""

    NOT_NONE = "not_none"  # the field is not None (deepseek n_shared_experts)
    POSITIVE = "positive"  # the field is not None and > 0 (exaone_moe num_shared_experts,
    # ernie4_5_moe moe_num_shared_experts)
    POSITIVE_INT = "positive_int"  # the field > 0, an int (null refused: mlx-lm compares it with
    # 0 unguarded; afmoe num_shared_experts)


class SharedSize(StrEnum):
    MOE_TIMES_N = "moe_times_n"  # expert width * the shared-expert count field
    INTERMEDIATE_TIMES_N = "intermediate_times_n"  # int(intermediate_size * the count field) (hunyuan)
    SHARED_OR_MOE_TIMES_N = "shared_or_moe_times_n"  # (moe_shared_expert_intermediate_size or the
    # expert width) * the count field (bailing_moe)


class MoeLayers(StrEnum):
    """Which decoder layers hold the MoE block (the others a dense MLP), as the file decides."""

    ALL = "all"
    SPARSE_STEP = "sparse_step"  # i not in mlp_only_layers and experts > 0 and
    # (i + 1) % decoder_sparse_step == 0 (qwen3_moe)
    FIRST_K_DENSE = "first_k_dense"  # experts is not None and i >= first_k_dense_replace
    FIRST_K_DENSE_FREQ = "first_k_dense_freq"  # ... and i % moe_layer_freq == 0 (deepseek)
    IS_MOE_LAYER = "is_moe_layer"  # is_moe_layer[i], a per-layer bool list (exaone_moe)
    NOT_SINGLE_EXPERT = "not_single_expert"  # every layer, unless the expert count is 1 (then
    # none: hunyuan)
    START_END_INTERVAL = "start_end_interval"  # (i + 1) % moe_layer_interval == 0 and
    # start <= i <= end: moe_layer_start_index (min of a list), moe_layer_end_index (max of a
    # list; null: the last layer) (ernie4_5_moe)
    NUM_DENSE = "num_dense"  # i >= num_dense_layers (afmoe)
    ENUM_STRING = "enum_string"  # i in moe_layers_enum ("1,2,..."); unset: every layer but 0 (step3p5)
    FREQ_LIST = "freq_list"  # moe_layer_freq[i] == 1, a per-layer list (mimo_v2_flash)
    MLP_LAYER_TYPES = "mlp_layer_types"  # mlp_layer_types[i] == "sparse" (laguna)
    PATTERN_E = "pattern_e"  # hybrid_override_pattern[i] == "E" (nemotron_h's one-op MoE layers)
    OFFSET_PERIOD = "offset_period"  # experts > 1 and (i + expert_layer_offset) % expert_layer_period
    # == 0 (jamba)


class SwigluClamp(StrEnum):
    """Per-layer clamped SwiGLU: silu(gate) clipped above at limit, up clipped to +-limit."""

    PER_LAYER_LISTS = "per_layer_lists"  # step3p5: swiglu_limits[i] (routed experts),
    # swiglu_limits_shared[i] (shared expert and dense MLP); a missing / 0 / null limit: plain


class PostInit(StrEnum):
    """Named `ModelArgs.__post_init__` steps (implemented in resolve.py)."""

    KV_HEADS_DEFAULT = "kv_heads_default"
    LAYER_TYPES_FULL = "layer_types_full"
    REQUIRE_FULL_LAYER = "require_full_layer"
    LAYER_TYPES_OLMO3 = "layer_types_olmo3"
    OLMO3_REQUIRE_BOTH = "olmo3_require_both"
    SMOLLM3_NO_ROPE = "smollm3_no_rope"
    QWEN3_ROPE_PARAMETERS = "qwen3_rope_parameters"
    PHI3_ROPE_SCALING = "phi3_rope_scaling"
    INTERNLM3_ROPE_SCALING = "internlm3_rope_scaling"
    INTERNLM2_ROPE_SCALING = "internlm2_rope_scaling"  # rope_scaling needs factor and type, a
    # type of linear or dynamic
    NEMOTRON_ROPE_SCALING = "nemotron_rope_scaling"
    HUNYUAN_ROPE_SCALING = "hunyuan_rope_scaling"
    COHERE2_HEAD_DIM_CHECK = "cohere2_head_dim_check"
    SPLIT_HEAD_DIM_CHECK = "split_head_dim_check"
    NEOX_DIVISIBLE = "neox_divisible"
    MINISTRAL3_ROPE = "ministral3_rope"
    LINEAR_ROPE_SCALING = "linear_rope_scaling"  # qwen2_moe: rope_scaling needs factor and
    # type, type 'linear' only (validated, never applied)
    DEEPSEEK_ROPE_SCALING = "deepseek_rope_scaling"  # rope_scaling needs 'type'; linear: float factor
    GPT_OSS_LAYER_TYPES = "gpt_oss_layer_types"  # layer_types None: [sliding, full] * (n // 2);
    # both kinds present (mlx-lm takes each mask from the first layer of its kind)
    HUNYUAN_MOE_ROPE_SCALING = "hunyuan_moe_rope_scaling"  # hunyuan: rope_scaling needs factor
    # and type (post-init) and alpha (the attention reads it), so it cannot be null
    ROPE_PARAMETERS_THETA = "rope_parameters_theta"  # exaone_moe: rope_parameters["rope_theta"],
    # when present, replaces rope_theta
    PHIMOE_ROPE_SCALING = "phimoe_rope_scaling"  # a non-null rope_scaling needs short/long factors
    # and mscales (phimoe's attention reads the four keys)
    LAYER_TYPE_ROPES = "layer_type_ropes"  # mellum: layer_types full / sliding only, one per
    # layer, a full one, each with a rope_parameters entry holding rope_theta
    SCALING_NONE_ONE = "scaling_none_one"  # mimo_v2_flash: a null routed_scaling_factor reads 1.0
    LFM2_FF_DIM = "lfm2_ff_dim"  # block_ff_dim None: intermediate_size (one of them required)
    FULL_ATTN_IDXS = "full_attn_idxs"  # full_attn_idxs None: the layer_types[i] == "full_attention"
    # indices (one of them required)
    OLMO_HYBRID_ARGS = "olmo_hybrid_args"  # rope_parameters not None: rope_theta = its rope_theta
    # (10000.0 when absent; a null rope_theta refused: mlx-lm then runs without rope); layer_types
    # None: full_attention on i % 4 == 3, linear_attention elsewhere
    QWEN3_5_ROPE = "qwen3_5_rope"  # rope_parameters (when truthy): rope_type renamed type, then
    # partial_rotary_factor (0.25), rope_theta (100000.0) read from it, rope_scaling = it
    MAMBA2_STATE = "mamba2_state"  # ssm_state_size None: state_size; time_step_rank "auto":
    # ceil(hidden_size / 16)
    NEMOTRON_PATTERN = "nemotron_pattern"  # time_step_limit None: (0.0, inf); no
    # hybrid_override_pattern: layers_block_type (or layer_types) mapped to its chars;
    # num_hidden_layers = the pattern's length
    MISTRAL3_LLAMA_TEXT = "mistral3_llama_text"  # mistral3's wrapper: text_config's model_type
    # ministral3 / mistral4 build those files' text models (not llama's): refused by name
    ROPE_PARAMETERS_REQUIRED = "rope_parameters_required"  # glm_moe_dsa: rope_scaling = rope_parameters,
    # rope_theta = its rope_theta (both required)
    MISTRAL4_ROPE = "mistral4_rope"  # head dims defaulted; rope_parameters sets rope_theta (100000.0
    # when absent) and rope_scaling; it must hold llama_4_scaling_beta and original_max_position_embeddings
    LAGUNA_LISTS = "laguna_lists"  # mlp_layer_types None: dense then sparse; num_attention_heads_
    # per_layer None: num_attention_heads on every layer; both one entry per layer
    GEMMA4_TEXT = "gemma4_text"  # rope_parameters / layer_types defaults; KV sharing checked (gemma4_args)
    SLIDING_WINDOW_SETS_WINDOW_SIZE = "sliding_window_sets_window_size"  # plamo3: a sliding_window
    # that is not None replaces window_size
    SPARK2_5_ARGS = "spark2_5_args"  # layer_types None: 3 sliding then 1 full, repeated; one per layer,
    # sliding / full only, each with rope_parameters; heads divisible by KV heads; each rope's dims
    # int(head_dim * partial_rotary_factor) even and in 1..head_dim
    MAMBA_ARGS = "mamba_args"  # time_step_rank "auto": ceil(hidden_size / 16); model_type
    # falcon_mamba: use_bcdt_rms True
    JAMBA_ARGS = "jamba_args"  # mamba_dt_rank "auto": ceil(hidden_size / 16); layers_block_type
    # None: attention where i % attn_layer_period == attn_layer_offset, mamba elsewhere
    LOOP_NUM_TWO = "loop_num_two"  # iquestloopcoder: loop_num must be 2 (mlx-lm asserts it)
    NEMOTRON_NAS_BLOCKS = "nemotron_nas_blocks"  # block_configs parsed as mlx-lm's BlockConfig: one
    # per layer; attention / ffn entries of known keys; no-op / linear ones drop their sizes, active
    # attention needs a positive n_heads_in_group dividing the heads, active ffn an ffn_mult (rounded
    # to 6 places); a truthy rope_scaling needs factor and rope_type
    DBRX_CONFIGS = "dbrx_configs"  # attn_config needs kv_n_heads, clip_qkv, rope_theta; ffn_config
    # ffn_hidden_size, moe_num_experts, moe_top_k (mlx-lm's modules read them)
    PLAMO2_ARGS = "plamo2_args"  # mamba_enabled: mamba_step > 1 (mlx-lm asserts it)
    RECURRENT_GEMMA_BLOCKS = "recurrent_gemma_blocks"  # block_types None: _block_types; it must
    # hold an "attention" block (mlx-lm takes the mask from the first)
    NO_ROPE_LAYERS_LIST = "no_rope_layers_list"  # llama4_text: no_rope_layers must hold a flag per layer
    GEAR_ARGS = "gear_args"  # num_key_value_heads None: the heads; query_pre_attn_scalar None: head_dim;
    # layer_types None: all full, else one per layer; use_bidirectional_attention refused
    NANBEIGE_ARGS = "nanbeige_args"  # head_dim None: hidden // heads; enable_double_loop_split,
    # loop_share_kv and enable_depth_attention refused (mlx-lm raises NotImplementedError)
    QWEN_KV_CHANNELS = "qwen_kv_channels"  # kv_channels * num_attention_heads must be hidden_size
    # (mlx-lm's c_proj is Linear(hidden_size, kv_channels * heads), fed the heads' kv_channels dims)
    AFM7_ARGS = "afm7_args"  # 0 <= num_kv_reuse_layers < num_layers (the reuse layers read the last
    # regular layer's cache); heads divisible by KV heads
    MUSE_GLIMMER_ARGS = "muse_glimmer_args"  # rope_parameters' rope_theta replaces rope_theta; layer_types
    # None: 3 sliding then 1 full, repeated; layer_rope_theta None: 0 on full layers, else rope_theta
    MULTI_QUERY_KV_HEADS = "multi_query_kv_heads"  # gpt_bigcode: num_key_value_heads None: 1 if
    # multi_query else n_head; a value that disagrees is refused (mlx-lm's attention reads multi_query)


def kind_field(enum: type[StrEnum], default: Any = dataclasses.MISSING, *, or_field: bool = False,
               or_bool: bool = False):
    """A knob dataclass field holding a member of `enum`; None only where that is the default.
    The row's checks (`schema._check_kinds`) turn its string spelling into the member.

    or_field: the value may instead name a ModelArgs field; or_bool: it may be a literal bool.
    """
    return dataclasses.field(default=default, metadata={"kind": enum, "or_field": or_field,
                                                        "or_bool": or_bool, "optional": default is None})


def exhaustive(members: Iterable[StrEnum], table: dict) -> dict:
    """A dispatch table keyed by exactly `members` (an enum or some of its members).

    Checked at import, so dispatch never needs an 'unknown kind' branch.
    """
    want = set(members)
    if set(table) != want:
        raise TypeError(f"dispatch table keys {sorted(map(str, table))} != {sorted(map(str, want))}")
    return table


exhaustive(RouterKind, dict(ROUTER_PARAMS))
