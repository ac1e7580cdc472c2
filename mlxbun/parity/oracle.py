"""Greedy trajectories: the record both sides of the gate produce, one driver for both.

`run_trajectory(model, prompt_ids, decode_steps)` prefills the prompt through a
fresh cache, then feeds each greedy token back one at a time through the same
cache. Step 0 is the prefill (its last position); steps 1..decode_steps are the
one-token decode forwards, so a trajectory holds decode_steps + 1 greedy ids
and decode_steps + 1 step logits, plus the full prefill logits [B, L, V].
Both the oracle and the candidate run this same driver, so any difference is
the model's, not the loop's.

Tiny random models often fall into one token repeated (with tied embeddings a
fed token tends to be its own best successor); `varied_prompt_ids` picks the
first prompt seed whose oracle trajectory is not, so decode feeds several ids.
"""

from __future__ import annotations

import hashlib
import numbers
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from mlxbun.errors import MlxbunError

__all__ = ["Trajectory", "as_batch", "default_prompt_ids", "repeated_tokens", "run_oracle", "run_trajectory",
           "varied_prompt_ids"]


@dataclass
class Trajectory:
    """One greedy run: explicit ids in, greedy ids and raw logits out."""

    prompt_ids: list[int] | list[list[int]]  # as given: flat for B = 1, nested for a batch
    greedy_ids: list[int] | list[list[int]]  # same nesting; decode_steps + 1 ids per row
    step_logits: list[mx.array]  # decode_steps + 1 arrays [B, V]; [0] = prefill's last position
    prefill_logits: mx.array  # [B, L, V]
    dtype: str  # the logits dtype, e.g. "float32"
    decode_steps: int = 0
    batched: bool = field(default=False)

    @property
    def batch_size(self) -> int:
        return int(self.prefill_logits.shape[0])


def as_batch(prompt_ids: Sequence) -> tuple[list[list[int]], bool]:
    """Rows of ids and whether the input was nested (a batch) or flat (one prompt)."""
    if len(prompt_ids) == 0:
        raise MlxbunError("prompt_ids is empty")
    batched = not isinstance(prompt_ids[0], numbers.Integral)
    rows = [list(map(int, r)) for r in prompt_ids] if batched else [list(map(int, prompt_ids))]
    if any(len(r) != len(rows[0]) for r in rows) or not rows[0]:
        lengths = [len(r) for r in rows]
        raise MlxbunError(f"batched prompts must be non-empty and of equal length, got lengths {lengths}")
    return rows, batched


def _cache_arrays(cache: Any) -> list[mx.array]:
    """The cache's arrays, evaluated each step (as mlx-lm's generate does) so graphs stay short."""
    from mlx.utils import tree_flatten

    states = [getattr(c, "state", None) for c in cache]
    return [v for _, v in tree_flatten(states) if isinstance(v, mx.array)]


def run_trajectory(model: Any, prompt_ids: Sequence, decode_steps: int = 16) -> Trajectory:
    """Prefill `prompt_ids` through `model.make_cache()`, then greedy-decode `decode_steps` steps."""
    if decode_steps < 0:
        raise MlxbunError(f"decode_steps must be >= 0, got {decode_steps}")
    from mlxbun.models.mlxlm import ensure_runtime

    rows, batched = as_batch(prompt_ids)
    model = ensure_runtime(model)
    cache = model.make_cache()
    prefill = model(mx.array(rows, dtype=mx.int32), cache=cache)
    if prefill.ndim != 3 or prefill.shape[:2] != (len(rows), len(rows[0])):
        raise MlxbunError(f"model returned logits of shape {tuple(prefill.shape)}, expected [B, L, V]")
    step_logits = [prefill[:, -1, :]]
    tokens = mx.argmax(step_logits[0], axis=-1)
    mx.eval(prefill, tokens, _cache_arrays(cache))
    greedy = [tokens.tolist()]
    for _ in range(decode_steps):
        logits = model(tokens[:, None].astype(mx.int32), cache=cache)[:, -1, :]
        tokens = mx.argmax(logits, axis=-1)
        mx.eval(logits, tokens, _cache_arrays(cache))
        step_logits.append(logits)
        greedy.append(tokens.tolist())
    per_row = [[step[b] for step in greedy] for b in range(len(rows))]
    return Trajectory(
        prompt_ids=rows if batched else rows[0],
        greedy_ids=per_row if batched else per_row[0],
        step_logits=step_logits,
        prefill_logits=prefill,
        dtype=str(prefill.dtype).removeprefix("mlx.core."),
        decode_steps=decode_steps,
        batched=batched,
    )


def run_oracle(path: str | Path, prompt_ids: Sequence, decode_steps: int = 16) -> Trajectory:
    """Load `path` with mlx-lm (live, this process, this backend) and run its trajectory."""
    from mlxbun.models.mlxlm import load_mlxlm

    return run_trajectory(load_mlxlm(path), prompt_ids, decode_steps)


def default_prompt_ids(vocab_size: int, length: int = 40, seed: int = 0, exclude: Sequence[int] = ()) -> list[int]:
    """A deterministic prompt of `length` ids from the middle half of the vocabulary.

    Special tokens sit at the ends of real vocabularies (pad/bos/eos/unk and
    <unusedN> low, added tokens high), so ids come from [V/4, 3V/4), minus
    `exclude`. The ids derive from sha256 (no PRNG whose stream could change
    across Python/numpy versions). 40 tokens cross a sliding window of 16.
    """
    if vocab_size < 8 or length < 1:
        raise MlxbunError(f"default_prompt_ids: need vocab_size >= 8 and length >= 1, got {vocab_size}, {length}")
    lo, hi = vocab_size // 4, (3 * vocab_size) // 4
    excluded = set(exclude)
    pool = hi - lo
    out: list[int] = []
    i = 0
    while len(out) < length:
        digest = hashlib.sha256(f"mlxbun-prompt:{seed}:{i}".encode()).digest()
        tok = lo + int.from_bytes(digest[:8], "little") % pool
        i += 1
        if tok not in excluded:
            out.append(tok)
        if i > 1000 * length:
            raise MlxbunError("default_prompt_ids: exclude removes every candidate id")
    return out


def repeated_tokens(greedy_ids: Sequence) -> list[int] | None:
    """The token each row repeats when every row of `greedy_ids` (flat for one prompt, nested for
    a batch) is one token repeated; None when some row varies."""
    if not greedy_ids:
        return None
    rows = [greedy_ids] if isinstance(greedy_ids[0], numbers.Integral) else greedy_ids
    if all(len(set(r)) == 1 for r in rows):
        return [int(r[0]) for r in rows]
    return None


def varied_prompt_ids(oracle: Any, vocab_size: int, length: int = 40, decode_steps: int = 16,
                      tries: int = 32) -> tuple[list[int], Trajectory]:
    """`default_prompt_ids(vocab_size, length)`, or, when the oracle's greedy trajectory on it is
    one token repeated, the prompt of the first later seed (up to `tries` seeds) whose trajectory
    is not. Returns the prompt and the oracle's trajectory on it (to hand to the gate). When
    every seed repeats one token, seed 0's prompt is kept (the gate's result warns)."""
    first = None
    for seed in range(max(1, tries)):
        prompt = default_prompt_ids(vocab_size, length=length, seed=seed)
        run = run_trajectory(oracle, prompt, decode_steps)
        if first is None:
            first = (prompt, run)
        if decode_steps == 0 or repeated_tokens(run.greedy_ids) is None:
            return prompt, run
    return first
