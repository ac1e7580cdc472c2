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

    @property
    def name(self) -> str:
        parts = [f"tiny-{self.arch}"]
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


def variant(arch: str, *, quant=None, dtype: str = "float32", seed: int = 0) -> Variant:
    get_arch(arch)  # UnsupportedModelError naming the known archs
    if dtype not in DTYPES:
        raise ZooArgumentError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ZooArgumentError(f"seed must be a non-negative integer, got {seed!r}")
    return Variant(arch, parse_quant(quant), dtype, seed)


def build_files(v: Variant, out: Path) -> None:
    """Write every file of variant `v` into the existing empty directory `out`."""
    from mlx_lm.utils import save_config

    from mlxbun.zoo import weights
    from mlxbun.zoo.tokenizer import write_tokenizer_files

    config = tiny_config(v.arch)
    config["torch_dtype"] = v.dtype
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
) -> Path:
    """Build the tiny `arch` checkpoint under `out_dir` and return its directory:
    `out_dir/tiny-<arch>[-<variant>]`, or with `hf_cache` the snapshot dir of
    `out_dir/models--mlxbun--tiny-<arch>[-<variant>]`. Same arguments, same bytes."""
    v = variant(arch, quant=quant, dtype=dtype, seed=seed)
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
