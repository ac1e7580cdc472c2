"""lab/quant_hurts: the notebook headless on its small setting (zoo:llama), and the driver's
pieces (mlxbun/experiments/quant_hurts.py)."""

from pathlib import Path

import mlx.core as mx
import nbformat
import pandas as pd
import pytest

import mlxbun.cli as cli
from mlxbun.errors import MlxbunError
from mlxbun.experiments import quant_hurts as qh
from mlxbun.experiments.weight_plan import WeightPlan, applied
from mlxbun.locate import open_runtime
from mlxbun.results import open_results

NOTEBOOK = Path(__file__).resolve().parent.parent / "lab" / "quant_hurts" / "quant_hurts.ipynb"
IDS = [1, 5, 9, 2, 7, 3, 11, 4, 8, 6]


def test_notebook_runs_headless_and_its_rows_mean_something(zoo_root, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    db, out, saved = tmp_path / "results.sqlite", tmp_path / "out", tmp_path / "saved"
    code = cli.main(["lab", "run", str(NOTEBOOK), "--out", str(out), "--results", str(db), "--no-progress",
                     "--timeout", "300", "-p", "out_dir", str(saved)])
    assert code == 0, capfd.readouterr().err
    executed = nbformat.read(out / "quant_hurts.ipynb", 4)
    assert sum("image/png" in o.get("data", {}) for c in executed.cells if c.cell_type == "code"
               for o in c.outputs) == 2
    assert {p.name for p in saved.iterdir()} == {"sweep.csv", "heatmap.csv", "rankings.csv", "equal_bits.csv", "heatmap.png",
                                                 "kld_bpw.png"}
    with open_results(db, create=False) as store:
        rows = store.load(expand_params=True)
    rows = rows[rows.experiment == "quant_hurts"]
    assert "error" not in set(rows.metric)
    kld = rows[rows.metric == "kld_mean"].set_index("params.label")["value"]
    bpw = rows[rows.metric == "bits_per_weight"].set_index("params.label")["value"]
    assert 0 < kld["q8 g64"] < kld["q4 g64"] / 20  # 8 bits is far closer to the float reference
    assert 4.5 < bpw["q4 g64"] < bpw["q4 g32"] < bpw["q8 g64"] < 8.6
    for kind in ("ranked:taps", "ranked:ablation", "naive"):
        assert bpw[f"q4 + {kind} top-1 at q8"] < bpw[f"q4 + {kind} top-4 at q8"]
    # the ablation's top 4 recovers KLD: what it is ranked by, on a disjoint segment
    assert kld["q4 + ranked:ablation top-4 at q8"] < kld["q4 g64"]
    rel = rows[rows.metric == "rel_err"]
    assert set(rel["params.path"]) >= {"model.embed_tokens", "model.layers.0.mlp", "model.layers.1.self_attn",
                                       "logits"}
    assert (rel.value > 0).all() and (rel.value < 1).all()
    scores = rows[rows.metric == "score_ablation"]
    assert set(scores["params.unit"]) == {"embed", "0.attention", "0.mlp", "1.attention", "1.mlp"}


def test_substep_errors_are_zero_against_itself_and_not_under_q4(zoo):
    ref, cand = open_runtime(zoo("llama")), open_runtime(zoo("llama"))
    same, _, _ = qh.substep_errors(cand, ref, IDS)
    assert (same.rel_err == 0).all() and same.path.iloc[-1] == "logits"
    with applied(cand, WeightPlan(4, 64)):
        errs, la, lb = qh.substep_errors(cand, ref, IDS)
    assert la.shape == lb.shape == (1, len(IDS), ref.config.vocab_size)
    assert (errs.rel_err > 0).all()
    layer0 = errs[errs.path == "model.layers.0.mlp"].iloc[0]
    block0 = errs[errs.path == "model.layers.0"].iloc[0]
    assert layer0.stream_err == pytest.approx(layer0.err_norm / block0.ref_norm)
    grid = qh.error_heatmap(errs)
    assert list(grid.index[:2]) == ["model.embed_tokens", "layer 0"] and grid.index[-1] == "logits"
    assert list(grid.columns[:2]) == ["attention", "mlp"] and grid.columns[-1] == "output"
    assert grid.loc["layer 0", "mlp"] == pytest.approx(layer0.rel_err)
    assert pd.isna(grid.loc["logits", "mlp"])


def test_units_rankings_and_the_naive_order(zoo):
    m = open_runtime(zoo("llama"))
    units = qh.unit_modules(m)
    assert set(units) == {"embed", "0.attention", "0.mlp", "1.attention", "1.mlp"}
    assert "model.layers.1.mlp.down_proj" in units["1.mlp"] and "lm_head" in units["embed"]
    assert qh.unit_of("model.layers.12.self_attn.q_proj") == "12.attention"
    assert qh.naive_order(["embed", "0.attention", "0.mlp", "1.attention", "1.mlp", "2.mlp"]) == [
        "0.attention", "0.mlp", "2.mlp", "1.attention", "1.mlp"]
    errors = pd.DataFrame([
        {"path": "model.embed_tokens", "layer": None, "substep": "embedding", "rel_err": 0.1, "stream_err": 0.1},
        {"path": "model.layers.0.self_attn", "layer": 0, "substep": "attention", "rel_err": 0.5, "stream_err": 0.3},
        {"path": "model.layers.0.mlp", "layer": 0, "substep": "mlp", "rel_err": 0.2, "stream_err": 0.05},
        {"path": "model.norm", "layer": None, "substep": "norm", "rel_err": 0.4, "stream_err": 0.4},
        {"path": "logits", "layer": None, "substep": "head", "rel_err": 0.6, "stream_err": 0.6}])
    errors["layer"] = errors["layer"].astype("Int64")
    s = qh.unit_scores(errors, ["embed", "0.attention", "0.mlp"])
    assert list(s.index) == ["0.attention", "embed", "0.mlp"] and s["embed"] == pytest.approx(0.2)
    ref = m(mx.array([IDS]))
    abl = qh.ablation_scores(m, ref, IDS, units, WeightPlan(4, 64))
    assert set(abl.index) == set(units) and abl.iloc[0] > 0 and list(abl) == sorted(abl, reverse=True)


@pytest.mark.parametrize("kw, match", [({"n_high": []}, "n_high"), ({"n_high": [0]}, "n_high"),
                                       ({"group_sizes": [32]}, "group_sizes"), ({"rank_by": ["x"]}, "rank_by")])
def test_sweep_refuses_bad_parameters(kw, match):
    with pytest.raises(MlxbunError, match=match):
        qh.sweep("zoo:llama", record=False, **kw)


def test_at_equal_bits_interpolates_the_naive_curve():
    rows = [("q4 g64", "uniform", 0, 4.5, 0.10), ("q8 g64", "uniform", 0, 8.5, 0.001),
            ("r1", "ranked:taps", 1, 5.0, 0.05), ("r2", "ranked:taps", 2, 7.0, 0.02),
            ("n1", "naive", 1, 5.5, 0.08), ("n2", "naive", 2, 6.5, 0.04)]
    table = pd.DataFrame(rows, columns=["label", "kind", "n_high", "bits_per_weight", "kld_mean"])
    table["top1_agreement"] = 1.0
    eq = qh.at_equal_bits(table).set_index("label")
    assert eq.loc["r1", "kld_naive"] == pytest.approx(0.09)  # halfway from q4 (0.10) to n1 (0.08)
    assert eq.loc["r1", "kld_vs_naive"] == pytest.approx(0.05 / 0.09)
    assert pd.isna(eq.loc["r2", "kld_naive"])  # beyond the naive curve's bits
    assert eq.loc["r2", "kld_recovered"] == pytest.approx(0.8)
