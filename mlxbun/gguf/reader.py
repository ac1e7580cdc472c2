"""Open a GGUF file: its metadata as plain Python values, its tensors as llama.cpp stores them.

    f = open_gguf("m.gguf")        # GGUFFile: .metadata, .tensors, .data_offset (memory-mapped)
    read_metadata("m.gguf")        # every metadata key as str / int / float / bool / list

The header (metadata and tensor directory) is parsed here with `struct`, as llama.cpp's
gguf-py lays it out (GGUF v2/v3, little-endian): its `GGUFReader` builds a numpy view per
value and takes seconds on a 262k-token vocabulary, this takes a fraction of one. Tensors are
the same as that reader's (`GGUFTensor.data`: a memory-mapped numpy view, quantized rows as raw
bytes) and GGML types are gguf's own `GGMLQuantizationType`. Anything wrong with the file
(missing, not GGUF, truncated, an unknown value or tensor type) is a `GGUFError` that names
the file, never an exception from inside the parser.

`Metadata` wraps the metadata with typed look-ups whose misses name the key; `fingerprint`
identifies a file for the import cache (size, mtime and a hash of the header).
"""

from __future__ import annotations

import hashlib
import math
import mmap
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mlxbun.errors import MlxbunError

__all__ = ["GGUFError", "GGUFFile", "GGUFTensor", "Metadata", "fingerprint", "open_gguf", "read_metadata"]

GGUF_MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# GGUF value types: id -> struct format (8 string, 9 array are read apart)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}
# GGML types stored as plain numbers; every other type is read as raw bytes (rows of blocks)
_PLAIN = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
          "I32": np.int32, "I64": np.int64}


class GGUFError(MlxbunError):
    """A GGUF file is missing, malformed, or holds something mlxbun cannot import."""


@dataclass
class GGUFTensor:
    """One tensor of the directory, as gguf's `ReaderTensor` has it: `shape` innermost first
    (GGML order), `data` rows first (numpy order; quantized types as bytes per row)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: np.ndarray
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


@dataclass
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[GGUFTensor]
    data_offset: int  # where tensor data starts: every byte before it is the header


class _Truncated(Exception):
    pass


class _Parser:
    def __init__(self, buf):
        self.buf, self.off, self.size = buf, 0, len(buf)

    def take(self, fmt: str):
        n = struct.calcsize(fmt)
        if self.off + n > self.size:
            raise _Truncated()
        out = struct.unpack_from("<" + fmt, self.buf, self.off)
        self.off += n
        return out[0] if len(out) == 1 else out

    def string(self) -> str:
        n = self.take("Q")
        if self.off + n > self.size:
            raise _Truncated()
        raw = self.buf[self.off:self.off + n]
        self.off += n
        return raw.decode("utf-8")

    def value(self, vtype: int):
        if vtype in _SCALARS:
            return self.take(_SCALARS[vtype])
        if vtype == 8:
            return self.string()
        if vtype == 9:
            itype, count = self.take("I"), self.take("Q")
            if itype in _NUMPY:
                width = np.dtype(_NUMPY[itype]).itemsize
                if self.off + count * width > self.size:
                    raise _Truncated()
                arr = np.frombuffer(self.buf, _NUMPY[itype], count, self.off)
                self.off += count * width
                return [bool(x) for x in arr] if itype == 7 else arr.tolist()
            return [self.value(itype) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def open_gguf(path: str | os.PathLike) -> GGUFFile:
    """The header of GGUF file `path` parsed, its tensors memory-mapped (read when used)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    with path.open("rb") as f:
        magic = f.read(4)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        return _parse(path, buf)
    except _Truncated:
        raise GGUFError(f"{path}: truncated GGUF file (its header runs past the end, {len(buf)} bytes)") from None
    except (ValueError, UnicodeDecodeError, struct.error) as e:
        raise GGUFError(f"{path}: malformed GGUF file ({e})") from None


