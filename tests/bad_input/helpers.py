"""What every bad-input test asserts with: run the real CLI, require a one-line refusal naming the
culprit with no traceback, and fingerprint a directory tree to prove a refusal changed nothing."""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

from mlxbun import cli

ROOT = Path(__file__).resolve().parents[2]


def tree(root: Path) -> dict[str, str]:
    """Every entry under `root`, hidden ones too: a file's sha256 and mode, a link's target, a
    directory. Equal before and after = nothing was written, deleted or changed."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        rel = str(p.relative_to(root))
        if p.is_symlink():
            out[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest() + f" {stat.S_IMODE(p.stat().st_mode):o}"
    return out


def run(capsys, argv: list[str]) -> tuple[int, str, str]:
    """`mlxbun ARGV` in this process: (exit code, stdout, stderr); never a traceback."""
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as e:  # argparse's own errors and --help
        code = e.code or 0
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err, out + err
    return code, out, err


def refused(capsys, argv: list[str], *culprits, code: int = 1) -> str:
    """`mlxbun ARGV` exits `code` with nothing on stdout and one line on stderr naming every
    culprit; returns the line."""
    got, out, err = run(capsys, argv)
    assert got == code, (out, err)
    line = err.strip()
    assert out == "" and "\n" not in line and line.startswith(f"mlxbun {argv[0]}: error: "), err
    for c in culprits:
        assert str(c) in line, (c, line)
    return line


def subprocess_mlxbun(*args: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m mlxbun ARGS` in a fresh process (the real entry point, its exit code and stderr)."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
            **(env or {})}
    return subprocess.run([sys.executable, "-m", "mlxbun", *args], cwd=cwd, env=full, capture_output=True,
                          text=True, timeout=300)
