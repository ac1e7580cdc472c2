"""Layers, norms, activations and load-time quantization as mlx-lm 0.32.2 computes them.

Where mlx-lm uses an `mlx.nn` class or function we re-export it unchanged;
what a target arch file defines itself is copied op-for-op (same ops, order,
dtypes, python-float constants, and `mx.compile` where the oracle compiles:
compiled and eager kernels may differ in the last bit). The source of each is
named in its docstring.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from functools import lru_cache, partial
from typing import Any, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import ConfigError, LoadError, UnsupportedModelError

__all__ = [
    # mlx.nn classes used as-is by mlx-lm
    "Linear", "Embedding", "QuantizedLinear", "QuantizedEmbedding", "RMSNorm", "LayerNorm",
    # norms defined in arch files
    "GemmaRMSNorm", "NemotronLayerNorm1P", "LayerNorm2D", "LayerNormPerHead", "rms_norm_no_weight",
    # activations
    "silu", "gelu", "gelu_approx", "relu", "relu2", "relu_squared",
    "swiglu", "precise_swiglu", "swiglu_oai", "SwigluOAI", "xielu", "XieLU",
    "gelu_mul", "gelu_approx_mul",
    # residual / logits
    "clip_residual", "logit_softcap", "softcap_compiled",
    # quantization
    "QUANT_MODES", "quant_mode_supported", "check_quant_params", "infer_quant_config",
    "resolve_quantization", "quantize_model",
]

# ---------------------------------------------------------------- mlx.nn as-is

Linear = nn.Linear
Embedding = nn.Embedding
QuantizedLinear = nn.QuantizedLinear
QuantizedEmbedding = nn.QuantizedEmbedding
RMSNorm = nn.RMSNorm
LayerNorm = nn.LayerNorm  # olmo/cohere/stablelm pass bias=False; nn.LayerNorm handles it

# mlx.nn's activations are themselves `mx.compile(shapeless=True)` functions.
silu = nn.silu
gelu = nn.gelu  # gemma, starcoder2
gelu_approx = nn.gelu_approx  # gemma2, gemma3_text, phi, gpt_neox
relu = nn.relu
relu2 = nn.relu2  # nanochat: mx.square(mx.maximum(x, 0))


# ---------------------------------------------------------------- norms


class GemmaRMSNorm(nn.Module):
    """gemma / gemma2 / gemma3_text `RMSNorm`: scale by (1 + weight), weight init ones."""

    def __init__(self, dims: int, eps: float = 1e-5):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class NemotronLayerNorm1P(nn.LayerNorm):
    """nemotron: LayerNorm scaled by (weight + 1)."""

    def __call__(self, x):
        weight = self.weight + 1 if "weight" in self else None
        bias = self.bias if "bias" in self else None
        return mx.fast.layer_norm(x, weight, bias, self.eps)


class LayerNorm2D(nn.Module):
    """cohere q/k norm: per-head weight [heads, head_dim] applied after a plain layer norm."""

    def __init__(self, d1, d2, eps):
        super().__init__()
        self.weight = mx.zeros((d1, d2))
        self.eps = eps

    def __call__(self, x):
        return self.weight * mx.fast.layer_norm(x, None, None, self.eps)


class LayerNormPerHead(nn.Module):
    """stablelm q/k norm: one bias-free LayerNorm per head (weights `norms.{i}.weight`)."""

    def __init__(self, head_dim, num_heads, eps):
        super().__init__()
        self.norms = [
            nn.LayerNorm(head_dim, eps=eps, bias=False) for _ in range(num_heads)
        ]
        self.eps = eps

    def __call__(self, x):
        w = mx.stack([n.weight for n in self.norms])
        return w * mx.fast.layer_norm(x, None, None, self.eps)


def rms_norm_no_weight(x, eps: float = 1e-5):
    """nanochat `rms_norm`: parameter-free fast RMSNorm (the oracle hard-codes eps 1e-5)."""
    return mx.fast.rms_norm(x, None, eps)


# ---------------------------------------------------------------- activations


@partial(mx.compile, shapeless=True)
def swiglu(gate, x):
    """mlx_lm/models/activations.py `swiglu` (compiled)."""
    return nn.silu(gate) * x


@partial(mx.compile, shapeless=True)
def precise_swiglu(h, gate, x):
    gate = nn.silu(gate.astype(mx.float32))
    x = x.astype(mx.float32)
    return (gate * x).astype(h.dtype)


@partial(mx.compile, shapeless=True)
def swiglu_oai(
    gate: mx.array, x: mx.array, alpha: float = 1.702, limit: float = 7.0
) -> mx.array:
    # GPT-OSS variant: clip the gate from above only, and add 1 to the linear part.
    gate = mx.minimum(gate, limit)
    x = mx.clip(x, -limit, limit)
    return (x + 1.0) * (gate * mx.sigmoid(alpha * gate))


class SwigluOAI(nn.Module):
    def __init__(self, alpha: float = 1.702, limit: float = 7.0):
        super().__init__()
        self._alpha = alpha
        self._limit = limit

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        return swiglu_oai(gate, x, alpha=self._alpha, limit=self._limit)


@partial(mx.compile, shapeless=True)
def xielu(x, alpha_p, alpha_n, beta, eps):
    alpha_p = nn.softplus(alpha_p)
    alpha_n = beta + nn.softplus(alpha_n)
    return mx.where(
        x > 0,
        alpha_p * mx.square(x) + beta * x,
        (mx.expm1(mx.minimum(x, eps)) - x) * alpha_n + beta * x,
    )


class XieLU(nn.Module):
    """apertus activation; `alpha_p`/`alpha_n`/`beta`/`eps` are checkpoint parameters."""

    def __init__(
        self,
        alpha_p_init=0.8,
        alpha_n_init=0.8,
        beta=0.5,
        eps=-1e-6,
    ):
        super().__init__()
        alpha_p_tensor = mx.array(alpha_p_init)
        alpha_n_tensor = mx.array(alpha_n_init - beta)
        self.alpha_p = mx.log(mx.exp(alpha_p_tensor) - 1)
        self.alpha_n = mx.log(mx.exp(alpha_n_tensor) - 1)

        self.beta = mx.array(beta)
        self.eps = mx.array(eps)

    def __call__(self, x: mx.array) -> mx.array:
        return xielu(x, self.alpha_p, self.alpha_n, self.beta, self.eps)


@partial(mx.compile, shapeless=True)
def relu_squared(x):
    """nemotron `relu_squared` (its own compiled fn; differs in form from nn.relu2)."""
    return nn.relu(x).square()


def gelu_mul(gate, up):
    """gemma MLP core, eager: nn.gelu(gate) * up."""
    return nn.gelu(gate) * up


def gelu_approx_mul(gate, up):
    """gemma2 / gemma3_text MLP core, eager: nn.gelu_approx(gate) * up."""
    return nn.gelu_approx(gate) * up


# ---------------------------------------------------------------- residual / logits


@partial(mx.compile, shapeless=True)
def clip_residual(x, y):
    """gemma3_text: fp16 residual add done in fp32 and clipped to the fp16 range."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(
        mx.float16
    )


