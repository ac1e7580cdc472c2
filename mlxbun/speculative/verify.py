"""Verification of a draft against the target: greedy exact match and rejection sampling.

`Sampling` is the token distribution both sides are scored under: mlx-lm's `make_sampler`
filters (top-p, then min-p, then top-k, on the log-probabilities; `mlxbun.sampling`'s own
functions) followed by `softmax(filtered / temperature)`, which is exactly the distribution
`categorical_sampling` draws from in plain decoding. The same processing gives the target's p
and the draft's q.

Rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x_i is accepted with
probability min(1, p_i(x)/q_i(x)); at the first rejection a token is drawn from
normalize(max(p_i - q_i, 0)); when every draft token is accepted the bonus token is drawn from
p_{m}. Each emitted token is then distributed exactly as p. A drafter that proposes
deterministically (n-gram lookup) has q = one-hot(x). Randomness is threaded through explicit
`mx.random` keys, so a seed fixes the whole stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from mlxbun.sampling import (
    GenerationError,
    apply_min_p,
    apply_top_k,
    apply_top_p,
    check_sampling_options,
)

__all__ = ["Sampling", "Verdict", "verify_greedy", "verify_sampled"]


@dataclass(frozen=True)
class Sampling:
    """Temperature / top-p / top-k / min-p, checked as `mlxbun.sampling.make_sampler` checks them
    (temperature 0 is greedy; top_p 1, top_k 0 and min_p 0 are off)."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    min_tokens_to_keep: int = 1

    def __post_init__(self):
        check_sampling_options(self.temperature, self.top_p, self.min_p, self.min_tokens_to_keep, self.top_k)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def filtered(self, logprobs: mx.array) -> mx.array:
        """make_sampler's filters, in its order, over rows [n, V] (removed tokens get -inf)."""
        if 0 < self.top_p < 1.0:
            logprobs = apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0:
            vocab = logprobs.shape[-1]
            if not 0 < self.top_k < vocab:
                raise GenerationError(f"top_k must be below the vocabulary size {vocab}, got {self.top_k}")
            logprobs = apply_top_k(logprobs, self.top_k)
        return logprobs

    def scaled_logits(self, logprobs: mx.array) -> mx.array:
        """What `categorical_sampling` draws from: filtered log-probabilities times 1/temperature."""
        if self.greedy:
            raise GenerationError("greedy decoding has no sampling distribution (temperature is 0)")
        return self.filtered(logprobs) * (1.0 / self.temperature)

    def probs(self, logprobs: mx.array) -> mx.array:
        """The processed distribution [n, V] (float32) that plain sampling draws from."""
        return mx.softmax(self.scaled_logits(logprobs).astype(mx.float32), axis=-1)

    def sample(self, logprobs: mx.array, key: Optional[mx.array]) -> mx.array:
        """One token per row: argmax when greedy (mlx-lm's greedy sampler), else a draw."""
        if self.greedy:
            return mx.argmax(logprobs, axis=-1)
        return mx.random.categorical(self.scaled_logits(logprobs), key=key)

    def as_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "min_p": self.min_p,
                "min_tokens_to_keep": self.min_tokens_to_keep}


@dataclass(frozen=True)
class Verdict:
    """The outcome of one round: how many draft tokens were accepted, and the token the target
    emits after them (the correction at the first mismatch, or the bonus token)."""

    n_accepted: int
    token: int


def verify_greedy(target_tokens: Sequence[int], drafts: Sequence[int]) -> Verdict:
    """Accept drafts up to the first mismatch with the target's argmax; emit the target's token
    there (or its bonus token after the last draft). `target_tokens` has len(drafts) + 1 entries."""
    if len(target_tokens) != len(drafts) + 1:
        raise ValueError(f"verify_greedy: {len(target_tokens)} target tokens for {len(drafts)} drafts")
    n = 0
    while n < len(drafts) and int(target_tokens[n]) == int(drafts[n]):
        n += 1
    return Verdict(n, int(target_tokens[n]))


def verify_sampled(p: mx.array, drafts: Sequence[int], q: Optional[mx.array], key: mx.array) -> Verdict:
    """Rejection sampling over one round.

    p: the target's processed distributions [m+1, V] at the m draft positions and after them;
    drafts: the m proposed tokens; q: the draft's distributions [m, V] they were drawn from, or
    None for a deterministic proposal (q = one-hot of each draft token); key: an mx.random key.
    """
    m = len(drafts)
    if p.ndim != 2 or p.shape[0] != m + 1:
        raise ValueError(f"verify_sampled: p has shape {tuple(p.shape)}, expected [{m + 1}, V]")
    if q is not None and tuple(q.shape) != (m, p.shape[1]):
        raise ValueError(f"verify_sampled: q has shape {tuple(q.shape)}, expected [{m}, {p.shape[1]}]")
    k_accept, k_resample = mx.random.split(key)
    n = m
    if m:
        d = mx.array([int(t) for t in drafts], dtype=mx.int32)[:, None]
        px = mx.take_along_axis(p[:m], d, axis=-1)[:, 0]
        qx = mx.ones_like(px) if q is None else mx.take_along_axis(q, d, axis=-1)[:, 0]
        u = mx.random.uniform(shape=(m,), key=k_accept)
        # u < min(1, p/q)  <=>  u * q < p  (u < 1; no division by a zero q)
        accepted = (u * qx < px).tolist()
        n = accepted.index(False) if False in accepted else m
    if n < m:
        one_hot = mx.zeros((p.shape[1],), p.dtype).at[int(drafts[n])].add(1.0)
        residual = mx.maximum(p[n] - (one_hot if q is None else q[n]), 0.0)
        # p == q would never reject; a zero residual only arises from rounding: fall back to p
        dist = mx.where(residual.sum() > 0, residual, p[n])
    else:
        dist = p[m]
    token = mx.random.categorical(mx.log(dist), key=k_resample)
    return Verdict(n, int(token.item()))
