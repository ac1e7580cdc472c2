"""Directories that appear whole or not at all: build in a temporary directory next to the target,
then `replace_dir` it into place (the zoo's builds and GGUF imports both land this way); and
`unwritable`, why an output path could not be created, asked before the work that fills it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

__all__ = ["replace_dir", "unwritable"]


def unwritable(path, *, parents: bool = True) -> Optional[str]:
    """Why a file or directory cannot be created at `path` (None: it can), checked before any work:
    the nearest existing directory above it is a directory (not a file) and writable. `parents`:
    missing directories on the way would be created (else the parent itself must exist). An
    existing `path` is the caller's to judge (a directory where a file goes, a file to replace)."""
    path = Path(path).expanduser().absolute()
    existing = next((p for p in path.parents if p.exists() or p.is_symlink()), None)
    if existing is None:  # the root itself
        return f"{path} has no directory above it"
    if existing != path.parent and not parents:
        return f"directory {path.parent} does not exist"
    if not existing.is_dir():
        return f"{existing} is a file, not a directory" if existing.exists() else f"{existing} is a broken link"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"directory {existing} is not writable"
    return None


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
