"""lab/prompt_lookup: the speedup bound from the acceptance-length distribution (a hand-computed
case), the cost terms next to it, the task prompt set, and the notebook run headless on zoo:llama
(two tasks, two n, two k, a few tokens)."""

import math
from pathlib import Path

import pandas as pd
import pytest

import mlxbun.cli as cli
from mlxbun.errors import MlxbunError
from mlxbun.experiments.spec_acceptance import draft_length
from mlxbun.experiments.spec_tasks import best_per_task, bound_plot, grid_plot, read_tasks, render_task, table_from_rows
from mlxbun.results import open_results
from mlxbun.speculative.stats import SpecStats, speedup_bound

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "lab" / "prompt_lookup" / "prompts"


def test_the_bound_of_a_hand_computed_distribution():
    # rounds of acceptance length 1, 1, 3, 5: 10 tokens in 4 verify rounds
    hist = {1: 2, 3: 1, 5: 1}
    assert speedup_bound(hist) == 2.5
    assert speedup_bound(hist, plain_rounds=2) == 2.0  # two rounds with no draft emit one token each
    assert speedup_bound(hist, verify_cost=2.0) == 1.25  # each verify costs two decoding steps
    assert speedup_bound(hist, verify_cost=1.5, draft_cost=0.5) == 1.25
    assert speedup_bound(hist, plain_rounds=2, verify_cost=2.0) == 12 / 10
    assert math.isnan(speedup_bound({}))
    with pytest.raises(MlxbunError, match="acceptance lengths must be >= 1"):
        speedup_bound({0: 3})
    with pytest.raises(MlxbunError, match="verify_cost must be > 0"):
        speedup_bound(hist, verify_cost=0)


def test_spec_stats_bound_and_costs():
    s = SpecStats()
    for k, m, n in [(4, 4, 0), (4, 4, 2), (4, 0, 0), (4, 4, 4)]:  # lengths 1, 3, (no draft), 5
        s.add_round(k, m, n, draft_s=0.01, verify_s=0.2 if m else 0.1)
    s.generated_tokens, s.wall_s, s.prefill_s = 10, 1.5, 0.5
    assert s.speedup_bound == (1 + 3 + 5 + 1) / 4
    assert math.isnan(s.verify_cost) and math.isnan(s.decode_speedup)  # plain decoding not measured
    s.plain_decode_tokens_per_s = 10.0  # one plain step = 0.1 s
    assert s.decode_tokens_per_s == 10 / 1.0 and s.decode_speedup == 1.0
    assert s.verify_cost == pytest.approx((0.7 / 0.1 - 1) / 3)  # the no-draft round is one step
    assert s.draft_cost == pytest.approx(0.04 * 10 / 3)
    assert s.cost_aware_bound == pytest.approx(10 / (3 * (s.verify_cost + s.draft_cost) + 1))
    agg = SpecStats.aggregate([s, s])
    assert agg.plain_decode_tokens_per_s == pytest.approx(10.0) and agg.speedup_bound == s.speedup_bound
    rows = {name for name, *_ in s.as_rows()}
    assert {"speedup_bound", "decode_speedup", "verify_cost", "cost_aware_bound"} <= rows


def test_draft_length_names():
    assert draft_length(4) == (4, False) and draft_length("a8") == (8, True) and draft_length("6") == (6, False)
    for bad in ("x", 0, "a0", "a", True, -1):
        with pytest.raises(MlxbunError, match="ks: each k must be a positive integer or 'aK'"):
            draft_length(bad)


def test_the_task_prompt_set(tmp_path):
    tasks = read_tasks(PROMPTS)
    assert set(tasks) == {"summarize", "quote", "code_edit", "translate", "chat"}
    assert "Rabbit" in tasks["quote"][1] and tasks["chat"][1] == "" and "def avg" in tasks["code_edit"][1]
    assert list(read_tasks(PROMPTS, ["chat", "quote"])) == ["chat", "quote"]
    with pytest.raises(MlxbunError, match=r"tasks: no file for \['poem'\]"):
        read_tasks(PROMPTS, ["poem"])
    with pytest.raises(MlxbunError, match="prompts_dir: .* is not a directory"):
        read_tasks(tmp_path / "none")
    (tmp_path / "empty.txt").write_text("---\nsource only\n")
    with pytest.raises(MlxbunError, match="no instruction"):
        read_tasks(tmp_path)

    class NoTemplate:
        def apply_chat_template(self, *a, **k):
            raise MlxbunError("no chat template")

    assert render_task(NoTemplate(), "Do it.", "text") == ("Do it.\n\ntext\n\n", "plain")


def test_the_notebook_on_zoo(zoo_root, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    db, out, saved = tmp_path / "r.sqlite", tmp_path / "out", tmp_path / "saved"
    code = cli.main(["lab", "run", str(ROOT / "lab" / "prompt_lookup"), "--out", str(out), "--results", str(db),
                     "--no-progress", "--timeout", "300", "-p", "save_dir", str(saved)])
    assert code == 0, capfd.readouterr().err
    with open_results(db, create=False) as store:
        rows = store.load(experiment="prompt_lookup", expand_params=True)
    same = rows[rows.metric == "same_as_plain"]
    assert len(same) == 2 * 2 * 2 and (same.value == 1.0).all()  # tasks x n x k, greedy == plain
    assert set(rows["params.prompt_format"]) == {"chat_template"}
    keys = ["params.drafter", "params.k", "params.prompt"]
    wide = rows[rows["params.acceptance_length"].isna()].pivot_table(index=keys, columns="metric", values="value")
    hist = rows[rows.metric == "acceptance_length_count"]
    for key, g in hist.groupby(keys):  # the recorded bound is the recorded distribution's
        r = wide.loc[key]
        emitted = (g["params.acceptance_length"].astype(float) * g.value).sum() + (r.rounds - r.drafts)
        assert r.speedup_bound == pytest.approx(emitted / r.rounds)
    # the quote task repeats its source: lookup drafts get accepted there
    assert wide.xs("quote", level="params.prompt").mean_acceptance_length.max() > 1.0
    table = pd.read_csv(saved / "prompt_lookup.csv")
    assert len(table) == 8 and table.same_as_plain.all()
    rebuilt = table_from_rows(rows)  # the same table from the results rows alone
    order = ["prompt", "drafter", "k"]
    pd.testing.assert_frame_equal(rebuilt.sort_values(order).reset_index(drop=True),
                                  table.sort_values(order).reset_index(drop=True), check_dtype=False, rtol=1e-3)
    assert grid_plot(rebuilt) is not None and bound_plot(table) is not None
    best = best_per_task(table).set_index("task")  # read back from the CSV
    assert set(best.index) == {"quote", "chat"}
    for task, g in table.groupby("prompt"):
        assert best.loc[task, "decode_speedup"] == g.decode_speedup.max()
        assert best.loc[task, "top_bound"] == g.speedup_bound.max() >= 1.0
    assert {"acceptance_length.png", "bound.png", "decode_speedup.png"} <= {p.name for p in saved.iterdir()}
