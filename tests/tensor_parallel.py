"""Launching mlxbun across ranks from a test: `mlx.launch -n N --backend ring` on this CPU.

Every launch gets ports no other launch of this run uses (each pytest-xdist worker its own range,
each probed free), the run's zoo and GGUF caches through the environment, and a bounded time.
The ring backend runs the ranks as local processes talking TCP over loopback.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]  # the tree under test (an editable install may point elsewhere)
LAUNCH_TIMEOUT_S = 600
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_NEXT = itertools.count(0)


def _free(port: int, n: int) -> bool:
    for p in range(port, port + n):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", p))
            except OSError:
                return False
    return True


def free_ports(n: int) -> int:
    """A first port of n consecutive free ones, in this xdist worker's own range."""
    for _ in range(200):
        port = 45000 + 2000 * _WORKER + 16 * (next(_NEXT) % 120)
        if _free(port, n):
            return port
    raise RuntimeError("no free ports for the ring backend")


def launch(args: list[str], *, ranks: int = 2, env: dict | None = None,
           timeout: float = LAUNCH_TIMEOUT_S) -> subprocess.CompletedProcess:
    """`mlx.launch -n ranks --backend ring .venv/bin/mlxbun ARGS` (output captured as text)."""
    cmd = [str(BIN / "mlx.launch"), "-n", str(ranks), "--backend", "ring",
           "--starting-port", str(free_ports(ranks)), "--python", sys.executable,
           str(BIN / "mlxbun"), *args]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": path, **(env or {})})


def failed_ranks(done: subprocess.CompletedProcess) -> dict[int, int]:
    """{rank: exit code} of the ranks that exited non-zero. mlx.launch itself exits 0 whatever
    its ranks do; it says so on stderr ("Node with rank R exited with code C")."""
    return {int(r): int(c) for r, c in re.findall(r"Node with rank (\d+) exited with code (-?\d+)", done.stderr)
            if int(c) != 0}


def launch_json(args: list[str], **kwargs):
    """The one JSON document rank 0 prints (the other ranks print nothing)."""
    done = launch([*args, "--json"], **kwargs)
    out = done.stdout.strip()
    if not out:
        raise AssertionError(f"no output (ranks failed: {failed_ranks(done)}); stderr:\n{done.stderr[-3000:]}")
    return json.loads(out), done


class FakeGroup:
    """What the split checks (and the in-place splits, which read the rank) read of a group before
    any communication: tests of a split without a launch."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank
