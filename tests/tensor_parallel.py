"""Launching mlxbun across ranks from a test: `mlx.launch -n N --backend ring` on this CPU.

Every launch gets ports no other launch of this run uses (each pytest-xdist worker its own range,
each probed free), the run's zoo and GGUF caches through the environment, this tree's mlxbun
first on the path, and a bounded time. The ring backend runs the ranks as local processes talking
TCP over loopback. Also what the tensor-parallel test files share: one launch for every xdist
worker (`launch_json_once`), the assertions on a tp-check row, whether mlx-lm's file shards, and a
stand-in group for the checks that run without a launch.
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

import pytest

BIN = Path(sys.executable).parent
ROOT = Path(__file__).resolve().parents[1]  # the tree under test (an editable install may point elsewhere)
LAUNCH_TIMEOUT_S = 600
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_NEXT = itertools.count(0)
# the end of a refusal of a split off whole quantization groups of 64 over 2 ranks
GROUPS_OF_64 = ("not whole quantization groups of 64 (tensor-parallel group of 2); a smaller group or fewer "
                "ranks split it")


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


def once(shared: Path, key: str, make):
    """`make()`'s JSON-able result, computed once for every pytest-xdist worker of the run: a
    module's fixture runs in each worker that runs one of its tests, so the first worker to ask
    computes it (a launch, say) and leaves it under `shared` (the conftest's `run_tmp`), the others
    wait on the lock and read it. A failure leaves nothing: the next asker tries again."""
    from filelock import FileLock

    out = Path(shared) / f"tp-{key}.json"
    with FileLock(f"{out}.lock"):
        if not out.is_file():
            out.write_text(json.dumps(make()))
        return json.loads(out.read_text())


def launch_json_once(shared: Path, key: str, args: list[str], **kwargs):
    """`launch_json(args)`'s document, launched once for every worker of the run (`once`)."""
    return once(shared, key, lambda: launch_json(args, **kwargs)[0])


def named_report(run_tmp: Path, key: str, zoo_root: Path, targets: list[str], off_zoo: dict[str, Path]) -> dict:
    """{target: tp-check row} of one 2-rank launch over `targets` and the off-zoo checkpoints (launched once
    for every xdist worker), an off-zoo row under its name in `off_zoo` rather than its path."""
    rows = launch_json_once(run_tmp, key, ["tp-check", *targets, *map(str, off_zoo.values())],
                            env={"MLXBUN_ZOO_CACHE": str(zoo_root)})
    names = {str(path): name for name, path in off_zoo.items()}
    return {names.get(r["target"], r["target"]): r for r in rows}


def mlxlm_has_shard(path: Path) -> bool:
    """Whether mlx-lm's model file for the checkpoint at `path` has `shard()` (then tp-check holds
    mlxbun's split to its split bit for bit)."""
    from mlx_lm.utils import _get_classes

    config = json.loads((Path(path) / "config.json").read_text())
    return hasattr(_get_classes(config)[0], "shard")


def assert_split_holds(r: dict) -> None:
    """A tp-check row that passed as `mlxbun.parallel.check` states the hold: float32 activations
    (quantized weights too) every greedy id equal, logits within 2^-17 of the largest; half
    precision within twice its own drift from float32, the ids equal up to a tie inside that. And
    split for real: the reordered sums moved some bits."""
    assert r["status"] == "pass", r["reason"]
    if r["dtype"] == "float32":
        assert r["tokens_equal"] and r["tie_at"] is None, r
        assert r["tolerance"] == pytest.approx(2.0 ** -17 * r["max_abs_logit"])
    else:
        assert 0 < r["noise_floor"] and r["tolerance"] == pytest.approx(2 * r["noise_floor"])
        assert r["tokens_equal"] or r["tie_at"] is not None, r
    assert 0 < r["max_abs_diff"] <= r["tolerance"], r


def param_shapes(module) -> dict:
    """{parameter path: shape} of a module: what a refused split must leave as it was."""
    from mlx.utils import tree_flatten

    return {k: v.shape for k, v in tree_flatten(module.parameters())}


class FakeGroup:
    """What the split checks (and the in-place splits, which read the rank) read of a group before
    any communication: tests of a split without a launch."""

    def __init__(self, size: int, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank
