"""The combinations a descriptor row may not make (`schema.ArchDescriptor.__post_init__` calls
`check_combinations`): knob values the universal graph has no branch for together, each refused
with the row's DescriptorError naming the knobs."""

from __future__ import annotations

from mlxbun.models.universal.kinds import (
    FUSED_ACTS,
    GATED_ACTS,
    PLAIN_ACTS,
    QKV,
    AttnKind,
    AttnOutGate,
    LayerKinds,
    MakeCache,
    MlpKind,
    NopeRule,
    NormKind,
    NormSlot,
    QKNormAt,
    Residual,
    RopeKind,
)
from mlxbun.models.universal.kinds_mla import MlaKind
from mlxbun.models.universal.kinds_sanitize import SanitizeOp
from mlxbun.models.universal.schema_hybrid import check_hybrid, check_hybrid_sanitize
from mlxbun.models.universal.schema_moe import StackExperts, check_moe

__all__ = ["check_combinations"]


def check_combinations(d) -> None:
    """Combinations the graph has no branch for (d: the ArchDescriptor being built); raises its
    DescriptorError naming the row and the knobs."""
    m = d.mlp
    acts = {MlpKind.GATED: GATED_ACTS, MlpKind.GATED_FUSED: FUSED_ACTS, MlpKind.PLAIN: PLAIN_ACTS}[m.kind]
    if m.act not in acts:
        raise d.error(f"mlp.act = {m.act.value!r} with mlp.kind {m.kind.value!r}: accepted "
                      f"{', '.join(repr(a.value) for a in acts)}")
    b = d.block
    # a literal `parallel` fixes the block form; a field name allows both
    forms = (b.parallel,) if isinstance(b.parallel, bool) else (False, True)
    slots = {s for parallel in forms for s in b.norm_slots(parallel)}
    unnamed = sorted(s.value for s in slots if d.names.norms.of(s) is None)
    if unnamed:
        raise d.error(f"block uses norm slot(s) {', '.join(unnamed)} that names.norms leaves "
                      f"unnamed")
    if (b.residual is Residual.SCALED) != (b.residual_scale is not None):
        raise d.error("block.residual 'scaled' and block.residual_scale go together")
    if "." in d.names.attn and (d.names.attn.count(".") > 1 or d.hybrid is not None or d.mla is not None):
        raise d.error(f"names.attn {d.names.attn!r}: a dotted name is one level of holder around the "
                      "attention, in a row without hybrid or mla knobs")
    if d.names.final_norm is None and d.norm.kind is not NormKind.FUNCTIONAL_RMS:
        raise d.error("names.final_norm is None but norm.kind has a module")
    if d.qkv is QKV.FUSED_NEOX and d.qk_norm and d.qk_norm.at is not QKNormAt.AFTER_ROPE:
        raise d.error("a fused_neox projection takes q/k norms only after rope")
    lk = d.layers
    if lk.kinds in (LayerKinds.PERIOD, LayerKinds.EXAONE) and not lk.period:
        raise d.error(f"layers.kinds {lk.kinds.value!r} needs layers.period (the pattern field)")
    if lk.make_cache is MakeCache.ROTATING_SLIDING and not lk.sliding_window:
        raise d.error("layers.make_cache 'rotating_sliding' needs layers.sliding_window")
    if lk.kv_share is not None and (d.qkv is not QKV.SEPARATE or d.block.parallel is not False):
        raise d.error("layers.kv_share takes separate q/k/v projections and a sequential block")
    if d.sinks and d.attention is not AttnKind.SDPA:
        raise d.error(f"sinks with attention {d.attention.value!r}: only 'sdpa' takes attention sinks")
    if d.sinks_when is not None and not d.sinks:
        raise d.error("sinks_when names the fields switching sinks, which are off")
    if (d.sinks_when or lk.sliding_attn or d.v_head_dim or d.value_scale
            or d.attn_gate is AttnOutGate.QUERY_SIGMOID) and d.qkv is not QKV.SEPARATE:
        raise d.error("sinks_when, layers.sliding_attn, v_head_dim, value_scale, query_sigmoid take separate q/k/v")
    if lk.sliding_attn is not None and (lk.kinds is LayerKinds.ALL_FULL or lk.sliding_heads):
        raise d.error("layers.sliding_attn needs sliding layers and excludes layers.sliding_heads")
    if d.rope.nope in (NopeRule.GLOBAL_LAYERS, NopeRule.SLIDING_OR_ALL) and lk.kinds is LayerKinds.ALL_FULL:
        raise d.error(f"rope.nope {d.rope.nope.value!r} needs sliding layers (layers.kinds)")
    if d.attn_gate_when and d.attn_gate is None:
        raise d.error("attn_gate_when names the field switching attn_gate, which is unset")
    if (d.rope.kind in (RopeKind.LAYER_TYPE_PARAMS, RopeKind.LAYER_TYPE_PARTIAL, RopeKind.LAYER_TYPE_PLAIN)
            and lk.kinds is not LayerKinds.LAYER_TYPES):
        raise d.error(f"rope.kind {d.rope.kind.value!r} reads rope_parameters by layer_types: "
                      "layers.kinds must be 'layer_types'")
    if lk.heads_per_layer and (lk.sliding_attn is not None or lk.sliding_heads
                               or not (d.n_kv_heads or lk.kv_heads_per_layer)):
        raise d.error("layers.heads_per_layer needs n_kv_heads or kv_heads_per_layer, excludes sliding_attn / "
                      "sliding_heads")
    # (n_heads None without per-layer lists: a row with no attention head count field, mamba's,
    # rwkv7's: the attention sizes are placeholders)
    if lk.kv_heads_per_layer and (d.n_heads or d.n_kv_heads or not lk.heads_per_layer or d.mla or d.hybrid
                                  or d.kv_tile):
        raise d.error("layers.kv_heads_per_layer goes with heads_per_layer and n_heads / n_kv_heads None "
                      "(every layer its own counts), without mla, hybrid or kv_tile knobs")
    if d.wrapper_fields and (not d.names.wrapper or not set(d.wrapper_fields) <= set(d.fields)):
        raise d.error("wrapper_fields needs names.wrapper and names ModelArgs fields only")
    if d.wrapper_sets and (not d.names.wrapper or not set(d.wrapper_sets) <= set(d.fields)
                           or set(d.wrapper_sets) & set(d.wrapper_fields)):
        raise d.error("wrapper_sets needs names.wrapper and names ModelArgs fields only, none of "
                      "wrapper_fields'")
    if d.loops is not None and (d.hybrid or d.moe or d.mla or d.layers.kv_share or d.embed_scale or d.positions
                                or d.layers.kinds is not LayerKinds.ALL_FULL or d.names.final_norm is None):
        raise d.error("loops take a plain row: full attention everywhere, a final norm module, no hybrid, "
                      "MoE, MLA, KV sharing, embedding scale or positions (looped.py runs nothing else)")
    if d.kv_tile and (d.n_kv_heads or d.qkv is not QKV.SEPARATE or d.mla or d.hybrid or d.layers.kv_share):
        raise d.error("kv_tile computes the KV heads (n_kv_heads None) of separate q/k/v projections in a "
                      "row without mla, hybrid or KV-sharing knobs")
    if d.names.layers.count(".") > 1 or ("." in d.names.layers and (d.hybrid or d.loops)):
        raise d.error(f"names.layers {d.names.layers!r}: a dotted name is one level of holder around the "
                      "layer list, in a row without hybrid or loops knobs")
    if d.mlp.intermediate == "make_divisible" and (d.moe or d.hybrid):
        raise d.error("mlp.intermediate 'make_divisible' (a width per layer) takes a dense row")
    slots = {s.value for s in NormSlot} | {"final"}
    if d.norm.offsets and (d.norm.kind is not NormKind.OFFSET_RMS or not set(d.norm.offsets) <= slots):
        raise d.error(f"norm.offsets go with norm.kind 'offset_rms', keyed by {', '.join(sorted(slots))}")
    if not set(d.norm.slot_eps) <= slots - {"final"} or (d.norm.final_kind or d.norm.slot_eps) and (
            NormKind.FUNCTIONAL_RMS in (d.norm.kind, d.norm.final_kind) or d.head.holds_norm):
        raise d.error("norm.slot_eps (keyed by block slot) and norm.final_kind take module norms (not "
                      "functional_rms) and a final norm in the root")
    if d.text_config_merge and d.names.wrapper:
        raise d.error("text_config_merge reads text_config's keys in a row without a wrapper module")
    if d.layers.mask_window_extra and not d.layers.sliding_window:
        raise d.error("layers.mask_window_extra widens the sliding mask: it needs layers.sliding_window")
    if d.head.holds_norm and (d.head.in_root or d.head.tie is not False or d.names.final_norm is None
                              or d.names.wrapper or d.head.split):
        raise d.error("head.holds_norm puts the final norm in an untied head module (head.tie False), "
                      "not in the root, a wrapper or a vocabulary split")
    if "." in d.names.embed and d.names.embed.count(".") > 1:
        raise d.error(f"names.embed {d.names.embed!r}: a dotted name is one level of holder")
    if d.text_config_required and not d.names.wrapper:
        raise d.error("text_config_required needs names.wrapper")
    if d.text_rows and (not d.names.wrapper or any(
            not isinstance(r, type(d)) or r.model_type != d.model_type
            or r.names.wrapper != d.names.wrapper or r.text_rows for r in d.text_rows.values())):
        raise d.error("text_rows needs names.wrapper and rows of the same model_type and wrapper "
                      "(without text_rows of their own)")
    if d.hybrid is not None:
        check_hybrid(d)
    else:  # the args of the ops the hybrid rows brought, which the wrappers use too
        check_hybrid_sanitize(d)
    if d.moe is not None:
        check_moe(d, d.moe, StackExperts)
    elif any(r.op in _MOE_SANITIZE for r in d.sanitize):
        raise d.error("sanitize rules stack_experts / split_glu_experts / split_interleaved_experts / "
                      "rename_in_moe_layers need a moe block")
    if any(r.op is SanitizeOp.SPLIT_KV_B for r in d.sanitize) and (
            d.mla is None or d.mla.kind is MlaKind.EXPANDED):
        raise d.error("sanitize rule split_kv_b needs mla knobs of kind 'absorbed' or 'absorbed_decode'")
    if d.mla is not None and (d.mla.indexer is not None) != (d.mla.kind is MlaKind.ABSORBED_INDEXED):
        raise d.error("mla kind 'absorbed_indexed' and mla.indexer go together (deepseek_v32's DSA indexer)")
    if d.mla is not None and (d.query_scale is not None) != (d.mla.kind is MlaKind.ABSORBED_DECODE):
        raise d.error("mla kind 'absorbed_decode' and query_scale go together (mistral4's llama-4 scale)")


_MOE_SANITIZE = (SanitizeOp.STACK_EXPERTS, SanitizeOp.SPLIT_GLU_EXPERTS, SanitizeOp.SPLIT_INTERLEAVED_EXPERTS,
                 SanitizeOp.RENAME_IN_MOE_LAYERS)
