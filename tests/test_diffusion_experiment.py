"""The diffusion experiment (`mlxbun.experiments.diffusion`, notebooks/diffusion.ipynb): the sweep's
numbers against direct engine runs, its reference and agreement, its results rows, and the
reveal-order matrix on hand-made stats. The notebook itself runs in test_notebooks.py."""

import math

import matplotlib

matplotlib.use("Agg")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from mlxbun.diffusion import BlockStats, DiffusionStats, collect, diffusion_generate  # noqa: E402
from mlxbun.experiments import diffusion as wb  # noqa: E402
from mlxbun.errors import MlxbunError  # noqa: E402
from mlxbun.results import open_results  # noqa: E402
from mlxbun.zoo.diffusion import cached_diffusion_checkpoint  # noqa: E402

PROMPTS = [[1, 40, 77, 300, 12, 9, 100, 200], "Once upon a time"]
STEPS, THRESHOLDS, BOUNDS, SEEDS = (3, 6), (0.5, 0.95), (0.3, 0.05), (0, 1)
MAX_TOKENS = 20  # two canvases: 16 + 4 (a short last block)


@pytest.fixture(scope="module", autouse=True)
def _env(zoo_root):
    mp = pytest.MonkeyPatch()
    mp.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))  # zoo:diffusion_gemma resolves through the default root
    mp.delenv("MLXBUN_LAB_RUN", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def ckpt(zoo_root):
    return wb.load_diffusion(cached_diffusion_checkpoint(root=zoo_root))


@pytest.fixture(scope="module")
def sweep(ckpt, tmp_path_factory):
    db = tmp_path_factory.mktemp("diffusion-results") / "results.sqlite"
    table = wb.diffusion_sweep(ckpt, PROMPTS, steps=STEPS, thresholds=THRESHOLDS, entropy_bounds=BOUNDS,
                               seeds=SEEDS, max_tokens=MAX_TOKENS, results=db)
    return table, db


def _direct(ckpt, sampler, steps, bound, seed):
    """The same configuration straight through the engine, one run per prompt."""
    knob = {"threshold": bound} if sampler == "confidence-threshold" else {"entropy_bound": bound}
    return [collect(diffusion_generate(ckpt.model, ckpt.tokenizer, p, max_tokens=MAX_TOKENS, seed=seed,
                                       steps=steps, sampler=sampler, **knob)) for p in PROMPTS]


def test_the_grid_is_complete_and_the_reference_is_the_longest_strictest_run(sweep):
    table, _ = sweep
    assert list(table.columns) == wb.SWEEP_COLUMNS
    assert len(table) == 2 * len(STEPS) * 2 * len(SEEDS)
    refs = table[table["reference"]]
    assert len(refs) == 2 * len(SEEDS)  # one per sampler and seed
    assert set(refs["steps"]) == {max(STEPS)}
    assert set(refs[refs.sampler == "confidence-threshold"]["bound"]) == {max(THRESHOLDS)}
    assert set(refs[refs.sampler == "entropy-bound"]["bound"]) == {min(BOUNDS)}
    assert (refs["agreement"] == 1.0).all()
    assert table["agreement"].between(0, 1).all()
    # the random tiny model: cheaper runs do not reproduce the reference everywhere
    assert (table.loc[~table["reference"], "agreement"] < 1).any()


def test_nfe_tokens_per_forward_and_agreement_match_direct_engine_runs(sweep, ckpt):
    table, _ = sweep
    for sampler, bounds in (("confidence-threshold", THRESHOLDS), ("entropy-bound", BOUNDS)):
        seed = SEEDS[1]
        ref = _direct(ckpt, sampler, max(STEPS), wb.reference_bound(sampler, bounds), seed)
        for steps in STEPS:
            for bound in bounds:
                runs = _direct(ckpt, sampler, steps, bound, seed)
                row = table[(table.sampler == sampler) & (table.steps == steps) & (table.bound == bound)
                            & (table.seed == seed)].iloc[0]
                nfe = sum(s.nfe for _, s in runs)
                tokens = sum(s.generation_tokens for _, s in runs)
                assert row["nfe"] == nfe == sum(b.steps for _, s in runs for b in s.blocks)
                assert row["generation_tokens"] == tokens
                assert row["tokens_per_forward"] == pytest.approx(tokens / nfe)
                assert row["blocks"] == sum(len(s.blocks) for _, s in runs)
                assert row["early_stops"] == sum(b.stopped_early is not None for _, s in runs for b in s.blocks)
                matched = sum(sum(a == b for a, b in zip(ids, r)) for (ids, _), (r, _) in zip(runs, ref))
                compared = sum(max(len(ids), len(r)) for (ids, _), (r, _) in zip(runs, ref))
                assert row["agreement"] == pytest.approx(matched / compared)
                assert row["tokens_per_s"] > 0
    # the confidence sampler's early stop shows: a loose threshold spends fewer forwards
    ct = table[(table.sampler == "confidence-threshold") & (table.steps == max(STEPS))]
    assert ct.groupby("bound")["nfe"].sum()[min(THRESHOLDS)] < ct.groupby("bound")["nfe"].sum()[max(THRESHOLDS)]


def test_rows_land_in_the_results_table(sweep):
    table, db = sweep
    with open_results(db, create=False) as store:
        rows = store.load(experiment="diffusion", expand_params=True)
    assert set(rows.run_id) == {table.attrs["run_id"]}
    assert "lab_run" not in "".join(rows.columns)
    assert len(rows) == len(table) * 5
    assert set(rows.metric) == {"nfe", "generation_tokens", "tokens_per_forward", "tokens_per_s", "agreement"}
    assert rows["model_type"].iloc[0] == "diffusion_gemma"
    for r in table.itertuples():
        knob = "params.threshold" if r.sampler == "confidence-threshold" else "params.entropy_bound"
        mine = rows[(rows["params.sampler"] == r.sampler) & (rows["params.steps"] == r.steps)
                    & (rows[knob] == r.bound) & (rows["params.seed"] == r.seed)]
        got = dict(zip(mine.metric, mine.value))
        assert got["nfe"] == r.nfe and got["agreement"] == pytest.approx(r.agreement)
        assert bool(mine["params.reference"].iloc[0]) == r.reference
    assert list(rows["params.steps_grid"].iloc[0]) == list(STEPS)


def test_a_lab_run_id_tags_the_rows(ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("MLXBUN_LAB_RUN", "lab-123")
    db = tmp_path / "r.sqlite"
    table = wb.diffusion_sweep(ckpt, PROMPTS[:1], samplers=["entropy-bound"], steps=[2], entropy_bounds=[0.1],
                               max_tokens=8, warmup=False, results=db)
    assert len(table) == 1 and table["reference"].all() and table["agreement"].iloc[0] == 1.0
    _, stats = collect(diffusion_generate(ckpt.model, ckpt.tokenizer, PROMPTS[0], max_tokens=8, seed=0, steps=2,
                                          sampler="entropy-bound", entropy_bound=0.1))
    assert table["nfe"].iloc[0] == stats.nfe
    assert table["tokens_per_forward"].iloc[0] == stats.tokens_per_forward  # one prompt: the same division
    with open_results(db, create=False) as store:
        rows = store.load(expand_params=True)
    assert set(rows["params.lab_run"]) == {"lab-123"}
    assert wb.diffusion_sweep(ckpt, PROMPTS[:1], samplers=["entropy-bound"], steps=[2], max_tokens=8,
                              warmup=False, record=False).attrs.get("run_id") is None


def test_bad_sweeps_are_refused(ckpt):
    with pytest.raises(MlxbunError, match="sampler"):
        wb.diffusion_sweep(ckpt, PROMPTS, samplers=["greedy"], record=False)
    with pytest.raises(MlxbunError, match="samplers is empty"):
        wb.diffusion_sweep(ckpt, PROMPTS, samplers=[], record=False)
    with pytest.raises(MlxbunError, match="steps is empty"):
        wb.diffusion_sweep(ckpt, PROMPTS, steps=[], record=False)
    with pytest.raises(MlxbunError, match="prompts is empty"):
        wb.diffusion_sweep(ckpt, [], record=False)
    with pytest.raises(MlxbunError, match="not a diffusion model"):
        wb.load_diffusion(object())
    with pytest.raises(MlxbunError, match="zoo:diffusion_gemma"):
        wb.load_diffusion("zoo:llama")


def test_zoo_spec_loads_the_zoo_checkpoint(ckpt):
    loaded = wb.load_diffusion("zoo:diffusion_gemma")
    assert loaded.path == ckpt.path and loaded.tokenizer is not None


def test_agreement_counts_missing_and_extra_positions():
    assert wb.agreement([1, 2, 3], [1, 2, 3]) == (3, 3)
    assert wb.agreement([1, 9, 3], [1, 2, 3]) == (2, 3)
    assert wb.agreement([1, 2], [1, 2, 3, 4]) == (2, 4)
    assert wb.agreement([1, 2, 3, 4], [1, 2]) == (2, 4)
    assert wb.agreement([], []) == (0, 0)


def _hand_made():
    # block 1: 4 positions over 3 steps; block 2: 2 positions, stopped after 2 steps
    b1 = BlockStats(index=1, canvas_length=4, steps=3, accepted_per_step=[1, 2], reveal_step=[1, 3, 2, 2], emitted=4)
    b2 = BlockStats(index=2, canvas_length=2, steps=2, accepted_per_step=[2], reveal_step=[1, 1], emitted=1,
                    stopped_early="all-revealed")
    return DiffusionStats(generation_tokens=5, tokens=[5, 6, 7, 8], stop_token=2, finish_reason="stop",
                          blocks=[b1, b2])


def test_reveal_order_on_hand_made_stats():
    stats = _hand_made()
    order = wb.reveal_order(stats)
    assert order.shape == (6, 3) and list(order.columns) == [1, 2, 3] and order.index.name == "position"
    want = np.array([[1, 1, 1], [0, 0, 1], [0, 1, 1], [0, 1, 1], [1, 1, math.nan], [1, 1, math.nan]], dtype=float)
    np.testing.assert_array_equal(order.to_numpy(), want)
    once = wb.reveal_order(stats, cumulative=False).to_numpy()
    np.testing.assert_array_equal(once, np.array([[1, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 0],
                                                  [1, 0, math.nan], [1, 0, math.nan]], dtype=float))
    # each block's revealed_per_step is the column sum of its rows
    assert list(np.nansum(once[:4], axis=0)) == stats.blocks[0].revealed_per_step
    assert wb.reveal_order(DiffusionStats()).shape == (0, 0)


def test_reveal_order_of_a_real_run_matches_its_stats(ckpt):
    _, stats = wb.diffusion_run(ckpt, PROMPTS[0], sampler="confidence-threshold", steps=6, bound=0.9, seed=0,
                                max_tokens=MAX_TOKENS)
    order = wb.reveal_order(stats, cumulative=False)
    assert len(order) == stats.canvas_tokens
    start = 0
    for b in stats.blocks:
        rows = order.iloc[start:start + b.canvas_length].to_numpy()
        assert list(np.nansum(rows, axis=0)[:b.steps].astype(int)) == b.revealed_per_step
        assert list(np.nanargmax(rows, axis=1) + 1) == b.reveal_step
        start += b.canvas_length


def test_plots_render(sweep, ckpt):
    from matplotlib.figure import Figure

    table, _ = sweep
    figs = [wb.sweep_plot(table), wb.sweep_plot(table, metrics=("tokens_per_s",), x="bound"),
            wb.agreement_plot(table), wb.reveal_plot(_hand_made(), ckpt.tokenizer, "hand-made")]
    for fig in figs:
        assert isinstance(fig, Figure)
        fig.canvas.draw()  # renders with Agg: no pyplot, no GUI
    assert len(figs[0].axes) == 4  # 2 metrics x 2 samplers
    with pytest.raises(MlxbunError, match="x must be"):
        wb.sweep_plot(table, x="seed")
    # headless: the explorer re-runs the first sampler's reference run and shows it statically
    stats = wb.reveal_explorer(ckpt, PROMPTS[0], table, max_tokens=MAX_TOKENS)
    ref = table[table["reference"]].iloc[0]
    _, direct = wb.diffusion_run(ckpt, PROMPTS[0], sampler=ref.sampler, steps=int(ref.steps), bound=ref.bound,
                                 seed=int(ref.seed), max_tokens=MAX_TOKENS)
    assert stats.tokens == direct.tokens and stats.nfe == direct.nfe


def test_reveal_explorer_shows_static_headless_and_a_picker_with_a_frontend(sweep, ckpt, monkeypatch):
    import ipywidgets

    from mlxbun.lab import plots

    table, _ = sweep
    shown = []
    monkeypatch.setattr(plots, "_ipython", lambda: object())  # a notebook: figures go to display
    monkeypatch.setattr(plots, "display", shown.append)
    monkeypatch.setenv(plots.HEADLESS_ENV, "1")
    wb.reveal_explorer(ckpt, PROMPTS[0], table, max_tokens=MAX_TOKENS)
    assert len(shown) == 1  # one PNG, no widget

    monkeypatch.setattr(plots, "interactive", lambda: True)
    shown.clear()
    box = wb.reveal_explorer(ckpt, PROMPTS[0], table, max_tokens=MAX_TOKENS)
    picker = box.children[0]
    assert isinstance(picker, ipywidgets.Dropdown) and len(picker.options) == len(table)
    assert picker.value == next(v for _, v in picker.options if v[:2] == ("confidence-threshold", max(STEPS))
                                and v[2] == max(THRESHOLDS))
    assert shown[-1] is box
    picker.value = picker.options[0][1]  # re-runs and re-renders without error
    assert len(shown) == 3 and type(shown[-1]).__name__ == "Image"
