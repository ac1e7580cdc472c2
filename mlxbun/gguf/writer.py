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

import json
import os
from pathlib import Path
from typing import Any, Optional

from mlxbun.atomic import staging as atomic_staging
from mlxbun.atomic import sweep_staging as atomic_sweep

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


def staging(out: Path):
    """An empty temp directory next to `out` (`.NAME.import-PID.HOST-XXXXXXXX`), removed on the way
    out whatever happened (`mlxbun.atomic.staging`); one a killed import left is removed by
    `sweep_staging` on the next import beside it."""
    return atomic_staging(out.parent, out.name, "import")


def sweep_staging(out: Path, *, now: Optional[float] = None) -> list[Path]:
    """Remove the staging directories of imports into `out` that died (`mlxbun.atomic.sweep_staging`)."""
    return atomic_sweep(out.parent, out.name, "import", now=now)
