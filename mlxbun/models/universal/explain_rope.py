"""The rope line of `mlxbun explain` per layer: the rope kind of a layer's `RopeSpec` in words
(dims, base, scaling parameters), or NoPE."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxbun.models.rope import rope_type_of
from mlxbun.models.universal.kinds import RopeKind
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, UniversalArgs

__all__ = ["rope_text"]


def rope_text(layer: LayerSpec, d: ArchDescriptor, a: UniversalArgs) -> str:
    spec = layer.rope
    if spec is None:
        return "NoPE (no rotary embedding)"
    dims = "hd"
    if d.rope.rotary_dim and a.fields[d.rope.rotary_dim] is not None:
        dims = f"{spec.dims} of hd ({d.rope.rotary_dim})"
    elif d.rope.partial:
        dims = f"{spec.dims} of hd ({d.rope.partial} {a.fields[d.rope.partial]})"
    elif spec.dims != a.head_dim:  # step3p5: partial_rotary_factors[i]
        dims = f"{spec.dims} of hd"
    trad = f", traditional {spec.traditional}" if spec.traditional else ""
    if spec.kind is RopeKind.LAYER_TYPE_PLAIN:  # spark2_5
        return (f"nn.RoPE, dims {dims}, base {spec.base} "
                f"(rope_parameters[{a.fields['layer_types'][layer.index]!r}]){trad}")
    if spec.kind in (RopeKind.INITIALIZE, RopeKind.LAYER_TYPE_PARAMS, RopeKind.PER_LAYER_LISTS,
                     RopeKind.LAYER_TYPE_PARTIAL):
        kind = rope_type_of(spec.scaling)
        params = {k: v for k, v in (spec.scaling or {}).items()
                  if k not in ("type", "rope_type", "rope_theta")}
        extra = f", {_short(params)}" if params else ""
        local = (f" ({d.rope.sliding_theta}, unscaled)" if layer.sliding and d.rope.sliding_theta
                 else "")
        if spec.kind in (RopeKind.LAYER_TYPE_PARAMS, RopeKind.LAYER_TYPE_PARTIAL):
            local = f" (rope_parameters[{a.fields['layer_types'][layer.index]!r}])"
        return f"{kind} rope, dims {dims}, base {spec.base}{local}{trad}{extra}"
    if spec.kind is RopeKind.PHI3:
        kind = spec.scaling["type"] if spec.scaling else "default"
        if kind in ("longrope", "su"):
            return (f"phi3 su-scaled rope (long factors), dims {dims}, base {spec.base}, "
                    f"original_max_position_embeddings {spec.original_max_positions}")
        scale = f", scale 1/{spec.scaling['factor']}" if kind == "linear" else ""
        return f"phi3 rope, dims {dims}, base {spec.base}{trad}{scale}"
    if spec.kind is RopeKind.NEMOTRON:
        return f"nn.RoPE, dims {dims}, base {spec.base}, scale {spec.scale}"
    if spec.kind is RopeKind.SU_SCALED:
        if spec.scaling is None:
            return f"nn.RoPE, dims {dims}, base {spec.base} (rope_scaling null)"
        return (f"su-scaled rope (long factors, long_mscale {spec.scaling['long_mscale']}), dims "
                f"{dims}, base {spec.base}, original_max_position_embeddings "
                f"{spec.original_max_positions}")
    if spec.kind is RopeKind.HUNYUAN_ALPHA:
        return (f"NTK-alpha rope, dims {dims}, base {spec.base} * alpha**(dims / (dims - 2)), "
                f"alpha {spec.alpha}")
    return f"nanochat rope (negated exp frequencies), dims {dims}, base {spec.base}"


def _short(params: Mapping[str, Any]) -> str:
    def value(v):
        return f"[{len(v)} values]" if isinstance(v, list) and len(v) > 4 else v
    return ", ".join(f"{k} {value(v)}" for k, v in params.items())
