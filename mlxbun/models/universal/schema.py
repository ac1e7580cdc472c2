"""The descriptor schema: what one row of the table (`table.py`) may say, checked when it is built.

A row (`ArchDescriptor`) is declarative: which branch of each op the arch takes
(qk-norm kind and place, norm kind and placement, MLP shape, attention dispatch,
rope kind, head post-processing, ...), which mlx-lm `ModelArgs` fields it reads
with their defaults, the module names of the mlx-lm file (so parameter paths and
safetensors names are identical), and the `sanitize` rules of that file.

Every branch choice is an enum. Rows may spell a kind as its string value; the
row's `__post_init__` turns it into the enum member, and a typo, a field name
the row does not declare, or a combination the graph has no branch for raises a
`DescriptorError` naming the model_type, the knob and the accepted values, at
import time instead of at the first forward.

Knobs typed `bool | str` are a literal or the name of a `ModelArgs` field (or "not FIELD": the
field negated, qwen's `not no_bias`);
knobs typed `SomeEnum | str` are a named computation or the name of a field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxbun.errors import MlxbunError
from mlxbun.models.universal.kinds import (
    BLOCK_SLOTS,
    POST_OVER,
    QKV,
    Act,
    AttnKind,
    AttnOutGate,
    AttnScale,
    BlockKind,
    EmbedScale,
    FinalSoftcap,
    HeadDim,
    KVShare,
    LayerKinds,
    MakeCache,
    MlpKind,
    MlpSize,
    NopeRule,
    NormKind,
    NormSlot,
    ParallelMlpNorm,
    ParallelSum,
    PostInit,
    PostOp,
    PreDivide,
    QKNormAt,
    QKNormKind,
    QueryScale,
    Residual,
    ResidualScale,
    RopeKind,
    StrEnum,
    SwigluClamp,
    TiedOp,
    TieRule,
)
from mlxbun.models.universal.kinds import kind_field as _kind
from mlxbun.models.universal.kinds_sanitize import SanitizeOp
from mlxbun.models.universal.fields import NOT
from mlxbun.models.universal.schema_checks import check_combinations
from mlxbun.models.universal.schema_hybrid import HybridKnobs, hybrid_refs
from mlxbun.models.universal.schema_mla import MlaKnobs
from mlxbun.models.universal.schema_moe import (  # the MoE knobs (StackExperts: sanitize.py reads it here)
    MoEKnobs,
    StackExperts,
    moe_refs,
)

REQUIRED = "<required>"  # a ModelArgs field without a default


class DescriptorError(MlxbunError):
    """A descriptor row names a kind, field or combination the universal graph does not have."""


# ----------------------------------------------------------------- descriptor parts


@dataclass(frozen=True)
class NormNames:
    """The block's norm modules by slot; None = the slot holds no norm."""

    pre_attn: str | None = "input_layernorm"
    post_attn: str | None = None
    pre_mlp: str | None = "post_attention_layernorm"
    post_mlp: str | None = None

    def of(self, slot: NormSlot) -> str | None:
        return getattr(self, slot.value)


@dataclass(frozen=True)
class Names:
    """mlx-lm attribute names: they are the parameter paths and the safetensors keys."""

    root: str = "model"  # Model.<root> holds embed / layers / final norm
    embed: str = "embed_tokens"
    layers: str = "layers"  # dotted "outer.inner": the list held one level down (plamo's layers.layers)
    final_norm: str | None = "norm"
    head: str = "lm_head"
    attn: str = "self_attn"  # dotted "outer.inner": the attention held one level down (exaone)
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
    norms: NormNames = NormNames()
    inner_norm: str = "norm"  # lille-130m: the pre-norm lives inside attention / mlp
    rope: str = "rope"  # the attention's rope child (qwen: rotary_emb)
    act: str = "act_fn"  # apertus: the XieLU module (it has parameters)
    attn_gate: str = "gate_proj"  # the attention's output gate (attn_gate knob; afmoe)
    sinks: str = "sinks"  # the attention's per-head sink logits (mimo_v2_flash: attention_sink_bias)
    wrapper: str | None = None  # a VLM wrapper's Model.<wrapper> holding root and head (qwen3_5:
    # language_model); its ModelArgs are text_config's (the whole config when it has none)


