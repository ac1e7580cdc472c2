"""Weight quantization, one job per section: parse, resolve, apply, count.

- parse: `parse_quantization` reads what a checkpoint declares, as mlx-lm's `load_model`
  reads it: config.json's `quantization` (mlx-lm's own block, with per-module overrides), else
  a Hugging Face `quantization_config` (top level, under `text_config`, or NVIDIA ModelOpt's
  `hf_quant_config.json` sidecar) mapped onto mlx packing. `TextConfig` keeps the result.
- resolve: `module_spec` answers "how is this module packed" (`TextConfig.quant_for`);
  `resolve_quantization` gives the dict mlx-lm's `load_model` applies, refusing formats
  mlxbun cannot load.
- apply: `quantize_model` swaps Linear/Embedding modules for quantized ones as `load_model`
  does; `check_quant_params` refuses what this mlx build cannot run, naming the module.
- count: `quantized_bits` / `logical_parameters` read packed weights back from safetensors
  headers (mlx-lm's parameter count).

Argument order: mlxbun's own API names (bits, group_size[, mode]), in that order, everywhere:
`QuantSpec`'s fields, the `MODE_DEFAULTS` / `QUANT_MODES` pairs, labels like "4-bit g64".
mlx and mlx-lm put group_size first, so they are always called with keyword arguments.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from mlxbun.config_reader import is_int, json_type, read_json
from mlxbun.errors import ConfigError, LoadError, MlxbunError, UnsupportedModelError, WeightsError

__all__ = [
    "MODE_DEFAULTS", "QUANT_MODES", "QuantSpec",
    "parse_quantization", "module_spec", "resolve_quantization",
    "quant_mode_supported", "check_quant_params", "infer_quant_config", "quantize_model",
    "quantized_bits", "logical_parameters",
]


@dataclass(frozen=True)
class QuantSpec:
    """How one module's weights are packed (mlx `nn.quantize` parameters)."""

    bits: int
    group_size: int
    mode: str = "affine"


# (bits, group_size) mlx.nn fills in for a missing one, per mode (nn's `_defaults_for_mode`).
MODE_DEFAULTS: Mapping[str, tuple[int, int]] = {
    "affine": (4, 64), "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32),
}
# mode -> the one (bits, group_size) pair it allows, or None when free (affine).
QUANT_MODES: Mapping[str, Optional[tuple[int, int]]] = {
    mode: None if mode == "affine" else pair for mode, pair in MODE_DEFAULTS.items()
}
# The fp modes by their pair: packed shapes with uint8 scales name their mode this way.
_FP_MODE_OF = {pair: mode for mode, pair in QUANT_MODES.items() if pair is not None}


# ---------------------------------------------------------------- parse


def parse_quantization(
    full: Mapping, label: str, directory: Path | None
) -> tuple[QuantSpec | None, dict[str, QuantSpec | None], str | None]:
    """(global spec, per-module overrides, quant_method) of a config.json dict.

    Overrides map module paths to a QuantSpec, or None for "left unquantized". A Hugging
    Face method mlx-lm dequantizes (plain fp8) or does not know gives spec None.
    """
    block, where = _declared_block(full)
    if block is None and directory is not None:  # NVIDIA ModelOpt keeps it in a sidecar
        sidecar = directory / "hf_quant_config.json"
        if sidecar.is_file():
            block, label = read_json(sidecar, required=True), str(sidecar)
    if not block:
        return None, {}, None
    if not isinstance(block, Mapping):
        raise ConfigError(f"{label}: key '{where}' must be an object, got {json_type(block)}")
    method = block.get("quant_method")
    if where != "quantization" and method is not None:
        return _hf_spec(block, method, where, label, ConfigError), {}, method
    spec = _quant_spec(where, block, label=label, defaults=(None, None))
    overrides: dict[str, QuantSpec | None] = {}
    for key, v in block.items():
        if isinstance(v, bool):  # class_predicate: False = leave unquantized, True = global params
            overrides[key] = spec if v else None
        elif isinstance(v, Mapping):  # to_quantized(**v): missing keys take the mode's defaults
            overrides[key] = _quant_spec(f"{where}.{key}", v, label=label, defaults=None)
    return spec, overrides, method


