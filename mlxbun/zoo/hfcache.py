"""Lay a checkpoint out as a Hugging Face hub cache repo, as huggingface_hub does:

    models--<org>--<name>/blobs/<hash>                 file contents, content-addressed
    models--<org>--<name>/snapshots/<rev>/<file>       relative symlinks ../../blobs/<hash>
    models--<org>--<name>/refs/main                    <rev>

Blob names follow the hub: sha256 for LFS files (safetensors), the git blob sha1 otherwise.
The revision is a hash of the snapshot's (file, blob) list, so it is deterministic.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from mlxbun.zoo.common import ZooArgumentError

LFS_SUFFIXES = (".safetensors",)


def repo_folder_name(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _blob_name(path: Path) -> str:
    data = path.read_bytes()
    if path.name.endswith(LFS_SUFFIXES):
        return hashlib.sha256(data).hexdigest()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id


def check_repo(cache_root: Path, repo_id: str) -> None:
    """Refuse a cache where the repo folder of `repo_id` or its blobs/snapshots/refs is not a
    directory (or refs/main not a file): the zoo adds to a hub cache and replaces nothing there."""
    repo = Path(cache_root) / repo_folder_name(repo_id)
    for p, kind in ((repo, "directory"), (repo / "blobs", "directory"), (repo / "snapshots", "directory"),
                    (repo / "refs", "directory"), (repo / "refs" / "main", "file")):
        if (p.exists() or p.is_symlink()) and not (p.is_dir() if kind == "directory" else p.is_file()):
            raise ZooArgumentError(f"{p} exists and is not a {kind}, so {repo} is not a hub cache repo "
                                   "the zoo can add to: move it away or build into another directory")


def install_snapshot(src: Path, cache_root: Path, repo_id: str) -> Path:
    """Move the files of checkpoint dir `src` into `cache_root`'s repo for `repo_id`; return the
    snapshot dir (a checkpoint dir whose files are symlinks into blobs/)."""
    repo = Path(cache_root) / repo_folder_name(repo_id)
    blobs = repo / "blobs"
    blobs.mkdir(parents=True, exist_ok=True)
    entries = []
    for f in sorted(p for p in Path(src).iterdir() if p.is_file()):
        blob = blobs / _blob_name(f)
        if blob.exists():  # same content already stored
            f.unlink()
        else:
            os.replace(f, blob)
        entries.append((f.name, blob.name))
    rev = hashlib.sha1("".join(f"{n}\0{b}\n" for n, b in entries).encode()).hexdigest()

    snapshot = repo / "snapshots" / rev
    staging = repo / "snapshots" / f".{rev}.{os.getpid()}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name, blob in entries:
        os.symlink(os.path.join("..", "..", "blobs", blob), staging / name)
    if snapshot.exists():  # same revision: same content, keep the existing one
        shutil.rmtree(staging)
    else:
        os.replace(staging, snapshot)
    refs = repo / "refs"
    refs.mkdir(exist_ok=True)
    (refs / "main").write_text(rev)  # huggingface_hub writes the bare revision, no newline
    return snapshot
