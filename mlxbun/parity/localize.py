"""Localize a parity failure: the first module whose output differs, in execution order.

Both sides run the same forwards under layer taps: the prefill, then (when
`decode_ids` is given) one-token decode steps fed the same ids, each side on
its own fresh cache. Each forward's recorded calls are walked in completion
order (embedding, layer 0's sub-steps as they ran, layer 0's output, layer 1,
..., final norm, head); the first (path, call) whose output is not bit-equal
is the divergence. Paths are matched by name; a call recorded on one side
only is a structural divergence; an output holding NaN or inf on either side
is a non-finite divergence (never "equal", even where both sides hold the same
NaN: that is where a broken weight or an overflow first shows). If every
tapped output agrees but the logits do not, the divergence is reported at
"logits" (a head op outside the taps: tied `as_linear`, softcap, scaling).

Side "a" is the candidate, side "b" the oracle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import MlxbunError
from mlxbun.models.taps import Taps, block_paths, capture, layer_index_of, substep_of

__all__ = ["Divergence", "bit_equal", "first_divergence", "max_abs_diff", "nonfinite_sides", "tap"]


@dataclass
class Divergence:
    path: str  # module path, or "logits" for the head ops outside the taps
    layer_index: int | None  # block index, None outside the blocks
    substep: str  # 'embedding' | 'attention' | 'mlp' | 'norm' | 'layer' | 'head' | <child name>
    max_abs_diff: float | None  # float32 max |a - b|; None when shapes differ or one side is missing,
    # NaN where a side is not finite
    shape_a: tuple[int, ...] | None  # candidate
    shape_b: tuple[int, ...] | None  # oracle
    dtype_a: str | None
    dtype_b: str | None
    step: int = 0  # 0 = prefill, k = k-th one-token decode forward
    call: int = 0  # which call of this module within that forward
    kind: str = "numeric"  # "numeric" | "structural" | "nonfinite"
    nonfinite: str | None = None  # kind "nonfinite": "candidate" | "oracle" | "candidate and oracle"

    def __str__(self) -> str:
        where = f"{self.path} (step {self.step}, {self.substep}"
        where += f", layer {self.layer_index})" if self.layer_index is not None else ")"
        if self.kind == "structural":
            return f"{where}: recorded on {'the oracle' if self.shape_a is None else 'the candidate'} only"
        if self.kind == "nonfinite":
            return f"{where}: non-finite values (NaN/inf) on the {self.nonfinite}"
        return (f"{where}: max |diff| {self.max_abs_diff}, candidate {self.dtype_a}{list(self.shape_a or ())} "
                f"vs oracle {self.dtype_b}{list(self.shape_b or ())}")


def _dtype(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def _finite(a: mx.array) -> bool:
    return bool(mx.all(mx.isfinite(a)).item())


def nonfinite_sides(a: mx.array, b: mx.array) -> str | None:
    """Which side holds a NaN or inf: "candidate" (a), "oracle" (b), "candidate and oracle", or
    None when both are finite."""
    sides = [name for name, x in (("candidate", a), ("oracle", b)) if not _finite(x)]
    return " and ".join(sides) or None


def bit_equal(a: mx.array, b: mx.array) -> bool:
    """Same dtype, same shape, same values, and finite: a NaN or inf is never equal, not even
    to the same NaN or inf on the other side (a model that emits them has failed)."""
    return (a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b))
            and _finite(a))


def max_abs_diff(a: mx.array, b: mx.array) -> float | None:
    """max |a - b| computed in float32 (0.0 where bit-equal); None when the shapes differ, NaN
    when either side holds a NaN or inf."""
    if a.shape != b.shape:
        return None
    if not (_finite(a) and _finite(b)):
        return math.nan
    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.max(mx.abs(a32 - b32)).item()) if a.size else 0.0


def tap(model: Any, paths: Any = None):
    """The model's own `layers_tap` (RuntimeModel), else the generic capture on an nn.Module."""
    if hasattr(model, "layers_tap"):
        return model.layers_tap(paths)
    if isinstance(model, nn.Module):
        return capture(model, paths)
    raise MlxbunError(f"{type(model).__name__} has no layers_tap and is not an mlx.nn.Module")


