"""Results rows for a notebook or experiment run: one `Run` per call, its store closed after.

When `mlxbun lab run` executes a notebook, its run id (`$MLXBUN_LAB_RUN`) joins every row's
parameters as `lab_run`, tying the rows to that run. When the notebook is a Lab experiment
(`lab/<name>/`), the runner also sets `$MLXBUN_LAB_EXPERIMENT` = <name>, and every row is recorded
under experiment <name> whatever driver wrote it (the driver's own name stays in params as `driver`):
a Lab experiment's rows are found by its name.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from mlxbun.results import open_results

__all__ = ["LAB_EXPERIMENT_ENV", "LAB_RUN_ENV", "recording"]

LAB_RUN_ENV = "MLXBUN_LAB_RUN"  # set by `mlxbun lab run` in the notebook kernel's environment
LAB_EXPERIMENT_ENV = "MLXBUN_LAB_EXPERIMENT"  # set by `mlxbun lab run` for a Lab experiment: its name


@contextlib.contextmanager
def recording(experiment: str, *, model: Any = None, params: dict | None = None, results_path=None,
              record: bool = True):
    """A results `Run` for `experiment` (None when record=False), its store closed afterwards; under
    `mlxbun lab run lab/<name>` the rows' experiment is <name> and `experiment` is params["driver"]."""
    if not record:
        yield None
        return
    params = dict(params or {})
    lab_run = os.environ.get(LAB_RUN_ENV)
    if lab_run:
        params["lab_run"] = lab_run
    lab_experiment = os.environ.get(LAB_EXPERIMENT_ENV)
    if lab_experiment and lab_experiment != experiment:
        params["driver"], experiment = experiment, lab_experiment
    with open_results(results_path) as store:
        yield store.new_run(experiment, model=model, params=params)
