"""Where two generated token trajectories part ways, and what each side wanted there.

`compare_trajectories(ids_a, ids_b, logits_a, logits_b, tokenizer, k)` walks
two id sequences (greedy runs of a base and a lever, two backends, ...) step
by step: the first step whose ids differ (or where one side has ended) is the
divergence. With per-step logits it adds, at every step, each side's top-k
(id, probability), the max |logit diff| and KL(a || b); with a tokenizer it
decodes the ids. Side "a" is the base.

An `mlxbun.parity.oracle.Trajectory` may be passed for ids_a / ids_b: its
greedy ids and step logits are used (row `row` of a batch).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from mlxbun.errors import MlxbunError
from mlxbun.parity.metrics import kld_from_logprobs, log_softmax, logits_rows, step_max_abs_diff

__all__ = ["StepDiff", "TrajectoryDiff", "compare_trajectories", "top_k"]


@dataclass
class StepDiff:
    step: int
    id_a: int | None  # None: side a has ended before this step
    id_b: int | None
    text_a: str | None = None
    text_b: str | None = None
    top_a: list[tuple[int, float]] | None = None  # (id, probability), most probable first
    top_b: list[tuple[int, float]] | None = None
    max_abs_diff: float | None = None  # raw logits, when both sides have them at this step
    kld: float | None = None  # KL(a || b) of the step's distributions

    @property
    def same(self) -> bool:
        return self.id_a == self.id_b


@dataclass
class TrajectoryDiff:
    first_divergence: int | None  # first step whose ids differ or where one side ended; None if identical
    length_a: int
    length_b: int
    steps: list[StepDiff] = field(repr=False)
    context_ids: list[int] = field(default_factory=list)  # the common ids just before the divergence
    context_text: str | None = None

    @property
    def identical(self) -> bool:
        return self.first_divergence is None

    @property
    def divergence(self) -> StepDiff | None:
        """The step where the trajectories part (ids, text and top-k of both sides)."""
        return None if self.first_divergence is None else self.steps[self.first_divergence]

    def as_dict(self) -> dict[str, Any]:
        return {"first_divergence": self.first_divergence, "length_a": self.length_a, "length_b": self.length_b,
                "context_ids": list(self.context_ids), "context_text": self.context_text,
                "steps": [{**s.__dict__, "same": s.same} for s in self.steps]}

    def as_table(self):
        """One row per step: ids, texts, same, max |diff|, KLD, top-k of both sides."""
        import pandas as pd

        return pd.DataFrame([{**s.__dict__, "same": s.same} for s in self.steps]).set_index("step")

    def summary(self) -> str:
        if self.first_divergence is None:
            return f"identical: {self.length_a} ids on both sides"
        d = self.divergence

        def show(tok, text, top):
            if tok is None:
                return "(ended)"
            out = f"{tok}" + (f" {text!r}" if text is not None else "")
            if top:
                out += "  top: " + ", ".join(f"{i}:{p:.3f}" for i, p in top)
            return out

        lines = [f"first divergence at step {self.first_divergence} "
                 f"(lengths {self.length_a} / {self.length_b})"]
        if self.context_ids:
            lines.append(f"  after {self.context_ids}" + (f" {self.context_text!r}" if self.context_text else ""))
        lines.append(f"  a: {show(d.id_a, d.text_a, d.top_a)}")
        lines.append(f"  b: {show(d.id_b, d.text_b, d.top_b)}")
        if d.max_abs_diff is not None:
            lines.append(f"  max |logit diff| {d.max_abs_diff:.6g}, KLD {d.kld:.6g}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()


def top_k(logits_row: np.ndarray, k: int) -> list[tuple[int, float]]:
    """The k most probable (id, probability) of one logits row (ties: lower id first)."""
    logp = log_softmax(np.asarray(logits_row)[None])[0]
    order = np.argsort(-logp, kind="stable")[:k]
    return [(int(i), float(np.exp(logp[i]))) for i in order]


def _flat_ids(ids: Any, name: str) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    ids = list(ids)
    if ids and isinstance(ids[0], (list, tuple)):
        if len(ids) != 1:
            raise MlxbunError(f"{name}: {len(ids)} rows of ids; pass one row (or a Trajectory with row=)")
        ids = list(ids[0])
    try:
        return [int(t) for t in ids]
    except (TypeError, ValueError):
        raise MlxbunError(f"{name}: expected a flat list of integer token ids") from None


def _unpack(side: Any, logits: Any, row: int, name: str) -> tuple[list[int], Any]:
    """A Trajectory gives its greedy ids and step logits (one row); anything else is ids as given."""
    if hasattr(side, "greedy_ids") and hasattr(side, "step_logits"):
        ids = side.greedy_ids[row] if side.batched else side.greedy_ids
        if logits is None:
            logits = [s[row] for s in side.step_logits]
        return _flat_ids(ids, name), logits
    return _flat_ids(side, name), logits


def _decode(tokenizer: Any, ids: Sequence[int]) -> str | None:
    if tokenizer is None or not ids:
        return None if tokenizer is None else ""
    try:
        return tokenizer.decode(list(ids))
    except Exception as e:  # noqa: BLE001 - a report must not die on an undecodable id
        return f"<decode failed: {type(e).__name__}>"


def compare_trajectories(ids_a: Any, ids_b: Any, logits_a: Any = None, logits_b: Any = None, tokenizer: Any = None,
                         k: int = 5, *, context: int = 8, row: int = 0) -> TrajectoryDiff:
    """Step-by-step comparison of two id trajectories (a = base), with top-k per step when logits are given.

    `logits_a` / `logits_b`: one logits row per step ([T, V] or a list of
    [V] / [1, V] arrays), the distribution that step's id was chosen from.
    """
    if k < 1:
        raise MlxbunError(f"k must be >= 1, got {k}")
    a, logits_a = _unpack(ids_a, logits_a, row, "ids_a")
    b, logits_b = _unpack(ids_b, logits_b, row, "ids_b")
    la = None if logits_a is None else logits_rows(logits_a, "logits_a")
    lb = None if logits_b is None else logits_rows(logits_b, "logits_b")
    if la is not None and lb is not None and la.shape[-1] != lb.shape[-1]:
        raise MlxbunError(f"logits_a and logits_b disagree on the vocabulary size ({la.shape[-1]} vs {lb.shape[-1]})")

    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))

    steps = []
    for i in range(max(len(a), len(b))):
        ta, tb = (a[i] if i < len(a) else None), (b[i] if i < len(b) else None)
        s = StepDiff(step=i, id_a=ta, id_b=tb,
                     text_a=None if ta is None else _decode(tokenizer, [ta]),
                     text_b=None if tb is None else _decode(tokenizer, [tb]))
        ra = la[i] if la is not None and i < len(la) else None
        rb = lb[i] if lb is not None and i < len(lb) else None
        if ra is not None:
            s.top_a = top_k(ra, k)
        if rb is not None:
            s.top_b = top_k(rb, k)
        if ra is not None and rb is not None:
            s.max_abs_diff = float(step_max_abs_diff(ra[None], rb[None])[0])
            s.kld = float(kld_from_logprobs(log_softmax(ra[None]), log_softmax(rb[None]))[0])
        steps.append(s)

    ctx = a[max(0, first - context):first] if first is not None else []
    return TrajectoryDiff(first_divergence=first, length_a=len(a), length_b=len(b), steps=steps,
                          context_ids=list(ctx), context_text=_decode(tokenizer, ctx) if ctx else None)
