"""Rejection sampling preserves the target distribution (mlxbun.speculative.verify, engine).

Statistical tests run with fixed seeds, so they are deterministic. Thresholds:
- histogram vs the exact distribution: Pearson chi-square p-value > 1e-3;
- empirical acceptance rate vs sum_x min(p(x), q(x)): within 0.02 (over 3 binomial standard
  deviations at N = 6000 trials);
- end to end, a long speculative run on toy bigram models is a Markov chain whose transition
  counts must fit the target's processed transition matrix (p-value > 1e-3) and must not fit
  the draft's (p-value < 1e-6).
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.cache.kv import KVCache
from mlxbun.sampling import GenerationError, make_sampler
from mlxbun.speculative import (
    DraftModelDrafter,
    DraftSession,
    NGramDrafter,
    Sampling,
    SpecStats,
    Verdict,
    speculative_generate_step,
    verify_greedy,
    verify_sampled,
)

P_MIN = 1e-3
RATE_TOL = 0.02


def chi2_sf(x: float, df: int) -> float:
    """Survival function of the chi-square distribution: the regularized upper incomplete gamma
    Q(df/2, x/2), from the power series of P (ample precision for p-values near 1e-3)."""
    a, z = df / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    term = total = 1.0 / a
    for n in range(1, 5000):
        term *= z / (a + n)
        total += term
        if term < total * 1e-15:
            break
    return max(0.0, 1.0 - math.exp(a * math.log(z) - z - math.lgamma(a)) * total)


def chi2_stat(counts, probs) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of counts against probabilities; cells whose
    expected count is below 5 are pooled into one; counts where p is 0 make it infinite."""
    counts, probs = np.asarray(counts, float), np.asarray(probs, float)
    if np.any(counts[probs == 0] > 0):
        return math.inf, 1
    keep = probs > 0
    counts, probs = counts[keep], probs[keep] / probs[keep].sum()
    expected = counts.sum() * probs
    small = expected < 5
    if small.sum() > 1:
        counts = np.append(counts[~small], counts[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
    return float(((counts - expected) ** 2 / expected).sum()), len(counts) - 1


def chi2_pvalue(counts, probs) -> float:
    x, df = chi2_stat(counts, probs)
    return 0.0 if math.isinf(x) else chi2_sf(x, max(df, 1))


def markov_pvalue(tokens, transition) -> float:
    """Goodness of fit of a token chain's transition counts to a transition matrix [V, V]
    (rows conditioned on their counts; statistics and degrees of freedom add up)."""
    v = transition.shape[0]
    counts = np.zeros((v, v))
    for a, b in zip(tokens[:-1], tokens[1:]):
        counts[a, b] += 1
    x = df = 0
    for a in range(v):
        if counts[a].sum():
            xa, da = chi2_stat(counts[a], transition[a])
            if math.isinf(xa):
                return 0.0
            x, df = x + xa, df + da
    return chi2_sf(x, df)


def test_chi2_helpers_reject_a_wrong_distribution():
    rng = np.random.default_rng(0)
    p = np.array([0.1, 0.2, 0.3, 0.4, 0.0])
    good = np.bincount(rng.choice(5, 5000, p=p), minlength=5)
    bad = np.bincount(rng.choice(5, 5000, p=[0.15, 0.2, 0.25, 0.4, 0.0]), minlength=5)
    assert chi2_pvalue(good, p) > P_MIN
    assert chi2_pvalue(bad, p) < 1e-6
    assert chi2_pvalue([1, 0, 0, 0, 1], p) == 0.0  # mass where p is 0
    assert abs(chi2_sf(3.841459, 1) - 0.05) < 1e-5 and abs(chi2_sf(9.487729, 4) - 0.05) < 1e-5
    t = np.array([[0.9, 0.1], [0.3, 0.7]])
    chain = [0]
    for _ in range(3000):
        chain.append(int(rng.choice(2, p=t[chain[-1]])))
    assert markov_pvalue(chain, t) > P_MIN
    assert markov_pvalue(chain, np.array([[0.8, 0.2], [0.3, 0.7]])) < 1e-6


# ----------------------------------------------------------------------------- verify_sampled


P = np.array([0.05, 0.40, 0.25, 0.20, 0.10])
Q = np.array([0.30, 0.10, 0.35, 0.05, 0.20])
N = 6000


def _trials(p_rows, q_rows, n_trials, seed, deterministic_draft=None):
    """Run verify_sampled n_trials times on fixed rows; the draft tokens are drawn from q (or
    fixed). Returns (first emitted tokens, accepted-at-position-0 flags)."""
    p = mx.array(np.asarray(p_rows, np.float32))
    q = None if q_rows is None else mx.array(np.asarray(q_rows, np.float32))
    keys = mx.random.split(mx.random.key(seed), 2 * n_trials)
    if deterministic_draft is None:
        drafts = mx.random.categorical(mx.log(q[0]), num_samples=n_trials, key=keys[0]).tolist()
    else:
        drafts = [[deterministic_draft] * (p.shape[0] - 1)] * n_trials
    firsts, accepted = [], []
    for i in range(n_trials):
        d = drafts[i] if isinstance(drafts[i], list) else [drafts[i]]
        v = verify_sampled(p, d, q, keys[i + n_trials])
        firsts.append(d[0] if v.n_accepted > 0 else v.token)
        accepted.append(v.n_accepted > 0)
    return np.array(firsts), np.array(accepted)


def test_emitted_token_follows_p_and_acceptance_is_sum_min():
    firsts, acc = _trials([P, P], [Q], N, seed=0)
    assert chi2_pvalue(np.bincount(firsts, minlength=5), P) > P_MIN
    assert abs(acc.mean() - np.minimum(P, Q).sum()) < RATE_TOL


def test_deterministic_proposal_is_one_hot_q():
    # n-gram drafts have no q: accept with p(x), else draw from p without x
    firsts, acc = _trials([P, P], None, 4000, seed=1, deterministic_draft=2)
    assert chi2_pvalue(np.bincount(firsts, minlength=5), P) > P_MIN
    assert abs(acc.mean() - P[2]) < RATE_TOL


def test_disjoint_supports_always_reject_and_still_follow_p():
    p = np.array([0.5, 0.5, 0.0, 0.0, 0.0])
    q = np.array([0.0, 0.0, 0.6, 0.4, 0.0])
    firsts, acc = _trials([p, p], [q], 2000, seed=2)
    assert not acc.any()
    assert chi2_pvalue(np.bincount(firsts, minlength=5), p) > P_MIN


def test_identical_p_and_q_always_accept():
    firsts, acc = _trials([P, P], [P], 1000, seed=3)
    assert acc.all()


def test_bonus_token_after_all_accepted_follows_the_last_row():
    p_last = np.array([0.0, 0.1, 0.0, 0.6, 0.3])
    p = mx.array(np.stack([P, P, p_last]).astype(np.float32))
    keys = mx.random.split(mx.random.key(4), 1500)
    bonus = [verify_sampled(p, [1, 1], mx.array(np.stack([P, P]).astype(np.float32)), k).token for k in keys]
    assert chi2_pvalue(np.bincount(bonus, minlength=5), p_last) > P_MIN


def test_verify_is_deterministic_per_key_and_checks_shapes():
    p = mx.array(np.stack([P, P]).astype(np.float32))
    q = mx.array(Q[None].astype(np.float32))
    k = mx.random.key(7)
    assert verify_sampled(p, [3], q, k) == verify_sampled(p, [3], q, k)
    with pytest.raises(ValueError, match="expected"):
        verify_sampled(p, [3, 1], q, k)
    with pytest.raises(ValueError, match="q has shape"):
        verify_sampled(p, [3], mx.ones((1, 4)), k)


def test_verify_greedy():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]) == Verdict(3, 8)  # all accepted: bonus token
    assert verify_greedy([5, 9, 7, 8], [5, 6, 7]) == Verdict(1, 9)  # first mismatch: target's token
    assert verify_greedy([4], []) == Verdict(0, 4)


