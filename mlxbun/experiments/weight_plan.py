"""Mixed per-module weight quantization plans: a default (bits, group size) plus named modules
kept at other bits, expressed the way mlx-lm expresses it (a `quant_predicate` returning
per-module params; config.json's `quantization` block holds one entry per overridden module).

- `WeightPlan`: the plan; `.predicate` is mlx-lm's `quant_predicate` and mlxbun's `quant_for`;
  `.with_high(paths)` keeps modules at 8 bits;
- `apply_plan(model, plan)`: quantize an in-memory float model (mlxbun's `quantize_model`, the
  same QuantizedLinear a checkpoint of the plan loads into); `applied(...)` undoes it afterwards;
- `quantize_with_plan(src_dir, plan, out_dir)`: a float checkpoint re-quantized with the plan,
  written like `mlx_lm.convert` writes a mixed recipe (mlx-lm's `quantize_model` + `save_model`);
- `bits_per_weight(model, plan)`: what the plan stores per parameter, in the bfloat16 convention
  (scales and biases 16 bits each per group, unquantized parameters 16 bits).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.errors import MlxbunError
from mlxbun.quant import quantize_model

__all__ = ["WeightPlan", "applied", "apply_plan", "bits_per_weight", "quantizable_modules", "quantize_with_plan"]

AFFINE_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
_CHECKPOINT_FILES = ("config.json", "model.safetensors.index.json", "gguf_import.json")


def _check(bits: Any, group_size: Any, where: str) -> None:
    if isinstance(bits, bool) or bits not in AFFINE_BITS:
        raise MlxbunError(f"{where}: bits must be one of {AFFINE_BITS}, got {bits!r}")
    if isinstance(group_size, bool) or group_size not in GROUP_SIZES:
        raise MlxbunError(f"{where}: group_size must be one of {GROUP_SIZES}, got {group_size!r}")


@dataclass(frozen=True)
class WeightPlan:
    """Affine weight quantization: `bits` / `group_size` for every quantizable module, except
    `overrides` (module path -> (bits, group_size)). `label` names the plan in tables."""

    bits: int = 4
    group_size: int = 64
    overrides: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    label: str = ""

    def __post_init__(self):
        _check(self.bits, self.group_size, "WeightPlan")
        for path, spec in self.overrides.items():
            if not isinstance(spec, tuple) or len(spec) != 2:
                raise MlxbunError(f"WeightPlan.overrides[{path!r}] must be (bits, group_size), got {spec!r}")
            _check(*spec, f"WeightPlan.overrides[{path!r}]")

    def spec(self, path: str) -> tuple[int, int]:
        """(bits, group_size) of the module at `path`."""
        return self.overrides.get(path, (self.bits, self.group_size))

    def predicate(self, path: str, module: nn.Module):
        """mlx-lm's quant_predicate: False (left float: nothing to quantize, or rows the group
        size does not divide), True (the defaults), or the module's own params."""
        if not hasattr(module, "to_quantized"):
            return False
        bits, group = self.spec(path)
        if module.weight.shape[-1] % group:
            return False
        if (bits, group) == (self.bits, self.group_size):
            return True
        return {"group_size": group, "bits": bits, "mode": "affine"}

    def with_high(self, paths: Iterable[str], bits: int = 8, group_size: int | None = None,
                  label: str | None = None) -> "WeightPlan":
        """This plan with `paths` kept at `bits` (group size: this plan's unless given)."""
        spec = (bits, self.group_size if group_size is None else group_size)
        return replace(self, overrides={**self.overrides, **{p: spec for p in paths}},
                       label=self.label if label is None else label)

    @property
    def quantization(self) -> dict:
        """The defaults as mlx's quantization dict (overrides come through `predicate`)."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": "affine"}


def quantizable_modules(model: nn.Module, plan: WeightPlan | None = None) -> dict[str, nn.Module]:
    """path -> module of every module `plan` (default: 4-bit g64) would quantize, in tree order."""
    plan = plan or WeightPlan()
    return {p: m for p, m in model.named_modules() if p and plan.predicate(p, m)}


def _check_paths(model: nn.Module, plan: WeightPlan) -> None:
    known = dict(model.named_modules())
    unknown = sorted(p for p in plan.overrides if p not in known or not hasattr(known[p], "to_quantized"))
    if unknown:
        raise MlxbunError(f"plan overrides name modules that are not quantizable here: {', '.join(unknown[:5])}")


def apply_plan(model: nn.Module, plan: WeightPlan) -> nn.Module:
    """Quantize float `model` in place with `plan`; returns it."""
    _check_paths(model, plan)
    return quantize_model(model, plan.quantization, quant_for=plan.predicate)


@contextmanager
def applied(model: nn.Module, plan: WeightPlan):
    """`model` quantized with `plan` inside the block, its float modules put back after."""
    _check_paths(model, plan)
    original = quantizable_modules(model, plan)
    apply_plan(model, plan)
    try:
        yield model
    finally:
        model.update_modules(tree_unflatten(list(original.items())))


def bits_per_weight(model: nn.Module, plan: WeightPlan | None, *, float_bits: int = 16) -> float:
    """Stored bits per parameter of float `model` under `plan` (None: unquantized): a quantized
    weight costs bits + 2 * float_bits / group_size (affine scale and bias per group), every other
    parameter float_bits. float_bits=16 is a bfloat16 checkpoint's accounting."""
    total = sum(v.size for _, v in tree_flatten(model.parameters()))
    if plan is None or total == 0:
        return float(float_bits)
    stored = total * float_bits
    for path, m in quantizable_modules(model, plan).items():
        bits, group = plan.spec(path)
        stored += m.weight.size * (bits + 2 * float_bits / group - float_bits)
    return stored / total


def quantize_with_plan(src_dir, plan: WeightPlan, out_dir, *, overwrite: bool = False) -> Path:
    """Write float checkpoint `src_dir` re-quantized with `plan` into `out_dir` as mlx_lm.convert
    writes a mixed recipe: the weights through mlx-lm's `quantize_model` (plan.predicate as its
    quant_predicate) and `save_model`; config.json with the `quantization` block (one entry per
    overridden module); tokenizer and generation files copied. Returns `out_dir`."""
    from mlx_lm.utils import load_model, save_config, save_model
    from mlx_lm.utils import quantize_model as mlxlm_quantize

    src, out = Path(src_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise MlxbunError(f"src_dir {src}: no config.json (a float checkpoint directory is needed)")
    if json.loads((src / "config.json").read_text()).get("quantization"):
        raise MlxbunError(f"src_dir {src}: already quantized; give the float checkpoint (e.g. import --quant none)")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise MlxbunError(f"out_dir {out}: not empty (overwrite=True replaces it)")
        shutil.rmtree(out)
    model, config = load_model(src, lazy=True)
    _check_paths(model, plan)
    with contextlib.redirect_stdout(io.StringIO()):  # mlx-lm prints its bits per weight
        model, config = mlxlm_quantize(model, config, plan.group_size, plan.bits, mode="affine",
                                       quant_predicate=plan.predicate)
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model, donate_model=True)
    save_config(config, out / "config.json")
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _CHECKPOINT_FILES:
            shutil.copy2(f, out / f.name)
    return out
