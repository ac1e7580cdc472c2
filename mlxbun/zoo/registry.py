"""The zoo's builders keyed by arch, and the two entry points that dispatch through them:
`make_checkpoint` (a directory, or a hub-cache snapshot) and `cached_checkpoint` (built once
per cache root). A builder is a module with `variant` (validate the arguments, name the
checkpoint), `build_files` (write it into an empty directory) and `cache_key` (its directory in
the cache); adding a graph to the zoo is one `BUILDERS` entry. The tower zoo's rows
(`zoo.towers.TOWER_ARCHS`: VLM checkpoints carrying their towers) are builders too, under their
own names (`gemma3-vision`, ...: suffixes no text arch has), so `zoo:NAME` reaches them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from mlxbun.errors import UnsupportedModelError
from mlxbun.zoo import build, diffusion, llada, towers
from mlxbun.zoo.archs import ARCHS, get_arch
from mlxbun.zoo.common import (
    Variant,
    ZooArgumentError,
    build_into,
    build_once,
    cache_root,
    check_out_dir,
    check_replaceable,
)


@dataclass(frozen=True)
class Builder:
    module: ModuleType  # variant / build_files / cache_key
    oracle: str  # the library the arch's graph is held bit-exact to
    hub_layout: bool = True  # can be laid out as a hub cache repo (`hf_cache=True`)
    towers: bool = False  # a VLM checkpoint with its towers (zoo.towers), held to mlx-vlm


BUILDERS: dict[str, Builder] = {
    **{arch: Builder(build, "mlx-lm") for arch in ARCHS},
    diffusion.ARCH: Builder(diffusion, "mlx-vlm", hub_layout=False),
    llada.ARCH: Builder(llada, "mlx-vlm", hub_layout=False),
    **{name: Builder(towers, "mlx-vlm", hub_layout=False, towers=True) for name in towers.TOWER_ARCHS},
}
# graphs held to mlx-vlm rather than mlx-lm: float weights only, plain directories
ORACLE_VLM_ARCHS: tuple[str, ...] = tuple(a for a, b in BUILDERS.items() if b.oracle == "mlx-vlm" and not b.towers)
# VLM checkpoints with their towers: float or quantized text weights (mlx_vlm.convert's), plain directories
TOWER_ZOO_ARCHS: tuple[str, ...] = tuple(a for a, b in BUILDERS.items() if b.towers)


def builder(arch: str) -> Builder:
    try:
        return BUILDERS[arch]
    except (KeyError, TypeError):
        raise UnsupportedModelError(f"unknown zoo arch {arch!r}; known archs: {', '.join(BUILDERS)}") from None


def check_build(arch: str, out_dir, *, quant=None, dtype: str = "float32", seed: int = 0,
                hf_cache: bool = False, head_dim: int | None = None) -> Variant:
    """Everything `make_checkpoint` would refuse, refused before anything is built: the variant's
    arguments, an output directory that is a file, a destination the zoo may not replace."""
    b = builder(arch)
    if quant is not None and arch in ARCHS and get_arch(arch).unquantizable:
        raise ZooArgumentError(f"zoo arch {arch!r} is built in float weights only: mlx-lm cannot quantize it "
                               f"(--quant {quant})")
    v = b.module.variant(arch, quant=quant, dtype=dtype, seed=seed, head_dim=head_dim)
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    if not hf_cache:
        check_replaceable(out_dir / v.name)
    elif not b.hub_layout:
        raise ZooArgumentError(f"zoo arch {arch!r} is built as a plain directory only (no hf-cache)")
    else:
        from mlxbun.zoo.hfcache import check_repo

        check_repo(out_dir, v.repo_id)
    return v


def make_checkpoint(
    arch: str,
    out_dir,
    *,
    quant=None,
    dtype: str = "float32",
    seed: int = 0,
    hf_cache: bool = False,
    head_dim: int | None = None,
) -> Path:
    """Build the tiny `arch` checkpoint under `out_dir` and return its directory:
    `out_dir/tiny-<arch>[-<variant>]`, or with `hf_cache` the snapshot dir of
    `out_dir/models--mlxbun--tiny-<arch>[-<variant>]`. Same arguments, same bytes.
    `head_dim` widens the heads (the zoo's are 16; quantized KV needs a group of 32+).
    A plain directory replaces only an earlier zoo build holding nothing else (see `check_build`)."""
    b = builder(arch)
    v = check_build(arch, out_dir, quant=quant, dtype=dtype, seed=seed, hf_cache=hf_cache, head_dim=head_dim)
    if not hf_cache:
        return build_into(out_dir, v.name, lambda out: b.module.build_files(v, out))
    from mlxbun.zoo.hfcache import install_snapshot

    return build_into(out_dir, v.name, lambda out: b.module.build_files(v, out),
                      land=lambda built, root: install_snapshot(built, root, v.repo_id))


def cached_checkpoint(
    arch: str, *, quant=None, dtype: str = "float32", seed: int = 0, root=None, head_dim: int | None = None
) -> Path:
    """The checkpoint dir of this variant in the cache `root` (default `$MLXBUN_ZOO_CACHE` or
    ~/.cache/mlxbun/zoo), built on first use (concurrent callers wait on a file lock; a visible
    checkpoint is always complete)."""
    b = builder(arch)
    v = b.module.variant(arch, quant=quant, dtype=dtype, seed=seed, head_dim=head_dim)
    return build_once(cache_root(root) / b.module.cache_key(), v.name, lambda out: b.module.build_files(v, out))
