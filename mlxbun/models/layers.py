"""Layers, norms and activations as mlx-lm 0.32.2 computes them.

Where mlx-lm uses an `mlx.nn` class or function we re-export it unchanged;
what a target arch file defines itself is copied op-for-op (same ops, order,
dtypes, python-float constants, and `mx.compile` where the oracle compiles:
compiled and eager kernels may differ in the last bit). The source of each is
named in its docstring. Load-time quantization lives in `mlxbun.quant`.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

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


class OffsetRMSNorm(nn.Module):
    """plamo3's RMSNorm: scale by (weight + offset), the sum in the weight's dtype (weight init zeros)."""

    def __init__(self, dims: int, eps: float = 1e-6, offset: float = 1.0):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps, self.offset = eps, offset

    def __call__(self, x):
        return mx.fast.rms_norm(x, self.weight + self.offset, self.eps)


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
