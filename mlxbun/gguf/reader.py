"""Open a GGUF file: its metadata as plain Python values, its tensors as llama.cpp stores them.

Reading goes through `gguf`, llama.cpp's own Python reader (the file's layout, every GGML type).
Anything wrong with the file (missing, not GGUF, truncated, an unknown value type) is a
`GGUFError` that names the file, never an exception from inside the reader.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from mlxbun.errors import MlxbunError

__all__ = ["GGUFError", "open_gguf", "read_metadata"]

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
    except (ValueError, IndexError, KeyError, OSError, TypeError, UnicodeDecodeError) as e:
        raise GGUFError(f"{path}: unreadable GGUF file, truncated or malformed "
                        f"({type(e).__name__}: {e})") from None


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
