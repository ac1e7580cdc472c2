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
from typing import Callable

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


def build_once(key_dir: Path, name: str, build: Callable[[Path], None]) -> Path:
    """`key_dir/name`, made by `build(empty_dir)` the first time (under a file lock, in a temp
    dir renamed into place, so concurrent callers wait and a visible checkpoint is complete)."""
    from filelock import FileLock

    final = key_dir / name
    if final.is_dir():
        return final
    key_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(key_dir / f".{name}.lock")):
        if final.is_dir():  # another process built it while we waited
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=key_dir))
        try:
            built = work / name
            built.mkdir()
            build(built)
            os.replace(built, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def cached_checkpoint(
    arch: str, *, quant=None, dtype: str = "float32", seed: int = 0, root=None, head_dim: int | None = None
) -> Path:
    """The checkpoint dir of this variant in the cache `root` (default `$MLXBUN_ZOO_CACHE` or
    ~/.cache/mlxbun/zoo), built on first use. `diffusion_gemma` and `llada2_moe` (graphs whose
    oracle is mlx-vlm, not mlx-lm) come from their own builders."""
    base = Path(root) if root is not None else default_root()
    if arch in ORACLE_VLM_ARCHS:
        if quant is not None or head_dim is not None:
            from mlxbun.zoo.build import ZooArgumentError

            raise ZooArgumentError(f"zoo arch {arch!r} is built in float weights only (no quant / head_dim)")
        return ORACLE_VLM_ARCHS[arch](seed=seed, dtype=dtype, root=base)
    v = variant(arch, quant=quant, dtype=dtype, seed=seed, head_dim=head_dim)
    return build_once(base / zoo_fingerprint(), v.name, lambda out: build_files(v, out))


def _cached_diffusion(*, seed, dtype, root):
    from mlxbun.zoo.diffusion import cached_diffusion_checkpoint

    return cached_diffusion_checkpoint(seed=seed, dtype=dtype, root=root)


def _cached_llada(*, seed, dtype, root):
    from mlxbun.zoo.llada import cached_llada2_checkpoint

    if dtype != "float32":
        from mlxbun.zoo.build import ZooArgumentError

        raise ZooArgumentError("zoo arch 'llada2_moe' is built in float32 only")
    return cached_llada2_checkpoint(seed=seed, root=root)


ORACLE_VLM_ARCHS: dict[str, Callable[..., Path]] = {
    "diffusion_gemma": _cached_diffusion,
    "llada2_moe": _cached_llada,
}