def merged_order(a: Taps, b: Taps) -> list[tuple[str, int]]:
    """Oracle order, with candidate-only calls slotted in after their predecessor on the candidate side."""
    merged = list(b.order)
    present = set(merged)
    prev = None
    for item in a.order:
        if item not in present:
            pos = merged.index(prev) + 1 if prev is not None else 0
            merged.insert(pos, item)
            present.add(item)
        prev = item
    return merged


def _compare_taps(a: Taps, b: Taps, step: int) -> Divergence | None:
    blocks = block_paths([(p, None) for p in set(a.called()) | set(b.called())])
    for path, k in merged_order(a, b):
        xa = a[path][k] if path in a and k < len(a[path]) else None
        xb = b[path][k] if path in b and k < len(b[path]) else None
        label = dict(path=path, layer_index=layer_index_of(path, blocks), substep=substep_of(path, blocks),
                     step=step, call=k)
        if (xb is None and path in a.observers) or (xa is None and path in b.observers):
            continue  # a module only mlxbun's tree has (an MoE router): nothing to compare
        if xa is None or xb is None:
            return Divergence(**label, max_abs_diff=None, kind="structural",
                              shape_a=None if xa is None else tuple(xa.shape),
                              shape_b=None if xb is None else tuple(xb.shape),
                              dtype_a=None if xa is None else _dtype(xa), dtype_b=None if xb is None else _dtype(xb))
        if not bit_equal(xa, xb):
            return _numeric(label, xa, xb)
    return None


def _numeric(label: dict, xa: mx.array, xb: mx.array) -> Divergence:
    """A value divergence: non-finite when either side holds NaN/inf, else numeric."""
    sides = nonfinite_sides(xa, xb)
    return Divergence(**label, max_abs_diff=max_abs_diff(xa, xb), shape_a=tuple(xa.shape), shape_b=tuple(xb.shape),
                      dtype_a=_dtype(xa), dtype_b=_dtype(xb), kind="nonfinite" if sides else "numeric",
                      nonfinite=sides)


def step_feeds(prompt_ids: Sequence, decode_ids: Sequence | None) -> list[mx.array]:
    from mlxbun.parity.oracle import as_batch

    rows, batched = as_batch(prompt_ids)
    feeds = [mx.array(rows, dtype=mx.int32)]
    if decode_ids:
        cols = [list(r) for r in decode_ids] if batched else [list(decode_ids)]
        if len(cols) != len(rows) or any(len(c) != len(cols[0]) for c in cols):
            raise MlxbunError("decode_ids must give the same number of ids for every prompt row")
        feeds += [mx.array([[c[t]] for c in cols], dtype=mx.int32) for t in range(len(cols[0]))]
    return feeds


def tapped_steps(model_a, model_b, prompt_ids: Sequence, decode_ids: Sequence | None = None, paths: Any = None):
    """Run both models step by step (prefill, then each decode id) through their own caches under
    taps; yields (step, taps_a, taps_b, logits_a, logits_b) with everything evaluated."""
    from mlxbun.models.mlxlm import ensure_runtime

    model_a, model_b = ensure_runtime(model_a), ensure_runtime(model_b)
    cache_a, cache_b = model_a.make_cache(), model_b.make_cache()
    for step, x in enumerate(step_feeds(prompt_ids, decode_ids)):
        with tap(model_a, paths) as ta:
            la = model_a(x, cache=cache_a)
        with tap(model_b, paths) as tb:
            lb = model_b(x, cache=cache_b)
        mx.eval(la, lb, [v for t in (ta, tb) for outs in t.values() for v in outs])
        yield step, ta, tb, la, lb


def first_divergence(candidate: Any, oracle: Any, prompt_ids: Sequence, decode_ids: Sequence | None = None,
                     *, paths: Any = None) -> Divergence | None:
    """The first tapped module output (or, failing that, the logits) where candidate and oracle differ.

    `decode_ids` (flat for one prompt, one list per row for a batch) are fed one
    at a time after the prefill, to reach a divergence that only shows in decode.
    Returns None when every tapped output and every logit is bit-equal.
    """
    for step, ta, tb, la, lb in tapped_steps(candidate, oracle, prompt_ids, decode_ids, paths):
        found = _compare_taps(ta, tb, step)
        if found is not None:
            return found
        if not bit_equal(la, lb):
            return _numeric(dict(path="logits", layer_index=None, substep="head", step=step, call=0), la, lb)
    return None
