"""The top-level `mlxbun` command: --version, and a reader that closes the pipe early."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlxbun
import mlxbun.cli as cli
from mlxbun.results.identity import environment

ROOT = Path(__file__).resolve().parents[1]


def test_version_prints_the_code_backend_and_device(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--version"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out.splitlines()
    env = environment()
    assert out[0] == f"mlxbun {mlxbun.__version__} ({env['revision']})"
    assert out[1] == f"mlx {env['mlx_version']}" and env["mlx_version"]
    assert out[2] == f"mlx-lm {env['mlx_lm_version']}" and env["mlx_lm_version"] == "0.32.2"
    assert out[3] == f"backend {env['backend']}" and env["backend"] in ("cpu", "metal", "cuda")
    assert out[4].startswith(f"device {env['device']}") and len(out) == 5


def test_version_through_the_entry_point_exits_0_before_any_command():
    """`mlxbun --version` as a shell runs it: exit 0, the five lines on stdout, nothing on stderr;
    it wins over a command given after it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for argv in (["--version"], ["--version", "generate"]):
        r = subprocess.run([sys.executable, "-m", "mlxbun", *argv], capture_output=True, text=True, env=env,
                           timeout=120)
        assert r.returncode == 0 and r.stderr == "", r.stderr
        assert r.stdout.startswith(f"mlxbun {mlxbun.__version__} (") and "\nmlx-lm 0.32.2\n" in r.stdout


def test_the_version_is_the_one_pyproject_declares():
    import re

    declared = re.search(r'^version = "([^"]+)"$', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    assert mlxbun.__version__ == declared


def test_a_reader_that_goes_away_is_not_a_traceback():
    """`mlxbun explain llama --json | head -0`: the pipe closes before the output is written."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "mlxbun", "explain", "llama", "--json"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the reader leaves at once
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err
