"""Run a lab notebook headless: papermill executes it in a kernel of this Python (or --kernel), nbconvert
renders it to HTML, and the run lands in the results table (a duration row, or a failure row
naming the failing cell: never a partial silent result).

The kernel gets $MLXBUN_HEADLESS (widgets render static), MPLBACKEND=Agg and $MLXBUN_LAB_RUN
(the lab row's run id, which the workflows add to their own rows as `lab_run`); a Lab experiment
(lab/<name>/) also gets $MLXBUN_LAB_EXPERIMENT = <name>, the experiment its rows are recorded under.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

from mlxbun.errors import MlxbunError
from mlxbun.lab.catalog import lab_dir, notebook_parameters, resolve_notebook
from mlxbun.lab.plots import HEADLESS_ENV
from mlxbun.lab.recording import LAB_EXPERIMENT_ENV, LAB_RUN_ENV
from mlxbun.results import open_results

__all__ = ["KERNEL", "LabRun", "kernel_for_this_python", "parse_parameters", "parse_value", "run_notebook"]


def parse_value(text: str) -> Any:
    """A `-p NAME VALUE` value, as papermill's CLI reads it: True / False / None, ints, floats,
    else the string; plus YAML flow lists and mappings (`[2, 4, 8]`, `{a: 1}`) and lowercase
    true / false / null."""
    import yaml

    if text in ("True", "true"):
        return True
    if text in ("False", "false"):
        return False
    if text in ("None", "null"):
        return None
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        pass
    stripped = text.strip()
    if stripped[:1] in ("[", "{"):
        try:
            return yaml.safe_load(stripped)
        except yaml.YAMLError as e:
            raise MlxbunError(f"parameter value {text!r}: not a valid YAML list/mapping ({e.problem})") from None
    return text


def parse_parameters(pairs: Iterable[Iterable[str]] | None) -> dict[str, Any]:
    """[(name, value text), ...] -> {name: value}; a name given twice is refused."""
    out: dict[str, Any] = {}
    for name, value in pairs or ():
        if not name.isidentifier():
            raise MlxbunError(f"-p {name}: not a valid parameter name")
        if name in out:
            raise MlxbunError(f"-p {name}: given twice")
        out[name] = parse_value(value)
    return out


KERNEL = "mlxbun-python"


@contextlib.contextmanager
def kernel_for_this_python():
    """A kernel that runs this interpreter: a temporary spec, `mlxbun-python`, found through
    $JUPYTER_PATH while the context is open, that starts `mlxbun.lab.kernel` (ipykernel less the
    shutdown's "KeyboardInterrupt caught in kernel" line) with sys.executable."""
    try:
        from ipykernel.kernelspec import write_kernel_spec
    except ImportError:
        raise MlxbunError(f"ipykernel is not installed for {sys.executable}: the notebook kernel runs this "
                          "Python (pip install ipykernel)") from None
    with tempfile.TemporaryDirectory(prefix="mlxbun-kernel-") as root:
        write_kernel_spec(os.path.join(root, "kernels", KERNEL), overrides={
            "argv": [sys.executable, "-m", "mlxbun.lab.kernel", "-f", "{connection_file}"],
            "display_name": f"mlxbun (Python {sys.version_info[0]}.{sys.version_info[1]})"})
        with _environ({"JUPYTER_PATH": os.pathsep.join(filter(None, [root, os.environ.get("JUPYTER_PATH")]))}):
            yield KERNEL


@contextlib.contextmanager
def _kernel(name: str | None):
    """(kernel name, its language): `name`'s installed spec, or this Python's kernel when None."""
    if name is None:
        with kernel_for_this_python() as name:
            yield name, "python"
        return
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    specs = KernelSpecManager()
    try:
        spec = specs.get_kernel_spec(name)
    except NoSuchKernel:
        raise MlxbunError(f"kernel '{name}': no such Jupyter kernel (installed: "
                          f"{', '.join(sorted(specs.find_kernel_specs())) or 'none'}; leave --kernel out to "
                          "use this Python)") from None
    yield name, spec.language


def _client_config():
    """nbclient's config: CurveZMQ transport encryption wherever the kernel spec declares it (ipykernel's
    does), so the kernel neither talks in plain TCP nor warns that it does."""
    import zmq
    from traitlets.config import Config

    return Config({"KernelManager": {"transport_encryption": "auto" if zmq.has("curve") else "disabled"}})


@contextlib.contextmanager
def _environ(updates: Mapping[str, str]):
    old = {k: os.environ.get(k) for k in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclass
class LabRun:
    name: str
    notebook: Path
    output: Path  # the executed notebook (also written when a cell fails)
    html: Path | None
    ok: bool
    duration_s: float
    error: str | None
    run_id: str
    results_path: Path
    parameters: dict = field(default_factory=dict)


def _failure(e: BaseException, path: Path, parameters: Mapping[str, Any]) -> str:
    from papermill.exceptions import PapermillExecutionError

    if isinstance(e, PapermillExecutionError):
        return f"{_cell_name(path, parameters, e.cell_index, e.exec_count)} raised {e.ename}: {e.evalue}"
    return f"{type(e).__name__}: {e}".strip()


def _cell_name(path: Path, parameters: Mapping[str, Any], index: int, exec_count) -> str:
    """papermill's failing cell `index` (0-based, in the notebook it executed) as the notebook file
    numbers it: "cell 4 of 9 (execution count 3)", counting every cell (markdown too) from 1 and not
    the cell of parameters papermill injects after the `parameters` cell."""
    import nbformat

    cells = nbformat.read(str(path), as_version=4).cells
    tags = [c.get("metadata", {}).get("tags", []) for c in cells]
    if parameters and not any("injected-parameters" in t for t in tags):  # else papermill replaces that cell
        at = next((i + 1 for i, t in enumerate(tags) if "parameters" in t), 0)
        if index == at:
            return f"the injected parameters cell (execution count {exec_count})"
        if index > at:
            index -= 1
    return f"cell {index + 1} of {len(cells)} (execution count {exec_count})"


def run_notebook(notebook, parameters: Mapping[str, Any] | None = None, *, out_dir=None, results_path=None,
                 progress: bool = True, kernel_name: str | None = None, timeout: float | None = None) -> LabRun:
    """Execute `notebook` (a name or a path) with `parameters` in `kernel_name` (default: a kernel of
    this Python); write `<out_dir>/<name>.ipynb` and `.html`; record a row (experiment "lab") in the
    results table. `results_path` is also given to the notebook as its `results_path` parameter when
    it declares one. Every refusal (unknown parameter or kernel, a foreign results file) comes before
    anything is created."""
    path = resolve_notebook(notebook)
    if timeout is not None and (not isinstance(timeout, (int, float)) or not timeout > 0 or math.isinf(timeout)):
        raise MlxbunError(f"timeout must be a positive number of seconds, got {timeout!r}")
    with _kernel(kernel_name) as (kernel, language):
        params, results_path = _checked_parameters(path, dict(parameters or {}), results_path, language)
        out = _checked_out_dir(out_dir if out_dir is not None else "lab-runs")
        with open_results(results_path) as store:  # a bad results file refuses before anything is created
            try:
                out.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise MlxbunError(f"{out}: cannot create the output directory ({e.strerror})") from None
            return _execute(path, params, store, out, kernel, language, progress, timeout)


def _checked_out_dir(out_dir) -> Path:
    """The output directory (absolute), refused when it or the nearest existing directory above it
    cannot hold it; created only once the results file has been accepted."""
    out = Path(out_dir).expanduser().absolute()
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise MlxbunError(f"--out {out}: {existing} is a file, not a directory")
    if existing != out and not os.access(existing, os.W_OK | os.X_OK):
        raise MlxbunError(f"--out {out}: cannot create it in {existing} (permission denied)")
    return out


def _checked_parameters(path: Path, params: dict, results_path, language: str) -> tuple[dict, Path | None]:
    """(the parameters, refused when the notebook does not declare them, with `results_path` set
    when it declares one; the results file, absolute)."""
    declared = notebook_parameters(path, language=language)
    unknown = sorted(set(params) - set(declared))
    if unknown:
        raise MlxbunError(f"{path.name}: no parameter(s) {', '.join(unknown)} "
                          f"(it takes: {', '.join(declared) or 'none'})")
    if "results_path" in params and results_path is not None and str(params["results_path"]) != str(results_path):
        raise MlxbunError(f"results_path given twice: -p results_path {params['results_path']} and --results "
                          f"{results_path}")
    results_path = results_path if results_path is not None else params.get("results_path")
    if results_path is not None:
        # absolute: the kernel runs in the notebook's directory, the lab row is written from here
        results_path = Path(results_path).expanduser().absolute()
        if "results_path" in declared:
            params["results_path"] = str(results_path)
    return params, results_path


def _execute(path: Path, params: dict, store, out: Path, kernel: str, language: str, progress: bool,
             timeout: float | None) -> LabRun:
    import papermill

    name = path.stem
    out_nb, out_html = out / f"{name}.ipynb", out / f"{name}.html"
    run = store.new_run("lab", params={"notebook": name, "path": str(path), "parameters": params,
                                       "output": str(out_nb)})
    env = {HEADLESS_ENV: "1", "MPLBACKEND": "Agg", LAB_RUN_ENV: run.run_id, LAB_EXPERIMENT_ENV: ""}
    if path.parent.parent == lab_dir().resolve():  # a Lab experiment: lab/<name>/<notebook>
        env[LAB_EXPERIMENT_ENV] = path.parent.name
    error, html = None, None
    tic = time.perf_counter()
    try:
        with _environ(env):
            papermill.execute_notebook(
                str(path), str(out_nb), parameters=params, kernel_name=kernel, language=language,
                progress_bar=progress, cwd=str(path.parent), execution_timeout=timeout, config=_client_config(),
            )
    except MlxbunError:
        raise
    except KeyboardInterrupt:
        run.record_failure("interrupted", duration_s=time.perf_counter() - tic)
        raise
    except Exception as e:  # noqa: BLE001 - any execution failure is this run's result
        error = _failure(e, path, params)
    duration = time.perf_counter() - tic
    if out_nb.is_file():
        try:
            html = _write_html(out_nb, out_html)
        except Exception as e:  # noqa: BLE001 - a rendering failure fails the run too
            error = error or f"HTML rendering failed: {type(e).__name__}: {e}"
    elif error is None:
        error = f"papermill wrote no executed notebook at {out_nb}"
    if error is None:
        run.record("duration_s", duration, "s")
    else:
        run.record_failure(error, duration_s=duration)
    return LabRun(name=name, notebook=path, output=out_nb, html=html, ok=error is None, duration_s=duration,
                  error=error, run_id=run.run_id, results_path=store.path, parameters=params)


def _write_html(nb_path: Path, html_path: Path) -> Path:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_filename(str(nb_path))
    html_path.write_text(body, encoding="utf-8")
    return html_path