@dataclass(frozen=True)
class QKNormKnobs:
    kind: QKNormKind = _kind(QKNormKind)
    at: QKNormAt = _kind(QKNormAt)
    enabled: bool | str = True  # literal, or the ModelArgs field that switches it
    names: tuple[str, str] = ("q_norm", "k_norm")
    q_scale: str | None = None  # field: the normed queries times it (muse_glimmer's qk_scale_factor)


@dataclass(frozen=True)
class RopeKnobs:
    kind: RopeKind = _kind(RopeKind, RopeKind.INITIALIZE)
    theta: str | float = "rope_theta"  # field (dotted = nested key, e.g. rope_parameters.rope_theta),
    # or the literal base of a file that reads none (qwen: nn.RoPE's default 10000)
    traditional: bool | str = "rope_traditional"
    scaling: str | None = "rope_scaling"  # field holding the scaling dict, None = never scaled
    max_positions: str | None = "max_position_embeddings"
    partial: str | None = None  # field holding the rotary fraction: dims = int(head_dim * f)
    rotary_dim: str | None = None  # field holding the rope dims; when not None it wins over partial
    # (bailing_moe; minimax's required rotary_dim)
    nope: NopeRule | None = _kind(NopeRule, None)
    sliding_theta: str | None = None  # sliding layers: plain rope with this base, no scaling
    child: bool = True  # the rope is the attention's `rope` child module (nanochat: a function)
    nope_child: bool = True  # NoPE layers still have a `rope` child (exaone4: none)


@dataclass(frozen=True)
class MlpKnobs:
    kind: MlpKind = _kind(MlpKind, MlpKind.GATED)
    act: Act = _kind(Act, Act.SILU)
    bias: bool | str = False
    intermediate: MlpSize | str = _kind(MlpSize, "intermediate_size", or_field=True)


@dataclass(frozen=True)
class NormKnobs:
    kind: NormKind = _kind(NormKind, NormKind.RMS)
    eps: str | float = "rms_norm_eps"  # field, or a literal (phixtral: nn.LayerNorm's 1e-5);
    # functional_rms: unused, eps is 1e-5
    bias: bool | str = True  # layernorm kinds only
    offsets: Mapping[str, float] = field(default_factory=dict)  # offset_rms: slot (or "final") -> offset
    slot_eps: Mapping[str, str] = field(default_factory=dict)  # block slot -> the field holding its eps
    # (muse_glimmer's post norms: post_norm_eps); the others read eps
    final_kind: NormKind | None = _kind(NormKind, None)  # the final norm's kind when not kind's


@dataclass(frozen=True)
class BlockKnobs:
    kind: BlockKind = _kind(BlockKind, BlockKind.PRE)
    parallel: bool | str = False  # attention and MLP read the same input
    parallel_mlp_norm: ParallelMlpNorm = _kind(ParallelMlpNorm, ParallelMlpNorm.SHARED)
    parallel_sum: ParallelSum = _kind(ParallelSum, ParallelSum.ATTN_FF_X)
    residual: Residual = _kind(Residual, Residual.PLAIN)
    residual_scale: ResidualScale | str | None = _kind(ResidualScale, None, or_field=True)
    inner_norms: bool = False  # lille-130m: attention / mlp apply their own pre-norm

    def norm_slots(self, parallel: bool) -> tuple[NormSlot, ...]:
        """The slots holding a norm module, in module-tree order."""
        if self.inner_norms:
            return ()
        if parallel:
            if self.parallel_mlp_norm is ParallelMlpNorm.OWN:
                return (NormSlot.PRE_ATTN, NormSlot.PRE_MLP)
            return (NormSlot.PRE_ATTN,)
        return BLOCK_SLOTS[self.kind]


