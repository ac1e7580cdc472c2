"""The parity gate: a candidate passes only if it is bit-exact to the oracle.

Both sides run the same greedy driver (`oracle.run_trajectory`) on the same
explicit prompt ids. Pass means: the greedy ids are equal, every step's raw
logits (the full prefill [B, L, V] at step 0, then each decode step) are
bit-equal (same dtype, shape and values: `mx.array_equal`), and a batch-2
run (two different prompts of equal length: prefill + a few decode steps) is
bit-equal too. Logits must be finite on both sides: a NaN or inf fails the
step it shows in, naming the side (never "equal", not even NaN against NaN).
Differences are measured in float32 for the report only; no tolerance exists.
On a failure the first diverging module is localized with layer taps.

A pass whose oracle trajectory is one token repeated carries a warning: every
decode step then fed the same id, which proves less than a varied trajectory
(`oracle.varied_prompt_ids` finds a prompt that avoids it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

from mlxbun.errors import MlxbunError
from mlxbun.parity.compare import bit_equal, max_abs_diff, nonfinite_sides
from mlxbun.parity.localize import Divergence, first_divergence
from mlxbun.parity.oracle import Trajectory, as_batch, repeated_tokens, run_trajectory

__all__ = ["GateResult", "compare_trajectories", "gate", "second_prompt"]


@dataclass
class GateResult:
    verdict: str  # "pass" | "fail"
    trajectory_equal: bool  # greedy ids equal and every step's logits bit-equal
    first_mismatch_step: int | None  # first step whose logits (or greedy id) differ; None when equal
    max_abs_diff: float  # float32 max |diff| over compared steps; 0.0 when bit-exact, inf if shapes
    # differ, NaN when a side's logits are not finite
    per_step_max_abs_diff: list[float | None]  # None: not comparable (shapes differ, or after ids diverged
    # or a NaN); NaN: that step's logits are not finite
    batch2_equal: bool | None  # None when not run
    first_divergence: Divergence | None
    reason: str
    prompt_ids: list = field(default_factory=list)
    greedy_ids: list = field(default_factory=list)  # the oracle's
    candidate_greedy_ids: list = field(default_factory=list)
    decode_steps: int = 0
    logits_dtype: str = ""
    batch2_prompt_ids: list | None = None
    warnings: list[str] = field(default_factory=list)  # a pass that proves less than it seems
    oracle_trajectory: Trajectory | None = field(default=None, repr=False, compare=False)
    candidate_trajectory: Trajectory | None = field(default=None, repr=False, compare=False)


@dataclass
class _Comparison:
    equal: bool
    first_mismatch_step: int | None
    per_step: list[float | None]
    nonfinite: str | None = None  # the side(s) whose logits at first_mismatch_step hold NaN/inf

    @property
    def max_abs_diff(self) -> float:
        s = self.first_mismatch_step
        if self.nonfinite:
            return math.nan
        if s is not None and self.per_step[s] is None:
            return math.inf  # not comparable (shapes differ or a side has no such step)
        return max((d for d in self.per_step if d is not None), default=0.0)

    def why(self) -> str:
        """What failed at the first mismatching step, for the gate's reason."""
        s = self.first_mismatch_step
        what = "prefill logits" if s == 0 else f"decode step {s} logits"
        if self.nonfinite:
            return f"{what} are not finite (NaN/inf) on the {self.nonfinite}"
        diff = self.per_step[s] if s < len(self.per_step) else None
        return f"{what} differ (max |diff| {diff if diff is not None else 'n/a: shapes differ'})"


def _step_arrays(t: Trajectory) -> list:
    """Step 0 compares the whole prefill (every position), later steps the decode logits."""
    return [t.prefill_logits] + list(t.step_logits[1:])


def _ids_at(t: Trajectory, step: int) -> list[int]:
    rows = t.greedy_ids if t.batched else [t.greedy_ids]
    return [r[step] for r in rows]


def compare_trajectories(candidate: Trajectory, oracle: Trajectory) -> _Comparison:
    """Step-by-step bit comparison; stops measuring once the greedy ids part ways."""
    sa, sb = _step_arrays(candidate), _step_arrays(oracle)
    n = max(len(sa), len(sb))
    per_step: list[float | None] = []
    first = None
    for step in range(n):
        if step >= len(sa) or step >= len(sb):
            first = step if first is None else first
            per_step += [None] * (n - step)
            break
        nonfinite = nonfinite_sides(sa[step], sb[step])
        if nonfinite:  # nothing after a NaN means anything: greedy ids of NaN logits are arbitrary
            if first is None:
                return _Comparison(False, step, per_step + [math.nan] + [None] * (n - step - 1), nonfinite)
            per_step += [None] * (n - step)
            break
        equal = bit_equal(sa[step], sb[step])
        per_step.append(0.0 if equal else max_abs_diff(sa[step], sb[step]))
        ids_equal = _ids_at(candidate, step) == _ids_at(oracle, step)
        if first is None and not (equal and ids_equal):
            first = step
        if not ids_equal:  # later steps see different inputs: nothing left to compare
            per_step += [None] * (n - step - 1)
            break
    return _Comparison(first is None, first, per_step)


