"""Directories that appear whole or not at all: build in a temporary directory next to the target,
then `replace_dir` it into place (the zoo's builds and GGUF imports both land this way)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["replace_dir"]


def replace_dir(new: Path, final: Path) -> None:
    """Move directory `new` to `final` on the same filesystem. An existing `final` is first renamed
    aside and removed after the move, so `final` is never missing or half-written for long."""
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, trash)
        os.replace(new, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(new, final)
