"""The lab: the standard notebooks (notebooks/), Lab experiments (lab/), and what they call.

- `catalog`: where notebooks live, their papermill parameters (`mlxbun lab list`);
- `runner`: headless execution through papermill + HTML + a results row (`mlxbun lab run`);
- `models`: model specs, evaluation text, teacher-forced logits under KV options;
- `workflows`: one function per standard notebook, computing its tables and results rows;
- `plots`: matplotlib figures and ipywidgets extras that degrade to static output headless.
"""

from mlxbun.lab.catalog import list_notebooks, notebook_parameters, resolve_notebook
from mlxbun.lab.runner import LabRun, parse_value, run_notebook

__all__ = ["LabRun", "list_notebooks", "notebook_parameters", "parse_value", "resolve_notebook", "run_notebook"]
