"""Every notebook in notebooks/ runs headless on its defaults through `mlxbun lab run`, with no
cell error, and leaves its rows (tied to the lab run) in the results table."""

import json
from pathlib import Path

import nbformat
import pytest

import mlxbun.cli as cli
from mlxbun.results import open_results

NOTEBOOKS = sorted((Path(__file__).resolve().parent.parent / "notebooks").glob("*.ipynb"))


def test_the_standard_notebooks_are_there_and_stored_clean():
    assert {p.stem for p in NOTEBOOKS} >= {"port_bringup", "logit_diff", "kv_quant", "benchmark"}
    for p in NOTEBOOKS:
        stored = json.loads(p.read_text())  # as stored: nbformat.read would fill in missing ids (and warn)
        assert all(c.get("id") for c in stored["cells"]), f"{p.name}: a cell without an id"
        nb = nbformat.read(p, 4)
        nbformat.validate(nb)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert "parameters" in code[0].metadata.get("tags", []), p.name  # the first code cell
        assert "results_path = None" in code[0].source, p.name
        assert all(not c.outputs and c.execution_count is None for c in code), f"{p.name}: outputs not cleared"
        assert any(c.cell_type == "markdown" for c in nb.cells), p.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_headless_and_records_rows(path, zoo_root, tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))  # the kernel inherits it: the test zoo
    db, out = tmp_path / "results.sqlite", tmp_path / "out"
    code = cli.main(["lab", "run", str(path), "--out", str(out), "--results", str(db), "--no-progress",
                     "--timeout", "120"])
    err = capfd.readouterr().err
    assert code == 0, err
    assert err == "", f"a good run prints nothing on stderr (the kernel's included):\n{err}"
    executed = nbformat.read(out / f"{path.stem}.ipynb", 4)
    errors = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert any("image/png" in o.get("data", {}) for c in executed.cells if c.cell_type == "code"
               for o in c.outputs), "no plot"
    assert (out / f"{path.stem}.html").stat().st_size > 0
    with open_results(db, create=False) as store:
        rows = store.load(expand_params=True)
    lab = rows[rows.experiment == "lab"]
    assert list(lab.metric) == ["duration_s"] and lab["params.notebook"].iloc[0] == path.stem
    mine = rows[rows["params.lab_run"] == lab.run_id.iloc[0]]
    assert len(mine) > 0 and "error" not in set(mine.metric)


def _code_cells(name: str) -> list[str]:
    nb = nbformat.read(next(p for p in NOTEBOOKS if p.stem == name), 4)
    return [c.source for c in nb.cells if c.cell_type == "code"]


def test_notebooks_end_by_asserting_their_verdicts():
    """A headless run must fail when the notebook's answer is 'no': the checks are the last cells."""
    assert _code_cells("port_bringup")[-1].startswith("report.require_pass()")
    assert _code_cells("spec_acceptance")[-1].startswith("sweep.require_same_as_plain()")


def test_port_bringup_fails_headless_when_the_port_does_not_pass(zoo, zoo_root, tmp_path, monkeypatch, capsys):
    """A checkpoint with a NaN weight: the gate's verdict is fail (non-finite logits), and the
    notebook run fails on its last cell instead of rendering a red table."""
    from tests.conftest import nan_weight_copy

    bad = nan_weight_copy(zoo("llama"), tmp_path / "nan-llama", "model.layers.1.mlp.down_proj.weight")
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    code = cli.main(["lab", "run", "port_bringup", "-p", "model", str(bad), "--out", str(tmp_path / "out"),
                     "--results", str(tmp_path / "r.sqlite"), "--no-progress", "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == 1 and "port fail" in err and "not finite" in err, err


def test_the_acceptance_notebook_runs_on_a_hybrid_with_rollback_stats(zoo_root, tmp_path, monkeypatch, capfd):
    """spec_acceptance on lfm2 (short convs + attention): every drafter kind, a draft model that is a
    hybrid itself; greedy equal to plain decoding (the notebook's last cell), and the recurrent
    rollbacks it needed (replayed tokens, replay time) in its tables and rows."""
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    db, out = tmp_path / "results.sqlite", tmp_path / "out"
    drafters = '["ngram", "self:2", "model:zoo:lfm2@q8", "model:zoo:lfm2@seed1"]'
    code = cli.main(["lab", "run", "spec_acceptance", "-p", "model", "zoo:lfm2", "-p", "drafters", drafters,
                     "-p", "ks", "[1, 4]", "--out", str(out), "--results", str(db), "--no-progress",
                     "--timeout", "120"])
    assert code == 0, capfd.readouterr().err
    executed = nbformat.read(out / "spec_acceptance.ipynb", 4)
    shown = "".join(o.get("data", {}).get("text/plain", "") for c in executed.cells if c.cell_type == "code"
                    for o in c.outputs)
    assert "replayed_tokens" in shown and "model:zoo:lfm2@seed1" in shown
    with open_results(db, create=False) as store:
        rows = store.load(expand_params=True)
    replayed = rows[(rows.experiment == "spec_acceptance") & (rows.metric == "replayed_tokens")]
    runs = replayed.filter(like="params.").drop_duplicates()
    assert len(replayed) > 0 and replayed.value.sum() > 0  # the seed-1 draft model gets rejected
    assert {"model:zoo:lfm2@seed1", "ngram"} <= set(replayed["params.drafter"]) and len(runs) >= 8
