"""A checkpoint's immutable identity: `hf:<org>/<repo>@<rev>` for Hugging Face hub snapshots."""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

_REV = re.compile(r"[0-9a-f]{40,64}")
_REPO_PREFIX = "models--"


def _snapshot_identity(parts: Sequence[str]) -> str | None:
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    for k in range(len(parts) - 2, 0, -1):
        if parts[k] != "snapshots" or not parts[k - 1].startswith(_REPO_PREFIX) or not _REV.fullmatch(parts[k + 1]):
            continue
        # huggingface_hub's repo_folder_name joins "models" and the repo id's parts with "--".
        pieces = parts[k - 1][len(_REPO_PREFIX):].split("--")
        if len(pieces) > 2 or not all(pieces):
            return None
        repo_id = "/".join(pieces)
        try:
            validate_repo_id(repo_id)
        except HFValidationError:
            return None
        return f"hf:{repo_id}@{parts[k + 1]}"
    return None


def artifact_fingerprint(path: str | os.PathLike) -> str | None:
    """`hf:<org>/<repo>@<rev>` when `path` is in an immutable HF hub cache snapshot, else None.

    Only `models--<org>--<repo>/snapshots/<40-64 lowercase hex>` counts, so
    mutable aliases (a snapshot named "main") and plain directories give None.
    The identity comes from the path's shape, so relocating the cache keeps it.
    Symlinks are followed: the given path first, then each ancestor resolved
    (a snapshot file itself links into blobs/, so resolving it whole loses the snapshot).
    """
    given = Path(os.path.abspath(path))
    candidates = [given]
    parts = given.parts
    for i in range(len(parts), 0, -1):
        try:
            candidates.append(Path(*parts[:i]).resolve().joinpath(*parts[i:]))
        except (OSError, RuntimeError):  # symlink loops
            continue
    for cand in candidates:
        fp = _snapshot_identity(cand.parts)
        if fp is not None:
            return fp
    return None