def logit_softcap(x, cap: float):
    """gemma2's eager softcap (final logits and attention scores): tanh(x / cap) * cap."""
    x = mx.tanh(x / cap)
    return x * cap


@partial(mx.compile, shapeless=True)
def _nanochat_softcap(logits, cap=15.0):
    return cap * mx.tanh(logits / cap)


def softcap_compiled(logits, cap: float = 15.0):
    """nanochat's compiled `softcap`: cap * tanh(logits / cap).

    Called without `cap` for the default (what the oracle does), so the
    compiled graph is the very one the oracle builds.
    """
    if cap == 15.0:
        return _nanochat_softcap(logits)
    return _nanochat_softcap(logits, cap)


# ---------------------------------------------------------------- quantization

# mode -> the one (bits, group_size) pair it allows, or None when free (affine).
QUANT_MODES: Mapping[str, Optional[tuple[int, int]]] = {
    "affine": None,
    "mxfp4": (4, 32),
    "nvfp4": (4, 16),
    "mxfp8": (8, 32),
}
# What mlx.nn fills in for a missing bits / group_size (nn's _defaults_for_mode).
_MODE_DEFAULTS = {"affine": (4, 64), "mxfp4": (4, 32), "nvfp4": (4, 16), "mxfp8": (8, 32)}


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
    bits = _MODE_DEFAULTS[mode][0] if bits is None else bits
    group_size = _MODE_DEFAULTS[mode][1] if group_size is None else group_size
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
    if (bits, group_size) == (4, 16):
        return {"group_size": group_size, "bits": bits, "mode": "nvfp4"}
    if (bits, group_size) == (4, 32):
        return {"group_size": group_size, "bits": bits, "mode": "mxfp4"}
    if (bits, group_size) == (8, 32):
        return {"group_size": group_size, "bits": bits, "mode": "mxfp8"}

    raise LoadError(
        f"Cannot infer the quantization mode of {path}: "
        f"{bits} bits with group size {group_size}."
    )


