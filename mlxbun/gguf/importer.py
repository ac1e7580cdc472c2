"""A GGUF file as a Hugging Face-layout MLX checkpoint directory.

    import_gguf("m.gguf", "out/", dtype="float32", quant="keep")   # `mlxbun import gguf`
    cached_import("m.gguf")                                          # open_model / locate: once per file

The directory holds model.safetensors (+ index when sharded), config.json (the arch's Hugging
Face keys, and mlx-lm's `quantization` block when tensors stay packed), generation_config.json,
the tokenizer files (`mlxbun.gguf.tokenizer.tokenizer_files`) and `gguf_import.json`, the marker
naming the source file, its fingerprint and the options. Everything is checked before a byte
is written (arch, metadata, every tensor placed and readable); the result is written into a
temp directory, checked by mlxbun's coverage and weight audit, then renamed into place.

quant "keep": Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K stay packed (the same bits, MLX
affine group 32: `blocks`), every other type (Q6_K, ...) is dequantized to `dtype`. quant 4 | 8:
those other types are re-quantized (affine, group 64) after the cast; the packed ones stay as
they are. quant "none": every tensor dequantized to `dtype` (nothing packed: the float reference
of a quantized file). F32 / F16 / BF16 tensors are cast to `dtype`, as are the scales and biases
of packed tensors (float32 keeps every type exact; float16 keeps d and m but not the K-quants'
d*sc; bfloat16 rounds). Each tensor's choice, and whether it holds gguf-py's float32
dequantization exactly, is reported (`ImportResult.tensors`, the marker's "tensors").
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

from mlxbun.atomic import replace_dir, unwritable
from mlxbun.gguf.archs import arch_for, hf_name, undo_converter
from mlxbun.gguf.blocks import Packed, exact_in
from mlxbun.gguf.reader import GGUFError, Metadata, fingerprint, open_gguf, read_metadata
from mlxbun.gguf.tensors import DTYPES, FLOAT_TYPES, read_tensor, readable, to_mlx
from mlxbun.gguf.tokenizer import tokenizer_files
from mlxbun.gguf.writer import SHARD_BYTES, ShardWriter, staging, sweep_staging, write_json

__all__ = ["DEFAULT_DTYPE", "MARKER", "QUANTS", "ImportResult", "cache_root", "cached_import", "import_gguf"]

# float32: exact for packed scales and by far the fastest on MLX's CPU backend (quantized
# matmuls with half-precision scales run 10-40x slower there)
DEFAULT_DTYPE = "float32"
QUANTS = ("keep", "none", "4", "8")
MARKER = "gguf_import.json"


@dataclass
class ImportResult:
    out: Path
    arch: str
    model_type: str
    dtype: str
    quant: str
    packed: int = 0  # tensors kept with their GGML bits
    dequantized: int = 0  # GGML-quantized tensors made float (then maybe quantized by --quant)
    floats: int = 0  # F32 / F16 / BF16 tensors
    requantized: int = 0  # of those two, quantized by --quant 4|8 (affine, group 64)
    files: list[str] = field(default_factory=list)
    tokenizer: bool = False
    seconds: float = 0.0
    swept: list[Path] = field(default_factory=list)  # stale staging directories of killed imports removed
    # per tensor: {"name": GGUF name, "type": GGML type, "as": what it became, "exact": whether it
    # holds gguf-py's float32 dequantization (packed: its scales and biases survive `dtype`)}
    tensors: list[dict] = field(default_factory=list)

    def summary(self) -> list[str]:
        """One line per (GGML type, choice): `Q4_K -> packed 4-bit g32, exact: 169`."""
        counts = Counter((t["type"], t["as"], t["exact"]) for t in self.tensors)
        return [f"{k} -> {how}, {'exact' if ok else 'rounded'}: {n}" for (k, how, ok), n in sorted(counts.items())]


@lru_cache(maxsize=1)
def importer_version() -> str:
    """A hash of this package's sources and the libraries that shape the bytes: a changed
    importer never serves a stale cached import."""
    from importlib import metadata

    h = hashlib.sha256()
    for f in sorted(Path(__file__).parent.glob("*.py")):
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    for dist in ("gguf", "mlx"):
        try:
            h.update(f"{dist}={metadata.version(dist)}\0".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=-\0".encode())
    return h.hexdigest()[:16]


def _options(dtype: str, quant: Union[str, int]) -> tuple[str, str]:
    quant = str(quant)
    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if quant not in QUANTS:
        raise GGUFError(f"quant {quant!r} is not one of {', '.join(QUANTS)}")
    return dtype, quant


def _read_marker(out: Path) -> Optional[dict]:
    try:
        return json.loads((out / MARKER).read_text())
    except (OSError, ValueError):
        return None


def _check_out_path(out: Path) -> None:
    """`out` can be (or already is) a directory: checked before the GGUF file is read."""
    if out.parent == out:
        raise GGUFError(f"--out {out}: the root directory cannot be replaced by an import; name a directory")
    if out.exists() and not out.is_dir():
        raise GGUFError(f"--out {out}: exists and is not a directory")
    if not out.is_dir() and (why := unwritable(out)):
        raise GGUFError(f"--out {out}: cannot be created: {why}")


def _check_out(out: Path, fp: dict, force: bool) -> None:
    if not out.is_dir() or not any(out.iterdir()) or force:
        return
    marker = _read_marker(out)  # the same file: size and header (a touched copy is the same file)
    same = marker is not None and isinstance(marker.get("fingerprint"), dict) and all(
        marker["fingerprint"].get(k) == fp[k] for k in ("size", "header_sha256"))
    if not same:
        raise GGUFError(f"--out {out}: not empty and not an import of this file (--force replaces it)")


def _plan(reader, meta: Metadata):
    """(arch, config, [(tensor, hf name)]): every refusal happens here, before writing."""
    arch = arch_for(meta)
    tensors = {t.name: t for t in reader.tensors}
    cfg = arch.config(meta, tensors)
    placed, unplaced = [], []
    for t in reader.tensors:
        if t.name in arch.into_config:
            continue
        name = hf_name(arch, t.name, cfg["num_hidden_layers"])
        if name is None:
            unplaced.append(t.name)
            continue
        if why := readable(t):
            raise GGUFError(f"{meta.path}: tensor {t.name!r}: {why}")
        placed.append((t, name))
    if unplaced:
        shown = ", ".join(repr(n) for n in unplaced[:8]) + (f" and {len(unplaced) - 8} more" if len(unplaced) > 8 else "")
        raise GGUFError(f"{meta.path}: {len(unplaced)} tensor(s) have no place in a {arch.gguf} checkpoint: {shown}")
    return arch, cfg, placed


def _choice(name: str, kind: str, value, spec, written, dtype: str) -> dict:
    """What GGUF tensor `name` became (see `ImportResult.tensors`)."""
    import mlx.core as mx

    if isinstance(value, Packed):
        how, exact = f"packed {value.bits}-bit g{value.group_size}", exact_in(value, dtype)
    elif spec is not None:
        how, exact = f"requantized {spec[0]}-bit g{spec[1]}", False
    else:
        how = f"{'float' if kind in FLOAT_TYPES else 'dequantized'} {dtype}"
        exact = dtype == "float32" or bool(mx.array_equal(written.astype(mx.float32), mx.array(value)))
    return {"name": name, "type": kind, "as": how, "exact": exact}


def _quantization_block(specs: dict[str, Optional[tuple[int, int]]]) -> Optional[dict]:
    """mlx-lm's `quantization` block: the commonest packing as the default, every other
    module named (False: left float)."""
    packed = [s for s in specs.values() if s]
    if not packed:
        return None
    (bits, group), _ = Counter(packed).most_common(1)[0]
    block: dict[str, Any] = {"group_size": group, "bits": bits, "mode": "affine"}
    for module, spec in sorted(specs.items()):
        if spec is None:
            block[module] = False
        elif spec != (bits, group):
            block[module] = {"group_size": spec[1], "bits": spec[0], "mode": "affine"}
    return block


def _generation_config(meta: Metadata) -> dict:
    out: dict[str, Any] = {}
    if (bos := meta.opt("tokenizer.ggml.bos_token_id", int)) is not None:
        out["bos_token_id"] = bos
    eos = [meta.opt(f"tokenizer.ggml.{k}_token_id", int) for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(e for e in eos if e is not None))
    if eos:
        out["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if (pad := meta.opt("tokenizer.ggml.padding_token_id", int)) is not None:
        out["pad_token_id"] = pad
    return out


def _self_check(built: Path) -> None:
    """The checkpoint passes mlxbun's coverage and weight audit (headers only), or nothing lands
    (what `factory.check_target_coverage` and `audit_dry_run` check; factory imports this module)."""
    from mlxbun.config import load_model_config
    from mlxbun.errors import MlxbunError
    from mlxbun.models.universal.coverage import require_coverage
    from mlxbun.models.universal.loader import audit_checkpoint
    from mlxbun.profile import resolve_model_profile, validate_profile

    try:
        config = load_model_config(built)
        validate_profile(resolve_model_profile(config, built))
        require_coverage(config.model_type, dict(config.raw))
        audit_checkpoint(built, config)
    except MlxbunError as e:
        raise GGUFError(f"the imported checkpoint fails mlxbun's own checks: {e}") from None


def import_gguf(path: Union[str, os.PathLike], out: Union[str, os.PathLike], *, dtype: str = DEFAULT_DTYPE,
                quant: Union[str, int] = "keep", force: bool = False, shard_bytes: int = SHARD_BYTES,
                reader=None) -> ImportResult:
    """Import `path` into directory `out` (see the module docstring). An existing non-empty `out`
    is replaced only when it is an import of the same file (its marker) or with `force`."""
    start = time.perf_counter()
    dtype, quant = _options(dtype, quant)
    path, out = Path(path).expanduser(), Path(os.path.abspath(Path(out).expanduser()))  # `.`, `..`: named
    _check_out_path(out)
    reader = reader if reader is not None else open_gguf(path)
    fp = fingerprint(path, reader)
    _check_out(out, fp, force)
    meta = Metadata(read_metadata(reader), path)
    arch, cfg, placed = _plan(reader, meta)
    res = ImportResult(out=out, arch=arch.gguf, model_type=cfg["model_type"], dtype=dtype, quant=quant)
    bits = int(quant) if quant.isdigit() else None
    tokenizer = tokenizer_files(meta)  # before writing: a tokenizer it cannot rebuild refuses here
    res.swept = sweep_staging(out)  # what killed imports into `out` left behind
    with staging(out) as work:
        built = work / out.name
        built.mkdir()
        shards = ShardWriter(built, shard_bytes)
        specs: dict[str, Optional[tuple[int, int]]] = {}
        for t, name in placed:
            kind = t.tensor_type.name
            try:
                value = undo_converter(arch, t.name, read_tensor(t, path=str(path), unpack=quant == "none"), cfg)
                arrays, spec = to_mlx(name, value, dtype=dtype, quant=bits, quantizable=True)
            except GGUFError as e:
                raise GGUFError(f"{path}: {e}") from None
            shards.add(arrays)
            if name.endswith(".weight") and arrays[name].ndim == 2:
                specs[name[: -len(".weight")]] = spec
            res.tensors.append(_choice(t.name, kind, value, spec, arrays[name], dtype))
            if isinstance(value, Packed):
                res.packed += 1
            else:
                res.floats += kind in FLOAT_TYPES
                res.dequantized += kind not in FLOAT_TYPES
                res.requantized += spec is not None
        res.files = shards.close()
        cfg["torch_dtype"] = dtype
        if (block := _quantization_block(specs)) is not None:
            cfg["quantization"] = block
            cfg["quantization_config"] = block
        write_json(built, "config.json", cfg)
        write_json(built, "generation_config.json", _generation_config(meta))
        for name, obj in tokenizer.items():
            write_json(built, name, obj)
        res.tokenizer = bool(tokenizer)
        write_json(built, MARKER, {
            "source": str(path.resolve()), "fingerprint": fp, "dtype": dtype, "quant": quant,
            "arch": arch.gguf, "importer": importer_version(), "tensors": res.tensors})
        _self_check(built)
        replace_dir(built, out)
    res.seconds = time.perf_counter() - start
    return res


# ------------------------------------------------------------------ the cache


def cache_root(root=None) -> Path:
    """`root`, else $MLXBUN_GGUF_CACHE, else ~/.cache/mlxbun/gguf."""
    if root is not None:
        return Path(root).expanduser()
    env = os.environ.get("MLXBUN_GGUF_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mlxbun" / "gguf"


def cached_import(path: Union[str, os.PathLike], *, root=None, dtype: str = DEFAULT_DTYPE,
                  quant: Union[str, int] = "keep") -> Path:
    """The checkpoint directory of GGUF file `path`, imported on first use into the cache.

    Keyed by the file's fingerprint (size, mtime and the sha256 of its header), the options and
    the importer's version: `<root>/<file stem>-<key>`. Concurrent callers wait on a file lock;
    a visible directory is always complete."""
    from filelock import FileLock

    dtype, quant = _options(dtype, quant)
    path = Path(path).expanduser().resolve()
    reader = open_gguf(path)
    key = json.dumps({"file": fingerprint(path, reader), "dtype": dtype, "quant": quant,
                      "importer": importer_version()}, sort_keys=True)
    final = cache_root(root) / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    if (final / MARKER).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(final.parent / f".{final.name}.lock")):
        if not (final / MARKER).is_file():  # another process may have imported it meanwhile
            import_gguf(path, final, dtype=dtype, quant=quant, force=True, reader=reader)
    return final