def _declared_block(full: Mapping) -> tuple[Any, str]:
    """config.json's quantization block and its key, in mlx-lm's order of precedence."""
    if full.get("quantization") is not None:
        return full["quantization"], "quantization"
    if full.get("quantization_config") is not None:
        return full["quantization_config"], "quantization_config"
    text = full.get("text_config")
    if isinstance(text, Mapping) and text.get("quantization_config") is not None:
        return text["quantization_config"], "text_config.quantization_config"
    return None, "quantization_config"


def _quant_spec(where: str, block: Mapping, *, label: str,
                defaults: tuple[int | None, int | None] | None) -> QuantSpec:
    """One block's (bits, group_size, mode); `defaults` None = the mode's mlx defaults."""
    mode = block.get("mode", "affine")
    if not isinstance(mode, str):
        raise ConfigError(f"{label}: key '{where}.mode' must be a string, got {json_type(mode)} {mode!r}")
    if defaults is None:
        defaults = MODE_DEFAULTS.get(mode, (None, None))
    values = {}
    for key, default in (("group_size", defaults[1]), ("bits", defaults[0])):
        v = block.get(key)
        if v is None:
            v = default
        if not is_int(v):
            what = "missing" if v is None else f"{json_type(v)} {v!r}"
            raise ConfigError(f"{label}: key '{where}.{key}' must be an integer, got {what}")
        values[key] = v
    return QuantSpec(bits=values["bits"], group_size=values["group_size"], mode=mode)


def _hf_spec(qc: Mapping, method: Any, where: str, label: str,
             error: type[MlxbunError]) -> QuantSpec | None:
    """mlx-lm's mapping of a Hugging Face quantization_config onto mlx packing.

    None: not mlx-packed (fp8 that mlx-lm dequantizes, or a method it does not know).
    `error` is the class refusals raise (the parser's ConfigError, the loader's
    UnsupportedModelError).
    """
    if method == "mxfp4":
        return QuantSpec(bits=4, group_size=32, mode="mxfp4")
    if method == "mxfp8":
        return QuantSpec(bits=8, group_size=32, mode="mxfp8")
    if method == "fp8":  # ue8m0 32x32 blocks stay packed as mxfp8; other fp8 dequantizes
        if qc.get("scale_fmt") == "ue8m0" and list(qc.get("weight_block_size", ())) == [32, 32]:
            return QuantSpec(bits=8, group_size=32, mode="mxfp8")
        return None
    if method == "compressed-tensors":
        fmt = qc.get("format")
        spec = {"nvfp4-pack-quantized": QuantSpec(bits=4, group_size=16, mode="nvfp4"),
                "mxfp4-pack-quantized": QuantSpec(bits=4, group_size=32, mode="mxfp4"),
                "pack-quantized": QuantSpec(bits=4, group_size=32, mode="affine")}.get(fmt)
        if spec is None:
            raise error(f"{label}: key '{where}.format' is {fmt!r}, an unsupported "
                        "compressed-tensors format (dequantize to bf16 before converting)")
        return spec
    if method == "modelopt":
        settings = qc.get("quantization", qc)
        algo = settings.get("quant_algo") if isinstance(settings, Mapping) else None
        if algo != "NVFP4":
            raise error(f"{label}: key '{where}.quant_algo' is {algo!r}; only NVFP4 is supported")
        group = settings.get("group_size", 16)
        if not is_int(group):
            raise error(f"{label}: key '{where}.group_size' must be an integer, got {group!r}")
        return QuantSpec(bits=4, group_size=group, mode="nvfp4")
    if method in _REWRITTEN:
        spec = _quant_spec(where, qc, label=label, defaults=(4, 128))
        if spec.bits != 4:
            raise error(f"{label}: key '{where}.bits' is {spec.bits}; only 4-bit {method} is supported")
        return QuantSpec(bits=spec.bits, group_size=spec.group_size, mode="affine")
    return None


