"""Logit drift statistics (llama-perplexity --kl-divergence definitions) and trajectory divergence, on known answers."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.errors import MlxbunError
from mlxbun.parity.metrics import KLDStats, compare_logits, mean_and_uncertainty, percentile
from mlxbun.parity.trajectory_diff import compare_trajectories, top_k

LN2 = math.log(2.0)


# ---------------------------------------------------------------- identical runs


def test_identical_runs_are_exactly_zero():
    logits = mx.random.normal((3, 7, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    tokens = mx.random.randint(0, 64, (3, 7), key=mx.random.key(1))
    s = compare_logits(logits, logits, tokens)
    assert s.count == 21 and s.vocab_size == 64
    assert s.kld_mean == 0.0 and s.kld_max == 0.0 and s.kld_min == 0.0 and s.kld_mean_unc == 0.0
    assert all(v == 0.0 for v in s.kld_percentiles.values())
    assert s.same_top_p == 1.0 and s.n_same_top == 21 and s.same_top_p_unc == 0.0
    assert s.max_abs_diff == 0.0 and not s.step_max_abs_diff.any()
    assert s.ppl_ratio == 1.0 and s.ln_ppl_ratio == 0.0 and s.ppl_diff == 0.0 and s.ppl_new == s.ppl_base
    assert s.dp_mean == 0.0 and s.dp_rms == 0.0 and s.dp_rms_unc == 0.0 and s.dp_max == 0.0 and s.dp_min == 0.0


def test_list_of_step_arrays_equals_one_array():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(6, 32)).astype(np.float32), rng.normal(size=(6, 32)).astype(np.float32)
    tokens = rng.integers(0, 32, 6)
    whole = compare_logits(a, b, tokens)
    steps = compare_logits([mx.array(r[None]) for r in a], [mx.array(r) for r in b], [[int(t)] for t in tokens])
    chunked = compare_logits(a, b, tokens, chunk_rows=4)
    for other in (steps, chunked):
        assert other.as_dict(per_position=True) == whole.as_dict(per_position=True)


# ---------------------------------------------------------------- a hand-computed pair


def test_hand_built_two_positions_three_tokens():
    # Position 0: base p = (1/2, 1/4, 1/4), new q = (1/4, 1/2, 1/4); next token 0.
    # Position 1: base p = (0.2, 0.2, 0.6) (its logits shifted by +1: softmax ignores it),
    #             new q = (0.2, 0.3, 0.5); next token 2.
    pb = np.array([[0.5, 0.25, 0.25], [0.2, 0.2, 0.6]])
    pn = np.array([[0.25, 0.5, 0.25], [0.2, 0.3, 0.5]])
    base = np.log(pb)
    base[1] += 1.0
    new = np.log(pn)
    s = compare_logits(base.astype(np.float32), new.astype(np.float32), [0, 2])

    # KLD_0 = 1/2 ln(2) + 1/4 ln(1/2) + 1/4 ln(1) = ln2 / 4
    # KLD_1 = 0.2 ln(1) + 0.2 ln(0.2/0.3) + 0.6 ln(0.6/0.5)
    k0 = LN2 / 4
    k1 = 0.2 * math.log(0.2 / 0.3) + 0.6 * math.log(0.6 / 0.5)
    assert s.kld_values == pytest.approx([k0, k1], rel=1e-6)
    assert s.kld_mean == pytest.approx((k0 + k1) / 2, rel=1e-6)
    assert s.kld_max == pytest.approx(k0, rel=1e-6) and s.kld_min == pytest.approx(k1, rel=1e-6)
    assert s.kld_median == pytest.approx((k0 + k1) / 2, rel=1e-6)
    # 99% of two sorted values: k1 + 0.99 (k0 - k1)
    assert s.kld_percentiles["99"] == pytest.approx(k1 + 0.99 * (k0 - k1), rel=1e-6)
    assert s.kld_mean_unc == 0.0  # llama.cpp: no uncertainty with N <= 10

    # Top-1: position 0 base 0 vs new 1 (differ); position 1 base 2 vs new 2 (same) -> 1/2,
    # uncertainty sqrt(p (1 - p) / (N - 1)) = sqrt(0.25 / 1) = 0.5.
    assert s.top_base.tolist() == [0, 2] and s.top_new.tolist() == [1, 2]
    assert s.same_top_p == 0.5 and s.same_top_p_unc == 0.5

    # delta-p of the next token: q(0) - p(0) = 0.25 - 0.5 = -0.25; q(2) - p(2) = 0.5 - 0.6 = -0.1.
    assert s.dp_values == pytest.approx([-0.25, -0.1], abs=1e-7)
    assert s.dp_mean == pytest.approx(-0.175, abs=1e-7)
    assert s.dp_rms == pytest.approx(math.sqrt((0.0625 + 0.01) / 2), rel=1e-6)
    assert s.dp_max == pytest.approx(-0.1, abs=1e-7) and s.dp_min == pytest.approx(-0.25, abs=1e-7)
    assert s.dp_percentiles["75"] == pytest.approx(-0.25 + 0.75 * 0.15, abs=1e-7)

    # PPL = exp(mean NLL): base exp((ln 2 + ln(1/0.6)) / 2) = sqrt(2 / 0.6); new exp((ln 4 + ln 2) / 2) = sqrt(8).
    assert s.ppl_base == pytest.approx(math.sqrt(2 / 0.6), rel=1e-6)
    assert s.ppl_new == pytest.approx(math.sqrt(8), rel=1e-6)
    assert s.ppl_ratio == pytest.approx(math.sqrt(8 / (2 / 0.6)), rel=1e-6)  # sqrt(2.4)
    assert s.ln_ppl_ratio == pytest.approx(0.5 * math.log(2.4), rel=1e-6)
    assert s.ppl_diff == pytest.approx(math.sqrt(8) - math.sqrt(2 / 0.6), rel=1e-6)

    # Raw logits: position 0 differs by ln 2 in two entries; position 1 by max(1, |ln(0.3/0.2) - 1|, 1 + ln 1.2).
    assert s.step_max_abs_diff == pytest.approx([LN2, 1 + math.log(1.2)], rel=1e-6)
    assert s.max_abs_diff == pytest.approx(1 + math.log(1.2), rel=1e-6)


# ---------------------------------------------------------------- llama.cpp's statistics


def test_percentiles_and_median_on_a_known_vector():
    v = np.arange(11.0)  # 0..10
    assert percentile(v, 0.999) == pytest.approx(9.99)
    assert percentile(v, 0.99) == pytest.approx(9.9)
    assert percentile(v, 0.9) == pytest.approx(9.0)
    assert percentile(v, 0.05) == pytest.approx(0.5)
    assert percentile(v, 0.001) == pytest.approx(0.01)
    assert percentile(v, 0.0) == 0.0 and percentile(v, 1.0) == 10.0
    w = [1.0, 2.0, 3.0, 4.0]
    assert percentile(w, 0.9) == pytest.approx(3.7)  # 0.9 * 3 = 2.7 -> 3 + 0.7 (4 - 3)
    assert percentile(w, 0.5) == pytest.approx(2.5)
    # numpy's default ("linear") method is the same definition.
    for f in (0.999, 0.99, 0.95, 0.9, 0.1, 0.05, 0.01, 0.001):
        assert percentile(v, f) == pytest.approx(np.percentile(v, 100 * f))


def test_mean_and_uncertainty_matches_llama_cpp():
    v = np.arange(11.0)  # mean 5, population variance 10 -> sigma = sqrt(10 / (11 - 1)) = 1
    assert mean_and_uncertainty(v.sum(), (v * v).sum(), 11) == (5.0, 1.0)
    w = v[:10]  # N = 10: llama.cpp reports no uncertainty
    assert mean_and_uncertainty(w.sum(), (w * w).sum(), 10) == (4.5, 0.0)
    assert mean_and_uncertainty(0.0, 0.0, 0) == (0.0, 0.0)


def test_uncertainties_with_many_positions():
    rng = np.random.default_rng(3)
    n, vocab = 200, 50
    base = rng.normal(size=(n, vocab))
    new = base + 0.3 * rng.normal(size=(n, vocab))
    tokens = rng.integers(0, vocab, n)
    s = compare_logits(base, new, tokens)

    def sigma(x):  # llama.cpp: sqrt(population variance / (N - 1))
        return math.sqrt(np.var(x) / (len(x) - 1))

    # KLD by the textbook formula, independently of compare_logits' log-softmax path.
    p = np.exp(base) / np.exp(base).sum(-1, keepdims=True)
    q = np.exp(new) / np.exp(new).sum(-1, keepdims=True)
    kld = np.sum(p * np.log(p / q), axis=-1)
    assert s.kld_values == pytest.approx(kld, rel=1e-9)
    assert (s.kld_values >= 0).all()
    assert s.kld_mean_unc == pytest.approx(sigma(kld), rel=1e-9)
    same = np.mean(p.argmax(-1) == q.argmax(-1))
    assert s.same_top_p == same and s.same_top_p_unc == pytest.approx(math.sqrt(same * (1 - same) / (n - 1)))

    nll_b, nll_n = -np.log(p[np.arange(n), tokens]), -np.log(q[np.arange(n), tokens])
    assert s.ppl_base == pytest.approx(math.exp(nll_b.mean()), rel=1e-9)
    assert s.ppl_base_unc == pytest.approx(s.ppl_base * sigma(nll_b), rel=1e-9)
    assert s.ppl_new_unc == pytest.approx(s.ppl_new * sigma(nll_n), rel=1e-9)
    # var(a) + var(b) - 2 cov(a, b) = var(a - b): the covariance-aware ratio uncertainty.
    assert s.ln_ppl_ratio_unc == pytest.approx(sigma(nll_n - nll_b), rel=1e-6)
    assert s.ppl_ratio_unc == pytest.approx(s.ppl_ratio * s.ln_ppl_ratio_unc, rel=1e-9)
    assert s.ppl_cor == pytest.approx(np.corrcoef(nll_n, nll_b)[0, 1], rel=1e-6)
    dp = q[np.arange(n), tokens] - p[np.arange(n), tokens]
    assert s.dp_mean == pytest.approx(dp.mean(), abs=1e-12) and s.dp_mean_unc == pytest.approx(sigma(dp), rel=1e-9)
    assert s.dp_rms == pytest.approx(math.sqrt(np.mean(dp ** 2)), rel=1e-9)
    assert s.dp_rms_unc == pytest.approx(0.5 / s.dp_rms * sigma(dp ** 2), rel=1e-9)


def test_report_views():
    rng = np.random.default_rng(4)
    a, b = rng.normal(size=(20, 16)), rng.normal(size=(20, 16))
    s = compare_logits(a, b, rng.integers(0, 16, 20))
    table = s.as_table()
    row = table.set_index("key")
    assert row.loc["same_top_p", "value"] == pytest.approx(100 * s.same_top_p) and row.loc["same_top_p", "unit"] == "%"
    assert row.loc["kld_p99.9", "value"] == s.kld_percentiles["99.9"]
    assert list(table["key"][:2]) == ["n_positions", "max_abs_diff"]
    rows = dict((m, v) for m, v, _ in s.as_rows())
    assert rows["kld_mean"] == s.kld_mean and rows["kld_mean_unc"] == s.kld_mean_unc and "dp_rms_unc" in rows
    json.dumps(s.as_dict(per_position=True))  # JSON-able
    assert "Same top p" in str(s) and "Mean PPL(Q)" in str(s)
    assert len(s.per_position()) == 20
    no_tokens = compare_logits(a, b)
    assert no_tokens.ppl_new is None and no_tokens.dp_mean is None and not no_tokens.has_tokens
    assert "ppl_new" not in set(no_tokens.as_table()["key"]) and isinstance(no_tokens, KLDStats)


def test_bad_inputs_are_refused():
    a = np.zeros((4, 8), np.float32)
    with pytest.raises(MlxbunError, match="differ in shape"):
        compare_logits(a, np.zeros((4, 9), np.float32))
    with pytest.raises(MlxbunError, match="3 ids for 4"):
        compare_logits(a, a, [0, 1, 2])
    with pytest.raises(MlxbunError, match="outside the vocabulary"):
        compare_logits(a, a, [0, 1, 2, 8])
    with pytest.raises(MlxbunError, match="vocabulary size"):
        compare_logits([np.zeros(8), np.zeros(9)], a)


# ---------------------------------------------------------------- trajectories


class CharTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_first_divergent_step_on_hand_made_ids():
    assert compare_trajectories([1, 2, 3, 4], [1, 2, 5, 4]).first_divergence == 2
    assert compare_trajectories([7, 2, 3], [8, 2, 3]).first_divergence == 0
    same = compare_trajectories([1, 2, 3], mx.array([1, 2, 3]))
    assert same.first_divergence is None and same.identical and same.divergence is None
    ended = compare_trajectories([1, 2, 3], [1, 2])
    assert ended.first_divergence == 2 and ended.divergence.id_a == 3 and ended.divergence.id_b is None
    assert compare_trajectories([], [5]).first_divergence == 0

    d = compare_trajectories([0, 1, 2, 3, 4], [0, 1, 2, 7, 4], tokenizer=CharTokenizer(), context=2)
    assert d.first_divergence == 3 and d.length_a == d.length_b == 5
    div = d.divergence
    assert (div.id_a, div.text_a, div.id_b, div.text_b) == (3, "d", 7, "h")
    assert d.context_ids == [1, 2] and d.context_text == "bc"
    assert [s.same for s in d.steps] == [True, True, True, False, True]
    assert "step 3" in d.summary() and "'d'" in d.summary()


def test_top_k_of_both_sides_at_each_step():
    pa = np.array([[0.5, 0.3, 0.2, 1e-12], [0.1, 0.2, 0.3, 0.4]])
    pb = np.array([[0.5, 0.3, 0.2, 1e-12], [0.4, 0.3, 0.2, 0.1]])
    d = compare_trajectories([0, 3], [0, 0], np.log(pa), [mx.array(np.log(r).astype(np.float32)) for r in pb], k=2)
    assert d.first_divergence == 1
    s0, s1 = d.steps
    assert [i for i, _ in s0.top_a] == [0, 1] and [p for _, p in s0.top_a] == pytest.approx([0.5, 0.3])
    assert [i for i, _ in s1.top_a] == [3, 2] and [i for i, _ in s1.top_b] == [0, 1]
    assert s1.top_b[0][1] == pytest.approx(0.4, rel=1e-6)
    # KL(a || b) at step 1, by hand.
    assert s1.kld == pytest.approx(sum(x * math.log(x / y) for x, y in zip(pa[1], pb[1])), rel=1e-5)
    assert s0.kld == pytest.approx(0.0, abs=1e-6)
    assert top_k(np.log([0.25, 0.25, 0.5]), 3) == [(2, pytest.approx(0.5)), (0, pytest.approx(0.25)),
                                                  (1, pytest.approx(0.25))]  # ties: lower id first
    assert d.as_table().loc[1, "same"] == False  # noqa: E712


def test_trajectory_objects_are_unpacked():
    from mlxbun.parity.oracle import Trajectory

    logits = [mx.array([[0.0, 1.0, 2.0]]), mx.array([[2.0, 1.0, 0.0]])]
    t = Trajectory(prompt_ids=[1], greedy_ids=[2, 0], step_logits=logits, prefill_logits=logits[0][:, None],
                   dtype="float32", decode_steps=1)
    u = Trajectory(prompt_ids=[1], greedy_ids=[2, 1], step_logits=logits, prefill_logits=logits[0][:, None],
                   dtype="float32", decode_steps=1)
    d = compare_trajectories(t, u, k=1)
    assert d.first_divergence == 1 and d.steps[1].top_a[0][0] == 0 and d.steps[1].max_abs_diff == 0.0
