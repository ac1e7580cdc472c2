"""The house as docs/ARCHITECTURE.md draws it: no import cycle anywhere in mlxbun/ (imports inside
functions count), imports point down the layers, modules stay small, notebooks stay thin, and no
test module imports another.

Read from the source with `ast` (nothing is imported), so a violation names the file and line.
"""

import ast
import json
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "mlxbun"

# From the bottom up. A module may import from its own layer and the layers below it, never
# from a layer above. A unit is a top-level module or package of mlxbun (models/universal is
# its own unit; `mlxbun` is the package's own __init__, the lazy `load_model_config` /
# `open_model` facade).
LAYERS = [
    ("foundation", {"errors", "atomic", "attention", "config_reader", "sampling", "chat_template", "detokenizer",
                    "quant", "layer_facts", "tokenizer", "config", "weights", "weight_audit",
                    "snapshot_identity", "kernels"}),
    ("caches", {"cache"}),
    ("names", {"names"}),
    ("graphs", {"models", "models.universal", "towers"}),
    ("loading", {"profile", "factory", "inventory", "mlxbun", "gguf", "real_models", "hub"}),
    ("zoo", {"zoo"}),
    ("locate", {"locate"}),
    ("features", {"generation_caches", "fast", "parallel", "generate", "speculative", "diffusion", "parity", "bench",
                  "results", "explain", "convert", "multimodal"}),
    ("lab", {"lab"}),
    ("experiments", {"experiments"}),
    ("entry points", {"commands", "cli", "__main__"}),
]
RANK = {unit: i for i, (_, units) in enumerate(LAYERS) for unit in units}

MAX_LINES = 600
DATA_TABLES = {"mlxbun/models/universal/table.py", "mlxbun/models/universal/not_covered.py"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The mlxbun module an imported name lives in (a submodule, else its package)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports() -> dict[str, list[tuple[str, int]]]:
    """module -> [(imported mlxbun module, line)], imports inside functions included."""
    out: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for mod, path in MODULES.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for name in names:
                target = _resolve(name)
                if target is not None and target != mod:
                    out[mod].append((target, node.lineno))
    return out


IMPORTS = _imports()


def _unit(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return "mlxbun"
    if parts[1:3] == ["models", "universal"]:
        return "models.universal"
    return parts[1]


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as one cycle path."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(_cycle_path(graph, set(component)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _cycle_path(graph: dict[str, set[str]], component: set[str]) -> list[str]:
    """One concrete cycle through a strongly connected component: a -> b -> ... -> a."""
    start = min(component)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return sorted(component)


def test_the_cycle_finder_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_mlxbun():
    graph = {m: {t for t, _ in IMPORTS.get(m, ())} for m in MODULES}
    cycles = _cycles(graph)
    assert not cycles, "import cycles (imports inside functions count): " + "; ".join(
        " -> ".join(c) for c in cycles)


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in MODULES}
    assert units <= set(RANK), f"units without a layer in LAYERS: {sorted(units - set(RANK))}"
    assert set(RANK) <= units, f"LAYERS names units that do not exist: {sorted(set(RANK) - units)}"


def test_imports_point_down_the_layers():
    upward = []
    for mod, targets in IMPORTS.items():
        for target, line in targets:
            a, b = _unit(mod), _unit(target)
            if RANK[b] > RANK[a]:
                upward.append(f"{MODULES[mod].relative_to(ROOT)}:{line} imports {target} "
                              f"({LAYERS[RANK[a]][0]} -> {LAYERS[RANK[b]][0]})")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_the_graph_dispatch_imports_nothing_from_the_caches():
    """Caches own their attention: models/base.py calls `cache.attention`, it does not know caches."""
    assert not [t for t, _ in IMPORTS["mlxbun.models.base"] if t.startswith("mlxbun.cache")]


@pytest.mark.parametrize("feature", ["speculative", "diffusion", "parity", "bench", "cache", "models"])
def test_features_import_no_experiment_lab_or_command(feature):
    bad = [f"{m} -> {t}" for m, ts in IMPORTS.items() if _unit(m) == feature
           for t, _ in ts if _unit(t) in ("experiments", "lab", "commands", "cli")]
    assert not bad, bad


def _imported_modules(path: Path) -> list[tuple[str, int]]:
    """(module, line) of every import in `path`, inside functions too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.module, node.lineno))
    return out


def test_no_test_module_imports_another():
    """Shared test code lives in helper modules (tests/dense_oracle.py, tests/checkpoint_edits.py,
    ...) and fixtures in conftest.py: a test module imported by another runs its module-level setup
    twice and ties the two files' fates together."""
    tests = ROOT / "tests"
    found = [f"{path.relative_to(ROOT)}:{line} imports {mod}" for path in sorted(tests.rglob("*.py"))
             for mod, line in _imported_modules(path)
             if mod.startswith("tests.") and mod.rsplit(".", 1)[-1].startswith("test_")]
    assert not found, "\n".join(found)


def test_modules_stay_small():
    big = {str(p.relative_to(ROOT)): n for p in MODULES.values()
           if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert set(big) <= DATA_TABLES, f"modules over {MAX_LINES} lines (split them by job): " + ", ".join(
        f"{k} ({v})" for k, v in sorted(big.items()) if k not in DATA_TABLES)


def test_notebooks_are_thin():
    """A notebook imports the experiment drivers, the lab's plots and the naming grammar; what it
    computes lives in the package."""
    allowed = ("mlxbun.experiments", "mlxbun.lab", "mlxbun.names")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] != "code":
                continue
            for node in ast.walk(ast.parse("".join(cell["source"]))):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlxbun"):
                    assert node.module.startswith(allowed), f"{path.name}: imports {node.module}"
                if isinstance(node, ast.FunctionDef | ast.ClassDef):
                    pytest.fail(f"{path.name}: defines {node.name} (logic belongs in mlxbun/)")
