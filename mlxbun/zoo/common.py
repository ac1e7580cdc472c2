"""What every zoo builder shares: the variant record and its checks, landing a build in place,
and the cache (root, fingerprint, build-once). Imports no other zoo module, so every builder
can use it and the registry can import every builder.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Callable

from mlxbun.atomic import replace_dir, staging_dir, sweep_staging
from mlxbun.errors import MlxbunError

DTYPES = {"float32": "", "float16": "fp16", "bfloat16": "bf16"}  # dtype -> name suffix
QUANTS = (None, 4, 8, "mixed", "mxfp4")
REPO_ORG = "mlxbun"
# the libraries whose versions shape a build's bytes (part of the cache key)
_VERSIONED = ("mlx", "mlx-lm", "transformers", "tokenizers")


class ZooArgumentError(MlxbunError, ValueError):
    """A zoo variant argument (quant, dtype, seed, head_dim, layout) is not one the zoo builds."""


@dataclass(frozen=True)
class Variant:
    """A validated (arch, quant, dtype, seed, head_dim) and its checkpoint name."""

    arch: str
    quant: int | str | None
    dtype: str
    seed: int
    head_dim: int | None = None  # a wider head than the zoo's 16 (quantized KV needs >= 32)

    @property
    def name(self) -> str:
        parts = [f"tiny-{self.arch}"]
        if self.head_dim is not None:
            parts.append(f"hd{self.head_dim}")
        if DTYPES[self.dtype]:
            parts.append(DTYPES[self.dtype])
        if self.quant is not None:
            parts.append(f"q{self.quant}")
        if self.seed:
            parts.append(f"s{self.seed}")
        return "-".join(parts)

    @property
    def repo_id(self) -> str:
        return f"{REPO_ORG}/{self.name}"


def parse_quant(quant) -> int | str | None:
    """None, 4, 8, "mixed" or "mxfp4" (the strings "4"/"8"/"none" are accepted too, as on the CLI)."""
    if quant is None or quant == "none":
        return None
    if isinstance(quant, str) and quant.strip().isdigit():
        quant = int(quant)
    if quant in QUANTS and not isinstance(quant, bool):
        return quant
    raise ZooArgumentError(f"unknown quant {quant!r}; choose one of: none, 4, 8, mixed, mxfp4")


def check_dtype_and_seed(dtype, seed) -> None:
    if dtype not in DTYPES:
        raise ZooArgumentError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ZooArgumentError(f"seed must be a non-negative integer, got {seed!r}")


# ------------------------------------------------------------------ landing a build

# Written into every directory the zoo builds: the names of the files it wrote there. A rebuild
# replaces a directory only when it carries this marker and holds nothing else.
MARKER = ".mlxbun-zoo.json"


def write_marker(built: Path) -> None:
    files = sorted(p.name for p in built.iterdir())
    doc = {"built_by": "mlxbun zoo", "files": files}
    (built / MARKER).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def _marked_files(path: Path) -> set[str] | None:
    """The files the zoo's marker in `path` lists, or None when there is no readable marker."""
    try:
        doc = json.loads((path / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    files = doc.get("files") if isinstance(doc, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    return set(files)


def check_out_dir(out_dir: Path) -> None:
    """Refuse an output directory that is a file (or lies under one)."""
    for p in (out_dir, *out_dir.parents):
        if p.is_dir():
            return
        if p.exists() or p.is_symlink():
            what = "is a file" if p == out_dir else f"lies under {p}, which is a file"
            raise ZooArgumentError(f"output directory {out_dir} {what}, not a directory")


def check_replaceable(final: Path) -> None:
    """Refuse to replace `final` unless it is absent or a zoo build holding only the zoo's files."""
    if not (final.exists() or final.is_symlink()):
        return
    if final.is_symlink() or not final.is_dir():
        raise ZooArgumentError(f"{final} exists and is not a directory the zoo built: "
                               "move it away or build into another directory")
    written = _marked_files(final)
    if written is None:
        raise ZooArgumentError(f"{final} exists and was not built by the zoo (no {MARKER} in it); "
                               "the zoo replaces only its own builds: move it away or build into another directory")
    others = sorted(set(os.listdir(final)) - written - {MARKER})
    if others:
        raise ZooArgumentError(f"{final} holds files the zoo did not write ({', '.join(others)}): "
                               "move them away before rebuilding, or build into another directory")


def _land_in_place(built: Path, out_dir: Path) -> Path:
    final = out_dir / built.name
    check_replaceable(final)  # again: it may have changed while building
    write_marker(built)
    replace_dir(built, final)
    return final


def build_into(out_dir, name: str, build: Callable[[Path], None],
               land: Callable[[Path, Path], Path] | None = None) -> Path:
    """Run `build(empty_dir)` in a temp dir under `out_dir`, then `land(built, out_dir)` it
    (default: as `out_dir/name` with the zoo's marker, replacing only an earlier zoo build that
    holds nothing else). Nothing half-built is left behind (the staging directory a killed build
    left is swept by the next build of `name` there); a refusal comes before any build."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    if land is None:
        check_replaceable(out_dir / name)
        land = _land_in_place
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        sweep_staging(out_dir, name, "build")  # what killed builds of `name` left behind
        work = staging_dir(out_dir, name, "build")
    except OSError as e:
        raise ZooArgumentError(f"cannot write into output directory {out_dir}: {e.strerror or e}") from None
    try:
        built = work / name
        built.mkdir()
        build(built)
        return land(built, out_dir)
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------ the cache


def cache_root(root=None) -> Path:
    """`root`, else $MLXBUN_ZOO_CACHE, else ~/.cache/mlxbun/zoo."""
    if root is not None:
        return Path(root)
    env = os.environ.get("MLXBUN_ZOO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "mlxbun" / "zoo"


@functools.lru_cache(maxsize=1)
def zoo_fingerprint() -> str:
    """A hash of the zoo package's own files and the versions of the libraries that shape the
    bytes: an edit to the zoo never serves a stale build."""
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


def graph_fingerprint(graph_source: Path) -> str:
    """The zoo fingerprint plus the source of the mlxbun graph a builder initializes its
    weights from (builders whose weights come from mlxbun's own graph, not mlx-lm's): one
    module, or every module of a package directory."""
    source = Path(graph_source)
    files = sorted(source.glob("*.py")) if source.is_dir() else [source]
    data = (zoo_fingerprint() + "\0").encode() + b"".join(f.read_bytes() for f in files)
    return hashlib.sha256(data).hexdigest()[:16]


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
        sweep_staging(key_dir, name, "build")
        work = staging_dir(key_dir, name, "build")
        try:
            built = work / name
            built.mkdir()
            build(built)
            write_marker(built)
            os.replace(built, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
