"""Bad input to `mlxbun lab run` (and `mlxbun --version`'s neighbours): each case runs the real entry
point (`python -m mlxbun`) and asserts the exit code, that no traceback is printed, that the
message names the culprit, and that no file outside the intended output changed (a refusal
creates nothing: neither --out nor a results file)."""

import sqlite3
import subprocess
from pathlib import Path

import nbformat
import pytest

from tests.bad_input.helpers import subprocess_mlxbun, tree
from tests.notebook_files import write_nb


def mlxbun(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess_mlxbun(*args, cwd=cwd, env={"MLXBUN_RESULTS": str(cwd / "default-results.sqlite")})


def notebook(path: Path, *cells: str) -> Path:
    return write_nb(path, *cells, params="x = 1")


@pytest.fixture
def work(tmp_path):
    """tmp_path with hello.ipynb (parameter x), a foreign SQLite database, a junk file, a text file."""
    notebook(tmp_path / "hello.ipynb", "print(x)")
    with sqlite3.connect(tmp_path / "theirs.sqlite") as conn:
        conn.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY, total REAL)")
        conn.execute("INSERT INTO invoices (total) VALUES (12.5)")
    conn.close()
    (tmp_path / "junk.sqlite").write_bytes(b"not a database at all, and someone's file")
    (tmp_path / "notes.txt").write_text("keep me\n")
    (tmp_path / "broken.ipynb").write_text('{"cells": [')
    return tmp_path


REFUSALS = [
    # (argv after `lab run`, what the one-line message must contain)
    (["hello.ipynb", "--results", "theirs.sqlite"], ["theirs.sqlite", "another application", "invoices"]),
    (["hello.ipynb", "--results", "junk.sqlite"], ["junk.sqlite", "not an SQLite database"]),
    (["hello.ipynb", "--results", "r.sqlite", "--kernel", "no-such-kernel"], ["kernel 'no-such-kernel'",
                                                                              "no such Jupyter kernel"]),
    (["hello.ipynb", "--results", "r.sqlite", "-p", "speed", "3"], ["hello.ipynb", "no parameter(s) speed",
                                                                    "it takes: x"]),
    (["hello.ipynb", "--results", "r.sqlite", "-p", "x", "[1, 2"], ["'[1, 2'", "YAML"]),
    (["hello.ipynb", "--results", "r.sqlite", "-p", "1x", "3"], ["-p 1x", "not a valid parameter name"]),
    (["hello.ipynb", "--results", "r.sqlite", "-p", "x", "3", "-p", "x", "4"], ["-p x", "given twice"]),
    (["hello.ipynb", "--results", "r.sqlite", "--timeout", "0"], ["timeout", "positive", "0.0"]),
    (["hello.ipynb", "--results", "r.sqlite", "--timeout", "nan"], ["timeout", "positive", "nan"]),
    (["hello.ipynb", "--results", "r.sqlite", "--timeout", "inf"], ["timeout", "positive", "inf"]),
    (["hello.ipynb", "--results", "r.sqlite", "--out", "notes.txt"], ["notes.txt", "is a file, not a directory"]),
    (["hello.ipynb", "--results", "r.sqlite", "--out", "notes.txt/runs"], ["notes.txt", "is a file"]),
    (["no_such_notebook", "--results", "r.sqlite"], ["'no_such_notebook'", "not a known notebook name"]),
    (["notes.txt", "--results", "r.sqlite"], ["notes.txt", "not a notebook (.ipynb)"]),
    (["broken.ipynb", "--results", "r.sqlite"], ["broken.ipynb", "cannot read the notebook's parameters"]),
]


@pytest.mark.parametrize("args, culprits", REFUSALS, ids=[" ".join(a) for a, _ in REFUSALS])
def test_lab_run_refuses_before_creating_anything(work, args, culprits):
    before = tree(work)
    r = mlxbun("lab", "run", *args, "--no-progress", *([] if "--out" in args else ["--out", "runs"]), cwd=work)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("mlxbun lab: error: "), r.stderr
    for culprit in culprits:
        assert culprit in lines[0], (culprit, lines[0])
    assert tree(work) == before  # no --out directory, no results file, the foreign files untouched


@pytest.mark.parametrize("args, culprit", [
    (["--timeout", "soon"], "argument --timeout: invalid float value: 'soon'"),
    (["-p", "x"], "argument -p/--parameter: expected 2 arguments"),
    (["--kernel"], "argument --kernel: expected one argument"),
])
def test_lab_run_bad_flags_are_one_line_usage_errors(work, args, culprit):
    before = tree(work)
    r = mlxbun("lab", "run", "hello.ipynb", *args, cwd=work)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and culprit in r.stderr, r.stderr
    assert tree(work) == before


def test_a_failing_notebook_names_its_cell_from_1(work):
    """Exit 1, no traceback on the terminal, the failing cell counted from 1 over every cell of the
    file (here the 4th of 5: markdown, parameters, print, 1 / 0, print), with its execution count;
    only the executed notebook, its HTML and the results file are written."""
    notebook(work / "fails.ipynb", "print('before')", "1 / 0", "print('never')")
    before = tree(work)
    r = mlxbun("lab", "run", "fails.ipynb", "-p", "x", "2", "--out", "runs", "--results", "r.sqlite",
               "--no-progress", cwd=work)
    assert r.returncode == 1 and "Traceback" not in r.stderr
    first = r.stderr.splitlines()[0]
    assert first.startswith("mlxbun lab: fails failed after ")
    assert first.endswith("cell 4 of 5 (execution count 4) raised ZeroDivisionError: division by zero"), first
    after = tree(work)
    written = {k for k in after if k not in before}
    assert written <= {"runs", "runs/fails.ipynb", "runs/fails.html", "r.sqlite", "r.sqlite-wal", "r.sqlite-shm"}
    assert {"runs/fails.ipynb", "runs/fails.html", "r.sqlite"} <= written
    assert {k: v for k, v in after.items() if k in before} == before


def test_a_good_run_says_nothing_on_stderr(work):
    r = mlxbun("lab", "run", "hello.ipynb", "-p", "x", "2", "--out", "runs", "--results", "r.sqlite",
               "--no-progress", cwd=work)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert r.stdout.startswith("hello: ok in ")


def test_a_notebook_without_kernelspec_takes_the_kernel_given(work):
    """(The kernel named is the installed one, whose own log lines are left as they are.)"""
    nb = nbformat.read(work / "hello.ipynb", 4)
    del nb.metadata["kernelspec"]
    nbformat.write(nb, work / "bare.ipynb")
    r = mlxbun("lab", "run", "bare.ipynb", "-p", "x", "2", "--kernel", "python3", "--out", "runs", "--results",
               "r.sqlite", "--no-progress", cwd=work)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    assert r.stdout.startswith("bare: ok in ")
