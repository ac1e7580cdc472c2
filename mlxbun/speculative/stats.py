"""Acceptance statistics of speculative decoding, named as vLLM and NVIDIA AIPerf name them.

Per request (one `SpecStats` filled by the engine) and aggregated (`SpecStats.aggregate`):

- drafts: draft rounds that proposed at least one token (vLLM `num_drafts`);
- draft_tokens / accepted_tokens: proposed / accepted draft tokens;
- acceptance_per_position[i]: accepted tokens at draft position i over `drafts` (vLLM's
  per-position acceptance rate; a round with fewer than i+1 proposals counts as a miss there);
- acceptance_length_histogram[a]: rounds whose acceptance length (1 + accepted) was a;
- mean_acceptance_length = 1 + accepted_tokens / drafts;
- draft_acceptance_rate = accepted_tokens / draft_tokens;
- time in draft vs verify, end-to-end tokens/s and, when measured on the same prompt, plain
  decoding's tokens/s and the speedup;
- the speedup bound from the acceptance-length distribution (`speedup_bound`): tokens emitted
  per verification round, i.e. the speedup if drafting were free and verifying k+1 tokens cost
  one plain decoding step; with measured costs (`verify_cost`, `draft_cost` in plain steps) the
  cost-aware bound; decode-only tokens/s (prefill left out) next to plain decoding's;
- the rollback cost of a recurrent target (mlxbun's own, no vLLM name): replays (rounds whose
  rejection sent a recurrent state back to the round's start), replayed_tokens (tokens fed
  again: the accepted drafts + the round's first token) and replay_s (their forwards' time,
  not part of verify_s).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional

from mlxbun.errors import MlxbunError

__all__ = ["SpecStats", "speedup_bound"]


def speedup_bound(acceptance_length_histogram, plain_rounds: int = 0, *, verify_cost: float = 1.0,
                  draft_cost: float = 0.0) -> float:
    """Tokens per plain-decoding step: a round of acceptance length a emits a tokens (a-1 accepted
    drafts + the target's own), a round that drafted nothing (`plain_rounds`) emits one. Each
    drafting round costs `verify_cost` + `draft_cost` plain steps (verifying k+1 tokens, and
    drafting them), a round without a draft one step. With the defaults (free drafts, a verify
    as cheap as one decoding step) this is the upper bound the distribution allows."""
    hist = {int(a): int(n) for a, n in dict(acceptance_length_histogram).items() if n}
    if any(a < 1 for a in hist) or any(n < 0 for n in hist.values()) or plain_rounds < 0:
        raise MlxbunError(f"speedup bound: acceptance lengths must be >= 1 and counts >= 0, got {hist} "
                          f"and plain_rounds={plain_rounds}")
    if verify_cost <= 0 or draft_cost < 0:
        raise MlxbunError(f"speedup bound: verify_cost must be > 0 and draft_cost >= 0, got {verify_cost}, "
                          f"{draft_cost}")
    drafted = sum(hist.values())
    steps = drafted * (verify_cost + draft_cost) + plain_rounds
    return (sum(a * n for a, n in hist.items()) + plain_rounds) / steps if steps else math.nan


@dataclass
class SpecStats:
    rounds: int = 0  # every verification step, including rounds with nothing drafted
    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    generated_tokens: int = 0
    accepted_per_position: list = field(default_factory=list)  # counts
    drafted_per_position: list = field(default_factory=list)  # counts
    acceptance_length_histogram: Counter = field(default_factory=Counter)
    k_histogram: Counter = field(default_factory=Counter)  # draft length asked per round
    prefill_s: float = 0.0  # the target's (and the drafter's first) prompt processing
    draft_s: float = 0.0
    verify_s: float = 0.0
    replays: int = 0
    replayed_tokens: int = 0
    replay_s: float = 0.0
    wall_s: float = 0.0  # from the call to the last token
    plain_tokens_per_s: Optional[float] = None
    plain_decode_tokens_per_s: Optional[float] = None  # plain decoding with its prefill left out
    requests: int = 1

    # ------------------------------------------------------------------ updates

    def add_round(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None:
        """One verification step: k asked, n_drafted proposed, n_accepted of them accepted."""
        self.rounds += 1
        self.k_histogram[int(k)] += 1
        self.draft_s += draft_s
        self.verify_s += verify_s
        if n_drafted == 0:
            return
        self.drafts += 1
        self.draft_tokens += n_drafted
        self.accepted_tokens += n_accepted
        grow = n_drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(n_drafted):
            self.drafted_per_position[i] += 1
        for i in range(n_accepted):
            self.accepted_per_position[i] += 1
        self.acceptance_length_histogram[1 + n_accepted] += 1

    def add_replay(self, tokens: int, seconds: float) -> None:
        """A rollback by replay: `tokens` fed again through the target in `seconds`."""
        self.replays += 1
        self.replayed_tokens += int(tokens)
        self.replay_s += seconds

    # ------------------------------------------------------------------ derived

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.accepted_tokens / self.drafts if self.drafts else math.nan

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else math.nan

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / self.drafts for a in self.accepted_per_position] if self.drafts else []

    @property
    def conditional_acceptance_per_position(self) -> list[float]:
        """Accepted at position i over rounds that proposed a token at i."""
        return [a / d if d else math.nan for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else math.nan

    @property
    def speedup(self) -> float:
        """End-to-end tokens/s over plain decoding's on the same prompt (NaN if not measured)."""
        if not self.plain_tokens_per_s:
            return math.nan
        return self.tokens_per_s / self.plain_tokens_per_s

    @property
    def decode_tokens_per_s(self) -> float:
        """Generated tokens over the time after the prefill (drafting, verifying, replaying)."""
        t = self.wall_s - self.prefill_s
        return self.generated_tokens / t if t > 0 and self.generated_tokens else math.nan

    @property
    def decode_speedup(self) -> float:
        """Decode-only tokens/s over plain decoding's decode-only tokens/s (NaN if not measured)."""
        if not self.plain_decode_tokens_per_s:
            return math.nan
        return self.decode_tokens_per_s / self.plain_decode_tokens_per_s

    @property
    def speedup_bound(self) -> float:
        """`speedup_bound` of this run's acceptance lengths (rounds that drafted nothing emit one)."""
        return speedup_bound(self.acceptance_length_histogram, self.rounds - self.drafts)

    @property
    def verify_cost(self) -> float:
        """A drafting round's verify (+ replay) seconds in plain decoding steps (from the plain
        decode tokens/s), NaN if not measured. Rounds without drafts count as one step each."""
        if not self.plain_decode_tokens_per_s or not self.drafts:
            return math.nan
        step = 1.0 / self.plain_decode_tokens_per_s
        return max(0.0, (self.verify_s + self.replay_s) / step - (self.rounds - self.drafts)) / self.drafts

    @property
    def draft_cost(self) -> float:
        """A drafting round's draft seconds in plain decoding steps (NaN if not measured)."""
        if not self.plain_decode_tokens_per_s or not self.drafts:
            return math.nan
        return self.draft_s * self.plain_decode_tokens_per_s / self.drafts

    @property
    def cost_aware_bound(self) -> float:
        """`speedup_bound` with the measured verify and draft costs (in plain steps)."""
        if math.isnan(self.verify_cost) or self.verify_cost <= 0:
            return math.nan
        return speedup_bound(self.acceptance_length_histogram, self.rounds - self.drafts,
                             verify_cost=self.verify_cost, draft_cost=self.draft_cost)

    @property
    def replay_time_fraction(self) -> float:
        """Replay seconds over draft + verify + replay seconds (0 when nothing was replayed)."""
        busy = self.draft_s + self.verify_s + self.replay_s
        return self.replay_s / busy if busy > 0 else math.nan

    @property
    def draft_time_fraction(self) -> float:
        busy = self.draft_s + self.verify_s
        return self.draft_s / busy if busy > 0 else math.nan

    # ------------------------------------------------------------------ aggregation

    @classmethod
    def aggregate(cls, stats: Iterable["SpecStats"]) -> "SpecStats":
        """Sum of requests (counts, histograms, times); plain tokens/s from the summed plain time."""
        out = cls(requests=0)
        plain_time, plain_tokens = 0.0, 0
        decode_time, decode_tokens = 0.0, 0
        for s in stats:
            out.requests += s.requests
            for name in ("rounds", "drafts", "draft_tokens", "accepted_tokens", "generated_tokens", "replays",
                         "replayed_tokens"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
            for name in ("prefill_s", "draft_s", "verify_s", "replay_s", "wall_s"):
                setattr(out, name, getattr(out, name) + getattr(s, name))
            for name in ("accepted_per_position", "drafted_per_position"):
                mine, theirs = getattr(out, name), getattr(s, name)
                mine += [0] * (len(theirs) - len(mine))
                for i, v in enumerate(theirs):
                    mine[i] += v
            out.acceptance_length_histogram.update(s.acceptance_length_histogram)
            out.k_histogram.update(s.k_histogram)
            if s.plain_tokens_per_s:
                plain_tokens += s.generated_tokens
                plain_time += s.generated_tokens / s.plain_tokens_per_s
            else:
                plain_time = math.nan
            if s.plain_decode_tokens_per_s:
                decode_tokens += s.generated_tokens
                decode_time += s.generated_tokens / s.plain_decode_tokens_per_s
            else:
                decode_time = math.nan
        if plain_tokens and plain_time > 0:
            out.plain_tokens_per_s = plain_tokens / plain_time
        if decode_tokens and decode_time > 0:
            out.plain_decode_tokens_per_s = decode_tokens / decode_time
        return out

    # ------------------------------------------------------------------ output

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "rounds": self.rounds,
            "drafts": self.drafts,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "generated_tokens": self.generated_tokens,
            "mean_acceptance_length": self.mean_acceptance_length,
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "accepted_per_position": list(self.accepted_per_position),
            "drafted_per_position": list(self.drafted_per_position),
            "acceptance_length_histogram": {int(k): v for k, v in sorted(self.acceptance_length_histogram.items())},
            "k_histogram": {int(k): v for k, v in sorted(self.k_histogram.items())},
            "prefill_s": self.prefill_s,
            "draft_s": self.draft_s,
            "verify_s": self.verify_s,
            "replays": self.replays,
            "replayed_tokens": self.replayed_tokens,
            "replay_s": self.replay_s,
            "replay_time_fraction": self.replay_time_fraction,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
            "plain_tokens_per_s": self.plain_tokens_per_s,
            "speedup": self.speedup,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "plain_decode_tokens_per_s": self.plain_decode_tokens_per_s,
            "decode_speedup": self.decode_speedup,
            "speedup_bound": self.speedup_bound,
            "verify_cost": self.verify_cost,
            "draft_cost": self.draft_cost,
            "cost_aware_bound": self.cost_aware_bound,
        }

    _UNITS = {"draft_s": "s", "verify_s": "s", "prefill_s": "s", "wall_s": "s", "tokens_per_s": "tok/s",
              "plain_tokens_per_s": "tok/s", "draft_tokens": "tokens", "accepted_tokens": "tokens",
              "generated_tokens": "tokens", "mean_acceptance_length": "tokens", "replays": "rounds",
              "replayed_tokens": "tokens", "replay_s": "s",
              "decode_tokens_per_s": "tok/s", "plain_decode_tokens_per_s": "tok/s", "verify_cost": "steps",
              "draft_cost": "steps"}

    def as_rows(self, **params: Any) -> list[tuple]:
        """(metric, value, unit, params) rows for `Run.record_many`; NaN metrics are left out, the
        per-position rates get a `position` parameter, histogram bins an `acceptance_length`."""
        d = self.as_dict()
        rows = []
        for name in ("drafts", "draft_tokens", "accepted_tokens", "generated_tokens", "rounds",
                     "mean_acceptance_length", "draft_acceptance_rate", "prefill_s", "draft_s", "verify_s",
                     "replays", "replayed_tokens", "replay_s", "wall_s", "tokens_per_s", "plain_tokens_per_s",
                     "speedup", "decode_tokens_per_s", "plain_decode_tokens_per_s", "decode_speedup",
                     "speedup_bound", "verify_cost", "draft_cost", "cost_aware_bound"):
            v = d[name]
            if v is None or (isinstance(v, float) and math.isnan(v)):
                continue
            rows.append((name, v, self._UNITS.get(name), dict(params)))
        for i, rate in enumerate(d["acceptance_per_position"]):
            rows.append(("acceptance_per_position", rate, None, {**params, "position": i}))
        for length, count in d["acceptance_length_histogram"].items():
            rows.append(("acceptance_length_count", count, "rounds", {**params, "acceptance_length": length}))
        return rows

    def record(self, run, **params: Any) -> list[int]:
        """Write the rows to a results `Run` (extra keyword params join every row)."""
        return run.record_many(self.as_rows(**params))

    def summary(self) -> str:
        """One line, vLLM-log style."""
        pos = ", ".join(f"{r:.3f}" for r in self.acceptance_per_position)
        line = (f"Mean acceptance length: {self.mean_acceptance_length:.2f}, "
                f"Accepted: {self.accepted_tokens} tokens, Drafted: {self.draft_tokens} tokens, "
                f"Draft acceptance rate: {100 * self.draft_acceptance_rate:.1f}%, "
                f"Per-position acceptance rate: [{pos}], "
                f"draft {self.draft_s:.3f}s / verify {self.verify_s:.3f}s, {self.tokens_per_s:.1f} tok/s")
        if self.replays:
            line += (f", rollback: {self.replayed_tokens} tokens replayed in {self.replays} rounds "
                     f"({self.replay_s:.3f}s)")
        if self.plain_tokens_per_s:
            line += f" (plain {self.plain_tokens_per_s:.1f} tok/s, speedup {self.speedup:.2f}x)"
        return line
