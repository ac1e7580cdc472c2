"""lab/self_draft: the notebook run headless on zoo:llama (self:1, fixed k and the adaptive draft
length, two tasks, a few tokens), its rows, and adaptive_vs_fixed's reading of a sweep."""

from pathlib import Path

import pandas as pd
import pytest

import mlxbun.cli as cli
from mlxbun.errors import MlxbunError
from mlxbun.experiments.spec_acceptance import SpecSweep
from mlxbun.experiments.spec_tasks import adaptive_vs_fixed
from mlxbun.results import open_results
from mlxbun.speculative.stats import SpecStats

ROOT = Path(__file__).resolve().parents[1]


def _stats(tokens_per_s: float) -> SpecStats:
    s = SpecStats(generated_tokens=10, wall_s=10 / tokens_per_s, plain_decode_tokens_per_s=1.0)
    s.add_round(1, 1, 1, 0.0, 0.0)
    return s


def test_adaptive_vs_fixed_reads_a_sweep():
    sweep = SpecSweep("m", "set", {"a": "", "b": ""}, ["self:1"], [1, 4, "a4"], 0.0)
    speeds = {(1, "a"): 2.0, (4, "a"): 1.0, ("a4", "a"): 2.2, (1, "b"): 1.0, (4, "b"): 3.0, ("a4", "b"): 2.0}
    for (k, p), v in speeds.items():
        sweep.runs[("self:1", k, p)] = _stats(v)
    df = adaptive_vs_fixed(sweep).set_index("task")
    assert list(df.best_fixed_k) == [1, 4] and list(df.set_best_k) == [4, 4]  # k=4 is best over the set
    assert df.loc["a", "adaptive_over_best_fixed"] == pytest.approx(1.1)
    assert df.loc["a", "adaptive_over_set_best"] == pytest.approx(2.2)
    assert df.loc["b", "adaptive_over_best_fixed"] == pytest.approx(2 / 3)
    sweep.ks = [1, 4]
    for p in "ab":
        del sweep.runs[("self:1", "a4", p)]
    with pytest.raises(MlxbunError, match="no adaptive k"):
        adaptive_vs_fixed(sweep)


def test_the_notebook_on_zoo(zoo_root, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    db, out, saved = tmp_path / "r.sqlite", tmp_path / "out", tmp_path / "saved"
    code = cli.main(["lab", "run", str(ROOT / "lab" / "self_draft"), "--out", str(out), "--results", str(db),
                     "--no-progress", "--timeout", "300", "-p", "save_dir", str(saved)])
    assert code == 0, capfd.readouterr().err
    with open_results(db, create=False) as store:
        rows = store.load(experiment="self_draft", expand_params=True)
    same = rows[rows.metric == "same_as_plain"]
    assert len(same) == 2 * 3 and (same.value == 1.0).all()  # tasks x (k=1, 4, a4), greedy == plain
    assert set(same["params.drafter"]) == {"self:1"} and set(same["params.k"].astype(str)) == {"1", "4", "a4"}
    drafted = rows[(rows.metric == "draft_tokens")].set_index(["params.k", "params.prompt"]).value
    assert (drafted > 0).all()  # every run drafted; the adaptive one asked for at most k_max=4 per round
    table = pd.read_csv(saved / "self_draft.csv")
    assert len(table) == 6 and table.same_as_plain.all() and (table.decode_speedup > 0).all()
    assert {"acceptance_rate.png", "decode_speedup.png", "per_position.png"} <= {p.name for p in saved.iterdir()}