# Methods mlx-lm loads by rewriting the weights into mlx packing at load time.
_REWRITTEN = ("awq", "gptq")


# ---------------------------------------------------------------- resolve


def module_spec(path: str, spec: QuantSpec | None, overrides: Mapping[str, QuantSpec | None],
                weight_prefix: str = "") -> QuantSpec | None:
    """The packing of the module at `path` (mlx-lm module path), None if unquantized.

    A per-module override wins (None = dense); else the global `spec`. With a VLM
    `weight_prefix` the path is also tried with the prefix added or removed, so both
    "model.layers.0.mlp.down_proj" and "language_model.model.layers.0..." resolve.
    """
    candidates = [path]
    if weight_prefix:
        candidates.append(path[len(weight_prefix):] if path.startswith(weight_prefix)
                          else weight_prefix + path)
    for candidate in candidates:
        if candidate in overrides:
            return overrides[candidate]
    return spec


def resolve_quantization(config: Mapping) -> Optional[dict]:
    """The mlx quantization dict mlx-lm's `load_model` would apply, or None.

    `config` is the raw config.json dict. mlx-lm's own "quantization" key wins and is
    returned as written (it may hold per-module overrides keyed by module path); a
    `quantization_config` (top-level, or under text_config) is mapped as `parse_quantization`
    maps it. Formats mlx-lm handles by rewriting weights (awq/gptq, bitnet) or by
    quantizing activations are refused (`UnsupportedModelError`).
    """
    label = "config.json"
    if config.get("quantize_activations", False):
        raise UnsupportedModelError(f"{label}: quantize_activations is not supported")
    block, where = _declared_block(config)
    if where == "quantization" or block:
        if not isinstance(block, Mapping):
            raise ConfigError(f"{label}: key '{where}' must be an object, got {json_type(block)}")
    if where == "quantization":
        return dict(block)
    if not block:
        return None
    method = block.get("quant_method")
    spec = None if method in _REWRITTEN else _hf_spec(block, method, where, label, UnsupportedModelError)
    if spec is None:
        raise UnsupportedModelError(
            f"{label}: {where}.quant_method {method!r} is not supported "
            "(mlxbun loads mlx-packed weights: mlx-lm 'quantization', mxfp4, mxfp8, "
            "fp8/ue8m0 32x32, compressed-tensors, modelopt NVFP4)"
        )
    return {"group_size": spec.group_size, "bits": spec.bits, "mode": spec.mode}


# ---------------------------------------------------------------- apply


@lru_cache(maxsize=None)
def quant_mode_supported(mode: str, bits: int, group_size: int) -> bool:
    """Whether this mlx build/backend quantizes (mode, bits, group_size): probed once."""
    try:
        # several groups wide: some kernels (nvfp4) refuse a single-group row
        w = mx.ones((2, 8 * group_size), dtype=mx.float32)
        out = mx.quantize(w, group_size=group_size, bits=bits, mode=mode)
        mx.eval(out)
        return True
    except (ValueError, RuntimeError, TypeError):
        return False


def check_quant_params(params: Mapping, where: str) -> None:
    """Refuse (mode, bits, group_size) mlx cannot run here, naming `where`."""
    mode = params.get("mode", "affine")
    if mode not in QUANT_MODES:
        raise UnsupportedModelError(
            f"{where}: quantization mode {mode!r} is not supported "
            f"(supported: {', '.join(QUANT_MODES)})"
        )
    bits, group_size = params.get("bits"), params.get("group_size")
    # None means "mlx's default for the mode", as QuantizedLinear resolves it.
    bits = MODE_DEFAULTS[mode][0] if bits is None else bits
    group_size = MODE_DEFAULTS[mode][1] if group_size is None else group_size
    for key, val in (("bits", bits), ("group_size", group_size)):
        if isinstance(val, bool) or not isinstance(val, int) or val <= 0:
            raise ConfigError(f"{where}: quantization {key} must be a positive int, got {val!r}")
    fixed = QUANT_MODES[mode]
    if fixed is not None and (bits, group_size) != fixed:
        raise UnsupportedModelError(
            f"{where}: mode {mode!r} needs bits={fixed[0]}, group_size={fixed[1]}; "
            f"got bits={bits}, group_size={group_size}"
        )
    if not quant_mode_supported(mode, bits, group_size):
        raise UnsupportedModelError(
            f"{where}: mlx {mx.__version__} on {mx.default_device()} cannot quantize "
            f"mode={mode!r} bits={bits} group_size={group_size}"
        )