# ----------------------------------------------------------------------------- the processing


def test_processed_distribution_is_what_the_plain_sampler_draws():
    logits = mx.array(np.log(np.array([[0.02, 0.08, 0.3, 0.1, 0.5]], np.float32)))
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    s = Sampling(temperature=0.7, top_p=0.9, top_k=3, min_p=0.1)
    probs = np.array(s.probs(logprobs))[0]
    # top-p 0.9 keeps {4, 2, 3} (0.5+0.3+0.1); min-p 0.1 * 0.5 drops < 0.05; top-k 3 keeps those
    assert probs[0] == 0 and probs[1] == 0
    expected = np.array([0, 0, 0.3, 0.1, 0.5]) ** (1 / 0.7)
    np.testing.assert_allclose(probs, expected / expected.sum(), rtol=1e-5)
    # mlxbun.sampling.make_sampler draws from the same distribution
    sampler = make_sampler(0.7, 0.9, 0.1, 1, top_k=3)
    mx.random.seed(11)
    draws = [sampler(logprobs).item() for _ in range(2000)]
    assert chi2_pvalue(np.bincount(draws, minlength=5), probs) > P_MIN


def test_sampling_options_are_checked():
    with pytest.raises(GenerationError, match="top_p"):
        Sampling(temperature=1.0, top_p=0.0)
    with pytest.raises(GenerationError, match="temperature"):
        Sampling(temperature=-1.0)
    with pytest.raises(GenerationError, match="vocabulary size"):
        Sampling(temperature=1.0, top_k=9).probs(mx.zeros((1, 5)))


