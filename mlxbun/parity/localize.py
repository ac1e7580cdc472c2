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

from dataclasses import dataclass
from typing import Any, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import MlxbunError
from mlxbun.models.taps import Taps, block_paths, capture, layer_index_of, substep_of
from mlxbun.parity.compare import bit_equal, dtype_name, max_abs_diff, nonfinite_sides
from mlxbun.parity.states import cache_layers_of, recurrent_slots

__all__ = ["Divergence", "bit_equal", "first_divergence", "first_state_divergence", "max_abs_diff", "nonfinite_sides",
           "tap"]


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
            return _structural(label, xa, xb)
        if not bit_equal(xa, xb):
            return _numeric(label, xa, xb)
    return None


def _structural(label: dict, xa: mx.array | None, xb: mx.array | None) -> Divergence:
    """A divergence in structure: a side missing, or (recurrent states) the shapes differing."""
    return Divergence(**label, max_abs_diff=None, kind="structural",
                      shape_a=None if xa is None else tuple(xa.shape), shape_b=None if xb is None else tuple(xb.shape),
                      dtype_a=None if xa is None else dtype_name(xa), dtype_b=None if xb is None else dtype_name(xb))


def _numeric(label: dict, xa: mx.array, xb: mx.array) -> Divergence:
    """A value divergence: non-finite when either side holds NaN/inf, else numeric."""
    sides = nonfinite_sides(xa, xb)
    return Divergence(**label, max_abs_diff=max_abs_diff(xa, xb), shape_a=tuple(xa.shape), shape_b=tuple(xb.shape),
                      dtype_a=dtype_name(xa), dtype_b=dtype_name(xb), kind="nonfinite" if sides else "numeric",
                      nonfinite=sides)


def first_state_divergence(cache_a: Sequence, cache_b: Sequence, step: int,
                           layers: Sequence[int] | None = None) -> Divergence | None:
    """The first recurrent slot (cache order) whose state is not bit-equal after `step`
    (`parity.states`), or None. `layers`: the model layer of each cache entry where the cache
    list skips layers (a model's `cache_layers`); None: entry i is layer i."""
    for entry, slot, xa, xb in recurrent_slots(cache_a, cache_b):
        label = dict(path=f"cache[{entry}].state[{slot}]", layer_index=entry if layers is None else layers[entry],
                     substep="state", step=step, call=0)
        if xa is None or xb is None or xa.shape != xb.shape:
            return _structural(label, xa, xb)
        if not bit_equal(xa, xb):
            return _numeric(label, xa, xb)
    return None


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
    taps; yields (step, taps_a, taps_b, logits_a, logits_b, cache_a, cache_b) with everything
    evaluated (the caches as the step left them: a hybrid's recurrent states included)."""
    from mlxbun.models.mlxlm import ensure_runtime

    model_a, model_b = ensure_runtime(model_a), ensure_runtime(model_b)
    cache_a, cache_b = model_a.make_cache(), model_b.make_cache()
    for step, x in enumerate(step_feeds(prompt_ids, decode_ids)):
        with tap(model_a, paths) as ta:
            la = model_a(x, cache=cache_a)
        with tap(model_b, paths) as tb:
            lb = model_b(x, cache=cache_b)
        mx.eval(la, lb, [v for t in (ta, tb) for outs in t.values() for v in outs])
        yield step, ta, tb, la, lb, cache_a, cache_b


def first_divergence(candidate: Any, oracle: Any, prompt_ids: Sequence, decode_ids: Sequence | None = None,
                     *, paths: Any = None) -> Divergence | None:
    """The first tapped module output (or, failing that, the logits) where candidate and oracle differ.

    `decode_ids` (flat for one prompt, one list per row for a batch) are fed one
    at a time after the prefill, to reach a divergence that only shows in decode.
    A hybrid's recurrent states are compared after each step's logits (`parity.states`): a state
    that differs while every output agrees is reported there, a step before the outputs show it.
    Returns None when every tapped output, every logit and every recurrent state is bit-equal.
    """
    for step, ta, tb, la, lb, ca, cb in tapped_steps(candidate, oracle, prompt_ids, decode_ids, paths):
        found = _compare_taps(ta, tb, step)
        if found is not None:
            return found
        if not bit_equal(la, lb):
            return _numeric(dict(path="logits", layer_index=None, substep="head", step=step, call=0), la, lb)
        found = first_state_divergence(ca, cb, step, cache_layers_of(candidate, oracle))
        if found is not None:
            return found
    return None
