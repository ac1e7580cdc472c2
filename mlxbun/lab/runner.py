"""Run a lab notebook headless: papermill executes it in a kernel of this Python, nbconvert
renders it to HTML, and the run lands in the results table (a duration row, or a failure row
naming the failing cell: never a partial silent result).

The kernel gets $MLXBUN_HEADLESS (widgets render static), MPLBACKEND=Agg and $MLXBUN_LAB_RUN
(the lab row's run id, which the workflows add to their own rows as `lab_run`).
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
from mlxbun.lab.catalog import notebook_parameters, resolve_notebook
from mlxbun.lab.plots import HEADLESS_ENV
from mlxbun.lab.recording import LAB_RUN_ENV
from mlxbun.results import open_results

__all__ = ["LabRun", "kernel_for_this_python", "parse_parameters", "parse_value", "run_notebook"]

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


@contextlib.contextmanager
def kernel_for_this_python():
    """The kernel name that runs this interpreter: 'python3' when its spec launches `python`
    (jupyter_client substitutes sys.executable) or this executable; otherwise a temporary spec
    for sys.executable, found through $JUPYTER_PATH while the context is open."""
    try:
        import ipykernel  # noqa: F401
    except ImportError:
        raise MlxbunError(f"ipykernel is not installed for {sys.executable}: the notebook kernel runs this "
                          "Python (pip install ipykernel)") from None
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        argv0 = KernelSpecManager().get_kernel_spec("python3").argv[0]
    except NoSuchKernel:
        argv0 = None
    same = argv0 is not None and (
        argv0 in ("python", f"python{sys.version_info[0]}", "python%d.%d" % sys.version_info[:2])
        or _same_file(argv0, sys.executable))
    if same:
        yield "python3"
        return
    from ipykernel.kernelspec import write_kernel_spec

    with tempfile.TemporaryDirectory(prefix="mlxbun-kernel-") as root:
        write_kernel_spec(os.path.join(root, "kernels", "mlxbun-python"))
        with _environ({"JUPYTER_PATH": os.pathsep.join(filter(None, [root, os.environ.get("JUPYTER_PATH")]))}):
            yield "mlxbun-python"


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


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


def _failure(e: BaseException) -> str:
    from papermill.exceptions import PapermillExecutionError

    if isinstance(e, PapermillExecutionError):
        return f"cell {e.cell_index} (execution count {e.exec_count}) raised {e.ename}: {e.evalue}"
    return f"{type(e).__name__}: {e}".strip()


def run_notebook(notebook, parameters: Mapping[str, Any] | None = None, *, out_dir=None, results_path=None,
                 progress: bool = True, kernel_name: str | None = None, timeout: float | None = None) -> LabRun:
    """Execute `notebook` (a name or a path) with `parameters`; write `<out_dir>/<name>.ipynb`
    and `.html`; record a row (experiment "lab") in the results table. `results_path` is also
    given to the notebook as its `results_path` parameter when it declares one."""
    import papermill

    path = resolve_notebook(notebook)
    name = path.stem
    declared = notebook_parameters(path)
    params = dict(parameters or {})
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
    if timeout is not None and (not isinstance(timeout, (int, float)) or not timeout > 0 or math.isinf(timeout)):
        raise MlxbunError(f"timeout must be a positive number of seconds, got {timeout!r}")

    out = Path(out_dir if out_dir is not None else "lab-runs").expanduser().absolute()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise MlxbunError(f"{out}: cannot create the output directory ({e.strerror})") from None
    out_nb, out_html = out / f"{name}.ipynb", out / f"{name}.html"

    with open_results(results_path) as store:  # a bad results file refuses before anything runs
        run = store.new_run("lab", params={"notebook": name, "path": str(path), "parameters": params,
                                           "output": str(out_nb)})
        env = {HEADLESS_ENV: "1", "MPLBACKEND": "Agg", LAB_RUN_ENV: run.run_id}
        error, html = None, None
        tic = time.perf_counter()
        try:
            with kernel_for_this_python() as default_kernel, _environ(env):
                papermill.execute_notebook(
                    str(path), str(out_nb), parameters=params, kernel_name=kernel_name or default_kernel,
                    progress_bar=progress, cwd=str(path.parent), execution_timeout=timeout,
                )
        except MlxbunError:
            raise
        except KeyboardInterrupt:
            run.record_failure("interrupted", duration_s=time.perf_counter() - tic)
            raise
        except Exception as e:  # noqa: BLE001 - any execution failure is this run's result
            error = _failure(e)
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
