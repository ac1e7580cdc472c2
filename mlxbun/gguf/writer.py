"""Writing an imported checkpoint: safetensors shards, JSON files, and landing it atomically.

    ShardWriter(dir).add({...}); ShardWriter.close()   model.safetensors, or model-0000i-of-0000n
                                                       shards + model.safetensors.index.json
    write_json(dir, name, obj)
    mlxbun.atomic.replace_dir(built, out)              rename into place (an older `out` is moved
                                                       aside first, then removed)

Everything is written into a temp directory next to the target first (`staging`), so a
failure leaves nothing half-written at the target; one a killed import left is removed by the
next import beside it (`sweep_staging`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Any, Iterator, Optional

__all__ = ["SHARD_BYTES", "ShardWriter", "staging", "sweep_staging", "write_json"]

SHARD_BYTES = 5 * 2**30  # mlx-lm's shard size


class ShardWriter:
    """Accumulates tensors and writes a shard whenever `shard_bytes` is reached."""

    def __init__(self, directory: Path, shard_bytes: int = SHARD_BYTES):
        self.directory, self.shard_bytes = Path(directory), shard_bytes
        self._pending: dict[str, Any] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, arrays: dict[str, Any]) -> None:
        import mlx.core as mx

        mx.eval(*arrays.values())
        for name, array in arrays.items():
            if name in self._pending or any(name in names for _, names in self._shards):
                raise ValueError(f"tensor {name!r} written twice")
            self._pending[name] = array
            self._pending_bytes += array.nbytes
            self.total_bytes += array.nbytes
        if self._pending_bytes >= self.shard_bytes:
            self._flush()

    def _flush(self) -> None:
        import mlx.core as mx

        if not self._pending:
            return
        path = self.directory / f".shard-{len(self._shards):05d}.safetensors"
        mx.save_safetensors(str(path), self._pending, metadata={"format": "mlx"})
        self._shards.append((path, sorted(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Name the shards (model.safetensors when one) and write the index when several."""
        self._flush()
        n = len(self._shards)
        if n == 0:
            raise ValueError("no tensors to write")
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (path, tensors), name in zip(self._shards, names):
            os.replace(path, self.directory / name)
            weight_map.update(dict.fromkeys(tensors, name))
        if n > 1:
            write_json(self.directory, "model.safetensors.index.json",
                       {"metadata": {"total_size": self.total_bytes}, "weight_map": dict(sorted(weight_map.items()))})
        return names


def write_json(directory: Path, name: str, obj: Any) -> None:
    with open(Path(directory) / name, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


STALE_AFTER_S = 24 * 3600  # a staging directory no live process of this host owns: stale after a day
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _staging_prefix(out: Path) -> str:
    return f".{out.name}.import-"


@contextlib.contextmanager
def staging(out: Path) -> Iterator[Path]:
    """An empty temp directory next to `out` (`.NAME.import-PID.HOST-XXXXXXXX`: the importing
    process and a tag of its host), removed on the way out whatever happened (after a successful
    `replace_dir` it is already gone). A killed import cannot remove its own: `sweep_staging`
    does, on the next import beside it."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(out)}{os.getpid()}.{_HOST}-", dir=out.parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process (or not ours to judge): keep its directory
    return True


def _newest_mtime(d: Path) -> float:
    times = [d.lstat().st_mtime]
    with contextlib.suppress(OSError):
        times += [p.lstat().st_mtime for p in d.iterdir()]
    return max(times)


def sweep_staging(out: Path, *, now: Optional[float] = None) -> list[Path]:
    """Remove the staging directories of imports into `out` that died (killed, out of power):
    those of this host whose process is gone, and any other (another host's, or an older
    mlxbun's `.NAME.import-XXXXXXXX`) untouched for `STALE_AFTER_S`. Only real directories whose
    whole name is the importer's pattern for `out` are touched; returns those removed."""
    pattern = re.compile(re.escape(_staging_prefix(out)) + r"(?:(\d+)\.([0-9a-f]{8})-)?[a-z0-9_]{8}")
    now = time.time() if now is None else now
    removed = []
    try:
        entries = list(out.parent.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = pattern.fullmatch(d.name)
        if m is None or d.is_symlink() or not d.is_dir():
            continue
        try:
            if m.group(1) is not None and m.group(2) == _HOST:
                stale = not _alive(int(m.group(1)))
            else:
                stale = now - _newest_mtime(d) > STALE_AFTER_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                removed.append(d)
    return removed