# ----------------------------------------------------------------------------- end to end


class Bigram:
    """A toy RuntimeModel: next-token logits depend on the last token only (a table [V, V]);
    its cache only counts tokens, so the spec-round contract applies as for a real model."""

    def __init__(self, table):
        self.table = mx.array(np.asarray(table, np.float32))

    def make_cache(self):
        return [KVCache()]

    def __call__(self, ids, cache=None):
        if cache:
            z = mx.zeros((ids.shape[0], 1, ids.shape[1], 1))
            cache[0].update_and_fetch(z, z)
        return self.table[ids]


def _table(seed, v=5, scale=1.5):
    return np.random.default_rng(seed).normal(size=(v, v)) * scale


def _transitions(table, sampling):
    lp = mx.array(np.asarray(table, np.float32))
    return np.array(sampling.probs(lp - mx.logsumexp(lp, axis=-1, keepdims=True)))


def _chain(target, drafter, sampling, *, k, n=1500, seed=0, prompt=(0, 1)):
    """One long speculative run: the tokens of a Markov chain whose transitions are the target's."""
    drafter.bind(DraftSession(target=target, vocab_size=5, sampling=sampling))
    stats = SpecStats()
    gen = speculative_generate_step(mx.array(list(prompt)), target, drafter, cache=target.make_cache(),
                                    num_draft=k, max_tokens=n, sampling=sampling, key=mx.random.key(seed),
                                    stats=stats)
    return [prompt[-1]] + [t for t, _, _ in gen], stats


@pytest.mark.parametrize("k", [1, 4])
def test_speculative_sampling_chain_follows_the_target(k):
    t_table, d_table = _table(0), _table(1)
    sampling = Sampling(temperature=1.0)
    tokens, stats = _chain(Bigram(t_table), DraftModelDrafter(Bigram(d_table)), sampling, k=k, seed=10 + k)
    assert 0 < stats.accepted_tokens < stats.draft_tokens  # both branches ran
    assert markov_pvalue(tokens, _transitions(t_table, sampling)) > P_MIN
    # and not the draft's chain
    assert markov_pvalue(tokens, _transitions(d_table, sampling)) < 1e-6


def test_processing_applies_to_target_and_draft_alike():
    # top-k 2 + temperature 0.8 on both sides: tokens outside the target's top 2 never appear
    t_table, d_table = _table(2), _table(3)
    sampling = Sampling(temperature=0.8, top_k=2)
    tokens, stats = _chain(Bigram(t_table), DraftModelDrafter(Bigram(d_table)), sampling, k=3, seed=20)
    transitions = _transitions(t_table, sampling)
    assert ((transitions > 0).sum(axis=1) == 2).all()
    assert stats.accepted_tokens > 0
    assert markov_pvalue(tokens, transitions) > P_MIN


def test_ngram_drafter_under_sampling_preserves_the_distribution():
    # a deterministic drafter (q one-hot): on a 5-token chain the lookup always finds a match
    t_table = _table(4)
    sampling = Sampling(temperature=1.0)
    tokens, stats = _chain(Bigram(t_table), NGramDrafter(max_n=2), sampling, k=3, seed=30)
    assert 0 < stats.accepted_tokens < stats.draft_tokens
    assert markov_pvalue(tokens, _transitions(t_table, sampling)) > P_MIN


def test_seeded_sampling_is_deterministic():
    t_table, d_table = _table(5), _table(6)
    sampling = Sampling(temperature=1.0, top_p=0.9)
    runs = [_chain(Bigram(t_table), DraftModelDrafter(Bigram(d_table)), sampling, k=2, n=40, seed=s)[0]
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]