@dataclass(frozen=True)
class LogitScale:
    op: PostOp = _kind(PostOp)
    by: str = ""  # the ModelArgs field holding the divisor / multiplier


@dataclass(frozen=True)
class HeadKnobs:
    tie: bool | TieRule | str = _kind(TieRule, "tie_word_embeddings", or_field=True, or_bool=True)
    tied_op: TiedOp = _kind(TiedOp, TiedOp.AS_LINEAR)
    always: bool = False  # the lm_head module exists even when tied (helium)
    bias: bool | str = False  # literal or field (qwen: "not no_bias")
    in_root: bool = False  # the head is Model.<root>.<head> (gpt_neox embed_out)
    holds_norm: str | None = None  # Model.<head> is a module holding the final norm (names.final_norm)
    # and the head Linear (this name): phixtral's OutputHead (ln, linear)
    pre_divide: PreDivide | None = _kind(PreDivide, None)
    post: LogitScale | None = None
    softcap: FinalSoftcap = _kind(FinalSoftcap, FinalSoftcap.NONE)
    split: bool = False  # tensor parallel: an untied head splits its vocabulary across the ranks,
    # the logits gathered (mlx-lm qwen3_5's Model.shard); else it stays whole on every rank


@dataclass(frozen=True)
class LearnedPositions:
    """Learned absolute positions (gpt2, gpt_bigcode): `Model.<root>.<name>`, an Embedding of
    `size` rows, looked up at arange(L) + cache[0].offset and added to the token embedding."""

    size: str  # the ModelArgs field holding the number of positions (n_positions)
    name: str = "wpe"


@dataclass(frozen=True)
class LoopKnobs:
    """The layer stack run several times with the same weights (nanbeige; `looped.py`): the fields
    holding the loop count, the per-loop loss weights (when set, one loop per entry plus one) and
    whether the final norm runs once at the end instead of after every loop."""

    loops: str = "num_loops"
    loss_weights: str = "loop_loss_weights"
    skip_final_norm: str = "skip_loop_final_norm"


@dataclass(frozen=True)
class SlidingAttn:
    """Sliding layers' own head counts and q/k, value head dims: fields (mimo_v2_flash's swa_*)."""

    heads: str
    kv_heads: str
    head_dim: str
    v_head_dim: str


@dataclass(frozen=True)
class LayerKnobs:
    kinds: LayerKinds = _kind(LayerKinds, LayerKinds.ALL_FULL)
    sliding_window: str | None = None  # field
    period: str | None = None  # field for "period" (int) and "exaone" (pattern string)
    make_cache: MakeCache = _kind(MakeCache, MakeCache.DEFAULT)
    mask_array: bool = False  # gemma2: create_attention_mask(..., return_array=True)
    mask_window_extra: int = 0  # the sliding mask's window is sliding_window + this (plamo3: 1; the
    # rotating cache keeps sliding_window)
    kv_share: KVShare | None = _kind(KVShare, None)  # cla: fields use_cla, cla_share_factor
    sliding_heads: str | None = None  # field: a dict whose num_attention_heads /
    # num_attention_groups replace the head counts on sliding layers (step3p5)
    sliding_attn: SlidingAttn | None = None  # sliding layers' own head counts and dims (mimo_v2_flash)
    heads_per_layer: str | None = None  # field: every layer's query head count, a list (laguna)
    other_types: tuple[str, ...] = ()  # layer_types values a row's own forward runs besides the
    # attention kinds (gear's conv_mixer: gear.py), accepted by coverage
    kv_heads_per_layer: str | None = None  # field: every layer's KV head count, a list (openelm; the
    # row's n_heads / n_kv_heads None: the model-wide counts are layer 0's)


