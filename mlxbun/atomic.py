"""Directories that appear whole or not at all: build in a temporary directory next to the target
(`staging_dir` / `staging`), then `replace_dir` it into place (the zoo's builds and GGUF imports
both land this way); `sweep_staging` removes the staging directories a killed build or import left;
and `unwritable`, why an output path could not be created, asked before the work that fills it."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator, Optional

__all__ = ["HOST", "STALE_AFTER_S", "replace_dir", "staging", "staging_dir", "sweep_staging", "unwritable"]

STALE_AFTER_S = 24 * 3600  # a staging directory no live process of this host owns: stale after a day
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _staging_prefix(name: str, kind: str) -> str:
    return f".{name}.{kind}-"


def staging_dir(parent: Path, name: str, kind: str) -> Path:
    """A new empty directory in `parent` for building `name` (`.NAME.KIND-PID.HOST-XXXXXXXX`: the
    building process and a tag of its host, so `sweep_staging` can tell a dead one from a live one).
    The caller removes it (`staging` does)."""
    return Path(tempfile.mkdtemp(prefix=f"{_staging_prefix(name, kind)}{os.getpid()}.{HOST}-", dir=parent))


@contextlib.contextmanager
def staging(parent: Path, name: str, kind: str) -> Iterator[Path]:
    """`staging_dir(parent, name, kind)` (`parent` made first), removed on the way out whatever
    happened (after a successful `replace_dir` it is already gone). A killed process cannot remove
    its own: `sweep_staging` does, on the next build of `name` beside it."""
    parent.mkdir(parents=True, exist_ok=True)
    work = staging_dir(parent, name, kind)
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # another user's process (or not ours to judge): keep its directory
    return True


def _newest_mtime(d: Path) -> float:
    times = [d.lstat().st_mtime]
    with contextlib.suppress(OSError):
        times += [p.lstat().st_mtime for p in d.iterdir()]
    return max(times)


def sweep_staging(parent: Path, name: str, kind: str, *, now: Optional[float] = None) -> list[Path]:
    """Remove the staging directories of `kind` for `name` in `parent` whose process died (killed,
    out of power): those of this host whose process is gone, and any other (another host's, or an
    older mlxbun's `.NAME.KIND-XXXXXXXX`) untouched for `STALE_AFTER_S`. Only real directories whose
    whole name is that pattern are touched; returns those removed."""
    pattern = re.compile(re.escape(_staging_prefix(name, kind)) + r"(?:(\d+)\.([0-9a-f]{8})-)?[a-z0-9_]{8}")
    now = time.time() if now is None else now
    removed: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for d in entries:
        m = pattern.fullmatch(d.name)
        if m is None or d.is_symlink() or not d.is_dir():
            continue
        try:
            if m.group(1) is not None and m.group(2) == HOST:
                stale = not _alive(int(m.group(1)))
            else:
                stale = now - _newest_mtime(d) > STALE_AFTER_S
        except OSError:
            continue
        if stale:
            shutil.rmtree(d, ignore_errors=True)
            if not d.exists():
                removed.append(d)
    return removed


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
