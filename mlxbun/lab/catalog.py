"""Where the lab's notebooks live and what parameters they take.

Two kinds: the standard workflows, `notebooks/*.ipynb`, and Lab experiments, `lab/<name>/`
(a notebook + README.md each). An experiment that graduated keeps its README (and its committed
results) in `lab/<name>/` while its notebook moved to `notebooks/<name>.ipynb`: it is listed once,
as that workflow with the experiment's header. Both directories are looked up next to the mlxbun package
(a checkout or an editable install: the repo root), else in the current directory.
`$MLXBUN_NOTEBOOKS` / `$MLXBUN_LAB` override them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from mlxbun.errors import MlxbunError
from mlxbun.lab.summary import ExperimentHeader, read_header

__all__ = ["NotebookInfo", "experiment_headers", "lab_dir", "list_notebooks", "notebook_parameters", "notebooks_dir",
           "resolve_notebook"]


def _repo_root() -> Path:
    import mlxbun

    return Path(mlxbun.__file__).resolve().parent.parent


def _find(dirname: str, env: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env]).expanduser()
    beside = _repo_root() / dirname
    return beside if beside.is_dir() else Path.cwd() / dirname


def notebooks_dir() -> Path:
    """The standard workflows: <repo root>/notebooks, else ./notebooks ($MLXBUN_NOTEBOOKS wins)."""
    return _find("notebooks", "MLXBUN_NOTEBOOKS")


def lab_dir() -> Path:
    """Lab experiments: <repo root>/lab, else ./lab ($MLXBUN_LAB wins)."""
    return _find("lab", "MLXBUN_LAB")


@dataclass
class NotebookInfo:
    name: str  # what `mlxbun lab run NAME` takes
    kind: str  # "workflow" | "lab"
    path: Path
    readme: Path | None = None
    parameters: dict = field(default_factory=dict)  # name -> {name, inferred_type_name, default, help}
    header: ExperimentHeader | None = None  # a Lab experiment's README header (Status / Question / Answer)


def _is_notebook(p: Path) -> bool:
    return p.suffix == ".ipynb" and p.is_file() and not p.name.startswith(".") and ".ipynb_checkpoints" not in p.parts


def _graduated_notebook(d: Path) -> Path | None:
    """notebooks/<name>.ipynb of an experiment directory that holds no notebook of its own."""
    moved = notebooks_dir() / f"{d.name}.ipynb"
    return moved if _is_notebook(moved) else None


def _experiments() -> list[NotebookInfo]:
    root = lab_dir()
    out = []
    if not root.is_dir():
        return out
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        nbs = sorted(p for p in d.glob("*.ipynb") if _is_notebook(p))
        main = next((p for p in nbs if p.stem == d.name), nbs[0]) if nbs else _graduated_notebook(d)
        if main is None:
            continue
        readme = d / "README.md"
        readme = readme if readme.is_file() else None
        kind = "lab" if nbs else "workflow"
        out.append(NotebookInfo(d.name, kind, main, readme, header=read_header(d.name, readme)))
    return out


def experiment_headers() -> list[ExperimentHeader]:
    """Every Lab experiment's README header, by name (a missing or malformed one: status "?" and a warning)."""
    return [i.header for i in _experiments()]


def list_notebooks(with_parameters: bool = False) -> list[NotebookInfo]:
    """The workflows (notebooks/*.ipynb) then the Lab experiments, each with its parameters when asked."""
    root = notebooks_dir()
    experiments = _experiments()
    graduated = {i.path for i in experiments if i.kind == "workflow"}
    infos = [NotebookInfo(p.stem, "workflow", p) for p in sorted(root.glob("*.ipynb"))
             if _is_notebook(p) and p not in graduated] if root.is_dir() else []
    infos += experiments
    if with_parameters:
        for info in infos:
            info.parameters = notebook_parameters(info.path)
    return infos


def notebook_parameters(path, language: str | None = None) -> dict:
    """papermill's view of the notebook's `parameters` cell: name -> {name, inferred_type_name, default,
    help}. The cell is read as `language` (the kernel's), else the notebook's own language, else
    Python: the language of the kernel `mlxbun lab run` starts (a notebook without a kernelspec)."""
    import nbformat
    from papermill.exceptions import PapermillException
    from papermill.translators import papermill_translators

    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as e:  # noqa: BLE001 - nbformat/JSON errors of a broken file
        raise MlxbunError(f"{path}: cannot read the notebook's parameters ({type(e).__name__}: {e})") from None
    cell = next((c for c in nb.cells if "parameters" in c.get("metadata", {}).get("tags", [])), None)
    if cell is None:
        return {}
    kernelspec = nb.metadata.get("kernelspec", {})
    language = language or nb.metadata.get("language_info", {}).get("name") or kernelspec.get("language") or "python"
    try:
        translator = papermill_translators.find_translator(kernelspec.get("name"), language)
    except PapermillException:
        raise MlxbunError(f"{path}: papermill cannot parameterize a notebook in {language!r}") from None
    try:
        return {p.name: p._asdict() for p in translator.inspect(cell)}
    except NotImplementedError:  # a translator without introspection: as papermill, no parameters known
        return {}


def resolve_notebook(name_or_path) -> Path:
    """A notebook path from a path, or a name in notebooks/ or lab/ (with or without .ipynb)."""
    text = str(name_or_path)
    p = Path(text).expanduser()
    if p.is_file():
        if p.suffix != ".ipynb":
            raise MlxbunError(f"{p}: not a notebook (.ipynb)")
        return p.resolve()
    if p.is_dir():
        nbs = sorted(q for q in p.glob("*.ipynb") if _is_notebook(q))
        graduated = None if nbs or p.resolve().parent != lab_dir().resolve() else _graduated_notebook(p)
        main = next((q for q in nbs if q.stem == p.name), nbs[0]) if nbs else graduated
        if main is None:
            raise MlxbunError(f"{p}: a directory without a notebook")
        return main.resolve()
    parts = p.parts
    if len(parts) == 2 and parts[0] == "lab" and (lab_dir() / parts[1]).is_dir():  # lab/<name> from elsewhere
        return resolve_notebook(lab_dir() / parts[1])
    stem = text[:-6] if text.endswith(".ipynb") else text
    infos = list_notebooks()
    for info in infos:
        if info.name == stem:
            return info.path.resolve()
    known = ", ".join(i.name for i in infos) or f"none (looked in {notebooks_dir()} and {lab_dir()})"
    raise MlxbunError(f"notebook '{text}': no such file, and not a known notebook name (known: {known})")