@dataclass(frozen=True)
class SanitizeRule:
    """One step of the mlx-lm file's `sanitize`, applied to the weight dict in order."""

    op: SanitizeOp = _kind(SanitizeOp)
    arg: Any = None
    reason: str = ""


@dataclass(frozen=True)
class ArchDescriptor:
    model_type: str
    fields: Mapping[str, Any]  # mlx-lm ModelArgs fields -> default (REQUIRED: no default)
    post_init: tuple[PostInit, ...] = ()  # named ModelArgs.__post_init__ steps
    # sizes
    hidden: str = "hidden_size"
    n_layers: str = "num_hidden_layers"
    n_heads: str | None = "num_attention_heads"  # None: per layer only (layers.kv_heads_per_layer)
    n_kv_heads: str | None = "num_key_value_heads"  # None: = n_heads (MHA)
    vocab: str = "vocab_size"
    head_dim: HeadDim = _kind(HeadDim, HeadDim.OR_SPLIT)
    names: Names = Names()
    # a VLM wrapper's own ModelArgs fields (top-level key -> default) its __post_init__ writes
    # over text_config's (gemma3: vocab_size, 262208); needs names.wrapper
    wrapper_fields: Mapping[str, Any] = field(default_factory=dict)
    # text_config fields the wrapper's __post_init__ sets whatever text_config holds (pixtral:
    # tie_word_embeddings False); needs names.wrapper
    wrapper_sets: Mapping[str, Any] = field(default_factory=dict)
    # a wrapper whose mlx-lm file picks the text model by text_config.model_type (mistral3:
    # ministral3): that model_type -> the row run then (same model_type and wrapper); any other
    # text model_type runs this row
    text_rows: Mapping[str, ArchDescriptor] = field(default_factory=dict)
    # the wrapper's ModelArgs require text_config (a dataclass field without a default: gemma3,
    # pixtral, mistral3...); False: a config without one is the text config (qwen2_vl's from_dict)
    text_config_required: bool = False
    # attention
    qkv: QKV = _kind(QKV, QKV.SEPARATE)
    attn_bias: bool | str = False
    out_bias: bool | str = False
    qk_norm: QKNormKnobs | None = None
    attn_scale: AttnScale = _kind(AttnScale, AttnScale.HEAD_DIM)
    attention: AttnKind = _kind(AttnKind, AttnKind.SDPA)
    sinks: bool = False  # gpt_oss: per-head sink logits `sinks` [H] on the attention, passed to sdpa
    sinks_when: tuple[str, str] | None = None  # bool fields: sinks on (full, sliding) layers (mimo)
    v_head_dim: str | None = None  # field: the value head dim when not head_dim (mimo_v2_flash)
    value_scale: str | None = None  # field: values * it after the head reshape, unless None (mimo)
    kv_tile: str | None = None  # field (plamo's n_shared_head): KV heads = ceil(heads / it), and the
    # cached keys / values tiled to the query heads (mx.tile: query head j reads KV head j % KV)
    query_scale: QueryScale | None = _kind(QueryScale, None)
    attn_gate: AttnOutGate | None = _kind(AttnOutGate, None)  # gate on the attention output
    attn_gate_when: str | None = None  # the bool field switching attn_gate (None: always)
    swiglu_clamp: SwigluClamp | None = _kind(SwigluClamp, None)  # per-layer clamped SwiGLU
    rope: RopeKnobs = RopeKnobs()
    mlp: MlpKnobs = MlpKnobs()
    norm: NormKnobs = NormKnobs()
    block: BlockKnobs = BlockKnobs()
    embed_scale: EmbedScale | str | None = _kind(EmbedScale, None, or_field=True)
    embed_norm: bool | str = False  # functional rms_norm after the embedding: True at eps 1e-5
    # (nanochat), or the field holding its eps (muse_glimmer: rms_norm_eps)
    text_config_merge: bool = False  # ModelArgs.from_dict reads text_config's keys over the top level's
    # (muse_glimmer); no wrapper module
    positions: LearnedPositions | None = None  # learned absolute positions added to the embedding
    loops: LoopKnobs | None = None  # the layer stack run several times (nanbeige: looped.py)
    head: HeadKnobs = HeadKnobs()
    layers: LayerKnobs = LayerKnobs()
    moe: MoEKnobs | None = None
    hybrid: HybridKnobs | None = None  # recurrent mixers on some layers (schema_hybrid.py)
    mla: MlaKnobs | None = None  # multi-head latent attention on every layer (mla.py; deepseek_v2)
    sanitize: tuple[SanitizeRule, ...] = ()
    # config keys mlx-lm deliberately ignores for this arch (known; reported, never refused)
    ignored_keys: Mapping[str, str] = field(default_factory=dict)
    # config keys whose value must be one mlx-lm implements (e.g. hidden_act)
    accepted_values: Mapping[str, tuple] = field(default_factory=dict)
    # config keys mlx-lm does not read that must equal a field it does read (gpt_neox rope_theta)
    aliases: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""

    def __post_init__(self):
        _check_kinds(self, self, "")
        post_init = tuple(_coerce(self, f"post_init[{i}]", PostInit, s)
                          for i, s in enumerate(self.post_init))
        object.__setattr__(self, "post_init", post_init)
        check_combinations(self)
        for where, name in self.field_refs():
            if name.removeprefix(NOT).partition(".")[0] not in self.fields:
                raise self.error(f"{where} reads the field {name!r}, which is not among the row's "
                                 f"ModelArgs fields ({', '.join(self.fields)})")

    def error(self, msg: str) -> DescriptorError:
        return DescriptorError(f"descriptor {self.model_type!r}: {msg}")

    def field_refs(self) -> Iterator[tuple[str, str]]:
        """(knob, ModelArgs field) for every field the resolution of this row reads."""
        yield from (("hidden", self.hidden), ("n_layers", self.n_layers), ("vocab", self.vocab))
        if self.n_heads:
            yield "n_heads", self.n_heads
        if self.n_kv_heads:
            yield "n_kv_heads", self.n_kv_heads
        if self.head_dim is not HeadDim.SPLIT:
            yield "head_dim", "head_dim"
        for knob, value in (("attn_bias", self.attn_bias), ("out_bias", self.out_bias), ("head.bias", self.head.bias),
                            ("mlp.bias", self.mlp.bias), ("norm.bias", self.norm.bias),
                            ("block.parallel", self.block.parallel),
                            ("qk_norm.enabled", self.qk_norm.enabled if self.qk_norm else False)):
            if isinstance(value, str):
                yield knob, value
        if self.attn_scale in (AttnScale.QPAS_INV_SQRT, AttnScale.QPAS_POW):
            yield "attn_scale", "query_pre_attn_scalar"
        elif self.attn_scale is AttnScale.ATTENTION_MULTIPLIER:
            yield "attn_scale", "attention_multiplier"
        if self.attention is AttnKind.SOFTCAP:
            yield "attention", "attn_logit_softcapping"
        if self.query_scale is QueryScale.LLAMA4:
            yield "query_scale", "rope_parameters"
        if self.attn_gate_when:
            yield "attn_gate_when", self.attn_gate_when
        if self.swiglu_clamp is SwigluClamp.PER_LAYER_LISTS:
            yield from (("swiglu_clamp", "swiglu_limits"), ("swiglu_clamp", "swiglu_limits_shared"))
        yield from self._rope_refs()
        if not isinstance(self.mlp.intermediate, MlpSize):
            yield "mlp.intermediate", self.mlp.intermediate
        elif self.mlp.intermediate is MlpSize.HALF_INTERMEDIATE:
            yield "mlp.intermediate", "intermediate_size"
        elif self.mlp.intermediate is MlpSize.SCALED_HIDDEN:
            yield "mlp.intermediate", "hidden_dim_scale_factor"
        elif self.mlp.intermediate is MlpSize.MAKE_DIVISIBLE:
            yield from (("mlp.intermediate", "ffn_multipliers"), ("mlp.intermediate", "ffn_dim_divisor"))
        if self.norm.kind is not NormKind.FUNCTIONAL_RMS and isinstance(self.norm.eps, str):
            yield "norm.eps", self.norm.eps
        b = self.block
        if b.residual_scale is ResidualScale.MINICPM_DEPTH:
            yield from (("block.residual_scale", "scale_depth"),
                        ("block.residual_scale", "num_hidden_layers"))
        elif b.residual_scale is not None:
            yield "block.residual_scale", b.residual_scale
        if self.embed_scale in (EmbedScale.SQRT_HIDDEN, EmbedScale.SQRT_HIDDEN_BF16):
            yield "embed_scale", "hidden_size"
        elif self.embed_scale is EmbedScale.SQRT_HIDDEN_MUP:
            yield from (("embed_scale", "hidden_size"), ("embed_scale", "mup_enabled"))
        elif self.embed_scale is not None:
            yield "embed_scale", self.embed_scale
        if self.positions is not None:
            yield "positions.size", self.positions.size
        if isinstance(self.embed_norm, str):
            yield "embed_norm", self.embed_norm
        yield from (("norm.slot_eps", f) for f in self.norm.slot_eps.values())
        if self.qk_norm is not None and self.qk_norm.q_scale:
            yield "qk_norm.q_scale", self.qk_norm.q_scale
        if self.loops is not None:
            yield from ((f"loops.{k}", v) for k, v in dataclasses.asdict(self.loops).items())
        h = self.head
        if isinstance(h.tie, str) and not isinstance(h.tie, TieRule):
            yield "head.tie", h.tie
        if h.pre_divide is PreDivide.WIDTH_RATIO:
            yield from (("head.pre_divide", "hidden_size"), ("head.pre_divide", "dim_model_base"))
        if h.post is not None:
            yield from (("head.post", f) for f in (h.post.by, POST_OVER.get(h.post.op)) if f)
        if h.softcap is FinalSoftcap.FIELD:
            yield "head.softcap", "final_logit_softcapping"
        lk = self.layers
        if lk.kinds in (LayerKinds.LAYER_TYPES, LayerKinds.LAYER_TYPES_OLMO3,
                        LayerKinds.LAYER_TYPES_OR_EVEN):
            yield "layers.kinds", "layer_types"
        if lk.sliding_heads:
            yield "layers.sliding_heads", lk.sliding_heads
        for knob, value in (("sinks_when", self.sinks_when or ()), ("v_head_dim", (self.v_head_dim,)),
                            ("kv_tile", (self.kv_tile,)),
                            ("value_scale", (self.value_scale,)),
                            ("layers.heads_per_layer", (lk.heads_per_layer,)),
                            ("layers.kv_heads_per_layer", (lk.kv_heads_per_layer,))):
            yield from ((knob, f) for f in value if f)
        if lk.kinds is LayerKinds.HYBRID_PATTERN:
            yield "layers.kinds", "hybrid_layer_pattern"
        if lk.sliding_attn is not None:
            yield from ((f"layers.sliding_attn.{k}", v) for k, v in dataclasses.asdict(lk.sliding_attn).items())
        if lk.period:
            yield "layers.period", lk.period
        if lk.sliding_window:
            yield "layers.sliding_window", lk.sliding_window
        if lk.kv_share is KVShare.CLA:
            yield from (("layers.kv_share", "use_cla"), ("layers.kv_share", "cla_share_factor"))
        if self.moe is not None:
            yield from moe_refs(self.moe)
        if self.mla is not None:
            yield from (("mla", name) for name in self.mla.field_names())
        if self.hybrid is not None:
            yield from hybrid_refs(self.hybrid)

    def _rope_refs(self) -> Iterator[tuple[str, str]]:
        r = self.rope
        if r.kind is RopeKind.LAYER_TYPE_PARAMS:  # every number comes from rope_parameters
            yield from (("rope", "rope_parameters"), ("rope", "layer_types"),
                        ("rope", "max_position_embeddings"))
            return
        if r.kind is RopeKind.LAYER_TYPE_PLAIN:
            yield from (("rope", "rope_parameters"), ("rope", "layer_types"))
            return
        if r.kind is RopeKind.LAYER_TYPE_PARTIAL:
            yield from (("rope", f) for f in ("rope_parameters", "layer_types", "partial_rotary_factor",
                                              "max_position_embeddings"))
            return
        if r.kind is RopeKind.PER_LAYER_LISTS:
            yield from (("rope", f) for f in ("rope_theta", "partial_rotary_factors", "yarn_only_types",
                                              "rope_scaling", "max_position_embeddings", "layer_types"))
            return
        if r.nope is NopeRule.ALL:
            return
        if isinstance(r.theta, str):
            yield "rope.theta", r.theta
        if r.partial:
            yield "rope.partial", r.partial
        if r.rotary_dim:
            yield "rope.rotary_dim", r.rotary_dim
        nope = {NopeRule.NO_ROPE_LAYERS: "no_rope_layers", NopeRule.NOPE_TYPE: "position_embedding_type"}
        if r.nope in nope:
            yield "rope.nope", nope[r.nope]
        if r.kind is RopeKind.INITIALIZE:
            for knob, value in (("rope.traditional", r.traditional), ("rope.scaling", r.scaling),
                                ("rope.max_positions", r.max_positions),
                                ("rope.sliding_theta", r.sliding_theta)):
                if isinstance(value, str):
                    yield knob, value
        elif r.kind is RopeKind.PHI3:
            yield from (("rope", f) for f in ("rope_traditional", "rope_scaling",
                                              "max_position_embeddings",
                                              "original_max_position_embeddings"))
        elif r.kind in (RopeKind.NEMOTRON, RopeKind.HUNYUAN_ALPHA):
            yield "rope", "rope_scaling"
        elif r.kind is RopeKind.SU_SCALED:
            yield from (("rope", f) for f in ("rope_scaling", "max_position_embeddings",
                                              "original_max_position_embeddings"))


