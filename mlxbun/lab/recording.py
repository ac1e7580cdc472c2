"""Results rows for a notebook or experiment run: one `Run` per call, its store closed after.

When `mlxbun lab run` executes a notebook, its run id (`$MLXBUN_LAB_RUN`) joins every row's
parameters as `lab_run`, tying the rows to that run.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from mlxbun.results import open_results

__all__ = ["LAB_RUN_ENV", "recording"]

LAB_RUN_ENV = "MLXBUN_LAB_RUN"  # set by `mlxbun lab run` in the notebook kernel's environment


@contextlib.contextmanager
def recording(experiment: str, *, model: Any = None, params: dict | None = None, results_path=None,
              record: bool = True):
    """A results `Run` for `experiment` (None when record=False), its store closed afterwards."""
    if not record:
        yield None
        return
    params = dict(params or {})
    lab_run = os.environ.get(LAB_RUN_ENV)
    if lab_run:
        params["lab_run"] = lab_run
    with open_results(results_path) as store:
        yield store.new_run(experiment, model=model, params=params)
