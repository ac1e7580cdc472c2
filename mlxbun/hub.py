"""A hub repo id to a complete snapshot in the local Hugging Face cache, downloaded on demand.

    fetch("HuggingFaceTB/SmolLM2-135M-Instruct")            # main: downloaded once, then reused
    fetch("HuggingFaceTB/SmolLM2-135M-Instruct", "a1b2c3")  # a pinned revision (branch, tag, commit)

Everything goes through huggingface_hub's own `snapshot_download`, so its variables hold:
HF_ENDPOINT, HF_HUB_CACHE / HF_HOME, HF_TOKEN, HF_HUB_DISABLE_PROGRESS_BARS (its tqdm bars are
the progress), HF_HUB_ETAG_TIMEOUT / HF_HUB_DOWNLOAD_TIMEOUT, and HF_HUB_OFFLINE (or `go_offline`,
the CLI's `--offline`): offline, only a complete cached snapshot is used. Only the files a graph
reads are fetched (`GRAPH_PATTERNS`, mlx-lm's own list less its remote code). A dry run first
lists what will come; a repo without a config or safetensors weights, or a download larger than
the free disk, is refused before any byte moves. A failed download is a named error; the files
it completed stay in the cache (the next run fetches only the rest), and a snapshot missing a
file is never returned as a model (huggingface_hub's tree listing of the commit says what it needs).
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Optional, Sequence

from mlxbun.errors import MlxbunError

__all__ = ["GRAPH_PATTERNS", "HubDiskFull", "HubDownloadError", "HubError", "HubGated", "HubNotCached",
           "HubNotFound", "cache_root", "fetch", "go_offline", "is_offline"]

# mlx_lm.utils.DEFAULT_ALLOW_PATTERNS less "*.py": mlxbun runs no remote code.
GRAPH_PATTERNS = ("*.json", "model*.safetensors", "tokenizer.model", "*.tiktoken", "tiktoken.model", "*.txt",
                  "*.jsonl", "*.jinja")


class HubError(MlxbunError):
    """A hub repo could not be had: the subclasses say why."""


class HubNotFound(HubError):
    """No such repo or revision on the hub (or a private repo without a token that reaches it)."""


class HubGated(HubError):
    """A gated repo whose terms this token has not accepted."""


class HubNotCached(HubError):
    """Downloads are off (HF_HUB_OFFLINE, --offline, or the hub unreachable) and the cache lacks the
    snapshot or part of it."""


class HubDiskFull(HubError):
    """Not enough free disk in the hub cache for the files to download."""


class HubDownloadError(HubError):
    """A transfer failed or was interrupted; what completed stays cached, nothing partial is used."""


def cache_root(cache_dir=None) -> Path:
    from huggingface_hub import constants

    return Path(cache_dir if cache_dir else constants.HF_HUB_CACHE).expanduser()


def is_offline() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) as huggingface_hub read it, or `go_offline()`."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def go_offline() -> None:
    """This process downloads nothing from here on, exactly as HF_HUB_OFFLINE=1 at its start would
    (huggingface_hub reads the variable once, at import; the CLI's `--offline`)."""
    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def _label(repo_id: str, revision: Optional[str]) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id


def fetch(repo_id: str, revision: Optional[str] = None, *, cache_dir=None,
          patterns: Sequence[str] = GRAPH_PATTERNS, offline: Optional[bool] = None) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default: main), every file matching
    `patterns` present; downloaded first unless offline."""
    cache = cache_root(cache_dir)
    if is_offline() if offline is None else offline:
        return _cached(repo_id, revision, cache, patterns, "downloads are off (HF_HUB_OFFLINE=1 or --offline)")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import DryRunError, GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    label = _label(repo_id, revision)
    try:
        plan = snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=list(patterns),
                                 dry_run=True)
    except GatedRepoError as e:
        raise _gated(label) from e
    except RepositoryNotFoundError as e:
        raise HubNotFound(f"repo '{repo_id}' not found on {_endpoint()} (a private repo needs a token: "
                          "HF_TOKEN or `hf auth login`)") from e
    except RevisionNotFoundError as e:
        raise HubNotFound(f"repo '{repo_id}' has no revision '{revision}' on {_endpoint()}") from e
    except DryRunError as e:  # the hub cannot be reached: the cache may still have it
        if isinstance(e.__cause__, GatedRepoError):
            raise _gated(label) from e
        if isinstance(e.__cause__, RepositoryNotFoundError):
            raise HubNotFound(f"repo '{repo_id}' not found on {_endpoint()} (a private repo needs a token: "
                              "HF_TOKEN or `hf auth login`)") from e
        return _cached(repo_id, revision, cache, patterns, f"{_endpoint()} cannot be reached ({_why(e)})")
    except OSError as e:  # a HEAD call failed for good (connection, gated file, ...)
        raise HubDownloadError(f"repo '{label}': {_why(e)}") from e
    names = {f.filename for f in plan}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise HubNotFound(f"repo '{label}' has no {'config.json' if 'config.json' not in names else 'safetensors weights'}"
                          f" to run (files mlxbun reads: {', '.join(sorted(names)) or 'none'}; it takes "
                          "Hugging Face checkpoints with config.json and *.safetensors)")
    todo = [f for f in plan if f.will_download]
    commit = plan[0].commit_hash
    if todo:
        _check_disk(label, sum(f.file_size or 0 for f in todo), cache)
        print(f"mlxbun: downloading {label} (commit {commit[:12]}) from {_endpoint()}: {len(todo)} of {len(plan)} "
              f"files, {_mb(sum(f.file_size or 0 for f in todo))} into {cache}", file=sys.stderr)
    try:
        # the commit the dry run saw: the files it sized are the files that come
        path = snapshot_download(repo_id, revision=commit, cache_dir=cache, allow_patterns=list(patterns))
    except GatedRepoError as e:
        raise _gated(label) from e
    except Exception as e:  # OSError, or the transport errors of huggingface_hub's HTTP client
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise HubDiskFull(f"repo '{label}': the disk under {cache} filled up during the download; the files "
                              "completed so far stay cached: free space (or set HF_HUB_CACHE) and run again") from e
        raise HubDownloadError(f"repo '{label}': download interrupted ({_why(e)}); the files completed so far stay "
                               "cached and the next run fetches the rest") from e
    return Path(path)


def _cached(repo_id: str, revision: Optional[str], cache: Path, patterns, why: str) -> Path:
    """The cached snapshot, complete for `patterns` as far as huggingface_hub's tree listing of the
    commit tells; without a revision: main, else the newest complete snapshot."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

    label = _label(repo_id, revision)
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=list(patterns),
                                      local_files_only=True))
    except IncompleteSnapshotError as e:
        missing = str(e).split("are missing (", 1)[-1].split(")", 1)[0]
        raise HubNotCached(f"repo '{label}' is only partly in hub cache {cache} (missing {missing}) and {why}: "
                           "run again with network to complete it") from e
    except LocalEntryNotFoundError as e:
        newest = _newest_snapshot(repo_id, cache) if revision is None else None
        if newest is not None:
            return _cached(repo_id, newest, cache, patterns, why)
        raise HubNotCached(f"repo '{label}' not found in hub cache {cache}, and {why}") from e


def _newest_snapshot(repo_id: str, cache: Path) -> Optional[str]:
    from huggingface_hub import scan_cache_dir

    if not cache.is_dir():
        return None
    for repo in scan_cache_dir(cache).repos:
        if repo.repo_id == repo_id and repo.repo_type == "model" and repo.revisions:
            return max(repo.revisions, key=lambda r: r.last_modified).commit_hash
    return None


def _check_disk(label: str, need: int, cache: Path) -> None:
    where = next((p for p in (cache, *cache.parents) if p.exists()), cache)
    free = shutil.disk_usage(where).free
    if need > free:
        raise HubDiskFull(f"repo '{label}' needs {_mb(need)} and {where} has {_mb(free)} free: free space or "
                          "point HF_HUB_CACHE at a larger disk (nothing was downloaded)")


def _gated(label: str) -> HubGated:
    repo = label.split("@", 1)[0]
    return HubGated(f"repo '{repo}' is gated: accept its terms at {_endpoint()}/{repo} and give a token that "
                    "has (HF_TOKEN or `hf auth login`)")


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _why(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