def _takes_global_scale(module: nn.Module) -> bool:
    """Only some layers hold an nvfp4 tensor scale (mlx-lm `_takes_global_scale`)."""
    params = inspect.signature(module.to_quantized).parameters
    return "global_scale" in params


def resolve_quantization(config: Mapping) -> Optional[dict]:
    """The mlx quantization dict mlx-lm's `load_model` would apply, or None.

    `config` is the raw config.json dict. mlx-lm's own "quantization" key wins
    (it may hold per-module overrides keyed by module path); otherwise a
    `quantization_config` (top-level, or under text_config) is mapped the way
    load_model maps it. Formats mlx-lm handles by rewriting weights (awq/gptq,
    bitnet) or by quantizing activations are refused.
    """
    if config.get("quantize_activations", False):
        raise UnsupportedModelError("config.json: quantize_activations is not supported")
    quantization = config.get("quantization")
    if quantization is not None:
        if not isinstance(quantization, Mapping):
            raise ConfigError(f"config.json: 'quantization' must be an object, got {quantization!r}")
        return dict(quantization)
    qc = config.get("quantization_config")
    if qc is None:
        qc = (config.get("text_config") or {}).get("quantization_config")
    if not qc:
        return None
    if not isinstance(qc, Mapping):
        raise ConfigError(f"config.json: 'quantization_config' must be an object, got {qc!r}")
    method = qc.get("quant_method")
    if method == "mxfp4":
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    if method == "mxfp8":
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    if (
        method == "fp8"
        and qc.get("scale_fmt") == "ue8m0"
        and list(qc.get("weight_block_size", ())) == [32, 32]
    ):
        return {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    if method == "compressed-tensors":
        fmt = qc.get("format")
        if fmt == "nvfp4-pack-quantized":
            return {"group_size": 16, "bits": 4, "mode": "nvfp4"}
        if fmt == "mxfp4-pack-quantized":
            return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
        if fmt == "pack-quantized":
            return {"group_size": 32, "bits": 4, "mode": "affine"}
        raise UnsupportedModelError(
            f"config.json: compressed-tensors format {fmt!r} is not supported"
        )
    if method == "modelopt":
        settings = qc.get("quantization", qc)
        algo = settings.get("quant_algo")
        if algo != "NVFP4":
            raise UnsupportedModelError(f"config.json: unsupported modelopt quant_algo {algo!r}")
        return {"group_size": settings.get("group_size", 16), "bits": 4, "mode": "nvfp4"}
    raise UnsupportedModelError(
        f"config.json: quantization_config.quant_method {method!r} is not supported "
        "(mlxbun loads mlx-packed weights: mlx-lm 'quantization', mxfp4, mxfp8, "
        "fp8/ue8m0 32x32, compressed-tensors, modelopt NVFP4)"
    )


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
