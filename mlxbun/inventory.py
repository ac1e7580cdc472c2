"""What models are on this machine: the HF hub cache plus any directories given.

`list_models` reads config.json and safetensors headers only (no tensor data),
so listing a cache of large checkpoints is instant. A checkpoint that cannot be
read is listed with the reason instead of aborting the scan.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path

from mlxbun.errors import MlxbunError


@dataclass(frozen=True)
class ModelEntry:
    repo: str  # "org/name" for the hub cache, else the directory path
    revision: str | None  # commit hash for hub snapshots
    path: str
    model_type: str | None
    parameters: int | None
    size_bytes: int  # on disk
    weights_bytes: int | None
    quantization: str | None  # e.g. "affine 4-bit g64", None for dense
    tier: str  # "targeted" | "generic" | "unsupported"
    reason: str | None  # why unsupported / unreadable
    fits_memory: bool | None

    def as_dict(self) -> dict:
        return asdict(self)


def physical_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# Weights may take at most this share of RAM: the rest is KV cache, activations and the OS.
FIT_FRACTION = 0.75


def default_cache_dir() -> Path:
    from huggingface_hub.constants import HF_HUB_CACHE

    return Path(HF_HUB_CACHE)


def _dir_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file():
                total += p.resolve().stat().st_size
        except OSError:
            pass
    return total


def _describe_quant(config) -> str | None:
    q = config.quantization
    if q is None:
        return None
    text = f"{q.mode} {q.bits}-bit g{q.group_size}"
    if getattr(config, "quant_overrides", None):
        text += " (mixed)"
    return text


def describe_checkpoint(path: Path, repo: str, revision: str | None, size_bytes: int | None = None) -> ModelEntry:
    """One listing row for a checkpoint directory; never raises for a bad checkpoint."""
    from mlxbun.config import load_model_config
    from mlxbun.profile import support_tier, unsupported_reason
    from mlxbun.weights import read_index

    size = _dir_size(path) if size_bytes is None else size_bytes
    row = dict(repo=repo, revision=revision, path=str(path), model_type=None, parameters=None,
               size_bytes=size, weights_bytes=None, quantization=None, tier="unsupported",
               reason=None, fits_memory=None)
    try:
        config = load_model_config(path)
    except MlxbunError as e:
        row["reason"] = str(e)
        return ModelEntry(**row)
    row["model_type"] = config.model_type
    row["quantization"] = _describe_quant(config)
    tier = support_tier(config.model_type)
    row["tier"] = tier or "unsupported"
    if tier is None:
        row["reason"] = unsupported_reason(config.source_model_type).split(". Supported")[0]
    try:
        index = read_index(path)
        row["weights_bytes"] = index.total_bytes
        row["parameters"] = index.num_parameters()  # reads the quantization block itself
        row["fits_memory"] = index.total_bytes <= FIT_FRACTION * physical_memory_bytes()
    except MlxbunError as e:
        row["reason"] = (row["reason"] + "; " if row["reason"] else "") + str(e)
        row["tier"] = row["tier"] if tier else "unsupported"
    return ModelEntry(**row)


def list_models(cache_dir: str | Path | None = None, paths=()) -> tuple[list[ModelEntry], list[str]]:
    """Scan the hub cache (and extra directories). Returns (entries, warnings)."""
    from huggingface_hub import scan_cache_dir

    entries: list[ModelEntry] = []
    warnings: list[str] = []
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if cache.is_dir():
        try:
            info = scan_cache_dir(cache)
        except Exception as e:  # huggingface_hub raises CacheNotFound / ValueError for odd dirs
            raise MlxbunError(f"cannot scan hub cache {cache}: {e}") from e
        warnings += [str(w) for w in info.warnings]
        for repo in sorted(info.repos, key=lambda r: r.repo_id):
            if repo.repo_type != "model":
                continue
            for rev in sorted(repo.revisions, key=lambda r: r.commit_hash):
                if not (rev.snapshot_path / "config.json").exists():
                    continue
                entries.append(describe_checkpoint(rev.snapshot_path, repo.repo_id, rev.commit_hash, rev.size_on_disk))
    elif cache_dir is not None:
        raise MlxbunError(f"hub cache directory {cache} does not exist")
    for p in paths:
        p = Path(p)
        if not p.is_dir():
            raise MlxbunError(f"{p}: not a directory")
        if (p / "config.json").exists():
            entries.append(describe_checkpoint(p, str(p), None))
        else:  # a folder of checkpoints (e.g. a zoo build)
            subdirs = sorted(d for d in p.iterdir() if (d / "config.json").exists())
            if not subdirs:
                warnings.append(f"{p}: no config.json in it or its sub-directories")
            entries += [describe_checkpoint(d, str(d), None) for d in subdirs]
    return entries, warnings
