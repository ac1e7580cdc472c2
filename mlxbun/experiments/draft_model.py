"""Draft-model speculative decoding against prompt lookup and self-draft (lab/draft_model): which
k, and when does a draft model beat n-gram lookup?

    sweep = spec_sweep(target, ["model:DRAFT", "ngram:3", "self:12"], [1, 2, 4, 8], prompts=..., ...)
    best_k(sweep)                                  # per drafter and task (and over the set): the best k
    model_vs_lookup(sweep, "model:DRAFT", "ngram:3")   # per task: each at its best k, the winner, and
                                                   # the acceptance length the model would need

Both take a `SpecSweep` or its `table()` (the CSV a lab run saved). "Best" is the highest decode
speedup (decode-only tokens/s over plain decoding's, measured in the same process); over the
whole set a k is scored by the geometric mean of its per-task decode speedups, the one k a user
would fix without knowing the task.

The reading of "when": a round of drafter D emits its mean acceptance length L_D tokens at a
cost of one verify plus D's drafting, so at its best k the draft model's decode speedup is
L_model / cost_model; it matches lookup's speedup S_lookup when L_model reaches
L_model * S_lookup / S_model (`needed_acceptance_length`, at the model's measured per-round
cost). Lookup costs nothing to draft but only proposes where the text repeats; the draft model
proposes everywhere at a price, so it wins where the output is new text its acceptance pays for.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from mlxbun.errors import MlxbunError
from mlxbun.experiments.spec_acceptance import SpecSweep, draft_length

__all__ = ["SET", "best_k", "model_vs_lookup"]

SET = "(set)"  # the task column's value for the whole prompt set


def _fixed(sweep: SpecSweep | pd.DataFrame) -> pd.DataFrame:
    df = sweep.table() if isinstance(sweep, SpecSweep) else sweep
    return df[[not draft_length(k)[1] for k in df.k]].copy()


def _geomean(values) -> float:
    v = np.asarray(values, dtype=float)
    return float(np.exp(np.log(v).mean())) if len(v) and (v > 0).all() else math.nan


def best_k(sweep: SpecSweep | pd.DataFrame, by: str = "decode_speedup") -> pd.DataFrame:
    """Per drafter: per task the fixed k of the highest `by` (its value, draft acceptance and mean
    acceptance length), and a row for the whole set (task `SET`: the k of the highest geometric
    mean of `by` over the tasks)."""
    df = _fixed(sweep)
    if df.empty:
        raise MlxbunError("sweep: no fixed-k runs to choose a k from")
    rows = []
    for d, g in df.groupby("drafter", sort=False):
        for task, t in g.groupby("prompt", sort=False):
            b = t.loc[t[by].idxmax()] if t[by].notna().any() else t.iloc[0]
            rows.append({"drafter": d, "task": task, "best_k": b.k, by: b[by],
                         "draft_acceptance_rate": b.draft_acceptance_rate,
                         "mean_acceptance_length": b.mean_acceptance_length})
        per_k = {k: _geomean(t[by]) for k, t in g.groupby("k", sort=False)}
        k = max(per_k, key=lambda k: -math.inf if math.isnan(per_k[k]) else per_k[k])
        at = g[g.k == k]
        rows.append({"drafter": d, "task": SET, "best_k": k, by: per_k[k],
                     "draft_acceptance_rate": float(at.draft_acceptance_rate.mean()),
                     "mean_acceptance_length": float(at.mean_acceptance_length.mean())})
    return pd.DataFrame(rows)


def model_vs_lookup(sweep: SpecSweep | pd.DataFrame, model: str, lookup: str,
                    by: str = "decode_speedup") -> pd.DataFrame:
    """Per task (and the set): the draft model `model` and the lookup drafter `lookup`, each at its
    best k (`best_k`), which wins, by how much (`model_over_lookup`), and the mean acceptance length
    the model would need at its own per-round cost to match lookup (`needed_acceptance_length`)."""
    best = best_k(sweep, by)
    for d in (model, lookup):
        if d not in set(best.drafter):
            raise MlxbunError(f"drafter {d!r} is not in this sweep (it has: {', '.join(dict.fromkeys(best.drafter))})")
    m, n = best[best.drafter == model].set_index("task"), best[best.drafter == lookup].set_index("task")
    rows = []
    for task in m.index:
        a, b = m.loc[task], n.loc[task]
        ratio = a[by] / b[by] if b[by] > 0 else math.nan
        rows.append({"task": task, "model_k": a.best_k, f"model_{by}": a[by],
                     "model_acceptance_length": a.mean_acceptance_length, "lookup_k": b.best_k,
                     f"lookup_{by}": b[by], "lookup_acceptance_length": b.mean_acceptance_length,
                     "winner": model if ratio > 1 else lookup, "model_over_lookup": ratio,
                     "needed_acceptance_length": a.mean_acceptance_length / ratio if ratio > 0 else math.nan})
    return pd.DataFrame(rows)
