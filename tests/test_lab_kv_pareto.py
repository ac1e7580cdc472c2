"""lab/kv_pareto: the library it adds (per-layer plans, the configurations a model takes, the
frontier table, TurboQuant's comparison, the written outputs) and the notebook headless on its small
setting (zoo:llama), its rows recorded as experiment kv_pareto."""

import math

import pandas as pd
import pytest

from mlxbun.errors import MlxbunError
from mlxbun.experiments import kv_pareto, turboquant_study
from tests.lab_runs import lab_run_rows


def test_plans():
    assert kv_pareto.uniform_plan([5, 11], 4, 32) == [{"layer_idx": 5, "bits": 4, "group_size": 32},
                                                      {"layer_idx": 11, "bits": 4, "group_size": 32}]
    plan = kv_pareto.edge_plan(range(6), edge_bits=8, rest_bits=2, edge=2)
    assert [e["bits"] for e in plan] == [8, 8, 2, 2, 8, 8]
    assert [e["bits"] for e in kv_pareto.edge_plan([3, 1, 2], 8, 4, 1)] == [8, 4, 8]  # sorted layers
    with pytest.raises(MlxbunError, match="edge"):
        kv_pareto.edge_plan([], 8, 4, 1)


def _table():
    rows = [("m", "plain", 1000, 0.0, 1.0), ("m", "uniform 8-bit g64", 300, 0.001, 1.0),
            ("m", "uniform 4-bit g64", 160, 0.05, 0.9), ("m", "uniform 4-bit g32", 190, 0.06, 0.9),  # dominated
            ("m", "turboquant 3.5-bit", 150, 0.2, 0.8), ("m", "q8 first/last 1, q4 rest", 170, 0.04, 0.92),
            ("m", "uniform 2-bit g128", math.nan, math.nan, math.nan),  # failed: left out
            ("n", "plain", 500, 0.0, 1.0), ("n", "turboquant 3.5-bit", 400, 0.5, 0.7)]
    df = pd.DataFrame(rows, columns=["model", "label", "bytes_per_token", "kld_mean", "top1_agreement"])
    df["layers"], df["kv_bytes_ratio"], df["kld_p99"] = "1/1", df["bytes_per_token"] / 1000, df["kld_mean"]
    return df


def test_frontier_table_is_per_model():
    f = kv_pareto.frontier_table(_table())
    assert list(f.columns) == kv_pareto.FRONTIER_COLUMNS
    m = f[f.model == "m"]
    assert list(m.label) == ["turboquant 3.5-bit", "uniform 4-bit g64", "q8 first/last 1, q4 rest",
                             "uniform 4-bit g32", "uniform 8-bit g64", "plain"]  # by bytes; the failure is gone
    assert dict(zip(m.label, m.pareto)) == {"turboquant 3.5-bit": True, "uniform 4-bit g64": True,
                                            "q8 first/last 1, q4 rest": True, "uniform 4-bit g32": False,
                                            "uniform 8-bit g64": True, "plain": True}
    assert f[f.model == "n"].pareto.all()  # another model's points do not dominate these


def test_tq_vs_uniform_picks_the_best_rival_within_the_slack():
    t = kv_pareto.tq_vs_uniform(kv_pareto.frontier_table(_table()), 3.5, slack=1.1)
    m = t.set_index("model").loc["m"]
    assert m.best_rival == "uniform 4-bit g64" and m.rival_kld_mean == 0.05 and m.tq_kld_mean == 0.2
    assert pd.isna(t.set_index("model").loc["n"].best_rival)  # only plain, which is not a rival
    tight = kv_pareto.tq_vs_uniform(kv_pareto.frontier_table(_table()), 3.5, slack=1.0).set_index("model")
    assert pd.isna(tight.loc["m"].best_rival)


def test_model_configs_on_the_zoo(zoo_root, monkeypatch):
    from mlxbun.experiments.common import model_path
    from mlxbun.locate import open_runtime

    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    m = open_runtime(model_path("zoo:llama", variant="float32", head_dim=64), "mlxbun")
    specs, plans, skipped = kv_pareto.model_configs(m, [4], [64, 128], [3.5], edge_plans=[(8, 4, 1), (8, 2, 0)])
    assert [s.label for s in specs] == ["uniform 4-bit g64", "turboquant 3.5-bit"]
    assert any("g128" in s and "head_dim 64" in s for s in skipped)  # 128 does not divide 64
    assert any("no middle" in s for s in skipped)  # 2 layers, 1 at each end
    assert list(plans) == ["q8 first/last 0, q2 rest"] and [e["bits"] for e in plans["q8 first/last 0, q2 rest"]] == [2, 2]


