"""Every knob of a descriptor row, placed by what the fused decode step does with it.

The fused kernels compute one fixed dense block; a row reaches them only when each of its knobs is
one the plan follows. So that a knob added to the schema cannot reach the kernels unread, every
field of `ArchDescriptor` (and every field of its knob groups: `rope.theta`, `head.bias`, ...) is
placed in exactly one of three sets (tests/test_fused_decode.py fails on one placed nowhere):

- `AT_DEFAULT`: the kernels do not do it; a row that sets it is refused, naming the knob;
- `READ`: the plan reads what it decides from the built modules or the resolved args, and
  `fused_plan` refuses the values the kernels lack (a LayerNorm module, a sliding layer, a
  non-SDPA attention, ...);
- `NOT_MATH`: how a config or checkpoint is read (field names, sanitize steps, notes), not the
  token's math.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Optional

from mlxbun.models.universal import schema

__all__ = ["AT_DEFAULT", "GROUPS", "NOT_MATH", "READ", "knob_gap", "knob_paths"]

AT_DEFAULT = frozenset({
    "v_head_dim", "kv_tile", "query_scale", "swiglu_clamp", "positions", "loops",
    "qk_norm.q_scale", "head.tied_op", "head.bias", "head.holds_norm",
})
READ = frozenset({
    "hidden", "n_layers", "n_heads", "n_kv_heads", "vocab", "head_dim", "qkv", "attn_bias", "out_bias",
    "attn_scale", "attention", "sinks", "sinks_when", "value_scale", "attn_gate", "attn_gate_when",
    "embed_scale", "embed_norm", "moe", "hybrid", "mla",
    "qk_norm.kind", "qk_norm.at", "qk_norm.enabled",
    "rope.kind", "rope.theta", "rope.traditional", "rope.scaling", "rope.max_positions", "rope.partial",
    "rope.rotary_dim", "rope.nope", "rope.sliding_theta", "rope.child", "rope.nope_child",
    "mlp.kind", "mlp.act", "mlp.bias", "mlp.intermediate",
    "norm.kind", "norm.eps", "norm.bias", "norm.offsets", "norm.slot_eps", "norm.final_kind",
    "block.kind", "block.parallel", "block.parallel_mlp_norm", "block.parallel_sum", "block.residual",
    "block.residual_scale", "block.inner_norms",
    "head.tie", "head.in_root", "head.pre_divide", "head.post", "head.softcap",
    "layers.kinds", "layers.sliding_window", "layers.period", "layers.make_cache", "layers.mask_array",
    "layers.mask_window_extra", "layers.kv_share", "layers.sliding_heads", "layers.sliding_attn",
    "layers.heads_per_layer", "layers.other_types", "layers.kv_heads_per_layer",
})
NOT_MATH = frozenset({
    "model_type", "fields", "post_init", "names", "wrapper_fields", "wrapper_sets", "text_rows",
    "text_config_required", "text_config_merge", "sanitize", "ignored_keys", "accepted_values", "aliases",
    "notes", "qk_norm.names", "head.always", "head.split",
})
# The knob groups whose fields are placed one by one (a field of any other type is placed whole)
GROUPS = {"qk_norm": schema.QKNormKnobs, "rope": schema.RopeKnobs, "mlp": schema.MlpKnobs,
          "norm": schema.NormKnobs, "block": schema.BlockKnobs, "head": schema.HeadKnobs,
          "layers": schema.LayerKnobs}


def knob_paths() -> Iterator[str]:
    """Every knob of the schema: ArchDescriptor's fields, a group's as GROUP.FIELD."""
    for f in dataclasses.fields(schema.ArchDescriptor):
        if f.name in GROUPS:
            yield from (f"{f.name}.{g.name}" for g in dataclasses.fields(GROUPS[f.name]))
        else:
            yield f.name


def _default(cls: type, name: str) -> Any:
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return f.default


def knob_gap(descriptor: schema.ArchDescriptor) -> Optional[str]:
    """The first AT_DEFAULT knob the row sets, as a reason; None when it sets none."""
    for path in sorted(AT_DEFAULT):
        group, _, name = path.rpartition(".")
        owner = getattr(descriptor, group) if group else descriptor
        if owner is None:  # a group left out (qk_norm None): its knobs are at their defaults
            continue
        value = getattr(owner, name)
        if value != _default(GROUPS[group] if group else schema.ArchDescriptor, name):
            return f"the {path} knob ({value!r}: the fused kernels do not do it)"
    return None
