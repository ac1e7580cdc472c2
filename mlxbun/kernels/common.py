"""What every mlxbun kernel module shares: the backend probe and the `Gap` a caller falls back on."""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

import mlx.core as mx

__all__ = ["HALF", "Gap", "cuda_available", "float_bits", "metal_available", "on_cuda_gpu"]

HALF = (mx.bfloat16, mx.float16)


@functools.lru_cache(maxsize=1)
def cuda_available() -> bool:
    """Whether MLX's CUDA backend is present (the kernels' only backend)."""
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


@functools.lru_cache(maxsize=1)
def metal_available() -> bool:
    """Whether MLX's Metal backend is present (only the untested Metal TurboQuant kernel uses it)."""
    return bool(getattr(mx, "metal", None) and mx.metal.is_available())


def on_cuda_gpu() -> bool:
    """Whether work built now runs on MLX's CUDA GPU (the backend is there and the default device is it)."""
    return cuda_available() and mx.default_device() == mx.gpu


class Gap(NamedTuple):
    """Why a kernel does not run on an input. `by_design`: a width or shape where MLX's op is
    the faster choice (nothing to report); otherwise a capability the kernel lacks."""

    reason: str
    by_design: bool = False


def float_bits(x: float) -> int:
    """The float32 bit pattern of `x` as a signed int: how a float reaches a kernel as a template
    constant (`__int_as_float(...)` in the source), since templates take ints, bools and dtypes."""
    return struct.unpack("<i", struct.pack("<f", float(x)))[0]
