"""`cached_checkpoint`: build a zoo checkpoint once per cache root, shared by processes.

The key is the variant name under a directory named by a hash of the zoo's own files and the
versions of the libraries that shape the bytes, so an edit to the zoo never serves a stale
build. Concurrent builders (pytest-xdist workers) serialize on a file lock; the build happens in
a temp dir and lands with an atomic rename, so a visible checkpoint is always complete.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import tempfile
from importlib import metadata
from pathlib import Path

from mlxbun.zoo.build import build_files, variant

_VERSIONED = ("mlx", "mlx-lm", "transformers", "tokenizers")


def default_root() -> Path:
    env = os.environ.get("MLXBUN_ZOO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mlxbun" / "zoo"


@functools.lru_cache(maxsize=1)
def zoo_fingerprint() -> str:
    h = hashlib.sha256()
    here = Path(__file__).parent
    for f in sorted(here.iterdir()):
        if f.is_file() and f.suffix in (".py", ".txt", ".jinja"):
            h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for dist in _VERSIONED:
        try:
            version = metadata.version(dist)
        except metadata.PackageNotFoundError:
            version = "-"
        h.update(f"{dist}={version}\0".encode())
    return h.hexdigest()[:16]


def cached_checkpoint(
    arch: str, *, quant=None, dtype: str = "float32", seed: int = 0, root=None, head_dim: int | None = None
) -> Path:
    """The checkpoint dir of this variant in the cache `root` (default `$MLXBUN_ZOO_CACHE` or
    ~/.cache/mlxbun/zoo), built on first use."""
    from filelock import FileLock

    v = variant(arch, quant=quant, dtype=dtype, seed=seed, head_dim=head_dim)
    base = Path(root) if root is not None else default_root()
    key_dir = base / zoo_fingerprint()
    final = key_dir / v.name
    if final.is_dir():
        return final
    key_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(key_dir / f".{v.name}.lock")):
        if final.is_dir():  # another process built it while we waited
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{v.name}.", dir=key_dir))
        try:
            built = work / v.name
            built.mkdir()
            build_files(v, built)
            os.replace(built, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
