"""Safetensors checkpoints: header-only index and lazy load.

Every header is validated in Python before mlx opens the file, so a corrupt or
hostile checkpoint becomes a `WeightsError` naming the file (and tensor), never
a crash inside mlx's C++ loader. Checking a graph against the tensors is
`mlxbun.weight_audit`; a checkpoint's hub identity is `mlxbun.snapshot_identity`;
packed-weight bit counts are `mlxbun.quant`.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import mlx.core as mx

from mlxbun.errors import WeightsError
from mlxbun.quant import logical_parameters

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# The safetensors reference implementation refuses larger headers; so do we.
MAX_HEADER_BYTES = 100_000_000
# mlx shapes are int32.
_MAX_DIM = 2**31 - 1

# Every dtype code the safetensors format defines, with its width in bits.
SAFETENSORS_DTYPE_BITS: Mapping[str, int] = MappingProxyType({
    "BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6,
    "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8, "F8_E5M2FNUZ": 8,
    "I16": 16, "U16": 16, "F16": 16, "BF16": 16,
    "I32": 32, "U32": 32, "F32": 32,
    "C64": 64, "F64": 64, "I64": 64, "U64": 64,
})

# The codes mlx's loader accepts, and the dtype it gives them (fp8 stays raw bytes).
SAFETENSORS_TO_MX: Mapping[str, mx.Dtype] = MappingProxyType({
    "BOOL": mx.bool_, "U8": mx.uint8, "I8": mx.int8, "U16": mx.uint16,
    "I16": mx.int16, "U32": mx.uint32, "I32": mx.int32, "U64": mx.uint64,
    "I64": mx.int64, "F16": mx.float16, "BF16": mx.bfloat16, "F32": mx.float32,
    "C64": mx.complex64, "F8_E4M3": mx.uint8, "F8_E8M0": mx.uint8,
})

# mlx dtype -> the code mx.save_safetensors writes for it.
MX_TO_SAFETENSORS: Mapping[mx.Dtype, str] = MappingProxyType({
    mx.bool_: "BOOL", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16",
    mx.int16: "I16", mx.uint32: "U32", mx.int32: "I32", mx.uint64: "U64",
    mx.int64: "I64", mx.float16: "F16", mx.bfloat16: "BF16", mx.float32: "F32",
    mx.float64: "F64", mx.complex64: "C64",
})

_MX_NAMES = {_d: str(_d).rsplit(".", 1)[-1] for _d in MX_TO_SAFETENSORS}


def dtype_name(dtype: Any) -> str:
    """Canonical name for comparing dtypes: the mlx dtype name mlx would load it as.

    Accepts an `mx.Dtype`, a safetensors code ("BF16") or an mlx name
    ("bfloat16"). Codes mlx cannot load (e.g. "F8_E5M2") stay as the code.
    """
    if isinstance(dtype, mx.Dtype):
        return _MX_NAMES[dtype]
    if isinstance(dtype, str):
        if dtype in SAFETENSORS_TO_MX:
            return _MX_NAMES[SAFETENSORS_TO_MX[dtype]]
        if dtype in SAFETENSORS_DTYPE_BITS or dtype in _MX_NAMES.values():
            return dtype
    raise ValueError(f"not a dtype: {dtype!r}")


def name_list(names: Sequence[str], limit: int = 10) -> str:
    """'a, b, c' or 'a, ..., j and 5 more' for error messages."""
    names = list(names)
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown} and {len(names) - limit} more"


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as its file's header describes it; no data is read."""

    name: str
    file: Path
    dtype: str  # safetensors code, e.g. "BF16"
    shape: tuple[int, ...]
    offsets: tuple[int, int]  # absolute [start, end) byte range in `file`

    @property
    def nbytes(self) -> int:
        return self.offsets[1] - self.offsets[0]

    @property
    def size(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def mx_dtype(self) -> mx.Dtype | None:
        """The dtype mlx loads this tensor as, or None when mlx cannot load it."""
        return SAFETENSORS_TO_MX.get(self.dtype)


# ----------------------------------------------------------------- header parsing


def _json_object_no_dupes(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dupes = [k for k, _ in pairs if k in seen or seen.add(k)]
        raise ValueError(f"duplicate key(s) {name_list(dupes)}")
    return obj


def _reject_constant(token: str) -> None:
    # Python's json accepts NaN/Infinity; JSON (and mlx's parser) does not.
    raise ValueError(f"invalid JSON constant {token}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _utf8_ok(s: str) -> bool:
    # json accepts lone surrogate escapes ("\ud800") that mlx's parser rejects.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def read_safetensors_header(path: str | os.PathLike) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and validate one file's header; return (tensors by name, `__metadata__`)."""
    file = Path(path)
    try:
        size = file.stat().st_size
        with open(file, "rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                what = "empty" if not prefix else f"only {len(prefix)} bytes"
                raise WeightsError(f"{file}: not a safetensors file ({what}; the 8-byte header length is missing)")
            (hlen,) = struct.unpack("<Q", prefix)
            if hlen > MAX_HEADER_BYTES:
                raise WeightsError(f"{file}: header length {hlen} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + hlen > size:
                raise WeightsError(f"{file}: header length {hlen} runs past the end of the file ({size} bytes)")
            raw = f.read(hlen)
    except OSError as e:
        raise WeightsError(f"{file}: cannot read: {e.strerror or e}") from e
    if len(raw) != hlen:
        raise WeightsError(f"{file}: file shrank while reading its header")
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_json_object_no_dupes,
                            parse_constant=_reject_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise WeightsError(f"{file}: header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{file}: header is a JSON {type(header).__name__}, not an object")

    data_start = 8 + hlen
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(
        isinstance(v, str) and _utf8_ok(k) and _utf8_ok(v) for k, v in metadata.items()
    ):
        raise WeightsError(f"{file}: __metadata__ must map strings to strings")

    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        tensors[name] = _tensor_info(file, name, entry, data_start, size)
    _check_overlaps(file, tensors.values())
    return tensors, dict(metadata)


def _tensor_info(file: Path, name: str, entry: Any, data_start: int, size: int) -> TensorInfo:
    where = f"{file}: tensor {name!r}"
    if not _utf8_ok(name):
        raise WeightsError(f"{file}: tensor name {name!r} is not valid UTF-8")
    if not isinstance(entry, dict):
        raise WeightsError(f"{where}: entry is a JSON {type(entry).__name__}, not an object")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in entry]
    if missing:
        raise WeightsError(f"{where}: entry lacks {', '.join(missing)}")
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str):
        raise WeightsError(f"{where}: dtype must be a string, got {dtype!r}")
    if dtype not in SAFETENSORS_DTYPE_BITS:
        raise WeightsError(f"{where}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise WeightsError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) and o >= 0 for o in offs)):
        raise WeightsError(f"{where}: data_offsets must be two non-negative integers, got {offs!r}")
    begin, end = offs
    if begin > end:
        raise WeightsError(f"{where}: data_offsets {offs} end before they begin")
    nbytes = _nbytes(shape, SAFETENSORS_DTYPE_BITS[dtype], cap=end - begin)
    if nbytes != end - begin:
        need = "a fractional number of" if nbytes is None else (f"more than {end - begin}" if nbytes < 0 else nbytes)
        raise WeightsError(
            f"{where}: shape {tuple(shape)} x {dtype} needs {need} bytes "
            f"but data_offsets {offs} span {end - begin}"
        )
    if data_start + end > size:
        raise WeightsError(
            f"{where}: data_offsets {offs} run past the end of the file "
            f"(data section is {size - data_start} bytes)"
        )
    return TensorInfo(name, file, dtype, tuple(shape), (data_start + begin, data_start + end))


def _nbytes(shape: list[int], bits: int, cap: int) -> int | None:
    """Bytes a shape needs; -1 once past `cap` (so hostile dims cannot make huge ints), None if not whole."""
    if 0 in shape:
        return 0
    total = bits
    for d in shape:
        total *= d
        if total > 8 * cap:
            return -1
    return None if total % 8 else total // 8


def _check_overlaps(file: Path, infos: Iterable[TensorInfo]) -> None:
    ranges = sorted((t.offsets, t.name) for t in infos if t.nbytes)
    for (prev, prev_name), (cur, cur_name) in zip(ranges, ranges[1:]):
        if cur[0] < prev[1]:
            raise WeightsError(f"{file}: tensors {prev_name!r} and {cur_name!r} overlap")


# ----------------------------------------------------------------- the index


@dataclass(frozen=True)
class WeightIndex:
    """Every tensor of a checkpoint, from headers only."""

    root: Path  # the checkpoint directory (a single file's parent)
    files: tuple[Path, ...]
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[Path, Mapping[str, str]]  # each file's __metadata__
    index_metadata: Mapping[str, Any] = field(default_factory=dict)  # the index json's "metadata"

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def __len__(self) -> int:
        return len(self.tensors)

    def __getitem__(self, name: str) -> TensorInfo:
        return self.tensors[name]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def num_parameters(self, quantization: Mapping | None = None) -> int:
        """Parameter count with packed weights unpacked (`mlxbun.quant.logical_parameters`).

        `quantization` is mlx-lm's config["quantization"]; when None it is read from the
        checkpoint's config.json if there is one.
        """
        if quantization is None:
            quantization = _config_quantization(self.root)
        return logical_parameters(self.tensors, quantization)

    def load(self, names: Iterable[str] | None = None) -> dict[str, mx.array]:
        """Lazily load the named tensors (all when None); only their files are opened."""
        wanted = list(self.tensors) if names is None else list(names)
        unknown = [n for n in wanted if n not in self.tensors]
        if unknown:
            raise WeightsError(f"{self.root}: no tensor(s) named {name_list(unknown)}")
        by_file: dict[Path, list[str]] = {}
        for n in wanted:
            by_file.setdefault(self.tensors[n].file, []).append(n)
        out: dict[str, mx.array] = {}
        for file, file_names in by_file.items():
            out.update(self._load_file(file, file_names))
        return out

    def _load_file(self, file: Path, names: list[str]) -> dict[str, mx.array]:
        # mx.load parses the whole header, so every tensor in the file must suit mlx.
        for t in self.tensors.values():
            if t.file != file:
                continue
            if t.mx_dtype is None:
                raise WeightsError(f"{file}: tensor {t.name!r} has dtype {t.dtype}, which mlx cannot load")
            if any(d > _MAX_DIM for d in t.shape):
                raise WeightsError(f"{file}: tensor {t.name!r} has a dimension beyond mlx's int32 shapes: {t.shape}")
        try:
            arrays = mx.load(str(file), format="safetensors")
        except (RuntimeError, ValueError, OSError) as e:
            raise WeightsError(f"{file}: mlx could not load it: {e}") from e
        out = {}
        for n in names:
            info, a = self.tensors[n], arrays.get(n)
            if a is None or tuple(a.shape) != info.shape or a.dtype != info.mx_dtype:
                raise WeightsError(f"{file}: tensor {n!r} changed since its header was read")
            out[n] = a
        return out


def _shard_files(directory: Path) -> tuple[list[Path], dict[str, str] | None, dict]:
    """The files of a checkpoint directory, plus its weight_map when it has an index."""
    index_file = directory / INDEX_FILE
    if index_file.is_file():
        return _read_shard_index(index_file)
    single = directory / SINGLE_FILE
    if single.is_file():
        return [single], None, {}
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise WeightsError(f"{directory}: no *.safetensors files")
    return files, None, {}


def _read_shard_index(index_file: Path) -> tuple[list[Path], dict[str, str], dict]:
    try:
        doc = json.loads(index_file.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise WeightsError(f"{index_file}: unreadable shard index: {e}") from None
    wmap = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(wmap, dict) or not all(isinstance(v, str) for v in wmap.values()):
        raise WeightsError(f"{index_file}: 'weight_map' must be an object mapping tensor names to file names")
    meta = doc.get("metadata")
    meta = meta if isinstance(meta, dict) else {}
    directory = index_file.parent
    files, absent, escaping = [], [], []
    for fname in sorted(set(wmap.values())):
        rel = Path(fname)
        if rel.is_absolute() or ".." in rel.parts or not fname:
            escaping.append(fname)
        elif not (directory / rel).is_file():
            absent.append(fname)
        else:
            files.append(directory / rel)
    if escaping:
        raise WeightsError(f"{index_file}: weight_map names files outside the checkpoint: {name_list(escaping)}")
    if absent:
        users = [n for n, f in wmap.items() if f in absent]
        raise WeightsError(
            f"{index_file}: weight_map names missing file(s) {name_list(absent)} "
            f"(for tensors {name_list(users)})"
        )
    return files, wmap, meta


def read_index(path: str | os.PathLike) -> WeightIndex:
    """Index a checkpoint directory, a single .safetensors file, or a shard index json.

    In a directory: `model.safetensors.index.json` when present (validated
    against the shard headers), else `model.safetensors`, else every
    `*.safetensors` sorted by name. Only headers are read.
    """
    p = Path(path)
    if p.is_dir():
        root = p
        files, wmap, index_meta = _shard_files(p)
    elif p.is_file():
        root = p.parent
        if p.name.endswith(".index.json"):
            files, wmap, index_meta = _read_shard_index(p)
        else:
            files, wmap, index_meta = [p], None, {}
    else:
        raise WeightsError(f"{p}: no such checkpoint file or directory")

    tensors: dict[str, TensorInfo] = {}
    metadata: dict[Path, Mapping[str, str]] = {}
    for file in files:
        file_tensors, metadata[file] = read_safetensors_header(file)
        for name, info in file_tensors.items():
            if name in tensors:
                raise WeightsError(f"tensor {name!r} is in both {tensors[name].file} and {file}")
            tensors[name] = info
    if wmap is not None:
        _check_weight_map(root / INDEX_FILE if p.is_dir() else p, root, wmap, tensors)
    return WeightIndex(
        root=root,
        files=tuple(files),
        tensors=MappingProxyType(tensors),
        metadata=MappingProxyType({f: MappingProxyType(m) for f, m in metadata.items()}),
        index_metadata=MappingProxyType(index_meta),
    )


def _check_weight_map(index_file: Path, root: Path, wmap: dict[str, str], tensors: dict[str, TensorInfo]) -> None:
    not_there = [f"{n} ({f})" for n, f in wmap.items() if n not in tensors or tensors[n].file != root / f]
    if not_there:
        raise WeightsError(f"{index_file}: weight_map lists tensor(s) absent from their shard: {name_list(not_there)}")
    unmapped = [f"{n} ({t.file.name})" for n, t in tensors.items() if n not in wmap]
    if unmapped:
        raise WeightsError(f"{index_file}: shard tensor(s) missing from weight_map: {name_list(unmapped)}")


# ----------------------------------------------------------------- parameter counts


def _config_quantization(root: Path) -> Mapping | None:
    # mlx-lm checkpoints record their packing in config.json's "quantization"; a missing or
    # unreadable file means "unknown" (counting then refuses affine packing rather than guess).
    try:
        q = json.loads((root / "config.json").read_text(encoding="utf-8")).get("quantization")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return q if isinstance(q, Mapping) else None
