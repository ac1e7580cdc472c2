"""lab/draft_model: best_k and model_vs_lookup on a hand-made sweep, and the notebook run headless
on zoo:llama (the q8 variant of the same model drafting, against ngram:3 and self:1)."""

from pathlib import Path

import pandas as pd
import pytest

import mlxbun.cli as cli
from mlxbun.errors import MlxbunError
from mlxbun.experiments.draft_model import SET, best_k, model_vs_lookup
from mlxbun.experiments.spec_acceptance import SpecSweep
from mlxbun.results import open_results
from mlxbun.speculative.stats import SpecStats

ROOT = Path(__file__).resolve().parents[1]


def _stats(speedup: float, accepted: int) -> SpecStats:
    """A run of 10 generated tokens in one round whose decode speedup is `speedup` (plain decode at
    1 token/s), `accepted` of its 4 drafts accepted."""
    s = SpecStats(generated_tokens=10, wall_s=10 / speedup, plain_decode_tokens_per_s=1.0)
    s.add_round(4, 4, accepted, 0.0, 0.0)
    return s


def test_best_k_and_model_vs_lookup_read_a_sweep():
    sweep = SpecSweep("m", "set", {"code": "", "chat": ""}, ["model:d", "ngram:3"], [1, 4], 0.0)
    speeds = {("model:d", 1, "code"): (1.2, 1), ("model:d", 4, "code"): (1.5, 3),
              ("model:d", 1, "chat"): (1.4, 1), ("model:d", 4, "chat"): (1.1, 1),
              ("ngram:3", 1, "code"): (2.0, 1), ("ngram:3", 4, "code"): (3.0, 4),
              ("ngram:3", 1, "chat"): (0.9, 0), ("ngram:3", 4, "chat"): (0.8, 0)}
    for key, (v, a) in speeds.items():
        sweep.runs[key] = _stats(v, a)
    ks = best_k(sweep).set_index(["drafter", "task"])
    assert ks.loc[("model:d", "code"), "best_k"] == 4 and ks.loc[("model:d", "chat"), "best_k"] == 1
    # over the set: k=1 has geometric mean sqrt(1.2 * 1.4) = 1.296, k=4 sqrt(1.5 * 1.1) = 1.285
    assert ks.loc[("model:d", SET), "best_k"] == 1
    assert ks.loc[("model:d", SET), "decode_speedup"] == pytest.approx((1.2 * 1.4) ** 0.5)
    assert ks.loc[("ngram:3", SET), "best_k"] == 4  # sqrt(3.0 * 0.8) = 1.55 > sqrt(2.0 * 0.9) = 1.34
    v = model_vs_lookup(sweep, "model:d", "ngram:3").set_index("task")
    assert v.loc["code", "winner"] == "ngram:3" and v.loc["chat", "winner"] == "model:d"
    assert v.loc["code", "model_over_lookup"] == pytest.approx(1.5 / 3.0)
    # the model's acceptance length at its best k (4 drafts, 3 accepted: 4 tokens a round) would
    # need to double to match lookup's 3.0x on code
    assert v.loc["code", "needed_acceptance_length"] == pytest.approx(4 * 3.0 / 1.5)
    with pytest.raises(MlxbunError, match="drafter 'self:2' is not in this sweep"):
        model_vs_lookup(sweep, "self:2", "ngram:3")


def test_the_notebook_on_zoo(zoo_root, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    db, out, saved = tmp_path / "r.sqlite", tmp_path / "out", tmp_path / "saved"
    code = cli.main(["lab", "run", str(ROOT / "lab" / "draft_model"), "--out", str(out), "--results", str(db),
                     "--no-progress", "--timeout", "300", "-p", "save_dir", str(saved), "-p", "ks", "[1, 4]"])
    assert code == 0, capfd.readouterr().err
    with open_results(db, create=False) as store:
        rows = store.load(experiment="draft_model", expand_params=True)
    same = rows[rows.metric == "same_as_plain"]
    assert len(same) == 2 * 3 * 2 and (same.value == 1.0).all()  # tasks x drafters x k, greedy == plain
    assert set(same["params.drafter"]) == {"model:zoo:llama@q8", "ngram:3", "self:1"}
    table = pd.read_csv(saved / "draft_model.csv")
    model = table[table.drafter == "model:zoo:llama@q8"]
    assert len(table) == 12 and table.same_as_plain.all()
    assert (model.draft_acceptance_rate > 0.5).all()  # the q8 copy of the target agrees with it mostly
    assert {"acceptance_rate.png", "decode_speedup.png", "per_position.png"} <= {p.name for p in saved.iterdir()}
