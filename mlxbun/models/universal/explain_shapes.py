"""The attention's own per-layer shapes in `mlxbun explain`'s listing (explain.py makes the pairs
its `Line`s)."""

from __future__ import annotations

from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["own_shapes"]


def own_shapes(d: ArchDescriptor, a: UniversalArgs):
    """(code, note) lines: mimo_v2_flash's value head dim, sliding layers' own shape and value
    scale; laguna's / openelm's per-layer heads; openelm's per-layer MLP widths."""
    if d.v_head_dim:
        yield ("(values: vd = v_head_dim, v Linear(D, KV*vd), out Linear(H*vd, D))",
               f"vd = {a.fields[d.v_head_dim]}")
    if d.layers.heads_per_layer:
        kv = d.layers.kv_heads_per_layer
        yield ("(per layer: H = " + ", ".join(str(s.heads[0]) for s in a.layers)
               + ("; KV = " + ", ".join(str(s.heads[1]) for s in a.layers) if kv else "") + ")",
               f"from {d.layers.heads_per_layer}" + (f", {kv}" if kv else ""))
    if any(s.width for s in a.layers):  # openelm
        yield ("(per layer MLP width: I = " + ", ".join(str(s.width) for s in a.layers) + ")",
               f"{d.mlp.intermediate.value}")
    sa = d.layers.sliding_attn
    if sa is not None:
        own = sorted({(s.heads, s.dims, s.scale) for s in a.layers if s.sliding})
        yield ("(sliding layers: H, KV, hd, vd = " + ", ".join(
            f"{h}, {kv}, {hd}, {vd}; scale {sc}" for (h, kv), (hd, vd), sc in own) + ")",
            f"from {sa.heads}, {sa.kv_heads}, {sa.head_dim}, {sa.v_head_dim}; rope dims and scale "
            "from their hd")
    if d.value_scale and a.fields[d.value_scale] is not None:
        yield ("v = v * value_scale", f"{d.value_scale} = {a.fields[d.value_scale]}, before rope "
               "and the cache")
