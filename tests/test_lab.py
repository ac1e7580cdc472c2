"""`mlxbun lab`: parameter parsing, notebook discovery, `lab list`, and `lab run` on small notebooks
(a failing cell exits non-zero and records a failure row; a good run records its duration)."""

import json
import sys

import nbformat
import pytest
from nbformat.v4 import new_code_cell

import mlxbun.cli as cli
from mlxbun.errors import MlxbunError
from mlxbun.lab.catalog import list_notebooks, resolve_notebook
from mlxbun.lab.runner import KERNEL, kernel_for_this_python, parse_parameters, parse_value
from mlxbun.results import open_results
from tests.notebook_files import write_nb


def main(argv):
    """`mlxbun ARGV` through the real entry point (the lab command as cli.py registers it)."""
    return cli.main(argv)


# ---------------------------------------------------------------- -p values


@pytest.mark.parametrize("text, value", [
    ("3", 3), ("-2", -2), ("1_000", 1000), ("0.5", 0.5), ("1e-3", 1e-3), ("True", True), ("false", False),
    ("None", None), ("null", None), ("zoo:llama", "zoo:llama"), ("q4", "q4"), ("[2, 4, 8]", [2, 4, 8]),
    ("[3.5]", [3.5]), ("{a: 1, b: [x]}", {"a": 1, "b": ["x"]}), ("", ""), ("hello world", "hello world"),
])
def test_parse_value(text, value):
    got = parse_value(text)
    assert got == value and type(got) is type(value)


def test_parse_parameters_refuses_bad_names_duplicates_and_bad_yaml():
    assert parse_parameters([["a", "1"], ["b", "x"]]) == {"a": 1, "b": "x"}
    with pytest.raises(MlxbunError, match="twice"):
        parse_parameters([["a", "1"], ["a", "2"]])
    with pytest.raises(MlxbunError, match="not a valid parameter name"):
        parse_parameters([["1a", "1"]])
    with pytest.raises(MlxbunError, match="YAML"):
        parse_value("[1, 2")


def test_cli_collects_repeated_p_options():
    import argparse

    from mlxbun.commands import lab

    parser = cli.OneLineParser(prog="mlxbun")
    lab.register(parser.add_subparsers(dest="command", parser_class=cli.OneLineParser))
    args = parser.parse_args(["lab", "run", "kv_quant", "-p", "bits", "[2, 4]", "--parameter", "model", "zoo:qwen3",
                              "--out", "o", "--results", "r.sqlite"])
    assert args.parameter == [["bits", "[2, 4]"], ["model", "zoo:qwen3"]]
    assert (args.out, args.results, args.func) == ("o", "r.sqlite", lab.run_run)
    with pytest.raises(SystemExit):
        parser.parse_args(["lab", "run", "kv_quant", "-p", "only_a_name"])
    assert isinstance(args, argparse.Namespace)


# ---------------------------------------------------------------- discovery and list


def test_list_and_resolve(lab_dirs, tmp_path):
    nbs, lab = lab_dirs
    write_nb(nbs / "alpha.ipynb", "print(x)")
    write_nb(nbs / ".ipynb_checkpoints" / "alpha-checkpoint.ipynb")
    write_nb(lab / "idea" / "idea.ipynb", params="speed = 2.5  # how fast")
    (lab / "idea" / "README.md").write_text("# idea\n")
    (lab / "empty").mkdir()
    infos = list_notebooks(with_parameters=True)
    assert [(i.name, i.kind) for i in infos] == [("alpha", "workflow"), ("idea", "lab")]
    assert infos[0].parameters["y"]["default"] == "'text'"
    assert infos[1].parameters["speed"]["help"] == "how fast" and infos[1].readme == lab / "idea" / "README.md"
    assert resolve_notebook("alpha") == (nbs / "alpha.ipynb").resolve()
    assert resolve_notebook("alpha.ipynb") == (nbs / "alpha.ipynb").resolve()
    assert resolve_notebook("idea") == (lab / "idea" / "idea.ipynb").resolve()
    assert resolve_notebook(str(lab / "idea")) == (lab / "idea" / "idea.ipynb").resolve()
    assert resolve_notebook(str(nbs / "alpha.ipynb")) == (nbs / "alpha.ipynb").resolve()
    with pytest.raises(MlxbunError, match="known: alpha, idea"):
        resolve_notebook("beta")
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(MlxbunError, match="not a notebook"):
        resolve_notebook(str(tmp_path / "notes.txt"))