def _parse(path: Path, buf) -> GGUFFile:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    p = _Parser(buf)
    p.off = 4
    version = p.take("I")
    if version & 0xFFFF == 0:
        raise GGUFError(f"{path}: a big-endian GGUF file; mlxbun reads little-endian ones")
    if version not in VERSIONS:
        raise GGUFError(f"{path}: GGUF version {version}; mlxbun reads versions {VERSIONS}")
    n_tensors, n_kv = p.take("QQ")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = p.string()
        try:
            metadata[key] = p.value(p.take("I"))
        except ValueError as e:
            raise GGUFError(f"{path}: metadata key {key!r}: {e}") from None
    directory = []
    for _ in range(n_tensors):
        name = p.string()
        dims = [p.take("Q") for _ in range(p.take("I"))]
        raw_type, offset = p.take("I"), p.take("Q")
        try:
            ggml_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise GGUFError(f"{path}: tensor {name!r} has unknown GGML type {raw_type}") from None
        directory.append((name, dims, ggml_type, offset))
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise GGUFError(f"{path}: general.alignment {alignment!r} is not a power of two")
    data_offset = -(-p.off // alignment) * alignment
    tensors, seen = [], set()
    for name, dims, ggml_type, offset in directory:
        if name in seen:
            raise GGUFError(f"{path}: tensor {name!r} appears twice")
        seen.add(name)
        n_elements = math.prod(dims)  # Python ints: corrupt dims (2^40 x 2^40) must not wrap around int64
        block, type_size = GGML_QUANT_SIZES[ggml_type]
        if dims and dims[0] % block:
            raise GGUFError(f"{path}: tensor {name!r} rows of {dims[0]} are not whole {ggml_type.name} blocks of {block}")
        n_bytes = n_elements // block * type_size
        start = data_offset + offset
        if start + n_bytes > len(buf):
            raise GGUFError(f"{path}: truncated GGUF file: tensor {name!r} (dims {dims}) ends at byte "
                            f"{start + n_bytes}, the file has {len(buf)}")
        np_dims = tuple(reversed(dims))
        if ggml_type.name in _PLAIN:
            data = np.frombuffer(buf, _PLAIN[ggml_type.name], n_elements, start).reshape(np_dims)
        else:
            data = np.frombuffer(buf, np.uint8, n_bytes, start).reshape(*np_dims[:-1], dims[0] // block * type_size)
        tensors.append(GGUFTensor(name, ggml_type, np.array(dims, dtype=np.uint64), n_elements, n_bytes, start, data))
    return GGUFFile(path, version, metadata, tensors, data_offset)


def read_metadata(path_or_file) -> dict[str, Any]:
    """Every metadata key as a plain Python value: str, int, float, bool, or a list of them."""
    f = path_or_file if isinstance(path_or_file, GGUFFile) else open_gguf(path_or_file)
    return dict(f.metadata)


def fingerprint(path: str | os.PathLike, reader=None) -> dict[str, Any]:
    """What identifies a GGUF file for the import cache: its size, its mtime (ns) and the
    sha256 of its header (magic, metadata and tensor directory: every byte before the tensor
    data). An edit in place changes the mtime; a copy with another mtime imports again."""
    path = Path(path).expanduser()
    reader = reader if reader is not None else open_gguf(path)
    st = path.stat()
    with path.open("rb") as f:
        header = f.read(int(reader.data_offset))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "header_sha256": hashlib.sha256(header).hexdigest()}


_MISSING = object()


class Metadata(Mapping):
    """A GGUF file's metadata (`read_metadata`) with look-ups that name the file and the key:
    `meta.need("llama.block_count", int)` raises a GGUFError when the key is missing or of
    another type. Floats read as the float32 the file stores, written as its shortest decimal
    (9.999999747378752e-06 -> 1e-05: the same float32)."""

    def __init__(self, values: Mapping[str, Any], path: str | os.PathLike = "GGUF file"):
        self._values = dict(values)
        self.path = str(path)

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self):
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def need(self, key: str, kind: type = int, why: str = "") -> Any:
        value = self._values.get(key, _MISSING)
        if value is _MISSING:
            raise GGUFError(f"{self.path}: missing metadata key {key!r}" + (f" ({why})" if why else ""))
        return self._typed(key, value, kind)

    def opt(self, key: str, kind: type = int, default: Any = None) -> Any:
        value = self._values.get(key, _MISSING)
        return default if value is _MISSING else self._typed(key, value, kind)

    def _typed(self, key: str, value: Any, kind: type) -> Any:
        if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            import numpy as np

            return float(str(np.float32(value)))
        if kind is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if kind in (str, list, bool) and isinstance(value, kind):
            return value
        raise GGUFError(f"{self.path}: metadata key {key!r} is {type(value).__name__} {value!r:.60}, "
                        f"expected {kind.__name__}")