def second_prompt(prompt: Sequence[int]) -> list[int]:
    """A different prompt of the same length and token set: reversed (rotated if a palindrome)."""
    p = list(prompt)
    q = p[::-1]
    return q if q != p else p[1:] + p[:1]


def gate(candidate: Any, oracle: Any, prompt_ids: Sequence, decode_steps: int = 16, batch2: bool = True,
         *, batch2_decode_steps: int = 2, localize: bool = True,
         oracle_trajectory: Trajectory | None = None) -> GateResult:
    """Run both trajectories (+ a batch-2 run) and compare them bit for bit. `oracle_trajectory`:
    the oracle's run on these prompt ids and steps when already made (`varied_prompt_ids`)."""
    from mlxbun.models.mlxlm import ensure_runtime

    candidate, oracle = ensure_runtime(candidate), ensure_runtime(oracle)
    rows, batched = as_batch(prompt_ids)
    ot = oracle_trajectory
    if ot is None:
        ot = run_trajectory(oracle, prompt_ids, decode_steps)
    elif (ot.prompt_ids, ot.decode_steps) != ((rows if batched else rows[0]), decode_steps):
        raise MlxbunError("oracle_trajectory was run on other prompt ids or decode steps than the gate's")
    ct = run_trajectory(candidate, prompt_ids, decode_steps)
    cmp = compare_trajectories(ct, ot)
    reasons = []
    if not cmp.equal:
        s = cmp.first_mismatch_step
        ids_differ = not cmp.nonfinite and s < len(cmp.per_step) and _ids_at(ct, s) != _ids_at(ot, s)
        reasons.append(cmp.why() + (f"; greedy ids part at step {s}" if ids_differ else ""))

    b2_equal, b2_prompt, b2 = None, None, None
    if batch2 and not batched:
        b2_prompt = [rows[0], second_prompt(rows[0])]
        bo = run_trajectory(oracle, b2_prompt, batch2_decode_steps)
        bc = run_trajectory(candidate, b2_prompt, batch2_decode_steps)
        b2 = compare_trajectories(bc, bo)
        b2_equal = b2.equal
        if not b2.equal:
            reasons.append(f"batch-2 run: {b2.why()}")

    passed = cmp.equal and b2_equal is not False
    divergence = None
    if not passed and localize:
        try:
            if not cmp.equal:
                divergence = first_divergence(candidate, oracle, prompt_ids, _decode_feed(ot, cmp.first_mismatch_step))
            else:
                divergence = first_divergence(candidate, oracle, b2_prompt, _decode_feed(bo, b2.first_mismatch_step))
        except MlxbunError as e:
            reasons.append(f"localization failed: {e}")
        if divergence is not None:
            reasons.append(f"first divergence: {divergence}")
        else:
            reasons.append("localization replay found every tapped output and logit equal (nondeterminism?)")
    reason = "; ".join(reasons) if reasons else (
        f"bit-exact: {decode_steps + 1} steps, greedy ids equal" + (", batch-2 equal" if b2_equal else ""))
    warnings = []
    tokens = repeated_tokens(ot.greedy_ids)
    if decode_steps and tokens is not None:
        warnings.append(f"the oracle's greedy ids are one token repeated ({', '.join(map(str, tokens))}): every "
                        "decode step fed the same id (a prompt from oracle.varied_prompt_ids avoids it)")
        reason += f"; warning: {warnings[-1]}"
    return GateResult(
        verdict="pass" if passed else "fail",
        trajectory_equal=cmp.equal,
        first_mismatch_step=cmp.first_mismatch_step,
        max_abs_diff=max(cmp.max_abs_diff, b2.max_abs_diff if b2 is not None else 0.0),
        per_step_max_abs_diff=cmp.per_step,
        batch2_equal=b2_equal,
        first_divergence=divergence,
        reason=reason,
        prompt_ids=ot.prompt_ids,
        greedy_ids=ot.greedy_ids,
        candidate_greedy_ids=ct.greedy_ids,
        decode_steps=decode_steps,
        logits_dtype=ot.dtype,
        batch2_prompt_ids=b2_prompt,
        warnings=warnings,
        oracle_trajectory=ot,
        candidate_trajectory=ct,
    )


def _decode_feed(t: Trajectory, step: int | None) -> list:
    """The oracle's greedy ids that lead up to `step` (fed one at a time after the prefill)."""
    n = step or 0
    return [r[:n] for r in t.greedy_ids] if t.batched else t.greedy_ids[:n]
