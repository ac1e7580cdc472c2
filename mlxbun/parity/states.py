"""Recurrent-state diffing: the arrays a hybrid's recurrent layers keep between forwards (an
ArraysCache's slots: a conv window, an SSM / delta-rule state) compared after each step.

A recurrent layer's output can agree bit for bit while the state it leaves behind does not (a
wrong window kept, a state written in another dtype): the difference shows only at the next
step. `state_records` gives, per step, per layer, per slot, both sides' L2 norm and the max
|a - b| (`layer_diff` keeps them); `localize.first_state_divergence` the first slot that is not
bit-equal (layer order).
A cache is a recurrent state when it holds a `cache` list of slots and no `offset` (mlx-lm's
ArraysCache and mlxbun's alike), alone or as a CacheList's child (falcon_h1); attention caches
are left to the tapped outputs.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import mlx.core as mx

from mlxbun.parity.compare import bit_equal, dtype_name, max_abs_diff

__all__ = ["cache_layers_of", "is_recurrent_state", "recurrent_slots", "state_cells", "state_records"]


def is_recurrent_state(cache: Any) -> bool:
    return isinstance(getattr(cache, "cache", None), list) and not hasattr(cache, "offset")


def _recurrent(cache: Any) -> Any:
    """The recurrent state a layer's cache is or holds (falcon_h1: a CacheList's child), or None."""
    if is_recurrent_state(cache):
        return cache
    return next((c for c in getattr(cache, "caches", ()) if is_recurrent_state(c)), None)


def recurrent_slots(cache_a: Sequence, cache_b: Sequence) -> Iterator[tuple[int, int, Any, Any]]:
    """(layer, slot, array a, array b) of every recurrent slot either side holds, layer order."""
    for layer, (ca, cb) in enumerate(zip(cache_a, cache_b)):
        ra, rb = _recurrent(ca), _recurrent(cb)
        if ra is None and rb is None:
            continue
        sa = ra.cache if ra is not None else []
        sb = rb.cache if rb is not None else []
        for slot in range(max(len(sa), len(sb))):
            xa = sa[slot] if slot < len(sa) else None
            xb = sb[slot] if slot < len(sb) else None
            if xa is not None or xb is not None:
                yield layer, slot, xa, xb


def cache_layers_of(*models: Any) -> list[int] | None:
    """The model layer of each cache entry, from the first model that says (`cache_layers`: a
    cache list that skips layers, nemotron_h's); None: entry i is layer i."""
    return next((m.cache_layers for m in models if getattr(m, "cache_layers", None)), None)


def _norm(x: mx.array | None) -> float | None:
    if x is None:
        return None
    return float(mx.sqrt(mx.sum(mx.square(x.astype(mx.float32)))).item())


def state_records(cache_a: Sequence, cache_b: Sequence, step: int,
                  layers: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """One record per recurrent slot after `step`: layer, slot, shapes, dtypes, both L2 norms
    (float32), max |a - b| (None when the shapes differ or a side has no state) and equality.
    `layers`: the model layer of each cache entry when the cache list skips layers (a model's
    `cache_layers`); None: entry i is layer i."""
    out = []
    for entry, slot, xa, xb in recurrent_slots(cache_a, cache_b):
        both = xa is not None and xb is not None
        out.append({
            "step": step, "layer": entry if layers is None else layers[entry], "slot": slot,
            "shape_a": None if xa is None else tuple(xa.shape),
            "shape_b": None if xb is None else tuple(xb.shape),
            "dtype_a": None if xa is None else dtype_name(xa),
            "dtype_b": None if xb is None else dtype_name(xb),
            "norm_a": _norm(xa), "norm_b": _norm(xb),
            "max_abs_diff": max_abs_diff(xa, xb) if both else None,
            "equal": both and bit_equal(xa, xb),
        })
    return out


def state_cells(records: Sequence[dict[str, Any]]) -> dict[tuple[int, int], float]:
    """(layer, step) -> max |diff| over the layer's slots (NaN where a slot's diff is unknown)."""
    cells: dict[tuple[int, int], float] = {}
    for r in records:
        d = math.nan if r["max_abs_diff"] is None else r["max_abs_diff"]
        key = (r["layer"], r["step"])
        cells[key] = d if key not in cells or math.isnan(d) else (
            cells[key] if math.isnan(cells[key]) else max(cells[key], d))
    return cells
