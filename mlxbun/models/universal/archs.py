"""The descriptor table: one row per mlx-lm model_type that `UniversalDense` runs bit-exactly.

A row (`ArchDescriptor`) is declarative: which branch of each op the arch takes
(qk-norm kind and place, norm kind and placement, MLP shape, attention dispatch,
rope kind, head post-processing, ...), which mlx-lm `ModelArgs` fields it reads
with their defaults, the module names of the mlx-lm file (so parameter paths and
safetensors names are identical), and the `sanitize` rules of that file. The
model_type picks the row; nothing is sniffed from the config.

`resolve_args(descriptor, config)` reproduces `ModelArgs.from_dict` (+ its
`__post_init__`) and turns the row into concrete numbers (`UniversalArgs`).
Every value mlx-lm computes in python (scales, multipliers) is computed here
with the same python expression so the float is the same.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from mlxbun.errors import ConfigError

REQUIRED = "<required>"  # a ModelArgs field without a default


# ----------------------------------------------------------------- descriptor parts


@dataclass(frozen=True)
class Names:
    """mlx-lm attribute names: they are the parameter paths and the safetensors keys."""

    root: str = "model"  # Model.<root> holds embed / layers / final norm
    embed: str = "embed_tokens"
    layers: str = "layers"
    final_norm: str | None = "norm"
    head: str = "lm_head"
    attn: str = "self_attn"
    mlp: str = "mlp"
    q: str = "q_proj"
    k: str = "k_proj"
    v: str = "v_proj"
    o: str = "o_proj"
    qkv: str = "qkv_proj"  # fused projection (phi3, lille-130m, gpt_neox)
    gate: str = "gate_proj"
    up: str = "up_proj"  # the input projection of a plain 2-layer MLP too
    down: str = "down_proj"
    gate_up: str = "gate_up_proj"
    # (pre-attention, post-attention, pre-mlp, post-mlp) block norms; None = slot unused
    norms: tuple[str | None, str | None, str | None, str | None] = (
        "input_layernorm", None, "post_attention_layernorm", None)
    inner_norm: str = "norm"  # lille-130m: the pre-norm lives inside attention / mlp
    act: str = "act_fn"  # apertus: the XieLU module (it has parameters)


@dataclass(frozen=True)
class QKNorm:
    kind: str  # rms | gemma_rms | functional_rms | layernorm2d | layernorm_per_head
    at: str  # flat (before the head reshape) | heads (after reshape) | heads_transposed | after_rope
    enabled: bool | str = True  # literal, or the ModelArgs field that switches it
    names: tuple[str, str] = ("q_norm", "k_norm")


@dataclass(frozen=True)
class Rope:
    kind: str = "initialize"  # initialize (rope_utils) | phi3 | nemotron | hunyuan_alpha | nanochat
    theta: str = "rope_theta"  # field (dotted = nested key, e.g. rope_parameters.rope_theta)
    traditional: bool | str = "rope_traditional"
    scaling: str | None = "rope_scaling"  # field holding the scaling dict, None = never scaled
    max_positions: str | None = "max_position_embeddings"
    partial: str | None = None  # field holding the rotary fraction: dims = int(head_dim * f)
    nope: str | None = None  # no_rope_layers (smollm3) | global_layers (cohere2, exaone4)
    sliding_theta: str | None = None  # sliding layers: plain rope with this base, no scaling
    child: bool = True  # the rope is the attention's `rope` child module (nanochat: a function)
    nope_child: bool = True  # NoPE layers still have a `rope` child (exaone4: none)


@dataclass(frozen=True)
class Mlp:
    kind: str = "gated"  # gated | gated_fused | plain
    act: str = "silu"  # silu (compiled swiglu) | gelu | gelu_approx | relu_squared | relu2 | xielu
    bias: bool | str = False
    intermediate: str = "intermediate_size"  # field, or "4x_hidden" (gpt_neox) | "lille"


@dataclass(frozen=True)
class Norm:
    kind: str = "rms"  # rms | gemma_rms | layernorm | layernorm1p | functional_rms
    eps: str = "rms_norm_eps"  # field
    bias: bool | str = True  # layernorm kinds only


@dataclass(frozen=True)
class Block:
    kind: str = "pre"  # pre | sandwich | post  (which of Names.norms are used)
    parallel: bool | str = False  # attention and MLP read the same input
    parallel_mlp_norm: str = "shared"  # shared (cohere, phi, stablelm) | own (gpt_neox)
    parallel_sum: str = "attn_ff_x"  # attn_ff_x: attn + ff + x | x_attn_ff: x + attn + ff
    residual: str = "plain"  # plain | scaled (x + r * s) | clip_f16 (gemma3 clip_residual)
    residual_scale: str | None = None  # field, or "minicpm" (scale_depth / n_layers**0.5)
    inner_norms: bool = False  # lille-130m


@dataclass(frozen=True)
class Head:
    tie: bool | str = "tie_word_embeddings"  # literal, field, or "weights" (tied iff lm_head absent)
    tied_op: str = "as_linear"  # as_linear | matmul (h @ embed.weight.T)
    always: bool = False  # the lm_head module exists even when tied (helium)
    bias: bool = False
    in_root: bool = False  # the head is Model.<root>.<head> (gpt_neox embed_out)
    pre_divide: str | None = None  # "minicpm": h / (hidden_size / dim_model_base), untied only
    post: tuple[str, str] | None = None  # ("div", field) | ("mul", field)
    softcap: str | None = None  # gemma2 (field final_logit_softcapping) | nanochat (compiled, 15.0)


@dataclass(frozen=True)
class Layers:
    kinds: str = "all_full"  # all_full | layer_types | layer_types_olmo3 | period | exaone
    sliding_window: str | None = None
    period: str | None = None  # field for "period" (int) and "exaone" (pattern string)
    make_cache: str = "default"  # default (KVCache each) | rotating_sliding
    mask_array: bool = False  # gemma2: create_attention_mask(..., return_array=True)


@dataclass(frozen=True)
class SanitizeRule:
    """One step of the mlx-lm file's `sanitize`, applied to the weight dict in order.

    op: drop_containing (arg: substring) | drop_suffixes (arg: tuple) | drop_tied_head |
    neox_rename | copy_if_missing (arg: (dst, src)) | squeeze_suffixes (arg: tuple) |
    fp8_scale_inv.
    """

    op: str
    arg: Any = None
    reason: str = ""


@dataclass(frozen=True)
class ArchDescriptor:
    model_type: str
    fields: Mapping[str, Any]  # mlx-lm ModelArgs fields -> default (REQUIRED: no default)
    post_init: tuple[str, ...] = ()  # named ModelArgs.__post_init__ steps (see _POST_INIT)
    # sizes
    hidden: str = "hidden_size"
    n_layers: str = "num_hidden_layers"
    n_heads: str = "num_attention_heads"
    n_kv_heads: str | None = "num_key_value_heads"  # None: = n_heads (MHA)
    vocab: str = "vocab_size"
    head_dim: str = "or_split"  # or_split (head_dim or hidden//heads) | split | field
    names: Names = Names()
    # attention
    qkv: str = "separate"  # separate | fused (q|k|v split) | fused_neox (per-head interleaved)
    attn_bias: bool | str = False
    out_bias: bool | str = False
    qk_norm: QKNorm | None = None
    attn_scale: str = "head_dim"  # head_dim | qpas_inv_sqrt | qpas_pow | sqrt_inv | attention_multiplier
    attention: str = "sdpa"  # sdpa | softcap | sdpa_f32_if_f16 | sdpa_q_f32 | sdpa_qk_f32
    query_scale: str | None = None  # llama4 (ministral3 position-dependent query scale)
    rope: Rope = Rope()
    mlp: Mlp = Mlp()
    norm: Norm = Norm()
    block: Block = Block()
    embed_scale: str | None = None  # sqrt_hidden | sqrt_hidden_bf16 | field (a multiplier)
    embed_norm: bool = False  # nanochat: functional rms_norm after the embedding
    head: Head = Head()
    layers: Layers = Layers()
    sanitize: tuple[SanitizeRule, ...] = ()
    # config keys mlx-lm deliberately ignores for this arch (known; reported, never refused)
    ignored_keys: Mapping[str, str] = field(default_factory=dict)
    # config keys whose value must be one mlx-lm implements (e.g. hidden_act)
    accepted_values: Mapping[str, tuple] = field(default_factory=dict)
    # config keys mlx-lm does not read that must equal a field it does read (gpt_neox rope_theta)
    aliases: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""


# ----------------------------------------------------------------- resolved arguments


@dataclass(frozen=True)
class LayerSpec:
    index: int
    sliding: bool
    # ("initialize", dims, base, traditional, scaling, max_pos), another kind's tuple, or None (NoPE)
    rope: tuple | None


@dataclass(frozen=True)
class UniversalArgs:
    """A descriptor applied to one config: every number the graph needs."""

    model_type: str
    fields: Mapping[str, Any]  # the ModelArgs view (after __post_init__)
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    eps: float
    attn_bias: bool
    out_bias: bool
    mlp_bias: bool
    norm_bias: bool
    qk_norm: bool
    attn_scale: float
    attn_softcap: float | None
    layers: tuple[LayerSpec, ...]
    sliding_window: int | None
    tie: bool  # for Head.tie == "weights": the constructor's choice (untied), the loader decides
    embed_scale: Any
    residual_scale: Any
    head_pre_divide: Any
    head_post: tuple[str, Any] | None
    final_softcap: Any
    llama4: tuple[float, int] | None  # (beta, original_max_position_embeddings)
    parallel: bool


# ----------------------------------------------------------------- the table

_RMS_DROP_INV_FREQ = SanitizeRule("drop_containing", "self_attn.rotary_emb.inv_freq",
                                  "precomputed rotary frequencies (recomputed at init)")
_DROP_TIED = SanitizeRule("drop_tied_head", None, "tied embeddings: the head is the embedding matrix")

_LLAMA_FIELDS = {
    "model_type": REQUIRED, "hidden_size": REQUIRED, "num_hidden_layers": REQUIRED,
    "intermediate_size": REQUIRED, "num_attention_heads": REQUIRED, "rms_norm_eps": REQUIRED,
    "vocab_size": REQUIRED, "head_dim": None, "max_position_embeddings": None,
    "num_key_value_heads": None, "attention_bias": False, "mlp_bias": False, "rope_theta": 10000,
    "rope_traditional": False, "rope_scaling": None, "tie_word_embeddings": True,
    "layer_types": None, "sliding_window": None,
}
_SILU = {"hidden_act": ("silu",)}
_GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm",
                "pre_feedforward_layernorm", "post_feedforward_layernorm")
_POST_NORMS = (None, "post_attention_layernorm", None, "post_feedforward_layernorm")


def _fields(*required: str, **defaults: Any) -> dict[str, Any]:
    return {**{k: REQUIRED for k in required}, **defaults}


_ROWS = [
    ArchDescriptor(
        "llama", _LLAMA_FIELDS, ("kv_heads_default", "layer_types_full", "require_full_layer"),
        attn_bias="attention_bias", out_bias="attention_bias",
        mlp=Mlp(bias="mlp_bias"),
        layers=Layers("layer_types", sliding_window="sliding_window", make_cache="rotating_sliding"),
        sanitize=(_RMS_DROP_INV_FREQ, _DROP_TIED), accepted_values=_SILU,
        ignored_keys={"pretraining_tp": "training-time tensor-parallel split; inference is unaffected"},
        notes="mistral, iquestcoder and xverse remap here (mlx-lm MODEL_REMAPPING). Transformers-5 "
              "`rope_parameters` is not read by mlx-lm's llama (rope_theta keeps its default).",
    ),
    ArchDescriptor(
        "smollm3", {**_LLAMA_FIELDS, "no_rope_layer_interval": 4, "no_rope_layers": None},
        ("kv_heads_default", "layer_types_full", "require_full_layer", "smollm3_no_rope"),
        attn_bias="attention_bias", out_bias="attention_bias",
        rope=Rope(nope="no_rope_layers"), mlp=Mlp(bias="mlp_bias"),
        layers=Layers("layer_types", sliding_window="sliding_window", make_cache="default"),
        sanitize=(_RMS_DROP_INV_FREQ, _DROP_TIED), accepted_values=_SILU,
        notes="llama's LlamaModel with NoPE layers; the Model defines no make_cache, so sliding "
              "layers (if any) get a plain KVCache and a windowed mask.",
    ),
    ArchDescriptor(
        "qwen2",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", "num_key_value_heads",
                max_position_embeddings=32768, rope_theta=1000000, rope_traditional=False,
                rope_scaling=None, tie_word_embeddings=True),
        head_dim="split", attn_bias=True, out_bias=False,
        sanitize=(_DROP_TIED, _RMS_DROP_INV_FREQ), accepted_values=_SILU,
        ignored_keys={"sliding_window": "mlx-lm runs every qwen2 layer with global attention",
                      "layer_types": "mlx-lm runs every qwen2 layer with global attention",
                      "use_sliding_window": "mlx-lm runs every qwen2 layer with global attention",
                      "max_window_layers": "mlx-lm runs every qwen2 layer with global attention"},
    ),
    ArchDescriptor(
        "qwen3",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", "num_key_value_heads",
                "max_position_embeddings", "head_dim", "tie_word_embeddings",
                rope_theta=None, rope_scaling=None, rope_parameters=None),
        ("qwen3_rope_parameters",), head_dim="field",
        qk_norm=QKNorm("rms", "heads"), rope=Rope(traditional=False),
        sanitize=(_DROP_TIED,), accepted_values=_SILU,
        ignored_keys={"attention_bias": "mlx-lm's qwen3 has no attention biases",
                      "sliding_window": "mlx-lm runs every qwen3 layer with global attention",
                      "layer_types": "mlx-lm runs every qwen3 layer with global attention",
                      "use_sliding_window": "mlx-lm runs every qwen3 layer with global attention",
                      "max_window_layers": "mlx-lm runs every qwen3 layer with global attention"},
    ),
    ArchDescriptor(
        "gemma",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "head_dim", "rms_norm_eps", "vocab_size",
                "num_key_value_heads", rope_theta=10000, rope_traditional=False),
        head_dim="field", rope=Rope(scaling=None, max_positions=None),
        mlp=Mlp(act="gelu"), norm=Norm("gemma_rms"), embed_scale="sqrt_hidden",
        head=Head(tie=True),
        accepted_values={"tie_word_embeddings": (True,)},
        ignored_keys={"hidden_act": "mlx-lm's gemma uses exact GELU whatever the config says",
                      "hidden_activation": "mlx-lm's gemma uses exact GELU whatever the config says",
                      "max_position_embeddings": "mlx-lm's gemma rope is unscaled"},
    ),
    ArchDescriptor(
        "gemma2",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "head_dim", "rms_norm_eps", "vocab_size",
                "num_key_value_heads", rope_theta=10000, rope_traditional=False,
                attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                query_pre_attn_scalar=144.0),
        head_dim="field", attn_scale="qpas_inv_sqrt", attention="softcap",
        rope=Rope(scaling=None, max_positions=None), mlp=Mlp(act="gelu_approx"),
        norm=Norm("gemma_rms"), names=Names(norms=_GEMMA_NORMS), block=Block("sandwich"),
        embed_scale="sqrt_hidden", head=Head(tie=True, softcap="gemma2"),
        layers=Layers(mask_array=True),
        accepted_values={"hidden_act": ("gelu_pytorch_tanh",),
                         "hidden_activation": ("gelu_pytorch_tanh",), "tie_word_embeddings": (True,)},
        ignored_keys={"sliding_window": "mlx-lm runs every gemma2 layer with global attention",
                      "layer_types": "mlx-lm runs every gemma2 layer with global attention",
                      "max_position_embeddings": "mlx-lm's gemma2 rope is unscaled",
                      "cache_implementation": "a transformers cache choice"},
        notes="mlx-lm ignores gemma2's sliding window (every layer global, plain KVCache).",
    ),
    ArchDescriptor(
        "phi3",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", num_key_value_heads=None,
                rope_theta=10000, rope_traditional=False, rope_scaling=None,
                partial_rotary_factor=1.0, max_position_embeddings=131072,
                original_max_position_embeddings=4096, tie_word_embeddings=False),
        ("kv_heads_default", "phi3_rope_scaling"), head_dim="split", qkv="fused",
        rope=Rope("phi3", partial="partial_rotary_factor"), mlp=Mlp("gated_fused"),
        accepted_values=_SILU,
        ignored_keys={"sliding_window": "mlx-lm runs every phi3 layer with global attention",
                      "resid_pdrop": "dropout", "embd_pdrop": "dropout"},
    ),
    ArchDescriptor(
        "olmo2",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", head_dim=None,
                max_position_embeddings=None, num_key_value_heads=None, attention_bias=False,
                mlp_bias=False, rope_theta=10000, rope_traditional=False, rope_scaling=None,
                tie_word_embeddings=True),
        ("kv_heads_default",), attn_bias="attention_bias", out_bias="attention_bias",
        qk_norm=QKNorm("rms", "flat"), mlp=Mlp(bias="mlp_bias"),
        names=Names(norms=_POST_NORMS), block=Block("post"),
        sanitize=(_RMS_DROP_INV_FREQ,), accepted_values=_SILU,
        notes="mlx-lm's olmo2 does not drop lm_head.weight when tied.",
    ),
    ArchDescriptor(
        "glm4",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "attention_bias", "head_dim", "rms_norm_eps",
                "vocab_size", "num_key_value_heads", "partial_rotary_factor", "rope_theta",
                rope_traditional=True, max_position_embeddings=32768),
        head_dim="field", attn_bias="attention_bias", out_bias=False,
        rope=Rope(scaling=None, max_positions=None, partial="partial_rotary_factor"),
        mlp=Mlp("gated_fused"), block=Block("sandwich"),
        names=Names(norms=("input_layernorm", "post_self_attn_layernorm",
                           "post_attention_layernorm", "post_mlp_layernorm")),
        head=Head(tie=False), accepted_values=_SILU,
        ignored_keys={"tie_word_embeddings": "mlx-lm's glm4 always has its own lm_head"},
    ),
    ArchDescriptor(
        "granite",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", "logits_scaling",
                "attention_multiplier", "embedding_multiplier", "residual_multiplier",
                "max_position_embeddings", "num_key_value_heads", "attention_bias", "mlp_bias",
                "rope_theta", rope_scaling=None, tie_word_embeddings=True),
        head_dim="split", attn_bias="attention_bias", out_bias="attention_bias",
        attn_scale="attention_multiplier", rope=Rope(traditional=False), mlp=Mlp(bias="mlp_bias"),
        block=Block(residual="scaled", residual_scale="residual_multiplier"),
        embed_scale="embedding_multiplier", head=Head(post=("div", "logits_scaling")),
        sanitize=(_DROP_TIED,), accepted_values=_SILU,
    ),
    ArchDescriptor(
        "starcoder2",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "num_key_value_heads", norm_epsilon=1e-5,
                vocab_size=49152, rope_theta=100000, tie_word_embeddings=True),
        head_dim="split", attn_bias=True, out_bias=True,
        rope=Rope(traditional=False, scaling=None, max_positions=None),
        mlp=Mlp("plain", act="gelu", bias=True), names=Names(up="c_fc", down="c_proj"),
        norm=Norm("layernorm", eps="norm_epsilon"),
        ignored_keys={"sliding_window": "mlx-lm runs every starcoder2 layer with global attention",
                      "hidden_act": "mlx-lm's starcoder2 uses exact GELU whatever the config says",
                      "use_bias": "mlx-lm's starcoder2 always has biases",
                      "max_position_embeddings": "mlx-lm's starcoder2 rope is unscaled",
                      "residual_dropout": "dropout", "embedding_dropout": "dropout"},
        notes="mlx-lm ignores starcoder2's sliding window and hidden_act (exact GELU).",
    ),
    ArchDescriptor(
        "gemma3_text",
        _fields("model_type", hidden_size=1152, num_hidden_layers=26, intermediate_size=6912,
                num_attention_heads=4, head_dim=256, rms_norm_eps=1.0e-6, vocab_size=262144,
                num_key_value_heads=1, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6,
                max_position_embeddings=32768, rope_scaling=None),
        head_dim="field", attn_scale="qpas_pow",
        qk_norm=QKNorm("gemma_rms", "heads_transposed"),
        rope=Rope(traditional=False, sliding_theta="rope_local_base_freq"),
        mlp=Mlp(act="gelu_approx"), norm=Norm("gemma_rms"), names=Names(norms=_GEMMA_NORMS),
        block=Block("sandwich", residual="clip_f16"), embed_scale="sqrt_hidden_bf16",
        head=Head(tie="weights"),
        layers=Layers("period", sliding_window="sliding_window", period="sliding_window_pattern",
                      make_cache="rotating_sliding"),
        accepted_values={"hidden_activation": ("gelu_pytorch_tanh",),
                         "hidden_act": ("gelu_pytorch_tanh",)},
        ignored_keys={"tie_word_embeddings": "mlx-lm ties iff the checkpoint has no lm_head.weight",
                      "cache_implementation": "a transformers cache choice",
                      "attn_logit_softcapping": "mlx-lm's gemma3 has no attention softcap",
                      "final_logit_softcapping": "mlx-lm's gemma3_text has no final softcap"},
        notes="tied iff the checkpoint has no lm_head.weight (mlx-lm decides in sanitize).",
    ),
    ArchDescriptor(
        "olmo3",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", "max_position_embeddings",
                "sliding_window", "rope_theta", attention_bias=False, layer_types=None,
                num_key_value_heads=None, head_dim=None, rope_scaling=None,
                tie_word_embeddings=False),
        ("kv_heads_default", "layer_types_olmo3", "olmo3_require_both"),
        attn_bias="attention_bias", out_bias="attention_bias", qk_norm=QKNorm("rms", "flat"),
        rope=Rope(traditional=False, sliding_theta="rope_theta"),
        names=Names(norms=_POST_NORMS), block=Block("post"),
        layers=Layers("layer_types_olmo3", sliding_window="sliding_window",
                      make_cache="rotating_sliding"),
        accepted_values=_SILU,
    ),
    ArchDescriptor(
        "cohere",
        _fields("model_type", hidden_size=8192, num_hidden_layers=40, intermediate_size=22528,
                num_attention_heads=64, num_key_value_heads=64, rope_theta=8000000.0,
                vocab_size=256000, layer_norm_eps=1e-05, logit_scale=0.0625, attention_bias=False,
                layer_norm_bias=False, use_qk_norm=False),
        head_dim="split", attn_bias="attention_bias", out_bias="attention_bias",
        qk_norm=QKNorm("layernorm2d", "heads", enabled="use_qk_norm"),
        rope=Rope(traditional=True, scaling=None, max_positions=None),
        norm=Norm("layernorm", eps="layer_norm_eps", bias="layer_norm_bias"),
        names=Names(norms=("input_layernorm", None, None, None)),
        block=Block(parallel=True), head=Head(tie=True, post=("mul", "logit_scale")),
        accepted_values={**_SILU, "tie_word_embeddings": (True,)},
        ignored_keys={"max_position_embeddings": "mlx-lm's cohere rope is unscaled"},
    ),
    ArchDescriptor(
        "cohere2",
        _fields("model_type", hidden_size=4096, head_dim=128, num_hidden_layers=32,
                intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                rope_theta=50000.0, vocab_size=256000, layer_norm_eps=1e-05, logit_scale=0.0625,
                attention_bias=False, layer_norm_bias=False, sliding_window=4096,
                sliding_window_pattern=4),
        ("cohere2_head_dim_check",), head_dim="field",
        attn_bias="attention_bias", out_bias="attention_bias", attention="sdpa_f32_if_f16",
        rope=Rope(traditional=True, scaling=None, max_positions=None, nope="global_layers"),
        norm=Norm("layernorm", eps="layer_norm_eps", bias="layer_norm_bias"),
        names=Names(norms=("input_layernorm", None, None, None)),
        block=Block(parallel=True), head=Head(tie=True, post=("mul", "logit_scale")),
        layers=Layers("period", sliding_window="sliding_window", period="sliding_window_pattern",
                      make_cache="rotating_sliding"),
        accepted_values={**_SILU, "tie_word_embeddings": (True,)},
        ignored_keys={"max_position_embeddings": "mlx-lm's cohere2 rope is unscaled"},
        notes="rope only on sliding layers; global layers are NoPE.",
    ),
    ArchDescriptor(
        "ernie4_5",
        _fields("hidden_size", "intermediate_size", "model_type", "max_position_embeddings",
                "num_attention_heads", "num_key_value_heads", "head_dim", "num_hidden_layers",
                "rms_norm_eps", "vocab_size", "rope_theta", "use_bias", "tie_word_embeddings"),
        attn_bias="use_bias", out_bias="use_bias",
        rope=Rope(traditional=True, scaling=None), mlp=Mlp(bias="use_bias"),
        accepted_values=_SILU,
    ),
    ArchDescriptor(
        "exaone4",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", "num_key_value_heads",
                "max_position_embeddings", "rope_theta", "head_dim", "tie_word_embeddings",
                "rope_scaling", "sliding_window", "sliding_window_pattern"),
        head_dim="field", qk_norm=QKNorm("rms", "heads"),
        rope=Rope(traditional=False, nope="global_layers", nope_child=False),
        names=Names(norms=_POST_NORMS), block=Block("post"),
        layers=Layers("exaone", sliding_window="sliding_window", period="sliding_window_pattern",
                      make_cache="rotating_sliding"),
        accepted_values=_SILU,
    ),
    ArchDescriptor(
        "helium",
        _fields("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "vocab_size", "attention_bias", "head_dim",
                "max_position_embeddings", "mlp_bias", "model_type", "rope_theta",
                "tie_word_embeddings"),
        head_dim="split", attn_bias="attention_bias", out_bias=False,
        rope=Rope(traditional=True, scaling=None, max_positions=None), mlp=Mlp(bias="mlp_bias"),
        head=Head(always=True), accepted_values=_SILU,
        notes="mlx-lm builds lm_head even when tied, so a tied checkpoint still needs lm_head.weight.",
    ),
    ArchDescriptor(
        "internlm3",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", bias=False, qkv_bias=False,
                max_position_embeddings=32768, num_key_value_heads=None, rope_theta=10000,
                rope_traditional=False, rope_scaling=None, tie_word_embeddings=False),
        ("kv_heads_default", "internlm3_rope_scaling"), head_dim="split",
        attn_bias="qkv_bias", out_bias="qkv_bias", mlp=Mlp(bias="bias"),
        sanitize=(SanitizeRule("drop_containing", "attention.rope.inv_freq",
                               "precomputed rotary frequencies (recomputed at init)"),),
        accepted_values=_SILU,
    ),
    ArchDescriptor(
        "seed_oss",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", "num_key_value_heads",
                "head_dim", max_position_embeddings=None, attention_bias=False,
                attention_out_bias=False, mlp_bias=False, rope_theta=10000,
                rope_traditional=False, rope_scaling=None, tie_word_embeddings=True),
        head_dim="field", attn_bias="attention_bias", out_bias="attention_out_bias",
        mlp=Mlp(bias="mlp_bias"), head=Head(tied_op="matmul"), sanitize=(_DROP_TIED,),
        accepted_values=_SILU,
    ),
    ArchDescriptor(
        "minicpm",
        _fields("model_type", "hidden_size", "dim_model_base", "num_hidden_layers",
                "intermediate_size", "num_attention_heads", "rms_norm_eps", "vocab_size",
                "num_key_value_heads", "scale_depth", "scale_emb", max_position_embeddings=None,
                rope_theta=1000000.0, rope_traditional=False, rope_scaling=None,
                tie_word_embeddings=False),
        head_dim="split", block=Block(residual="scaled", residual_scale="minicpm"),
        embed_scale="scale_emb", head=Head(tied_op="matmul", pre_divide="minicpm"),
        sanitize=(SanitizeRule("copy_if_missing", ("lm_head.weight", "model.embed_tokens.weight"),
                               "mlx-lm copies the embedding into a missing lm_head"),),
        accepted_values=_SILU,
        notes="sanitize always supplies lm_head.weight, so mlx-lm loads only untied configs.",
    ),
    ArchDescriptor(
        "nemotron",
        _fields("model_type", "hidden_size", "hidden_act", "num_hidden_layers",
                "intermediate_size", "num_attention_heads", "norm_eps", "vocab_size",
                "num_key_value_heads", head_dim=None, max_position_embeddings=None,
                attention_bias=False, mlp_bias=False, partial_rotary_factor=0.5,
                rope_theta=10000.0, rope_traditional=False, rope_scaling=None,
                tie_word_embeddings=False),
        ("nemotron_rope_scaling",), attn_bias="attention_bias", out_bias="attention_bias",
        rope=Rope("nemotron", partial="partial_rotary_factor"),
        mlp=Mlp("plain", act="relu_squared", bias="mlp_bias"),
        norm=Norm("layernorm1p", eps="norm_eps"),
        accepted_values={"hidden_act": ("relu2",)},
        notes="rope_traditional is read but unused by mlx-lm (always non-traditional).",
    ),
    ArchDescriptor(
        "stablelm",
        _fields("model_type", "vocab_size", "hidden_size", "num_attention_heads",
                "num_hidden_layers", "num_key_value_heads", "intermediate_size", "rope_theta",
                "use_qkv_bias", "partial_rotary_factor", "layer_norm_eps",
                use_parallel_residual=False, qk_layernorm=False),
        ("split_head_dim_check",), head_dim="split", attn_bias="use_qkv_bias", out_bias=False,
        qk_norm=QKNorm("layernorm_per_head", "heads", enabled="qk_layernorm",
                       names=("q_layernorm", "k_layernorm")),
        attn_scale="sqrt_inv", attention="sdpa_qk_f32",
        rope=Rope(traditional=False, scaling=None, max_positions=None,
                  partial="partial_rotary_factor"),
        norm=Norm("layernorm", eps="layer_norm_eps"),
        block=Block(parallel="use_parallel_residual", parallel_sum="x_attn_ff"),
        head=Head(tie=False), accepted_values=_SILU,
        ignored_keys={"tie_word_embeddings": "mlx-lm's stablelm always has its own lm_head",
                      "max_position_embeddings": "mlx-lm's stablelm rope is unscaled"},
    ),
    ArchDescriptor(
        "lille-130m",
        _fields("model_type", "block_size", "layer_norm_eps", "n_embd", "n_head", "n_kv_heads",
                "n_layer", "rope_theta", "vocab_size", tie_word_embeddings=True),
        hidden="n_embd", n_layers="n_layer", n_heads="n_head", n_kv_heads="n_kv_heads",
        head_dim="split", qkv="fused",
        names=Names(root="transformer", embed="tok_embeddings", attn="attention",
                    mlp="feed_forward", o="out_proj", norms=(None, None, None, None)),
        rope=Rope(traditional=True, scaling=None, max_positions=None),
        mlp=Mlp(intermediate="lille"), norm=Norm(eps="layer_norm_eps"),
        block=Block(inner_norms=True), head=Head(tie=True),
        accepted_values={"tie_word_embeddings": (True,)},
        sanitize=(SanitizeRule("drop_containing", "rotary_emb",
                               "precomputed rotary frequencies (recomputed at init)"),),
        notes="the head is always the tied embedding (tie_word_embeddings is not consulted).",
    ),
    ArchDescriptor(
        "gpt_neox",
        _fields("model_type", "max_position_embeddings", "hidden_size", "num_attention_heads",
                "num_hidden_layers", "layer_norm_eps", "vocab_size", "rotary_emb_base",
                "rotary_pct", use_parallel_residual=True, num_key_value_heads=None),
        ("kv_heads_default", "neox_divisible"), n_kv_heads=None, head_dim="split",
        qkv="fused_neox", attn_bias=True, out_bias=True,
        names=Names(embed="embed_in", layers="h", final_norm="final_layer_norm", head="embed_out",
                    attn="attention", qkv="query_key_value", o="dense",
                    up="dense_h_to_4h", down="dense_4h_to_h"),
        rope=Rope(theta="rotary_emb_base", traditional=False, scaling=None, max_positions=None,
                  partial="rotary_pct"),
        mlp=Mlp("plain", act="gelu_approx", bias=True, intermediate="4x_hidden"),
        norm=Norm("layernorm", eps="layer_norm_eps"),
        block=Block(parallel="use_parallel_residual", parallel_mlp_norm="own"),
        head=Head(tie=False, in_root=True),
        sanitize=(SanitizeRule("neox_rename", None,
                               "mlx-lm renames gpt_neox.* to model.* and drops attention buffers"),),
        ignored_keys={"hidden_act": "mlx-lm's gpt_neox uses the tanh GELU approximation",
                      "intermediate_size": "mlx-lm's gpt_neox MLP is 4 * hidden_size",
                      "tie_word_embeddings": "mlx-lm's gpt_neox always has embed_out",
                      "rope_scaling": None,
                      "attention_bias": "mlx-lm's gpt_neox always has biases",
                      "classifier_dropout": "dropout"},
        aliases={"rope_theta": "rotary_emb_base", "partial_rotary_factor": "rotary_pct"},
        notes="mlx-lm's MLP is always 4*hidden with the tanh GELU approximation.",
    ),
    ArchDescriptor(
        "phi",
        dict(model_type="phi", max_position_embeddings=2048, vocab_size=51200, hidden_size=2560,
             num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32,
             partial_rotary_factor=0.4, intermediate_size=10240, layer_norm_eps=1e-5,
             rope_theta=10000.0),
        ("kv_heads_default", "split_head_dim_check"), head_dim="split", attn_bias=True,
        out_bias=True, attn_scale="sqrt_inv", attention="sdpa_q_f32",
        names=Names(o="dense", up="fc1", down="fc2", final_norm="final_layernorm",
                    norms=("input_layernorm", None, None, None)),
        rope=Rope(traditional=False, scaling=None, max_positions=None,
                  partial="partial_rotary_factor"),
        mlp=Mlp("plain", act="gelu_approx", bias=True), norm=Norm("layernorm", eps="layer_norm_eps"),
        block=Block(parallel=True), head=Head(tie=False, bias=True),
        accepted_values={"hidden_act": ("gelu_new",)},
        ignored_keys={"tie_word_embeddings": "mlx-lm's phi always has its own lm_head",
                      "resid_pdrop": "dropout", "embd_pdrop": "dropout", "rope_scaling": None,
                      "qk_layernorm": None},
    ),
    ArchDescriptor(
        "hunyuan_v1_dense",
        _fields("model_type", "vocab_size", "hidden_size", "num_hidden_layers",
                "intermediate_size", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                rope_theta=10000, max_position_embeddings=32768, attention_bias=False,
                use_qk_norm=True, rope_scaling=None, tie_word_embeddings=False, head_dim=None),
        ("hunyuan_rope_scaling",), attn_bias="attention_bias", out_bias="attention_bias",
        qk_norm=QKNorm("rms", "after_rope", enabled="use_qk_norm",
                       names=("query_layernorm", "key_layernorm")),
        rope=Rope("hunyuan_alpha"), sanitize=(_DROP_TIED,), accepted_values=_SILU,
        notes="q/k RMSNorm after rope; NTK-alpha rope base (rope_scaling.alpha).",
    ),
    ArchDescriptor(
        "apertus",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "mlp_bias", "num_attention_heads", "attention_bias", "rms_norm_eps", "vocab_size",
                "num_key_value_heads", "max_position_embeddings", "rope_theta", "post_norm",
                "qk_norm", "tie_word_embeddings", rope_traditional=False, rope_scaling=None),
        head_dim="split", qk_norm=QKNorm("rms", "heads"),
        mlp=Mlp("plain", act="xielu", bias="mlp_bias"),
        names=Names(norms=("attention_layernorm", None, "feedforward_layernorm", None)),
        sanitize=(SanitizeRule("squeeze_suffixes", ("alpha_p", "alpha_n"),
                               "XieLU scalars are stored with a singleton axis"), _DROP_TIED),
        accepted_values={"hidden_act": ("xielu",)},
        notes="attention_bias, post_norm and qk_norm are required fields mlx-lm does not use.",
    ),
    ArchDescriptor(
        "ministral3",
        _fields("model_type", "hidden_size", "num_hidden_layers", "intermediate_size",
                "num_attention_heads", "rms_norm_eps", "vocab_size", head_dim=None,
                max_position_embeddings=None, num_key_value_heads=None, rope_parameters=None,
                tie_word_embeddings=True, layer_types=None, sliding_window=None),
        ("kv_heads_default", "layer_types_full", "require_full_layer", "ministral3_rope"),
        query_scale="llama4",
        rope=Rope(theta="rope_parameters.rope_theta", traditional=False, scaling="rope_parameters"),
        layers=Layers("layer_types", sliding_window="sliding_window", make_cache="rotating_sliding"),
        sanitize=(_RMS_DROP_INV_FREQ, _DROP_TIED,
                  SanitizeRule("fp8_scale_inv", None,
                               "fp8 weights are multiplied by weight_scale_inv; activation_scale dropped")),
        accepted_values=_SILU,
        notes="llama-4 position-dependent query scale from rope_parameters.llama_4_scaling_beta.",
    ),
    ArchDescriptor(
        "nanochat",
        dict(model_type="nanochat", hidden_size=1280, num_hidden_layers=20, num_attention_heads=10,
             num_key_value_heads=10, vocab_size=65536, max_position_embeddings=2048,
             intermediate_size=5120, rope_theta=10000.0),
        head_dim="split",
        names=Names(root="transformer", embed="wte", layers="h", final_norm="norm", attn="attn",
                    q="c_q", k="c_k", v="c_v", o="c_proj", up="c_fc", down="c_proj"),
        qk_norm=QKNorm("functional_rms", "after_rope"), rope=Rope("nanochat", child=False),
        mlp=Mlp("plain", act="relu2"), norm=Norm("functional_rms"), embed_norm=True,
        head=Head(tie=False, softcap="nanochat"),
        accepted_values={"hidden_act": ("relu2",), "final_logit_softcapping": (15.0,)},
        ignored_keys={"rms_norm_eps": "mlx-lm's nanochat hard-codes eps 1e-5 (transformers: 1e-6)"},
        notes="parameter-free RMSNorm (eps 1e-5) everywhere; logits softcap 15.",
    ),
]

DESCRIPTORS: dict[str, ArchDescriptor] = {d.model_type: d for d in _ROWS}

# mlx-lm model files that are infrastructure, not architectures.
INFRASTRUCTURE_FILES = (
    "__init__", "base", "cache", "rope_utils", "activations", "switch_layers", "ssm",
    "gated_delta", "mla", "bitlinear_layers", "pipeline",
)

_MOE = "mixture-of-experts MLP (router + SwitchGLU): UniversalMoE's job, not a dense descriptor"
_HYBRID = "recurrent / SSM / linear-attention layers: needs a dedicated port"
_MLA = "multi-head latent attention (low-rank q/kv, split rope dims): needs the MLA module"
_WRAP = "multimodal wrapper (text stack under language_model.*): needs a wrapper shim"

NOT_COVERED: dict[str, str] = {
    **dict.fromkeys(
        ["Klear", "afmoe", "bailing_moe", "dbrx", "deepseek", "dots1", "ernie4_5_moe", "exaone_moe",
         "glm4_moe", "gpt_oss", "granitemoe", "hunyuan", "llama4", "mellum", "mimo_v2_flash",
         "minimax", "mixtral", "olmoe", "phimoe", "phixtral", "qwen2_moe", "qwen3_moe", "solar_open",
         "step3p5", "laguna"], _MOE),
    **dict.fromkeys(
        ["bailing_hybrid", "bailing_moe_linear", "bailing_moe_v3", "falcon_h1",
         "gear", "granitemoehybrid", "jamba", "kimi_linear", "lfm2", "lfm2_moe", "longcat_flash_ngram",
         "mamba", "mamba2", "nemotron_h", "olmo_hybrid", "plamo2", "qwen3_5", "qwen3_next",
         "recurrent_gemma", "rwkv7", "kimi_k3"], _HYBRID),
    **dict.fromkeys(
        ["deepseek_v2", "deepseek_v3", "deepseek_v32", "glm4_moe_lite", "glm_moe_dsa",
         "longcat_flash", "minicpm3", "mistral4", "youtu_llm"], _MLA),
    **dict.fromkeys(
        ["gemma3", "gemma3n", "gemma4", "kimi_k25", "kimi_vl", "lfm2-vl", "minimax_m3_vl", "mistral3",
         "muse_glimmer", "muse_spark", "pixtral", "prism_hadamard_qwen35", "qwen2_vl", "qwen3_5_moe",
         "qwen3_vl", "qwen3_vl_moe"], _WRAP),
    "gemma4_text": "gemma-4 text stack (KV sharing across layers, per-layer inputs, optional MoE): "
                   "the dedicated gemma4 port (seed design 6.1)",
    "baichuan_m1": "a short convolution over keys/values with its own cache state: needs a port",
    "deepseek_v41": "DeepSeek-V4.1 attention (compressed/indexed KV) with MoE: "
                    "needs a dedicated port",
    "afm7": "fused LoRA-capable qkv linears and KV-reuse layers: needs a dedicated port",
    "bitnet": "ternary BitLinear weights with activation quantization: needs a dedicated port",
    "exaone": "dense but nested h.N.attn.attention.* with ln_1/ln_2/wte/ln_f names: "
              "naming the descriptor does not express",
    "glm": "llama-shaped (traditional full rope, fused gate_up): "
           "fits the table with no new knob; left out until the zoo has a checkpoint",
    "gpt2": "learned absolute position embeddings (wpe), no rope: not a descriptor knob",
    "gpt_bigcode": "learned absolute position embeddings (wpe) and multi-query c_attn: "
                   "not a descriptor knob",
    "gptj": "rotary on the first rotary_dim dims via split/concat and a single-norm parallel block: "
            "needs a port",
    "internlm2": "packed wqkv with a grouped (kv-major) head layout: not a descriptor knob",
    "iquestloopcoder": "loop-gated recurrent reuse of layers: needs a dedicated port",
    "llama4_text": "chunked attention with per-layer NoPE and functional qk-norm: "
                   "needs a dedicated port",
    "mimo": "llama-shaped (qkv biases, MTP layers dropped in sanitize): "
            "fits the table with one drop rule; left out until the zoo has a checkpoint",
    "nanbeige": "loops over the layer stack (num_loops, shared KV across loops): "
                "needs a dedicated port",
    "nemotron-nas": "per-layer heterogeneous blocks (no-op / linear attention, varied FFN width)",
    "olmo": "non-affine LayerNorm and fused att_proj / ff_proj under transformer.blocks: "
            "needs a port",
    "openelm": "per-layer head counts and FFN multipliers: "
               "layer geometry varies, not one descriptor",
    "phi3small": "blocksparse attention and gegelu: needs a dedicated port",
    "plamo": "blocks nested as model.layers.layers.N with separate qk/v head dims: "
             "not a descriptor knob",
    "plamo3": "offset RMSNorm and its own sliding schedule: needs a port",
    "qwen": "qwen v1 layout (fused c_attn, w1/w2 gated MLP, transformer.h): needs a port",
    "spark2_5": "per-layer sliding/global geometry and custom gains: needs a dedicated port",
    "talkie": "learned head / activation / weight gains around every op: needs a dedicated port",
    "telechat3": "llama-shaped (telechat3-yarn rope is in initialize_rope): "
                 "fits the table with no new knob; left out until the zoo has a checkpoint",
}


# ----------------------------------------------------------------- ModelArgs emulation


def _fail(model_type: str, msg: str) -> ConfigError:
    return ConfigError(f"config.json ({model_type}): {msg}")


def _kv_heads_default(a: dict, mt: str) -> None:
    if a.get("num_key_value_heads") is None:
        a["num_key_value_heads"] = a["num_attention_heads"]


def _layer_types_full(a: dict, mt: str) -> None:
    if a["layer_types"] is None:
        a["layer_types"] = ["full_attention"] * a["num_hidden_layers"]


def _require_full_layer(a: dict, mt: str) -> None:
    if "full_attention" not in a["layer_types"]:
        raise _fail(mt, "layer_types has no 'full_attention' layer (mlx-lm needs one)")


def _layer_types_olmo3(a: dict, mt: str) -> None:
    if a["layer_types"] is None:
        a["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention"
                            for i in range(a["num_hidden_layers"])]


def _olmo3_require_both(a: dict, mt: str) -> None:
    for kind in ("sliding_attention", "full_attention"):
        if kind not in a["layer_types"]:
            raise _fail(mt, f"layer_types has no '{kind}' layer (mlx-lm's olmo3 needs both)")


def _smollm3_no_rope(a: dict, mt: str) -> None:
    if a["no_rope_layers"] is None:
        a["no_rope_layers"] = [int((i + 1) % a["no_rope_layer_interval"] != 0)
                               for i in range(a["num_hidden_layers"])]
    elif len(a["no_rope_layers"]) != a["num_hidden_layers"]:
        raise _fail(mt, "`no_rope_layers` length mismatch")


def _qwen3_rope_parameters(a: dict, mt: str) -> None:
    # transformers >= 5 nests rope_theta and rope_scaling under rope_parameters.
    if a["rope_parameters"]:
        if a["rope_theta"] is None:
            a["rope_theta"] = a["rope_parameters"].get("rope_theta")
        if a["rope_scaling"] is None:
            a["rope_scaling"] = a["rope_parameters"]
    if a["rope_theta"] is None:
        raise _fail(mt, "rope_theta is missing from the model config.")


def _phi3_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs:
        if not all(k in rs for k in ("long_factor", "type")):
            raise _fail(mt, "rope_scaling must contain keys {'long_factor', 'type'}")
        if rs["type"] not in ["longrope", "su", "linear"]:
            a["rope_scaling"] = None  # mlx-lm warns and disables the scaling
        elif rs["type"] == "linear" and not isinstance(rs.get("factor"), float):
            raise _fail(mt, "rope_scaling.factor must be a float for linear scaling")
        elif rs["type"] != "linear" and "short_factor" not in rs:
            raise _fail(mt, "rope_scaling lacks 'short_factor'")


def _internlm3_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs:
        if not all(k in rs for k in ("factor", "rope_type")):
            raise _fail(mt, "rope_scaling must contain keys {'factor', 'rope_type'}")
        if rs["rope_type"] not in ["linear", "dynamic"]:
            raise _fail(mt, "rope_scaling 'rope_type' currently only supports 'linear' or 'dynamic'")


def _nemotron_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs:
        if "factor" not in rs:
            raise _fail(mt, "rope_scaling must contain 'factor'")
        rope_type = rs.get("type") or rs.get("rope_type")
        if rope_type is None:
            raise _fail(mt, "rope_scaling must contain either 'type' or 'rope_type'")
        if rope_type not in ["linear"]:
            raise _fail(mt, "rope_scaling 'type' currently only supports 'linear'")
        if "type" not in rs:  # the Attention reads rope_scaling["type"] (KeyError in mlx-lm)
            raise _fail(mt, "rope_scaling needs the key 'type' (mlx-lm's nemotron reads it)")
        if not isinstance(rs["factor"], float):  # mlx-lm asserts a float
            raise _fail(mt, "rope_scaling.factor must be a float")


def _hunyuan_rope_scaling(a: dict, mt: str) -> None:
    rs = a["rope_scaling"]
    if rs and not all(k in rs for k in ("alpha", "factor", "type")):
        raise _fail(mt, "rope_scaling must contain keys {'alpha', 'factor', 'type'}")


def _cohere2_head_dim_check(a: dict, mt: str) -> None:
    if a["head_dim"] * a["num_attention_heads"] != a["hidden_size"]:
        raise _fail(mt, "hidden_size must equal head_dim * num_attention_heads")


def _split_head_dim_check(a: dict, mt: str) -> None:
    if (a["hidden_size"] // a["num_attention_heads"]) * a["num_attention_heads"] != a["hidden_size"]:
        raise _fail(mt, "hidden_size must be divisible by num_attention_heads")


def _ministral3_rope(a: dict, mt: str) -> None:
    rp = a["rope_parameters"]
    if not isinstance(rp, Mapping):
        raise _fail(mt, "rope_parameters is required (mlx-lm's ministral3 reads it)")
    for key in ("rope_theta", "llama_4_scaling_beta", "original_max_position_embeddings"):
        if key not in rp:
            raise _fail(mt, f"rope_parameters lacks '{key}'")


_POST_INIT = {
    "kv_heads_default": _kv_heads_default,
    "layer_types_full": _layer_types_full,
    "require_full_layer": _require_full_layer,
    "layer_types_olmo3": _layer_types_olmo3,
    "olmo3_require_both": _olmo3_require_both,
    "smollm3_no_rope": _smollm3_no_rope,
    "qwen3_rope_parameters": _qwen3_rope_parameters,
    "phi3_rope_scaling": _phi3_rope_scaling,
    "internlm3_rope_scaling": _internlm3_rope_scaling,
    "nemotron_rope_scaling": _nemotron_rope_scaling,
    "hunyuan_rope_scaling": _hunyuan_rope_scaling,
    "cohere2_head_dim_check": _cohere2_head_dim_check,
    "split_head_dim_check": _split_head_dim_check,
    "neox_divisible": _split_head_dim_check,
    "ministral3_rope": _ministral3_rope,
}


def model_args(d: ArchDescriptor, config: Mapping[str, Any]) -> dict[str, Any]:
    """`ModelArgs.from_dict(config)` + `__post_init__`: only the fields, defaults filled."""
    missing = [k for k, v in d.fields.items() if v is REQUIRED and k not in config]
    if missing:
        raise _fail(d.model_type, f"missing required key(s) {', '.join(missing)}")
    a = {k: _thaw(config[k]) if k in config else _thaw(v) for k, v in d.fields.items()}
    for step in d.post_init:
        _POST_INIT[step](a, d.model_type)
    return a


def _thaw(v: Any) -> Any:
    # config mappings may be read-only / tuples; mlx-lm sees plain json dicts and lists
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_thaw(x) for x in v]
    return v


def _get(a: Mapping[str, Any], spec: bool | str | None, mt: str) -> Any:
    """A knob value: a literal, or a (dotted) ModelArgs field."""
    if not isinstance(spec, str):
        return spec
    head, _, rest = spec.partition(".")
    value = a[head]
    if rest:
        if not isinstance(value, Mapping) or rest not in value:
            raise _fail(mt, f"'{head}' lacks '{rest}'")
        value = value[rest]
    return value


# ----------------------------------------------------------------- resolution


def _layer_kinds(d: ArchDescriptor, a: dict, n: int) -> list[bool]:
    kind = d.layers.kinds
    if kind == "all_full":
        return [False] * n
    if kind == "layer_types":
        return [lt == "sliding_attention" for lt in a["layer_types"]]
    if kind == "layer_types_olmo3":
        return [lt != "full_attention" for lt in a["layer_types"]]
    if kind == "period":
        p = a[d.layers.period]
        if not isinstance(p, int) or isinstance(p, bool) or not 0 < p <= n:
            # mlx-lm takes the global mask from cache[p - 1]
            raise _fail(d.model_type, f"'{d.layers.period}' must be an integer in 1..{n}, got {p!r}")
        return [(i + 1) % p != 0 for i in range(n)]
    if kind == "exaone":
        pattern = a[d.layers.period]
        if pattern and (not isinstance(pattern, str) or "L" not in pattern or "G" not in pattern):
            raise _fail(d.model_type, f"'{d.layers.period}' must be a string of L and G holding "
                                      f"both, got {pattern!r}")
        return [pattern[i % len(pattern)] == "L" if pattern else False for i in range(n)]
    raise ValueError(f"unknown layer kind rule {kind!r}")


def _rope_for(d: ArchDescriptor, a: dict, i: int, sliding: bool, head_dim: int) -> tuple | None:
    r, mt = d.rope, d.model_type
    if r.nope == "no_rope_layers" and not a["no_rope_layers"][i]:
        return None
    if r.nope == "global_layers":
        if d.layers.kinds == "exaone" and not a[d.layers.period]:
            pass  # exaone4 without a pattern: every layer ropes
        elif not sliding:
            return None
    dims = int(head_dim * _get(a, r.partial, mt)) if r.partial else head_dim
    base = _get(a, r.theta, mt)
    if r.kind == "initialize":
        traditional = _get(a, r.traditional, mt)
        if sliding and r.sliding_theta:
            return ("initialize", dims, _get(a, r.sliding_theta, mt), traditional, None, None)
        scaling = _get(a, r.scaling, mt) if r.scaling else None
        max_pos = _get(a, r.max_positions, mt) if r.max_positions else None
        return ("initialize", dims, base, traditional, scaling, max_pos)
    if r.kind == "phi3":
        return ("phi3", dims, base, a["rope_traditional"], a["rope_scaling"],
                a["max_position_embeddings"], a["original_max_position_embeddings"])
    if r.kind == "nemotron":
        rs = a["rope_scaling"]
        scale = 1 / rs["factor"] if rs and rs["type"] == "linear" else 1.0
        return ("nemotron", dims, base, scale)
    if r.kind == "hunyuan_alpha":
        rs = a["rope_scaling"]
        alpha = rs["alpha"] if rs and "alpha" in rs else 1.0
        return ("hunyuan_alpha", dims, base, alpha)
    if r.kind == "nanochat":
        return ("nanochat", dims, base)
    raise ValueError(f"unknown rope kind {r.kind!r}")


def _attn_scale(d: ArchDescriptor, a: dict, head_dim: int) -> float:
    kind = d.attn_scale
    if kind == "head_dim":
        return head_dim**-0.5
    if kind == "qpas_inv_sqrt":
        return 1.0 / (a["query_pre_attn_scalar"] ** 0.5)
    if kind == "qpas_pow":
        return a["query_pre_attn_scalar"] ** -0.5
    if kind == "sqrt_inv":
        return math.sqrt(1 / head_dim)
    if kind == "attention_multiplier":
        return a["attention_multiplier"]
    raise ValueError(f"unknown attention scale {kind!r}")


def _int_field(a: dict, name: str, mt: str) -> int:
    v = a[name]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise _fail(mt, f"'{name}' must be a positive integer, got {v!r}")
    return v


def resolve_args(d: ArchDescriptor, config: Mapping[str, Any]) -> UniversalArgs:
    """Apply a descriptor to a config dict (the whole config.json, as mlx-lm reads it)."""
    mt = d.model_type
    a = model_args(d, config)
    hidden = _int_field(a, d.hidden, mt)
    n_layers = _int_field(a, d.n_layers, mt)
    n_heads = _int_field(a, d.n_heads, mt)
    n_kv = _int_field(a, d.n_kv_heads, mt) if d.n_kv_heads else n_heads
    vocab = _int_field(a, d.vocab, mt)
    if d.head_dim == "split":
        head_dim = hidden // n_heads
    elif d.head_dim == "field":
        head_dim = _int_field(a, "head_dim", mt)
    else:
        head_dim = a.get("head_dim") or hidden // n_heads
    if d.mlp.intermediate == "4x_hidden":
        inter = 4 * hidden
    elif d.mlp.intermediate == "lille":
        inter = 256 * round(int(8 * hidden / 3) / 256)
    else:
        inter = _int_field(a, d.mlp.intermediate, mt)

    kinds = _layer_kinds(d, a, n_layers)
    if len(kinds) != n_layers:
        raise _fail(mt, f"{len(kinds)} layer kinds for {n_layers} layers")
    layers = tuple(LayerSpec(i, s, _rope_for(d, a, i, s, head_dim)) for i, s in enumerate(kinds))
    window = a[d.layers.sliding_window] if d.layers.sliding_window else None
    if any(kinds) and d.layers.make_cache == "rotating_sliding":
        if not isinstance(window, int) or window <= 0:
            raise _fail(mt, f"sliding layers need a positive integer sliding_window, got {window!r}")

    tie = d.head.tie
    tie = False if tie == "weights" else bool(_get(a, tie, mt))
    b = d.block
    if b.residual_scale == "minicpm":
        residual_scale = a["scale_depth"] / a["num_hidden_layers"] ** 0.5
    else:
        residual_scale = _get(a, b.residual_scale, mt)
    embed_scale = d.embed_scale
    if embed_scale not in (None, "sqrt_hidden", "sqrt_hidden_bf16"):
        embed_scale = a[embed_scale]
    pre_divide = a["hidden_size"] / a["dim_model_base"] if d.head.pre_divide == "minicpm" else None
    post = (d.head.post[0], a[d.head.post[1]]) if d.head.post else None
    softcap = a["final_logit_softcapping"] if d.head.softcap == "gemma2" else d.head.softcap
    llama4 = None
    if d.query_scale == "llama4":
        rp = a["rope_parameters"]
        llama4 = (rp["llama_4_scaling_beta"], rp["original_max_position_embeddings"])

    return UniversalArgs(
        model_type=mt, fields=MappingProxyType(a), hidden=hidden, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab=vocab, intermediate=inter,
        eps=a[d.norm.eps] if d.norm.kind != "functional_rms" else 1e-5,
        attn_bias=bool(_get(a, d.attn_bias, mt)), out_bias=bool(_get(a, d.out_bias, mt)),
        mlp_bias=bool(_get(a, d.mlp.bias, mt)), norm_bias=bool(_get(a, d.norm.bias, mt)),
        qk_norm=bool(d.qk_norm and _get(a, d.qk_norm.enabled, mt)),
        attn_scale=_attn_scale(d, a, head_dim),
        attn_softcap=a["attn_logit_softcapping"] if d.attention == "softcap" else None,
        layers=layers, sliding_window=window, tie=tie, embed_scale=embed_scale,
        residual_scale=residual_scale, head_pre_divide=pre_divide, head_post=post,
        final_softcap=softcap, llama4=llama4, parallel=bool(_get(a, b.parallel, mt)),
    )
