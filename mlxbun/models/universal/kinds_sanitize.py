"""The sanitize steps a descriptor row lists (`schema.SanitizeRule.op`): each member's comment says
what `sanitize.py` does to the checkpoint's tensors, as the mlx-lm file's `sanitize` does."""

from __future__ import annotations

from mlxbun.models.universal.kinds import StrEnum

__all__ = ["SanitizeOp"]


class SanitizeOp(StrEnum):
    DROP_CONTAINING = "drop_containing"  # arg: substring
    DROP_SUFFIXES = "drop_suffixes"  # arg: tuple of suffixes
    DROP_TIED_HEAD = "drop_tied_head"
    NEOX_RENAME = "neox_rename"
    COPY_IF_MISSING = "copy_if_missing"  # arg: (dst, src)
    SQUEEZE_SUFFIXES = "squeeze_suffixes"  # arg: tuple of suffixes
    FP8_SCALE_INV = "fp8_scale_inv"
    STACK_EXPERTS = "stack_experts"  # arg: StackExperts; experts.N.<src>.<k> -> <switch>.<dst>.<k>
    SPLIT_GLU_EXPERTS = "split_glu_experts"  # granitemoe: input_linear -> gate_proj | up_proj,
    # output_linear -> down_proj (arg: (block name, switch name))
    DROP_LAYER_N = "drop_layer_n"  # keys starting "model.layers.{num_hidden_layers}" (MTP layer)
    DROP_LAYERS_FROM_N = "drop_layers_from_n"  # "<x>.layers.<i>..." with i >= N (glm4_moe_lite's MTP)
    DROP_PREFIX = "drop_prefix"  # arg: prefix (exaone_moe's "mtp." heads)
    HUNYUAN_FUSED = "hunyuan_fused"  # when layer 0 has mlp.gate_and_up_proj: every qkv_proj split
    # per kv head into q | k | v, every gate_and_up_proj into up | gate (hunyuan's original layout)
    NORM_HEAD = "norm_head"  # arg: the bool field; if set, lm_head.weight divided by its float32
    # column norms (axis 0) + 1e-7, cast back (bailing_moe)
    RENAME_IN_MOE_LAYERS = "rename_in_moe_layers"  # arg: ((src, dst), ...) under the MoE block of
    # each MoE layer: <layer>.<block>.<src> -> <layer>.<block>.<dst> (exaone_moe, bailing_moe)
    SPLIT_INTERLEAVED_EXPERTS = "split_interleaved_experts"  # gpt_oss: HF gate_up_proj rows
    # interleaved gate/up -> gate_proj | up_proj (weights, mxfp4 _blocks/_scales, biases)
    FP8_DEQUANT_BROADCAST = "fp8_dequant_broadcast"  # mistral4: every X_scale_inv: X from fp8 times
    # it (broadcast when it fits X, else per 128x128 block) as bfloat16; activation scales dropped
    FP8_BLOCK_DEQUANT = "fp8_block_dequant"  # minimax: each fp8 weight times its 128x128-block
    # weight_scale_inv, as bfloat16; the scales dropped (activation scales kept, as mlx-lm)
    STRIP_PREFIX = "strip_prefix"  # arg: prefix; when any key starts with it, those keys lose it
    # (laguna's repacked "language_model.")
    RENAME_SUBSTRINGS = "rename_substrings"  # arg: ((old, new), ...): every key holding old gets
    # it replaced by new, in order (lfm2_moe: w1.weight -> gate_proj.weight, ...)
    RENAME_PREFIXES = "rename_prefixes"  # arg: ((old, new), ...): a key starting with an old prefix
    # (the first that matches) gets it replaced by new (muse_glimmer's language_model nesting)
    SHARED_MLP_DENSE = "shared_mlp_dense"  # granitemoehybrid without experts: when layer 0 holds
    # shared_mlp.input_linear, each layer's [2I, D] split in two -> mlp.gate_proj | mlp.up_proj,
    # shared_mlp.output_linear -> mlp.down_proj
    CONV1D_LAYOUT = "conv1d_layout"  # arg: (substring, ConvLayout): the conv1d weights whose key
    # holds the substring go to mlx's layout when the test says they are in torch's
    NORM_PLUS_ONE = "norm_plus_one"  # arg: (suffixes, HfCheckpoint): when the test says the
    # checkpoint is transformers', its 1-D weights ending with a suffix + 1 (the (1 + w) RMSNorms
    # mlx-lm runs as plain RMSNorm: qwen3_next, qwen3_5)
    WRAPPER_KEYS = "wrapper_keys"  # arg: prefixes: qwen3_5's VLM wrapper: keys starting with one
    # dropped (the vision tower), HF's model.<wrapper> -> <wrapper>.<root>, the rest under <wrapper>
    SPLIT_GATE_UP_EXPERTS = "split_gate_up_experts"  # qwen3_5_moe: per layer, experts.gate_up_proj
    # [E, 2I, D] -> <switch>.gate_proj | up_proj, experts.down_proj -> <switch>.down_proj
    INT4_PACKED = "int4_packed"  # deepseek_v3: X.weight_shape present: X.weight_packed viewed
    # uint32 -> X.weight, X.weight_scale -> X.scales, X.biases = -8 * scales; other weight_scale /
    # weight_packed keys dropped
    SPLIT_KV_B = "split_kv_b"  # deepseek_v3: each layer's self_attn.kv_b_proj (dequantized when
    # quantized) split per head -> embed_q (k part, transposed) | unembed_out (v part), requantized
    FALCON_H1_MUP = "falcon_h1_mup"  # falcon_h1.sanitize: when layer 0's conv1d is in torch's layout,
    # the muP multipliers folded into the weights by key suffix (in its order) and every conv1d
    # transposed to mlx's layout; else nothing (mup.py)
    STEP3P5 = "step3p5"  # step3p5.sanitize: drop .mtp and layers >= num_hidden_layers, rename
    # HF moe.* / share_expert keys into mlp.*, norm weights + 1 when the checkpoint is HF's
    GEMMA4 = "gemma4"  # gemma4_text.sanitize (gemma4_sanitize.py); arg: gemma4's wrapper name or None
    DROP_PER_LAYER = "drop_per_layer"  # arg: key templates holding {i}: each dropped for every layer
    # index i < the row's layer count (gptj's transformer.h.{i}.attn.bias / masked_bias buffers)
    MOVE_IF_MISSING = "move_if_missing"  # arg: (dst, src): when src is present and dst is not, src
    # renamed dst (spark2_5's embed_tokens -> embedding)
    DBRX_EXPERTS = "dbrx_experts"  # arg: the expert-count path (ffn_config.moe_num_experts): every key
    # holding "experts.mlp" split in that many along axis 0 into ".mlp" -> ".<e>" keys + ".weight",
    # the w2 pieces transposed (dbrx.sanitize)
    ROW_NORM_HEAD = "row_norm_head"  # baichuan_m1: unless lm_head.scales is present, lm_head.weight
    # divided by its float32 row norms (axis -1) + 1e-7, cast back
    RESHAPE_TO_HEADS = "reshape_to_heads"  # arg: (substrings, head-dim field): every key holding one
    # reshaped to [hidden_size // head_dim, head_dim] (rwkv7's k_k / k_a / g_norm)
    GPT2 = "gpt2"  # gpt2.sanitize: for each layer i < n_layer, h.i.attn.bias dropped and h.i's
    # attn.c_attn / attn.c_proj / mlp.c_fc / mlp.c_proj weights transposed (Conv1D); then every key
    # not starting "model." gets that prefix