def _dtype_of(t: Any):
    # mx.array -> .dtype; mlxbun.weights.TensorInfo -> .mx_dtype (dtype is a code there).
    d = getattr(t, "mx_dtype", None)
    return d if d is not None else t.dtype


def infer_quant_config(path: str, module: nn.Module, weights: Mapping[str, Any]) -> dict:
    """mlx-lm `utils.infer_quant_config`: params a saved weight was packed with.

    `weights` maps names to mx.arrays or `TensorInfo`s (only shapes/dtypes are read).
    """
    scales = weights[f"{path}.scales"]
    in_dims = module.weight.shape[-1]
    group_size = in_dims // scales.shape[-1]
    bits = (weights[f"{path}.weight"].shape[-1] * 32) // in_dims
    # Only affine keeps the scales in the weight dtype. Each of the other modes
    # allows exactly one (bits, group_size) pair.
    if _dtype_of(scales) != mx.uint8:
        return {"group_size": group_size, "bits": bits, "mode": "affine"}
    mode = _FP_MODE_OF.get((bits, group_size))
    if mode is not None:
        return {"group_size": group_size, "bits": bits, "mode": mode}
    raise LoadError(
        f"Cannot infer the quantization mode of {path}: "
        f"{bits} bits with group size {group_size}."
    )


def _takes_global_scale(module: nn.Module) -> bool:
    """Only some layers hold an nvfp4 tensor scale (mlx-lm `_takes_global_scale`)."""
    params = inspect.signature(module.to_quantized).parameters
    return "global_scale" in params


QuantRule = Callable[[str, nn.Module], Union[bool, dict]]


def quantize_model(
    model: nn.Module,
    quantization: Mapping,
    weights: Optional[Mapping[str, Any]] = None,
    *,
    quant_for: Optional[QuantRule] = None,
) -> nn.Module:
    """Swap Linear/Embedding modules for quantized ones, as mlx-lm's `load_model`.

    `quantization` is mlx-lm's dict: defaults `group_size`, `bits`, `mode`, plus
    per-module overrides keyed by module path (a params dict, or False = dense);
    an override always wins, as in mlx-lm. For every other module that has
    `to_quantized`:
      - `quant_for(path, module)`, when given, decides (False / True / params);
      - else with `weights` (names -> mx.array or TensorInfo): quantized only if
        `{path}.scales` is present, with params inferred from the packed shapes;
      - else (no weights, no rule): quantized with the defaults.
    Every resulting params set is checked first; unsupported ones raise
    `UnsupportedModelError` naming the module. The model is updated in place
    and returned.
    """
    if not isinstance(quantization, Mapping):
        raise ConfigError(f"quantization must be a mapping, got {quantization!r}")
    defaults = {
        "group_size": quantization.get("group_size"),
        "bits": quantization.get("bits"),
        "mode": quantization.get("mode", "affine"),
    }

    def rule(p, m):
        if p in quantization:
            return quantization[p]
        if not hasattr(m, "to_quantized"):
            return False
        if quant_for is not None:
            return quant_for(p, m)
        if weights is None:
            return True
        if f"{p}.scales" not in weights:
            return False
        params = infer_quant_config(p, m, weights)
        if f"{p}.global_scale" in weights and _takes_global_scale(m):
            params["global_scale"] = True
        return params

    def class_predicate(p, m):
        decision = rule(p, m)
        if not decision:
            return decision
        if not hasattr(m, "to_quantized"):
            raise UnsupportedModelError(
                f"quantization names module {p!r} ({type(m).__name__}), which cannot be quantized"
            )
        if isinstance(decision, bool):
            check_quant_params(defaults, f"module {p!r} (default quantization)")
        elif isinstance(decision, Mapping):
            check_quant_params(decision, f"module {p!r}")
            decision = dict(decision)  # nn.quantize pops keys; keep the config intact
        else:
            raise ConfigError(
                f"quantization for module {p!r} must be a bool or a params object, got {decision!r}"
            )
        return decision

    nn.quantize(
        model,
        group_size=defaults["group_size"],
        bits=defaults["bits"],
        mode=defaults["mode"],
        class_predicate=class_predicate,
    )
    return model


