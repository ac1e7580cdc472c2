"""`make_checkpoint`: one tiny checkpoint (config, sharded weights, tokenizer) in HF layout."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from mlxbun.errors import MlxbunError
from mlxbun.zoo.archs import get_arch, tiny_config

DTYPES = {"float32": "", "float16": "fp16", "bfloat16": "bf16"}  # dtype -> name suffix
QUANTS = (None, 4, 8, "mixed")
REPO_ORG = "mlxbun"


class ZooArgumentError(MlxbunError, ValueError):
    """A zoo variant argument (quant, dtype, seed) is not one the zoo builds."""


@dataclass(frozen=True)
class Variant:
    """A validated (arch, quant, dtype, seed) and its checkpoint name."""

    arch: str
    quant: int | str | None
    dtype: str
    seed: int
    head_dim: int | None = None  # a wider head than the zoo's 16 (quantized KV needs >= 32)

    @property
    def name(self) -> str:
        parts = [f"tiny-{self.arch}"]
        if self.head_dim is not None:
            parts.append(f"hd{self.head_dim}")
        if DTYPES[self.dtype]:
            parts.append(DTYPES[self.dtype])
        if self.quant is not None:
            parts.append(f"q{self.quant}")
        if self.seed:
            parts.append(f"s{self.seed}")
        return "-".join(parts)

    @property
    def repo_id(self) -> str:
        return f"{REPO_ORG}/{self.name}"


def parse_quant(quant) -> int | str | None:
    """None, 4, 8 or "mixed" (the strings "4"/"8"/"none" are accepted too, as on the CLI)."""
    if quant is None or quant == "none":
        return None
    if isinstance(quant, str) and quant.strip().isdigit():
        quant = int(quant)
    if quant in QUANTS and not isinstance(quant, bool):
        return quant
    raise ZooArgumentError(f"unknown quant {quant!r}; choose one of: none, 4, 8, mixed")


def variant(arch: str, *, quant=None, dtype: str = "float32", seed: int = 0, head_dim: int | None = None) -> Variant:
    get_arch(arch)  # UnsupportedModelError naming the known archs
    if dtype not in DTYPES:
        raise ZooArgumentError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ZooArgumentError(f"seed must be a non-negative integer, got {seed!r}")
    if head_dim is not None:
        _check_head_dim(arch, head_dim)
    return Variant(arch, parse_quant(quant), dtype, seed, head_dim)


def _check_head_dim(arch: str, head_dim) -> None:
    """Only archs whose mlx-lm ModelArgs read `head_dim` can widen their heads: elsewhere the
    key would be ignored and the checkpoint silently keep hidden/heads."""
    import inspect

    from mlx_lm.utils import _get_classes

    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 2 or head_dim % 2:
        raise ZooArgumentError(f"head_dim must be an even integer >= 2, got {head_dim!r}")
    _, args_class = _get_classes(tiny_config(arch))
    if "head_dim" not in inspect.signature(args_class).parameters:
        raise ZooArgumentError(f"zoo arch {arch!r}: mlx-lm's {args_class.__module__} has no head_dim "
                               "setting, so its heads cannot be widened")


def build_files(v: Variant, out: Path) -> None:
    """Write every file of variant `v` into the existing empty directory `out`."""
    from mlx_lm.utils import save_config

    from mlxbun.zoo import weights
    from mlxbun.zoo.tokenizer import write_tokenizer_files

    config = tiny_config(v.arch)
    config["torch_dtype"] = v.dtype
    if v.head_dim is not None:
        config["head_dim"] = v.head_dim
    model = weights.build_model(config, v.seed)
    weights.cast(model, v.dtype)
    if v.quant is not None:
        config = weights.quantize(model, config, v.quant)
    weights.save_weights(model, out)
    save_config(config, out / "config.json")  # what mlx_lm.convert writes: sorted, indent 4
    write_tokenizer_files(out)


def _replace_dir(new: Path, final: Path) -> None:
    if final.exists():
        trash = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, trash)
        os.replace(new, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.replace(new, final)


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
    `head_dim` widens the heads (the zoo's are 16; quantized KV needs a group of 32+)."""
    if arch in ("diffusion_gemma", "llada2_moe"):  # held to mlx-vlm: their own builders
        return _make_oracle_vlm_checkpoint(arch, out_dir, quant=quant, dtype=dtype, seed=seed,
                                           hf_cache=hf_cache, head_dim=head_dim)
    v = variant(arch, quant=quant, dtype=dtype, seed=seed, head_dim=head_dim)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{v.name}.", dir=out_dir))
    try:
        built = work / v.name
        built.mkdir()
        build_files(v, built)
        if hf_cache:
            from mlxbun.zoo.hfcache import install_snapshot

            return install_snapshot(built, out_dir, v.repo_id)
        final = out_dir / v.name
        _replace_dir(built, final)
        return final
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _make_oracle_vlm_checkpoint(arch, out_dir, *, quant, dtype, seed, hf_cache, head_dim) -> Path:
    if quant is not None or head_dim is not None or hf_cache:
        raise ZooArgumentError(f"zoo arch {arch!r} is built in float weights only, as a plain directory "
                               "(no quant / head_dim / hf-cache)")
    if arch == "diffusion_gemma":
        from mlxbun.zoo.diffusion import make_diffusion_checkpoint

        return make_diffusion_checkpoint(out_dir, seed=seed, dtype=dtype)
    if dtype != "float32":
        raise ZooArgumentError("zoo arch 'llada2_moe' is built in float32 only")
    from mlxbun.zoo.llada import make_llada2_checkpoint

    return make_llada2_checkpoint(out_dir, seed=seed)
