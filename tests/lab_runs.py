"""Running a Lab notebook from a test: `mlxbun lab run` headless into a tmp directory, then its rows."""

from __future__ import annotations

import mlxbun.cli as cli
from mlxbun.results import open_results


def lab_run_rows(notebook: str, tmp_path, capture, *params: str, metric: str = "kld_mean"):
    """`mlxbun lab run NOTEBOOK -p out_dir <tmp_path>/outputs -p NAME VALUE ...` (the results in
    <tmp_path>/r.sqlite); asserts it succeeded and returns (the rows of `metric`, params expanded, and
    the outputs directory). `capture`: pytest's capsys or capfd (its stderr is the failure message)."""
    db, out = tmp_path / "r.sqlite", tmp_path / "outputs"
    flags = [x for pair in zip(["-p"] * (len(params) // 2), params[::2], params[1::2]) for x in pair]
    code = cli.main(["lab", "run", notebook, "--out", str(tmp_path / "run"), "--results", str(db), "--no-progress",
                     "-p", "out_dir", str(out), *flags])
    assert code == 0, capture.readouterr().err
    with open_results(db, create=False) as store:
        return store.load(metric=metric, expand_params=True), out