def test_the_notebook_on_the_zoo(zoo_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    rows, out = lab_run_rows("lab/kv_pareto", tmp_path, capsys, "edge_plans", "[[8, 4, 0]]")
    assert set(rows.experiment) == {"kv_pareto"} and rows["params.lab_run"].notna().all()
    seeded = rows[rows["params.part"] == "turboquant_seeds"]
    rows = rows[rows["params.part"] != "turboquant_seeds"]
    kld = dict(zip(rows["params.kv"], rows.value))
    assert kld["plain"] == 0.0
    # the seed study re-runs TurboQuant 3.5: seed 0 is the sweep's own run, bit for bit; seed 1 moves it
    by_seed = dict(zip(seeded["params.seed"], seeded.value))
    assert set(seeded["params.kv"]) == {"turboquant 3.5-bit"} and set(by_seed) == {0, 1}
    assert by_seed[0] == kld["turboquant 3.5-bit"] and by_seed[1] != by_seed[0] and by_seed[1] > 0
    summary = (out / "kv_pareto_llama_turboquant_seeds_summary.md").read_text()
    assert "| zoo:llama | turboquant 3.5-bit | 3.5 | 3 | 4 |" in summary and (out / "kv_pareto_llama_turboquant_seeds.png").stat().st_size > 5_000
    assert len(pd.read_csv(out / "kv_pareto_llama_turboquant_seeds.csv")) == 2
    assert 0 < kld["uniform 8-bit g64"] < kld["uniform 4-bit g64"] < 1  # fewer bits, more drift
    assert kld["turboquant 3.5-bit"] > 0
    table = pd.read_csv(out / "kv_pareto_llama.csv")
    b = dict(zip(table.label, table.bytes_per_token))
    assert b["plain"] > b["uniform 8-bit g64"] > b["uniform 4-bit g64"] > b["uniform 4-bit g32"] * 0.5
    assert b["uniform 4-bit g32"] > b["uniform 4-bit g64"]  # smaller groups cost more scales
    assert "q8 first/last 0, q4 rest" in b
    front = (out / "kv_pareto_llama_frontier.md").read_text()
    assert "| zoo:llama | plain |" in front and (out / "kv_pareto_llama.png").stat().st_size > 10_000


def test_seed_summary_configurations_and_refusals():
    spread = pd.DataFrame({"model": ["m"] * 4, "label": ["turboquant 3-bit"] * 2 + ["turboquant K4/V3"] * 2,
                           "bits": [3.0, 3.0, 3.5, 3.5], "key_bits": [3, 3, 4, 4], "value_bits": [3, 3, 3, 3],
                           "seed": [0, 1, 0, 1], "bytes_per_token": [100.0, 100.0, 110.0, 110.0],
                           "kld_mean": [0.2, 0.4, 0.3, 0.3], "kld_mean_unc": [0.05, 0.07, 0.04, 0.06],
                           "kld_median": [0.1, 0.2, 0.1, 0.1]})
    s = turboquant_study.seed_summary(spread).set_index("label")
    assert s.loc["turboquant 3-bit", "kld_mean_mean"] == pytest.approx(0.3)
    assert (s.loc["turboquant 3-bit", "kld_mean_min"], s.loc["turboquant 3-bit", "kld_mean_max"]) == (0.2, 0.4)
    assert s.loc["turboquant K4/V3", "kld_mean_std"] == 0 and s.loc["turboquant K4/V3", "bytes_per_token"] == 110
    assert s.loc["turboquant 3-bit", "one_run_unc"] == pytest.approx(0.06) and list(s.seeds) == [2, 2]
    assert turboquant_study.configuration(3.5) == ("turboquant 3.5-bit", 3.5, 3, 4)  # mlx-vlm's split
    assert turboquant_study.configuration([4, 3]) == ("turboquant K4/V3", 3.5, 4, 3)
    with pytest.raises(MlxbunError, match=r"\[key_bits, value_bits\]"):
        turboquant_study.configuration([4, 3, 2])
    with pytest.raises(MlxbunError, match="key_bits=2.5"):
        turboquant_study.configuration([2.5, 3])  # a fractional per-tensor width: not ported
    with pytest.raises(MlxbunError, match="at least one model, width and seed"):
        turboquant_study.turboquant_seed_spread(["zoo:llama"], widths=[3.5], seeds=[])
    with pytest.raises(MlxbunError, match="context must be"):
        turboquant_study.turboquant_seed_spread(["zoo:llama"], context=1)
