"""Open a GGUF file: its metadata as plain Python values, its tensors as llama.cpp stores them.

Reading goes through `gguf`, llama.cpp's own Python reader (the file's layout, every GGML type).
Anything wrong with the file (missing, not GGUF, truncated, an unknown value or tensor type)
is a `GGUFError` that names the file, never an exception from inside the reader.

`Metadata` wraps the metadata with typed look-ups whose misses name the key; `fingerprint`
identifies a file for the import cache (size, mtime and a hash of the header).
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxbun.errors import MlxbunError

__all__ = ["GGUFError", "Metadata", "fingerprint", "open_gguf", "read_metadata"]

GGUF_MAGIC = b"GGUF"


class GGUFError(MlxbunError):
    """A GGUF file is missing, malformed, or holds something mlxbun cannot import."""


def open_gguf(path: str | os.PathLike):
    """A `gguf.GGUFReader` over `path` (memory-mapped; tensors are read when used)."""
    import gguf

    path = Path(path).expanduser()
    if not path.is_file():
        raise GGUFError(f"{path}: no such GGUF file")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != GGUF_MAGIC:
        raise GGUFError(f"{path}: not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return gguf.GGUFReader(path)
    except ValueError as e:
        bad = re.match(r"(\d+) is not a valid GGMLQuantizationType", str(e))
        if bad:  # raised while reading the tensor directory
            raise GGUFError(f"{path}: unknown GGML tensor type {bad.group(1)} (not a type llama.cpp's "
                            f"gguf {_gguf_version()} knows)") from None
        raise GGUFError(f"{path}: unreadable GGUF file, truncated or malformed (ValueError: {e})") from None
    except (IndexError, KeyError, OSError, TypeError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: unreadable GGUF file, truncated or malformed "
                        f"({type(e).__name__}: {e})") from None


def _gguf_version() -> str:
    from importlib import metadata

    try:
        return metadata.version("gguf")
    except metadata.PackageNotFoundError:
        return "?"


def read_metadata(path_or_reader) -> dict[str, Any]:
    """Every metadata key as a plain Python value: str, int, float, bool, or a list of them."""
    reader = path_or_reader if hasattr(path_or_reader, "fields") else open_gguf(path_or_reader)
    name = getattr(reader.data, "filename", "GGUF file")  # the memory map knows its file
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the container's own header (version, counts), not model metadata
        try:
            out[key] = field.contents()
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise GGUFError(f"{name}: metadata key {key!r} cannot be read ({e})") from None
    return out


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
