"""Rotary position embeddings, ported op-for-op from mlx-lm 0.32.2.

`initialize_rope` and its classes mirror `mlx_lm/models/rope_utils.py`; the
other classes are the ropes a target arch defines in its own file (smollm3
NoPE, hunyuan's NTK-alpha rope, nanochat's negated-frequency rope, ministral3's
llama-4 attention scale). Frequency tables are built with the same mlx ops,
dtypes and python-float constants as the oracle so their bytes match; change
nothing here without re-running tests/test_rope.py.
"""

from __future__ import annotations

import math
from typing import List, Optional, Union

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import ConfigError, UnsupportedModelError

__all__ = [
    "RoPE",
    "SuScaledRoPE",
    "Llama3RoPE",
    "YarnRoPE",
    "ProportionalRoPE",
    "DynamicNTKScalingRoPE",
    "DynamicNTKAlphaRoPE",
    "NanochatRoPE",
    "NoPE",
    "apply_yarn_mscale",
    "initialize_rope",
    "rope_type_of",
    "llama4_attn_scale",
    "ROPE_TYPES",
]

# The plain rope every "default"/"linear"/"mrope" config gets: mlx's own class.
RoPE = nn.RoPE


class SuScaledRoPE(nn.Module):
    """LongRoPE / "su" scaling (Phi-3.x). Always uses the long factors, as mlx-lm."""

    def __init__(
        self,
        dims: int,
        base: float = 10000.0,
        max_position_embeddings: int = 131072,
        original_max_position_embeddings: int = 4096,
        short_factor: Union[List[float], float] = 1.0,
        long_factor: Union[List[float], float] = 1.0,
        short_mscale: Optional[float] = None,
        long_mscale: Optional[float] = None,
    ):
        super().__init__()
        self.original_max_position_embeddings = original_max_position_embeddings
        self.dim = dims

        freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        self._freqs = mx.array(long_factor, dtype=mx.float32) * freqs

        def default_scale(factor):
            return math.sqrt(
                1 + math.log(factor) / math.log(original_max_position_embeddings)
            )

        factor = max_position_embeddings / original_max_position_embeddings
        self._scale = long_mscale or (1.0 if factor <= 1.0 else default_scale(factor))

    def __call__(self, x, offset: Union[int, mx.array] = 0):
        return mx.fast.rope(
            x.at[..., : self.dim].multiply(self._scale),
            self.dim,
            traditional=False,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


class Llama3RoPE(nn.Module):
    def __init__(
        self,
        dims: int,
        max_position_embeddings: int = 2048,
        traditional: bool = False,
        base: float = 10000,
        scaling_config: Optional[dict] = None,
    ):
        super().__init__()
        self.dims = dims
        self.max_position_embeddings = max_position_embeddings
        self.traditional = traditional

        factor = scaling_config["factor"]
        low_freq_factor = scaling_config.get("low_freq_factor", 1.0)
        high_freq_factor = scaling_config.get("high_freq_factor", 4.0)
        old_context_len = scaling_config.get(
            "original_max_position_embeddings",
            8192,
        )

        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor

        # arange is int32 here (no dtype) exactly as in mlx-lm; the division promotes.
        freqs = base ** (mx.arange(0, dims, 2) / dims)
        wavelens = 2 * mx.pi * freqs

        freqs = mx.where(wavelens > low_freq_wavelen, freqs * factor, freqs)
        is_medium_freq = (wavelens > high_freq_wavelen) & (wavelens < low_freq_wavelen)
        smooth_factors = (old_context_len / wavelens - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        smooth_freqs = freqs / ((1 - smooth_factors) / factor + smooth_factors)
        self._freqs = mx.where(is_medium_freq, smooth_freqs, freqs)

    def extra_repr(self):
        return (
            f"{self.dims}, traditional={self.traditional}, "
            f"max_position_embeddings={self.max_position_embeddings}"
        )

    def __call__(self, x, offset: int = 0):
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


class YarnRoPE(nn.Module):
    def __init__(
        self,
        dims,
        traditional=False,
        max_position_embeddings=2048,
        base=10000,
        scaling_factor=1.0,
        original_max_position_embeddings=4096,
        beta_fast=32,
        beta_slow=1,
        mscale=1,
        mscale_all_dim=0,
    ):
        super().__init__()

        def yarn_find_correction_dim(num_rotations):
            return (
                dims
                * math.log(
                    original_max_position_embeddings / (num_rotations * 2 * math.pi)
                )
            ) / (2 * math.log(base))

        def yarn_find_correction_range():
            low = math.floor(yarn_find_correction_dim(beta_fast))
            high = math.ceil(yarn_find_correction_dim(beta_slow))
            return max(low, 0), min(high, dims - 1)

        def yarn_get_mscale(scale=1, mscale=1):
            if scale <= 1:
                return 1.0
            return 0.1 * mscale * math.log(scale) + 1.0

        def yarn_linear_ramp_mask(min_val, max_val, dim):
            if min_val == max_val:
                max_val += 0.001  # Prevent singularity

            linear_func = (mx.arange(dim, dtype=mx.float32) - min_val) / (
                max_val - min_val
            )
            return mx.clip(linear_func, 0, 1)

        self.mscale = yarn_get_mscale(scaling_factor, mscale) / yarn_get_mscale(
            scaling_factor, mscale_all_dim
        )
        freq_extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
        freq_inter = scaling_factor * freq_extra
        low, high = yarn_find_correction_range()
        freq_mask = 1.0 - yarn_linear_ramp_mask(low, high, dims // 2)
        self._freqs = (freq_inter * freq_extra) / (
            freq_inter * freq_mask + freq_extra * (1 - freq_mask)
        )
        self.dims = dims
        self.traditional = traditional

    def __call__(self, x, offset=0, scale=1.0, inverse=False):
        if self.mscale != 1.0:
            input_scale = 1.0 / self.mscale if inverse else self.mscale
            x = x.at[..., : self.dims].multiply(input_scale)
        freqs = -self._freqs if inverse else self._freqs
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=scale,
            offset=offset,
            freqs=freqs,
        )


class ProportionalRoPE(nn.Module):
    """Rotates the first `rotated_dims` of `dims`; the rest get infinite wavelength."""

    def __init__(
        self,
        dims: int,
        rotated_dims: int,
        traditional: bool = False,
        base: float = 10000.0,
        factor: float = 1.0,
    ):
        super().__init__()
        self.dims = dims
        self.traditional = traditional

        if rotated_dims > dims:
            raise ValueError("rotated_dims should be smaller than dims")

        exponents = mx.arange(0, rotated_dims, 2, dtype=mx.float32) / dims
        self._freqs = mx.concatenate(
            [
                factor * (base**exponents),
                mx.full(((dims - rotated_dims) // 2,), mx.inf),
            ]
        )

    def __call__(self, x, offset=0):
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


class DynamicNTKScalingRoPE(nn.Module):
    """rope_utils' "dynamic" type: the base grows with the sequence length."""

    def __init__(
        self,
        dims: int,
        max_position_embeddings: int,
        traditional: bool,
        base: float,
        factor: float,
    ):
        super().__init__()
        self.dims = dims
        self.max_position_embeddings = max_position_embeddings
        self.traditional = traditional
        self.base = base
        self.factor = factor

    def extra_repr(self) -> str:
        return (
            f"{self.dims}, traditional={self.traditional}, "
            f"max_position_embeddings={self.max_position_embeddings}, "
            f"factor={self.factor}"
        )

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        # x.shape: [batch, num_heads, seq_len, head_dim]
        if isinstance(offset, mx.array):
            return self._at_array_offset(x, offset)
        seq_len = max(x.shape[-2] + offset, self.max_position_embeddings)
        base = self.base * (
            (self.factor * seq_len / self.max_position_embeddings) - (self.factor - 1)
        ) ** (self.dims / (self.dims - 2))
        return mx.fast.rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=base,
            scale=1.0,
            offset=offset,
        )

    def _at_array_offset(self, x: mx.array, offset: mx.array) -> mx.array:
        """The same base from a position held in an array (the compiled decode step's, which must
        not read it into Python), applied as frequencies: mlx-lm's rule, not its bits."""
        seq_len = mx.maximum(x.shape[-2] + offset, self.max_position_embeddings).astype(mx.float32)
        base = self.base * (
            (self.factor * seq_len / self.max_position_embeddings) - (self.factor - 1)
        ) ** (self.dims / (self.dims - 2))
        freqs = base ** (mx.arange(0, self.dims, 2, dtype=mx.float32) / self.dims)
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0, offset=offset,
                            freqs=freqs)


class DynamicNTKAlphaRoPE(nn.Module):
    """hunyuan_v1_dense: NTK-alpha scaled base, frequencies precomputed (int arange)."""

    def __init__(
        self,
        dims: int,
        base: float = 10000,
        scaling_alpha: float = 1.0,
    ):
        super().__init__()
        self.dims = dims
        base = base * scaling_alpha ** (dims / (dims - 2))
        self._freqs = base ** (mx.arange(0, self.dims, 2) / self.dims)

    def __call__(self, x, offset: int = 0):
        return mx.fast.rope(
            x,
            self.dims,
            traditional=False,
            base=None,
            scale=1.0,
            offset=offset,
            freqs=self._freqs,
        )


class NanochatRoPE(nn.Module):
    """nanochat's rope: non-traditional layout with *negated* exp-built frequencies.

    Equivalent to the oracle's `apply_rotary_emb(x, offset, freqs=self._rope_freqs)`
    with the table its Attention precomputes; the whole last axis is rotated.
    """

    def __init__(self, dims: int, base: float = 10000.0):
        super().__init__()
        self.dims = dims
        half_D = dims // 2
        self._freqs = -mx.exp(
            mx.arange(0.0, half_D, dtype=mx.float32) * (math.log(base) / half_D)
        )

    def __call__(self, x, offset=0):
        return mx.fast.rope(
            x,
            dims=x.shape[-1],
            traditional=False,
            base=None,
            freqs=self._freqs,
            scale=1.0,
            offset=offset,
        )


class NoPE(nn.Module):
    """No-op rope (smollm3's no-rope layers)."""

    def __call__(self, x, offset: int = 0):
        return x


def llama4_attn_scale(size, offset, beta: float, max_position_embeddings: int):
    """ministral3's `_get_llama_4_attn_scale`: per-position query scale [.., L, 1].

    The caller casts the result to the activation dtype, as the oracle does.
    """
    if isinstance(offset, mx.array) and offset.ndim > 0:
        offset = offset[:, None]

    scaling = 1 + beta * mx.log(
        1 + mx.floor((mx.arange(size) + offset) / max_position_embeddings)
    )
    if scaling.ndim == 2:
        return scaling[:, None, :, None]
    else:
        return scaling[:, None]


def apply_yarn_mscale(scale: float, scaling_config: Optional[dict]) -> float:
    """Fold the yarn mscale into an attention scale (rope_utils.apply_yarn_mscale)."""
    if not scaling_config:
        return scale
    rope_type = scaling_config.get("type") or scaling_config.get("rope_type", "default")
    mscale_all_dim = scaling_config.get("mscale_all_dim", 0)
    factor = scaling_config.get("factor", 1)
    if rope_type == "default" or not mscale_all_dim or factor <= 1:
        return scale
    s = 0.1 * mscale_all_dim * math.log(factor) + 1.0
    return scale * s * s


# Every type initialize_rope accepts (what `rope_type_of` may return for a valid config).
ROPE_TYPES = (
    "default",
    "linear",
    "dynamic",
    "llama3",
    "yarn",
    "deepseek_yarn",
    "telechat3-yarn",
    "longrope",
    "proportional",
    "mrope",
)


def rope_type_of(scaling_config: Optional[dict]) -> str:
    """The rope type a scaling dict selects, resolved as initialize_rope does."""
    if scaling_config is None:
        return "default"
    return scaling_config.get("type") or scaling_config.get("rope_type", "default")


def _need(scaling_config: dict, key: str, rope_type: str):
    try:
        return scaling_config[key]
    except KeyError:
        raise ConfigError(
            f"rope_scaling of type {rope_type!r} lacks required key {key!r}"
        ) from None


def initialize_rope(
    dims,
    base,
    traditional,
    scaling_config: Optional[dict] = None,
    max_position_embeddings: Optional[int] = None,
):
    """Same signature and dispatch as mlx-lm's `rope_utils.initialize_rope`.

    Differences are only in error types: a missing key raises `ConfigError` and
    an unknown type `UnsupportedModelError` (mlx-lm: KeyError / ValueError).
    """
    rope_type = rope_type_of(scaling_config)

    if rope_type in ["default", "linear"]:
        scale = 1 / _need(scaling_config, "factor", rope_type) if rope_type == "linear" else 1.0
        return nn.RoPE(dims, traditional=traditional, base=base, scale=scale)

    elif rope_type == "dynamic":
        return DynamicNTKScalingRoPE(
            dims=dims,
            max_position_embeddings=max_position_embeddings,
            traditional=traditional,
            base=base,
            factor=_need(scaling_config, "factor", rope_type),
        )

    elif rope_type == "llama3":
        _need(scaling_config, "factor", rope_type)
        return Llama3RoPE(
            dims=dims,
            max_position_embeddings=max_position_embeddings,
            traditional=traditional,
            base=base,
            scaling_config=scaling_config,
        )
    elif rope_type in ("yarn", "deepseek_yarn", "telechat3-yarn"):
        scaling_factor = _need(scaling_config, "factor", rope_type)
        rope_kwargs = {
            key: scaling_config[key]
            for key in [
                "original_max_position_embeddings",
                "beta_fast",
                "beta_slow",
                "mscale",
                "mscale_all_dim",
            ]
            if key in scaling_config
        }
        return YarnRoPE(
            dims=dims,
            max_position_embeddings=max_position_embeddings,
            traditional=traditional,
            scaling_factor=scaling_factor,
            base=base,
            **rope_kwargs,
        )
    elif rope_type == "longrope":
        return SuScaledRoPE(
            dims=dims,
            base=base,
            max_position_embeddings=max_position_embeddings,
            original_max_position_embeddings=_need(
                scaling_config, "original_max_position_embeddings", rope_type
            ),
            short_factor=_need(scaling_config, "short_factor", rope_type),
            long_factor=_need(scaling_config, "long_factor", rope_type),
        )
    elif rope_type == "proportional":
        return ProportionalRoPE(
            dims=dims,
            rotated_dims=int(dims * scaling_config.get("partial_rotary_factor", 1.0)),
            traditional=traditional,
            base=base,
            factor=scaling_config.get("factor", 1.0),
        )
    elif rope_type == "mrope":
        mrope_section = scaling_config.get("mrope_section", [])
        if len(mrope_section) != 3:
            raise UnsupportedModelError(
                f"MRoPE currently only supports 3 sections, got {len(mrope_section)} "
                "(rope_scaling.mrope_section)"
            )
        return nn.RoPE(dims, traditional=traditional, base=base)
    else:
        raise UnsupportedModelError(
            f"Unsupported RoPE type {rope_type!r} (rope_scaling); supported: "
            + ", ".join(ROPE_TYPES)
        )
