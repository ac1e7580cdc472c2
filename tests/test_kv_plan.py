"""The per-layer KV sensitivity and plan search (mlxbun.parity.kv_plan) on a zoo model."""

from __future__ import annotations

import json

import pytest

from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.generation_caches import load_kv_plan
from mlxbun.locate import open_runtime
from mlxbun.parity import kv_plan as kp
from mlxbun.parity.forced import eval_ids, teacher_forced
from mlxbun.parity.metrics import compare_logits

PREFILL, N_EVAL = 48, 16


@pytest.fixture(scope="module")
def setting():
    path = model_path("zoo:llama", variant="float32", head_dim=64)
    model = open_runtime(path, "mlxbun")
    ids = eval_ids(optional_tokenizer(path), PREFILL + N_EVAL)
    probe = kp.KVProbe(model, ids, prefill=PREFILL)
    table = kp.sensitivity(probe, bits=(8, 4, 2))
    return path, model, ids, probe, table


def test_chunked_continuation_matches_teacher_forced_steps(setting):
    """The probe's one-chunk continuation measures what teacher_forced's one-token steps measure."""
    _, model, ids, probe, _ = setting
    layers = {0: (4, 64), probe.num_layers - 1: (2, 64)}
    m = probe.measure(layers)
    base = teacher_forced(model, ids, prefill=PREFILL)
    forced = teacher_forced(model, ids, prefill=PREFILL, plan=load_kv_plan(probe.plan(layers), probe.num_layers))
    ref = compare_logits(base.logits, forced.logits, forced.next_tokens)
    assert m.kld_mean > 0
    assert m.kld_mean == pytest.approx(ref.kld_mean, rel=1e-3, abs=1e-7)
    assert m.top1_agreement == ref.same_top_p
    assert m.kv_bytes == forced.kv_bytes and probe.plain_bytes == base.kv_bytes


def test_sensitivity_table(setting):
    _, _, _, probe, table = setting
    assert len(table) == len(probe.candidates) * 3 == probe.num_layers * 3
    assert (table["bytes_saved"] > 0).all()
    by_bits = table.groupby("bits")["kld_mean"].mean()
    assert by_bits[2] > by_bits[4] > by_bits[8] > 0  # fewer bits, more drift
    saved = table.groupby("bits")["bytes_saved"].mean()
    assert saved[2] > saved[4] > saved[8]


def test_budget_zero_is_all_plain(setting):
    _, _, _, probe, table = setting
    r = kp.search_plan(probe, table, 0.0)
    assert r.layers == {} and r.measured.kld_mean == 0 and r.measured.kv_bytes == probe.plain_bytes


def test_looser_budget_fewer_bytes_and_measured_within_budget(setting):
    _, _, _, probe, table = setting
    q8 = probe.measure(kp.uniform_plan(probe.candidates, 8))
    q2 = probe.measure(kp.uniform_plan(probe.candidates, 2))
    tight, loose = (kp.search_plan(probe, table, b) for b in (q8.kld_mean, 10 * q2.kld_mean))
    for r in (tight, loose):
        assert r.measured.kld_mean <= r.budget  # measured, not assumed additive
        assert r.measured.layers == r.layers
    assert loose.measured.kv_bytes < tight.measured.kv_bytes < probe.plain_bytes
    # a budget above every layer at the lowest width quantizes every layer at it
    assert loose.layers == kp.uniform_plan(probe.candidates, 2)


def test_edge_heuristic_and_matching(setting):
    _, _, _, probe, table = setting
    c = probe.candidates
    plan = kp.edge_plan(c, 1, 8, 4)
    assert plan[c[0]] == (8, 64) and plan[c[-1]] == (8, 64) and all(plan[i] == (4, 64) for i in c[1:-1])
    assert kp.edge_plan(c, 1, None, 4).keys() == set(c[1:-1])
    target = kp.predicted_bytes(table, probe.plain_bytes, plan)
    matched = kp.matched_edge_plan(table, c, probe.plain_bytes, target, (8, 4, 2))
    assert kp.predicted_bytes(table, probe.plain_bytes, matched) == target
    assert probe.measure(plan).kv_bytes == pytest.approx(target, abs=probe.num_layers)
    assert kp.matched_edge_plan(table, c, probe.plain_bytes, 1.0, (8, 4, 2)) is None


def test_kv_config_round_trips_through_generates_loader(setting, tmp_path):
    path, _, _, probe, table = setting
    r = kp.search_plan(probe, table, 1e9)
    file = tmp_path / "kv_config.json"
    file.write_text(json.dumps(kp.kv_config(r.layers, probe.num_layers, {"budget": r.budget})))
    assert load_kv_plan(str(file), probe.num_layers).layers == r.layers
    from mlxbun import cli

    assert cli.main(["generate", "--model", str(path), "--prompt", "The lighthouse", "--max-tokens", "4",
                     "--kv-config", str(file)]) == 0


@pytest.mark.parametrize("bad", [[], [7], [4, 4], 4])
def test_bad_bits(bad):
    with pytest.raises(MlxbunError, match="bits"):
        kp.check_bits(bad)


def test_bad_budget(setting):
    _, _, _, probe, table = setting
    for bad in (-1.0, float("nan"), "x"):
        with pytest.raises(MlxbunError, match="budget"):
            kp.search_plan(probe, table, bad)


def test_window_layers_are_not_candidates_and_the_plan_runs(tmp_path):
    """gemma3_text: sliding-window layers (RotatingKVCache) cannot take a plan; only the global ones
    are candidates, and the written plan (window layers at bits 0) loads and generates."""
    from mlxbun.cache.kv import RotatingKVCache
    from mlxbun.generation_caches import make_generation_cache

    path = model_path("zoo:gemma3_text", variant="float32", head_dim=64)
    model = open_runtime(path, "mlxbun")
    caches = make_generation_cache(model)
    probe = kp.KVProbe(model, eval_ids(optional_tokenizer(path), 40), prefill=32)
    windows = [i for i, c in enumerate(caches) if isinstance(c, RotatingKVCache)]
    assert windows and probe.candidates == [i for i in range(len(caches)) if i not in windows]
    r = kp.search_plan(probe, kp.sensitivity(probe, bits=(4,)), 1e9)
    assert set(r.layers) == set(probe.candidates) and r.measured.kld_mean > 0
    file = tmp_path / "kv_config.json"
    file.write_text(json.dumps(kp.kv_config(r.layers, probe.num_layers)))
    from mlxbun import cli

    assert cli.main(["generate", "--model", str(path), "--prompt", "The lighthouse", "--max-tokens", "3",
                     "--kv-config", str(file)]) == 0