def test_lab_list_cli(lab_dirs, capsys):
    nbs, lab = lab_dirs
    write_nb(nbs / "alpha.ipynb", params="x = 1  # the x")
    write_nb(lab / "idea" / "idea.ipynb", params="speed = 2.5")
    assert main(["lab", "list", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == ["alpha", "idea"]
    assert rows[0]["parameters"] == {"x": {"type": "None", "default": "1", "help": "the x"}}
    assert main(["lab", "list"]) == 0
    out = capsys.readouterr().out
    assert "alpha" in out and "x = 1" in out and "speed = 2.5" in out and "lab" in out


def test_lab_list_finds_the_repo_notebooks(monkeypatch, tmp_path):
    monkeypatch.delenv("MLXBUN_NOTEBOOKS", raising=False)
    monkeypatch.chdir(tmp_path)  # not the repo: the notebooks are found beside the package
    names = {i.name for i in list_notebooks()}
    assert {"port_bringup", "logit_diff", "kv_quant", "benchmark"} <= names


# ---------------------------------------------------------------- kernel


def test_kernel_is_this_python_through_the_quiet_launcher(tmp_path, monkeypatch):
    """The default kernel runs sys.executable through mlxbun.lab.kernel, declares CurveZMQ, is found
    first (a python3 or mlxbun-python spec of another interpreter on $JUPYTER_PATH does not shadow
    it) and is gone after the run."""
    from jupyter_client.kernelspec import KernelSpecManager

    for name in ("python3", KERNEL):
        spec = tmp_path / "jp" / "kernels" / name
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({"argv": ["/opt/other/python", "-m", "ipykernel_launcher", "-f",
                                                               "{connection_file}"], "display_name": "other",
                                                      "language": "python"}))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jp"))
    with kernel_for_this_python() as name:
        spec = KernelSpecManager().get_kernel_spec(name)
        assert name == KERNEL and spec.argv[:3] == [sys.executable, "-m", "mlxbun.lab.kernel"]
        assert spec.language == "python" and "curve" in spec.metadata["supported_encryption"]
    assert KernelSpecManager().get_kernel_spec(KERNEL).argv[0] == "/opt/other/python"


def test_the_launcher_drops_the_shutdown_interrupt_record_only():
    import logging

    from mlxbun.lab.kernel import ShutdownInterruptFilter

    def record(msg, *args):
        return logging.LogRecord("IPKernelApp", logging.ERROR, __file__, 1, msg, args, None)

    f = ShutdownInterruptFilter()
    assert not f.filter(record("KeyboardInterrupt caught in kernel."))
    assert not f.filter(record("KeyboardInterrupt caught in kernel"))
    assert f.filter(record("Exception in message handler:"))
    assert f.filter(record("%s", "a KeyboardInterrupt caught in kernel code is the user's"))


# ---------------------------------------------------------------- lab run


def _lab_rows(db):
    with open_results(db, create=False) as store:
        return store.load(experiment="lab", expand_params=True)


def test_a_failing_notebook_exits_non_zero_and_records_the_failure(lab_dirs, tmp_path, capsys):
    nbs, _ = lab_dirs
    nb = write_nb(tmp_path / "elsewhere" / "broken.ipynb", "print('before')", "x / 0", "print('never')")
    db, out = tmp_path / "r.sqlite", tmp_path / "out"
    code = main(["lab", "run", str(nb), "--out", str(out), "--results", str(db), "--no-progress"])
    assert code == 1
    err = capsys.readouterr().err
    assert "broken failed" in err and "ZeroDivisionError" in err
    rows = _lab_rows(db)
    assert len(rows) == 1 and rows.metric[0] == "error" and rows.value.isna().all()
    # 1-based over every cell of broken.ipynb: markdown, parameters, print, x / 0 (the 4th of 5)
    assert "cell 4 of 5 (execution count 3) raised ZeroDivisionError" in err
    assert "ZeroDivisionError" in rows["params.error"][0] and "cell 4 of 5" in rows["params.error"][0]
    assert rows["params.notebook"][0] == "broken" and rows["params.duration_s"][0] > 0
    executed = nbformat.read(out / "broken.ipynb", 4)
    outputs = [o for c in executed.cells if c.cell_type == "code" for o in c.outputs]
    assert any(o.get("ename") == "ZeroDivisionError" for o in outputs)
    assert not any("never" in o.get("text", "") for o in outputs)
    assert "ZeroDivisionError" in (out / "broken.html").read_text()


def test_a_good_run_injects_parameters_and_records_its_duration(lab_dirs, tmp_path, capsys, monkeypatch):
    nbs, _ = lab_dirs
    write_nb(nbs / "hello.ipynb",
             "import os\nprint(f'x={x!r} y={y!r} results={results_path}')\n"
             "print('headless', os.environ['MLXBUN_HEADLESS'], os.environ['MLXBUN_LAB_RUN'])",
             params="x = 1\ny = 'text'\nresults_path = None")
    db, out = tmp_path / "r.sqlite", tmp_path / "out"
    monkeypatch.chdir(tmp_path)  # relative paths are taken from here, not from the notebook's directory
    code = main(["lab", "run", "hello", "-p", "x", "[2, 3]", "-p", "y", "0.5", "--out", "out",
                 "--results", "r.sqlite", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert "hello: ok" in capsys.readouterr().out
    rows = _lab_rows(db)
    assert list(rows.metric) == ["duration_s"] and rows.value[0] > 0 and rows.unit[0] == "s"
    assert rows["params.parameters.x"][0] == [2, 3] and rows["params.parameters.results_path"][0] == str(db)
    executed = nbformat.read(out / "hello.ipynb", 4)
    text = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert f"x=[2, 3] y=0.5 results={db}" in text
    assert f"headless 1 {rows.run_id[0]}" in text
    assert (out / "hello.html").read_text().count("<html") == 1


def test_lab_run_refuses_mistakes_before_running(lab_dirs, tmp_path, capsys):
    nbs, _ = lab_dirs
    write_nb(nbs / "hello.ipynb", "print(x)")
    db = tmp_path / "r.sqlite"
    assert main(["lab", "run", "hello", "-p", "nope", "1", "--results", str(db), "--out", str(tmp_path)]) == 1
    assert "no parameter(s) nope" in capsys.readouterr().err
    assert main(["lab", "run", "missing", "--results", str(db), "--out", str(tmp_path)]) == 1
    assert "known: hello" in capsys.readouterr().err
    junk = tmp_path / "junk.sqlite"
    junk.write_bytes(b"not a database at all")
    assert main(["lab", "run", "hello", "--results", str(junk), "--out", str(tmp_path)]) == 1
    assert "not an SQLite database" in capsys.readouterr().err
    assert not db.exists() and not (tmp_path / "hello.ipynb").exists()


def test_a_failing_cell_is_numbered_in_the_notebook_as_written(lab_dirs, tmp_path, capsys):
    """papermill injects a cell of parameters after the `parameters` cell: the number is the one of
    the notebook file (1-based, every cell), not of the executed copy."""
    nb = write_nb(tmp_path / "broken.ipynb", "print(x)", "1 / 0", params="x = 1")
    code = main(["lab", "run", str(nb), "-p", "x", "5", "--out", str(tmp_path / "out"), "--results",
                 str(tmp_path / "r.sqlite"), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1 and "cell 4 of 4 (execution count 4) raised ZeroDivisionError" in err, err


def test_cell_names_around_papermill_s_injected_cell(tmp_path):
    from mlxbun.lab.runner import _cell_name

    nb = write_nb(tmp_path / "a.ipynb", "a", "b")  # markdown, parameters, a, b
    assert _cell_name(nb, {}, 3, 2) == "cell 4 of 4 (execution count 2)"
    # executed: markdown, parameters, injected, a, b
    assert _cell_name(nb, {"x": 1}, 1, 1) == "cell 2 of 4 (execution count 1)"
    assert _cell_name(nb, {"x": 1}, 2, 2) == "the injected parameters cell (execution count 2)"
    assert _cell_name(nb, {"x": 1}, 4, 4) == "cell 4 of 4 (execution count 4)"
    # a notebook saved from a papermill run keeps its injected cell, which papermill replaces in place
    saved = nbformat.read(nb, 4)
    injected = new_code_cell("x = 2")
    injected.metadata["tags"] = ["injected-parameters"]
    saved.cells.insert(2, injected)
    nbformat.write(saved, tmp_path / "b.ipynb")
    assert _cell_name(tmp_path / "b.ipynb", {"x": 1}, 4, 4) == "cell 5 of 5 (execution count 4)"


@pytest.mark.parametrize("kernel", [None, "python3"], ids=["default", "--kernel python3"])
def test_a_notebook_without_kernelspec_runs_in_the_kernel_asked_for(kernel, tmp_path, capsys):
    nb = write_nb(tmp_path / "bare.ipynb", "import sys\nprint('x is', x, sys.executable)", params="x = 1",
                  kernelspec=False)
    db, out = tmp_path / "r.sqlite", tmp_path / "out"
    code = main(["lab", "run", str(nb), "-p", "x", "7", "--out", str(out), "--results", str(db), "--no-progress"]
                + (["--kernel", kernel] if kernel else []))
    assert code == 0, capsys.readouterr().err
    executed = nbformat.read(out / "bare.ipynb", 4)
    text = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    assert f"x is 7 {sys.executable}" in text


def test_lab_list_reads_a_notebook_without_kernelspec_as_python(lab_dirs):
    nbs, _ = lab_dirs
    write_nb(nbs / "bare.ipynb", params="speed = 2.5  # how fast", kernelspec=False)
    assert list_notebooks(with_parameters=True)[0].parameters["speed"]["default"] == "2.5"


def test_a_good_run_prints_nothing_from_the_kernel_but_its_real_errors(tmp_path, capfd):
    """No TCP-encryption warning (the kernel runs over CurveZMQ) and no "KeyboardInterrupt caught in
    kernel" (the shutdown's SIGINT landing in the kernel's last reply, provoked here on purpose);
    an error the kernel logs still reaches the terminal."""
    provoke = (
        "import inspect\n"
        "kernel = get_ipython().kernel\n"
        "kernel_info = kernel.shell_handlers['kernel_info_request']\n"
        "async def kernel_info_then_interrupted(*args):\n"
        "    reply = kernel_info(*args)\n"
        "    if inspect.isawaitable(reply):\n"
        "        await reply\n"
        "    raise KeyboardInterrupt  # as jupyter_client's SIGINT before the shutdown request\n"
        "kernel.shell_handlers['kernel_info_request'] = kernel_info_then_interrupted\n"
        "kernel.log.error('a real kernel error')")
    nb = write_nb(tmp_path / "quiet.ipynb", provoke, params=None)
    argv = ["lab", "run", str(nb), "--out", str(tmp_path / "out"), "--results", str(tmp_path / "r.sqlite"),
            "--no-progress"]
    assert main(argv) == 0
    err = capfd.readouterr().err
    assert err.strip() == "[IPKernelApp] ERROR | a real kernel error", err
    # the kernel as installed (ipykernel_launcher) does print the line the launcher drops
    assert main(argv + ["--kernel", "python3"]) == 0
    assert "KeyboardInterrupt caught in kernel" in capfd.readouterr().err


def test_running_mean_keeps_its_level_to_the_ends():
    """A constant series has a constant running mean (the zero-padded convolution dipped at both
    ends); every point is the mean of exactly the values its centred window covers."""
    import numpy as np

    from mlxbun.lab.plots import running_mean

    assert np.array_equal(running_mean(np.full(40, 0.25), 8), np.full(40, 0.25))
    assert np.convolve(np.full(40, 0.25), np.ones(8) / 8, mode="same")[0] < 0.25  # the old dip
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 40):
        x = rng.random(n)
        for w in (1, 2, 3, 4, 5, 8, 64):
            lo = np.maximum(np.arange(n) - w // 2, 0)
            hi = np.minimum(np.arange(n) - w // 2 + w, n)
            want = np.array([x[a:b].mean() for a, b in zip(lo, hi)])
            np.testing.assert_allclose(running_mean(x, w), want, rtol=1e-12, err_msg=f"n={n} w={w}")
            if w <= n:  # away from the ends: the plain box filter
                inner = slice(w // 2, n - (w - 1) // 2)
                np.testing.assert_allclose(running_mean(x, w)[inner],
                                           np.convolve(x, np.ones(w) / w, mode="same")[inner], rtol=1e-12)
    assert running_mean([], 4).shape == (0,)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="window"):
            running_mean([1.0, 2.0], bad)


def test_the_kld_plot_draws_the_running_mean():
    from types import SimpleNamespace

    import numpy as np

    from mlxbun.lab.plots import kld_per_position_plot

    kld = np.full(64, 0.5)
    fig = kld_per_position_plot(SimpleNamespace(kld_values=kld, top_base=np.zeros(64), top_new=np.zeros(64)))
    line = next(l for l in fig.axes[0].lines if l.get_label().startswith("running mean"))
    assert np.array_equal(line.get_ydata(), kld)
