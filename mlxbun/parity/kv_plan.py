"""Per-layer KV sensitivity and a plan search under a KLD budget: which layers' KV can be quantized,
and how far, for the fewest bytes at a measured drift.

- `KVProbe(model, ids, prefill=)`: the prompt `ids[:prefill-1]` prefilled once through plain KV;
  `probe.measure(plan)` forks those caches, applies a per-layer plan (`KVPlan`: quantized after
  the prefill, as generation's quantize points do with `quantized_kv_start` 0), and teacher-forces
  the continuation `ids[prefill-1:-1]` through them, each position predicting the next id; KLD and
  top-1 agreement against the same continuation through plain KV (`compare_logits`), and the bytes
  of the cached tokens. The continuation runs as one chunk: a quantized cache quantizes new keys
  and values on write either way, so it equals `teacher_forced`'s one-token steps up to float
  rounding (tested), at a fraction of the cost.
- `sensitivity(probe, bits=)`: each quantizable layer's KV quantized alone at each bit width.
- `search_plan(probe, table, budget)`: the greedy chain: from all-plain, repeatedly the move (one
  layer to a lower bit width) that saves the most bytes per unit of predicted KLD (the sum of the
  layers' own KLDs), down to every layer at the lowest width; then a binary search over the chain's
  prefixes, each measured, for the longest within the budget. The returned plan's KLD is the
  measured one: the per-layer KLDs only order the moves (joint KLD is not additive: a first version
  that stopped where the sum reached the budget fell short of uniform q4 at uniform q4's KLD).
- `uniform_plan`, `edge_plan` (first / last layers at a higher precision: the published heuristic),
  `matched_edge_plan` (that heuristic at the largest bytes not above a target).
- `kv_config(plan, num_layers, meta)`: the object `mlxbun generate --kv-config FILE` reads
  (`{"layers": [{layer_idx, bits, group_size}, ...]}`, bits 0 = full precision).

Only full-attention layers (KVCache) are candidates: a plan refuses sliding-window layers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.mixed import KVPlan
from mlxbun.cache.quantized import KV_QUANT_GROUP_SIZES, check_kv_quant
from mlxbun.errors import MlxbunError
from mlxbun.generate import check_token_ids, vocab_size_of
from mlxbun.generation_caches import KVHeadDimError, make_generation_cache
from mlxbun.models.mlxlm import ensure_runtime
from mlxbun.parity.forced import cache_nbytes
from mlxbun.parity.metrics import compare_logits

__all__ = ["KVProbe", "Measured", "PlanSearch", "SENSITIVITY_COLUMNS", "check_bits", "edge_plan", "kv_config",
           "matched_edge_plan", "search_plan", "sensitivity", "uniform_plan"]

DEFAULT_BITS = (8, 4, 3, 2)
SENSITIVITY_COLUMNS = ["layer", "bits", "group_size", "kld_mean", "kld_p99", "top1_agreement", "bytes_saved"]


@dataclass(frozen=True)
class Measured:
    """One plan against plain KV over the probe's continuation."""

    layers: dict  # cache index -> (bits, group_size); the others plain
    kld_mean: float
    kld_p99: float
    kld_max: float
    top1_agreement: float
    kv_bytes: int  # bytes of the cached tokens (all layers) after the continuation
    tokens: int  # tokens the caches hold

    @property
    def bytes_per_token(self) -> float:
        return self.kv_bytes / self.tokens


def _fork(c: Any, i: int):
    """An independent copy of a prefilled cache (its own array objects: updates to one never show
    in the other)."""
    if not isinstance(c, (KVCache, RotatingKVCache)):
        raise MlxbunError(f"kv plan: cache layer {i} is a {type(c).__name__}; the plan search forks "
                          "prefilled KVCache / RotatingKVCache layers only")
    state = tuple(mx.array(x) if isinstance(x, mx.array) else x for x in c.state)
    return type(c).from_state(state, c.meta_state)