# ---------------------------------------------------------------- count

# The fp modes' (bits, group_size) by bits * group_size: what a packed row with uint8 scales fixes.
_FP_BY_PRODUCT = {bits * group: (bits, group) for bits, group in _FP_MODE_OF}
_AFFINE_BITS = (1, 2, 3, 4, 5, 6, 8)
_QUANT_AUX = ("scales", "biases", "global_scale")


def _is_packed(tensors: Mapping[str, Any], module: str) -> bool:
    w = tensors.get(f"{module}.weight")
    return w is not None and w.dtype == "U32" and f"{module}.scales" in tensors


def quantized_bits(module: str, weight: Any, scales: Any, quantization: Mapping | None) -> int:
    """Bits per element of an mlx-packed weight, from shapes plus the group size.

    `weight` / `scales` are `mlxbun.weights.TensorInfo`s. in_features = packed_cols * 32 /
    bits = scale_cols * group_size. uint8 scales mean an mx/nv fp mode, whose (bits,
    group_size) pair the product fixes; affine needs the group size from mlx-lm's
    `quantization` config (per-module entry first).
    """
    if not weight.shape or not scales.shape or scales.shape[-1] == 0:
        raise WeightsError(f"{weight.file}: tensor {weight.name!r}: packed weight and scales need a last dimension")
    packed, groups = weight.shape[-1] * 32, scales.shape[-1]
    if scales.dtype == "U8":
        pair = _FP_BY_PRODUCT.get(packed // groups) if packed % groups == 0 else None
        if pair is None:
            raise WeightsError(
                f"{weight.file}: tensor {weight.name!r}: shapes {weight.shape}/{scales.shape} "
                "fit no fp quantization mode"
            )
        return pair[0]
    cfg = quantization.get(module) if quantization else None
    if not isinstance(cfg, Mapping):
        cfg = quantization
    gs = cfg.get("group_size") if cfg else None
    if not is_int(gs) or gs <= 0:
        raise WeightsError(
            f"{weight.file}: tensor {weight.name!r} is packed (U32 with {module}.scales) but its group size "
            "is unknown; pass quantization={'group_size': ..., 'bits': ...} (mlx-lm's config key)"
        )
    bits, rem = divmod(packed, groups * gs)
    if rem or bits not in _AFFINE_BITS:
        raise WeightsError(
            f"{weight.file}: tensor {weight.name!r}: shapes {weight.shape}/{scales.shape} "
            f"do not fit group size {gs}"
        )
    return bits


def logical_parameters(tensors: Mapping[str, Any], quantization: Mapping | None = None) -> int:
    """Parameter count with packed weights unpacked, as mlx-lm's get_total_parameters.

    `tensors` maps names to `TensorInfo`s. A U32 `X.weight` with `X.scales` counts
    elements * 32 / bits; its scales, biases and global_scale are packing overhead and
    not counted. `quantization` is mlx-lm's config["quantization"] (affine packing needs
    its group size; `WeightIndex.num_parameters` reads it from config.json).
    """
    total = 0
    for name, info in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf in _QUANT_AUX and _is_packed(tensors, module):
            continue
        if leaf == "weight" and _is_packed(tensors, module):
            bits = quantized_bits(module, info, tensors[f"{module}.scales"], quantization)
            total += info.size * 32 // bits
        else:
            total += info.size
    return total
