"""The README's model table and command list stay true."""

from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_readme_lists_every_supported_model_type_with_its_tier():
    from mlxbun.profile import supported_model_types

    for model_type, tier in supported_model_types().items():
        assert f"| `{model_type}` | {tier} |" in README, f"README model table lacks {model_type}"


def test_readme_command_table_and_the_cli_match_both_ways():
    """Every command the CLI registers has a row in the README's command table, and every row
    names a command `mlxbun --help` lists (the parser as users get it, nothing patched in)."""
    import re

    from mlxbun.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "command")
    registered = set(sub.choices)
    table = README[README.index("## Commands"):README.index("## Python API")]
    rows = set(re.findall(r"^\| `mlxbun (\w[\w-]*)", table, re.M))
    assert registered == rows, (f"registered, not in the README table: {sorted(registered - rows)}; "
                                f"in the table, not registered: {sorted(rows - registered)}")


# ---------------------------------------------------------------- the first hour

ROOT = Path(__file__).resolve().parents[1]
MAKEFILE = (ROOT / "Makefile").read_text()


def _first_screen_commands() -> list[list[str]]:
    """The shell block under "## The first hour", as argv lists (comments dropped)."""
    import re
    import shlex

    start = README.index("## The first hour")
    block = re.search(r"```sh\n(.*?)```", README[start:], re.S)
    assert block, "the first hour has no ```sh block"
    # the first screen: the block ends within the README's first 30 lines
    assert README[:start + block.end()].count("\n") < 30
    return [argv for argv in (shlex.split(line, comments=True) for line in block.group(1).splitlines()) if argv]


def _make_variable(name: str) -> str:
    import re

    return re.search(rf"^{name}\s*:?=\s*(\S+)", MAKEFILE, re.M).group(1)


def test_the_first_screen_goes_from_clone_to_a_token_and_a_notebook():
    kinds = [argv[0] if argv[0] != "mlxbun" else f"mlxbun {argv[1]}" for argv in _first_screen_commands()]
    assert kinds[0] == "make" and "source" in kinds and "mlxbun generate" in kinds and "jupyter" in kinds, kinds
    assert kinds.index("source") < kinds.index("mlxbun generate"), "mlxbun is on PATH only once .venv is active"


def test_the_first_screen_make_targets_exist():
    import re

    targets = set(re.findall(r"^([\w.-]+)\s*:(?!=)", MAKEFILE, re.M))
    phony = set(re.search(r"^\.PHONY:(.*)$", MAKEFILE, re.M).group(1).split())
    for argv in _first_screen_commands():
        if argv[0] == "make":
            assert len(argv) == 2 and argv[1] in targets and argv[1] in phony, argv


def test_the_first_screen_activates_the_venv_make_installs_mlxbun_into():
    """`source .venv/bin/activate` names the Makefile's $(VENV), into which it installs this
    project (editable, so the `mlxbun` script lands in $(VENV)/bin); the venv running these tests
    has the two programs the first screen then calls."""
    import re
    import shutil
    import sys

    venv = _make_variable("VENV")
    sources = [argv for argv in _first_screen_commands() if argv[0] == "source"]
    assert sources == [["source", f"{venv}/bin/activate"]]
    assert "$(PY) -m pip install -e '.[$(EXTRAS)]'" in MAKEFILE and _make_variable("PY") == "$(VENV)/bin/python"
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^\[project\.scripts\]\nmlxbun = "mlxbun\.cli:main"$', pyproject, re.M)
    dependencies = pyproject[pyproject.index("dependencies = ["):pyproject.index("[project.optional-dependencies]")]
    assert '"jupyterlab>=' in dependencies and '"ipykernel>=' in dependencies
    bin_dir = str(Path(sys.executable).parent)
    for program in ("mlxbun", "jupyter"):
        assert shutil.which(program, path=bin_dir), f"{program} not in {bin_dir}"


def test_the_first_screen_mlxbun_commands_parse_and_generate_runs(zoo_root, monkeypatch, capsys):
    import pytest

    from mlxbun.cli import build_parser, main

    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    commands = [argv[1:] for argv in _first_screen_commands() if argv[0] == "mlxbun"]
    assert ["--version"] in commands
    for args in commands:
        if args == ["--version"]:
            with pytest.raises(SystemExit) as exit_:
                build_parser().parse_args(args)
            assert exit_.value.code == 0
            continue
        build_parser().parse_args(args)  # the command and its flags exist
        capsys.readouterr()
        assert main(args) == 0, capsys.readouterr().err
        if args[0] == "generate":
            out, err = capsys.readouterr()
            assert out.strip() and "Generation:" in err and "tokens-per-sec" in err, err


def test_the_first_screen_notebook_opens_on_this_venv_s_kernel():
    """`jupyter lab NOTEBOOK`: the notebook exists, JupyterLab is installed here, and the kernel its
    metadata names is one this venv provides, running this venv's Python (jupyter_client runs a
    spec's `python` as the server's own interpreter)."""
    import importlib.util
    import os
    import sys

    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager

    labs = [argv for argv in _first_screen_commands() if argv[0] == "jupyter"]
    assert labs and all(argv[1] == "lab" and len(argv) == 3 for argv in labs), labs
    assert importlib.util.find_spec("jupyterlab") is not None
    for argv in labs:
        notebook = ROOT / argv[2]
        assert notebook.is_file(), notebook
        kernel = nbformat.read(notebook, 4).metadata["kernelspec"]["name"]
        argv0 = KernelSpecManager().get_kernel_spec(kernel).argv[0]
        assert argv0 in ("python", f"python{sys.version_info[0]}") or os.path.samefile(argv0, sys.executable), argv0


def test_the_readme_links_only_what_a_clone_has():
    import re

    assert "DESIGN.md" not in README and "../shared" not in README
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links {target}, which the repository lacks"


def test_make_shows_a_line_per_install_step_and_pip_s_progress():
    recipe = MAKEFILE[MAKEFILE.index("$(VENV)/.installed:"):MAKEFILE.index("\ndemo:")]
    lines = [line.strip() for line in recipe.splitlines()[1:] if line.startswith("\t")]
    for i, line in enumerate(lines):
        if "pip install" in line:
            assert " -q" not in line, line
            assert lines[i - 1].startswith("@echo"), f"no step line before: {line}"


def test_the_demo_count_is_the_zoo_s():
    """`make demo` ports every zoo checkpoint this device runs: the README's N/N says how many."""
    from mlxbun.zoo.archs import ARCHS, runnable_variants

    n = sum(len(runnable_variants(a)) for a in ARCHS)
    assert f"{n}/{n} bit-exact" in README