class KVProbe:
    """A model and a text prefilled once; `measure(plan)` is the plan's drift and bytes."""

    def __init__(self, model, ids: Sequence[int], *, prefill: int):
        ids = [int(i) for i in ids]
        if not 2 <= prefill < len(ids):
            raise MlxbunError(f"prefill must be in [2, {len(ids) - 1}] for {len(ids)} ids, got {prefill}")
        self.model = ensure_runtime(model)
        check_token_ids(ids, vocab_size_of(self.model), "ids")
        self.ids, self.prefill = ids, prefill
        self._prefilled = make_generation_cache(self.model)
        self.model(mx.array([ids[: prefill - 1]], dtype=mx.int32), cache=self._prefilled)
        mx.eval([c.state for c in self._prefilled])
        self.num_layers = len(self._prefilled)
        # the layers a plan can quantize: full-attention KV (window and recurrent caches cannot)
        self.candidates = [i for i, c in enumerate(self._prefilled) if type(c) is KVCache]
        self.next_tokens = ids[prefill:]
        self.measurements = 0
        self._base_logits, self.plain_bytes = self._run(None)

    def _run(self, plan: Optional[KVPlan]):
        caches = [_fork(c, i) for i, c in enumerate(self._prefilled)]
        if plan is not None:
            caches = plan.make_caches(caches)
        logits = self.model(mx.array([self.ids[self.prefill - 1: -1]], dtype=mx.int32), cache=caches)[0]
        mx.eval(logits)
        return logits, cache_nbytes(caches)[0]

    def check_group_size(self, group_size: int) -> None:
        """Refuse (`KVHeadDimError`) a group size that does not divide a candidate layer's head dim,
        saying which sizes would (or that none can: a plan is affine KV, groups of 32, 64, 128)."""
        for i in self.candidates:
            c = self._prefilled[i]
            for dim in dict.fromkeys((c.keys.shape[-1], c.values.shape[-1])):
                if dim % group_size:
                    fits = [g for g in KV_QUANT_GROUP_SIZES if dim % g == 0]
                    advice = (f"use a group size that divides it: {' or '.join(map(str, fits))} (--group-size)"
                              if fits else f"it is {'below' if dim < min(KV_QUANT_GROUP_SIZES) else 'not a multiple of'}"
                              f" every KV group size ({', '.join(map(str, KV_QUANT_GROUP_SIZES))}), so no "
                              "affine KV plan can run on this model")
                    raise KVHeadDimError(f"group size {group_size} does not divide layer {i}'s head dim {dim}; "
                                         f"{advice}", dim, group_size)

    def plan(self, layers: dict) -> KVPlan:
        return KVPlan(layers, self.num_layers, "kv plan")

    def measure(self, layers: dict) -> Measured:
        """The plan {cache index: (bits, group_size)} against plain KV."""
        plan = self.plan(layers)
        logits, nbytes = self._run(plan)
        self.measurements += 1
        s = compare_logits(self._base_logits, logits, self.next_tokens)
        return Measured(dict(plan.layers), s.kld_mean, s.kld_percentiles["99"], s.kld_max, s.same_top_p,
                        nbytes, len(self.ids) - 1)

    @property
    def plain(self) -> Measured:
        return Measured({}, 0.0, 0.0, 0.0, 1.0, self.plain_bytes, len(self.ids) - 1)


def check_bits(bits: Sequence[int], group_size: int = 64) -> tuple[int, ...]:
    """The candidate bit widths, highest first, each checked (`KV_QUANT_BITS`), no repeats."""
    if isinstance(bits, (int, str)) or not len(bits):
        raise MlxbunError(f"bits must be a non-empty list of bit widths, got {bits!r}")
    out = [check_kv_quant(b, group_size, "kv plan bits", MlxbunError)[0] for b in bits]
    if len(set(out)) != len(out):
        raise MlxbunError(f"bits {list(bits)} repeat a width")
    return tuple(sorted(out, reverse=True))


def sensitivity(probe: KVProbe, bits: Sequence[int] = DEFAULT_BITS, group_size: int = 64,
                progress: Callable[[int, int], None] | None = None):
    """A DataFrame (SENSITIVITY_COLUMNS): each candidate layer quantized alone at each width."""
    import pandas as pd

    bits = check_bits(bits, group_size)
    probe.check_group_size(group_size)
    rows, total = [], len(probe.candidates) * len(bits)
    for layer in probe.candidates:
        for b in bits:
            m = probe.measure({layer: (b, group_size)})
            rows.append({"layer": layer, "bits": b, "group_size": group_size, "kld_mean": m.kld_mean,
                         "kld_p99": m.kld_p99, "top1_agreement": m.top1_agreement,
                         "bytes_saved": probe.plain_bytes - m.kv_bytes})
            if progress is not None:
                progress(len(rows), total)
    return pd.DataFrame(rows, columns=SENSITIVITY_COLUMNS)


@dataclass
class PlanSearch:
    """The greedy plan for one budget: `measured` is the plan's own measurement."""

    budget: float
    layers: dict  # cache index -> (bits, group_size)
    predicted_kld: float  # the sum of the layers' own KLDs (what the greedy steered by)
    measured: Measured
    moves: list = field(default_factory=list)  # (layer, bits) in the order taken
    cut_back: int = 0  # moves of the chain left out (the next prefix measured above the budget)


def _options(table, layer) -> list[tuple[Optional[int], int, float, float]]:
    """(bits, group, kld, bytes_saved) of one layer, plain first (0, 0), then highest bits first."""
    rows = table[table["layer"] == layer].sort_values("bits", ascending=False)
    return [(None, 0, 0.0, 0.0)] + [(int(r.bits), int(r.group_size), max(float(r.kld_mean), 0.0),
                                     float(r.bytes_saved)) for r in rows.itertuples()]