# ----------------------------------------------------------------- checks


def _coerce(d: ArchDescriptor, where: str, enum: type[StrEnum], value: Any, *,
            or_field: bool = False, or_bool: bool = False, optional: bool = False):
    if isinstance(value, enum) or (value is None and optional) or (isinstance(value, bool) and or_bool):
        return value
    if isinstance(value, str):
        if value in enum._value2member_map_:
            return enum(value)
        if or_field and value.partition(".")[0] in d.fields:
            return value
    accepted = ", ".join(repr(m.value) for m in enum)
    also = (" or one of the row's ModelArgs fields" if or_field else "") + \
        (" or a bool" if or_bool else "") + (" or None" if optional else "")
    raise d.error(f"{where} = {value!r} is not one of {accepted}{also}")


def _check_kinds(d: ArchDescriptor, obj: Any, prefix: str) -> None:
    """Turn every kind of `obj` (and its nested knob groups) into its enum member, in place."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        where = f"{prefix}{f.name}"
        if "kind" in f.metadata:
            meta = f.metadata
            new = _coerce(d, where, meta["kind"], value, or_field=meta["or_field"],
                          or_bool=meta["or_bool"], optional=meta["optional"])
            if new is not value:
                changes[f.name] = new
        elif dataclasses.is_dataclass(value):
            changes[f.name] = _check_kinds(d, value, f"{where}.")
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            changes[f.name] = tuple(_check_kinds(d, v, f"{where}[{i}].") for i, v in enumerate(value))
    if obj is d:
        for name, value in changes.items():
            object.__setattr__(d, name, value)
        return d
    return dataclasses.replace(obj, **changes) if changes else obj
