"""lab/tq_bits: TurboQuant's bits split between keys and values, headless on its small setting
(zoo:llama), its rows recorded as experiment tq_bits."""

import pandas as pd

from tests.lab_runs import lab_run_rows


def test_the_notebook_on_the_zoo(zoo_root, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    rows, out = lab_run_rows("lab/tq_bits", tmp_path, capsys, "splits", "[[3, 4], [4, 3], [2, 2], [8, 8]]")
    assert set(rows.experiment) == {"tq_bits"} and rows["params.lab_run"].notna().all()
    assert len(rows) == 4 * 2  # four splits, seeds 0 and 1
    runs = pd.read_csv(out / "tq_bits_llama_turboquant_seeds.csv")
    summary = runs.groupby("label")[["bytes_per_token", "kld_mean"]].mean()
    # a split moves bits between keys and values at the same bytes (equal key and value head dims)
    assert summary.loc["turboquant K3/V4", "bytes_per_token"] == summary.loc["turboquant K4/V3", "bytes_per_token"]
    assert summary.loc["turboquant K2/V2", "bytes_per_token"] < summary.loc["turboquant K3/V4", "bytes_per_token"]
    assert 0 < summary.loc["turboquant K8/V8", "kld_mean"] < summary.loc["turboquant K2/V2", "kld_mean"]
    assert set(runs.seed) == {0, 1} and (runs.groupby("label").kld_mean.nunique() == 2).all()  # seeds differ
    assert "| zoo:llama | turboquant K4/V3 | 3.5 | 4 | 3 |" in (out / "tq_bits_llama_turboquant_seeds_summary.md").read_text()
    assert (out / "tq_bits_llama_bytes_vs_kld.png").stat().st_size > 10_000