def _move_chain(table) -> list[tuple[int, int, int, float]]:
    """The greedy's moves from all-plain to every layer at the lowest width, each (layer, bits,
    group, predicted KLD after it): at every step the move (one layer to any lower width) that saves
    the most bytes per unit of predicted KLD (the sum of the layers' own KLDs). Each prefix is a plan;
    bytes fall along the chain."""
    opts = {int(layer): _options(table, layer) for layer in dict.fromkeys(table["layer"])}
    at = dict.fromkeys(opts, 0)
    total, moves = 0.0, []
    while True:
        best = None
        for layer, o in opts.items():
            cur = o[at[layer]]
            for j in range(at[layer] + 1, len(o)):
                dk, ds = o[j][2] - cur[2], o[j][3] - cur[3]
                if ds <= 0:
                    continue
                score = ds / max(dk, 1e-12)
                if best is None or score > best[0]:
                    best = (score, layer, j, dk)
        if best is None:
            return moves
        _, layer, j, dk = best
        at[layer], total = j, total + dk
        moves.append((layer, opts[layer][j][0], opts[layer][j][1], total))


def _plan_of(moves) -> dict:
    layers = {}
    for layer, bits, group, _ in moves:
        layers[layer] = (bits, group)
    return dict(sorted(layers.items()))


def search_plan(probe: KVProbe, table, budget: float) -> PlanSearch:
    """The longest prefix of the greedy chain (`_move_chain`) whose measured mean KLD vs plain KV
    (nats) is within `budget`: a binary search over the prefixes, each one tried measured (the
    per-layer KLDs only order the moves; they are not assumed to add up). The search takes KLD as
    rising along the chain; where it does not, it stops at a prefix within the budget whose next
    one is not."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget) or budget < 0:
        raise MlxbunError(f"budget must be a finite KLD >= 0 (nats), got {budget!r}")
    chain = _move_chain(table)
    results = {0: probe.plain}
    lo, hi = 0, len(chain)  # prefix lo is within the budget (0: plain, KLD 0); the whole chain tried first
    mid = hi
    while lo < hi:
        results[mid] = probe.measure(_plan_of(chain[:mid]))
        if results[mid].kld_mean <= budget:
            lo = mid
        else:
            hi = mid - 1
        mid = (lo + hi + 1) // 2
    k = lo
    return PlanSearch(float(budget), _plan_of(chain[:k]), chain[k - 1][3] if k else 0.0, results[k],
                      [(m[0], m[1]) for m in chain[:k]], len(chain) - k)


def uniform_plan(candidates: Sequence[int], bits: int, group_size: int = 64) -> dict:
    """Every candidate layer at `bits`."""
    return {i: (int(bits), group_size) for i in candidates}


def edge_plan(candidates: Sequence[int], n_edge: int, high: Optional[int], low: int, group_size: int = 64) -> dict:
    """The published heuristic: the first and last `n_edge` candidate layers at `high` bits (None:
    plain), the others at `low`."""
    c = list(candidates)
    edge = set(c[:n_edge]) | set(c[len(c) - n_edge:] if n_edge else [])
    return {i: (high, group_size) if i in edge else (low, group_size) for i in c if not (i in edge and high is None)}


def predicted_bytes(table, plain_bytes: int, layers: dict) -> float:
    """A plan's bytes from the sensitivity table's per-layer savings (bytes are additive per layer)."""
    saved = {(int(r.layer), int(r.bits)): float(r.bytes_saved) for r in table.itertuples()}
    return plain_bytes - sum(saved[(i, b)] for i, (b, _) in layers.items())


def matched_edge_plan(table, candidates: Sequence[int], plain_bytes: int, target_bytes: float,
                      bits: Sequence[int], group_size: int = 64) -> Optional[dict]:
    """The edge heuristic (any edge width, high in plain + `bits`, low below high) with the most
    bytes not above `target_bytes`: the heuristic given at most the memory a searched plan uses.
    None when no edge plan fits (the target is below the lowest uniform width's bytes)."""
    best, best_bytes = None, -1.0
    highs = [None, *sorted(bits, reverse=True)]
    for n in range(0, len(candidates) // 2 + 1):
        for high in highs:
            for low in bits:
                if high is not None and low >= high:
                    continue
                plan = edge_plan(candidates, n, high, low, group_size)
                nb = predicted_bytes(table, plain_bytes, plan)
                if best_bytes < nb <= target_bytes:
                    best, best_bytes = plan, nb
    return best


def kv_config(layers: dict, num_layers: int, meta: dict | None = None) -> dict:
    """The per-layer plan as `mlxbun generate --kv-config` reads it: every cache layer an entry
    (bits 0: full precision), plus `meta` under "mlxbun_kv_plan" (what was measured)."""
    entries = [{"layer_idx": i, "bits": layers[i][0] if i in layers else 0,
                "group_size": layers[i][1] if i in layers else 64} for i in range(num_layers)]
    out: dict = {"layers": entries}
    if meta:
        out["mlxbun_kv_plan"] = meta
    return out
