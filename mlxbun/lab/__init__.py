"""The lab's infrastructure: what runs the standard notebooks (notebooks/) and the Lab experiments
(lab/), and what their drivers (`mlxbun.experiments`) share.

- `catalog`: where notebooks live, their papermill parameters (`mlxbun lab list`);
- `runner`: headless execution through papermill + HTML + a results row (`mlxbun lab run`);
- `kernel`: the kernel process the runner starts by default (ipykernel, less a misleading log line);
- `recording`: a results `Run` per experiment call, tied to the `mlxbun lab run` that started it;
- `plots`: plot primitives (pyplot-free figures, `show`), the parity plots the notebooks share, and
  ipywidgets extras that degrade to static output headless.
"""

from mlxbun.lab.catalog import list_notebooks, notebook_parameters, resolve_notebook
from mlxbun.lab.runner import LabRun, parse_value, run_notebook

__all__ = ["LabRun", "list_notebooks", "notebook_parameters", "parse_value", "resolve_notebook", "run_notebook"]
