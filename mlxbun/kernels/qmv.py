"""`quantized_matmul` for few rows through mlxbun's deterministic CUDA kernel, else MLX's op.

`fast_quantized_matmul(x, w, scales, biases, group_size, bits)` computes what
`mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits)` computes (the
product with the affine-dequantized weight) in a different summation order: its bits differ
from MLX's (the fast path's fidelity is measured, never claimed bit-exact), and they are the
same on every run. `kernel_gap(...)` says why the kernel does not apply to an input (None when
it does); the caller then runs MLX's op.

Metal: not implemented. The same warp-per-row idea maps onto `mx.fast.metal_kernel` (simdgroups
of 32), but no Apple GPU is reachable from this project's machines to test it, so on Metal the
standard op runs and the fast path says so.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlxbun.kernels.common import HALF as _HALF
from mlxbun.kernels.common import Gap, cuda_available
from mlxbun.kernels.qmv_source import HEADER, SOURCE
from mlxbun.kernels import tuning
from mlxbun.kernels.tuning import DEFAULT, launch_shape

__all__ = ["MAX_ROWS", "SUPPORTED_BITS", "SUPPORTED_GROUPS", "Gap", "cuda_available", "fast_quantized_matmul",
           "input_gap", "kernel_gap", "launch_qmv", "weight_gap"]

# Decode (1) and short speculative verifies: the kernel keeps M accumulators per lane, and on
# the H200 it lost to MLX's op from 8 rows on (0.27x at 8, 0.14x at 16; 1.6x at 4).
MAX_ROWS = 4
SUPPORTED_BITS = (4, 8)
SUPPORTED_GROUPS = (32, 64, 128)
_kernel = None


def weight_gap(w: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int, bits: int,
               mode: str = "affine") -> Optional[Gap]:
    """Why the kernel never runs a layer holding these weights here (None: it may, for inputs
    of the scales' dtype and few rows): decided once, when the fast path swaps the layer in."""
    if not cuda_available():
        return Gap("no CUDA device (the kernel is CUDA only)")
    if mode != "affine" or biases is None:
        return Gap(f"quantization mode {mode!r} (the kernel does affine)")
    if bits not in SUPPORTED_BITS:
        return Gap(f"{bits}-bit weights (the kernel does {SUPPORTED_BITS})")
    if group_size not in SUPPORTED_GROUPS:
        return Gap(f"group size {group_size} (the kernel does {SUPPORTED_GROUPS})")
    if scales.dtype not in _HALF or biases.dtype != scales.dtype:
        return Gap(f"{scales.dtype} scales (the kernel does bfloat16 and float16)")
    if w.ndim != 2 or w.dtype != mx.uint32 or (w.shape[1] * 32 // bits) % 128:
        return Gap(f"weight {w.shape} {w.dtype} (the kernel needs an input width K % 128 == 0)")
    if tuning.MODE == "off":
        return Gap("the GEMV kernel is off (kernels.tuning.MODE; in the decode step it measured slower "
                   "than MLX's op)", True)
    if launch_shape(bits, w.shape[0], w.shape[1] * 32 // bits, 1) is None:
        return Gap(f"MLX's quantized_matmul measured faster at {w.shape[0]}x{w.shape[1] * 32 // bits} "
                   f"{bits}-bit", True)
    return None


def input_gap(x: mx.array, w: mx.array, scales: mx.array) -> Optional[Gap]:
    """Why the kernel does not run this input through a layer `weight_gap` accepted."""
    if mx.default_device() != mx.gpu:
        return Gap(f"default device {mx.default_device()} (the kernel is CUDA only)")
    if x.ndim == 0 or x.size == 0 or x.dtype != scales.dtype:
        return Gap(f"input {x.shape} {x.dtype} for {scales.dtype} scales (the kernel wants them equal)")
    rows = x.size // x.shape[-1]
    if rows > MAX_ROWS:
        return Gap(f"{rows} rows (the kernel does 1..{MAX_ROWS}; MLX's GEMM is faster above)", True)
    return None


def kernel_gap(x: mx.array, w: mx.array, scales: mx.array, biases: Optional[mx.array], group_size: int,
               bits: int, mode: str = "affine") -> Optional[Gap]:
    """Why the kernel does not compute this product here (None: it does)."""
    gap = weight_gap(w, scales, biases, group_size, bits, mode)
    if gap is None and x.shape[-1] != w.shape[1] * 32 // bits:
        gap = Gap(f"input width {x.shape[-1]} for a weight of width {w.shape[1] * 32 // bits}")
    return gap or input_gap(x, w, scales)


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxbun_qmv", input_names=["x", "w", "scales", "biases"], output_names=["out"],
            source=SOURCE, header=HEADER, ensure_row_contiguous=True)
    return _kernel


def fast_quantized_matmul(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                          bits: int, *, rows_per_warp: Optional[int] = None,
                          warps_per_block: Optional[int] = None) -> mx.array:
    """x [..., K] @ dequantize(w [N, K*bits/32]).T -> [..., N] through the kernel (see `kernel_gap`)."""
    gap = kernel_gap(x, w, scales, biases, group_size, bits)
    if gap is not None and not gap.by_design:  # a direct call may run shapes the tuning leaves to MLX
        raise ValueError(f"fast_quantized_matmul does not apply: {gap.reason}")
    return launch_qmv(x, w, scales, biases, group_size, bits, rows_per_warp=rows_per_warp,
                      warps_per_block=warps_per_block)


def launch_qmv(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, group_size: int, bits: int, *,
               rows_per_warp: Optional[int] = None, warps_per_block: Optional[int] = None) -> mx.array:
    """`fast_quantized_matmul` without its checks: for callers that ran `kernel_gap` already."""
    k, n = x.shape[-1], w.shape[0]
    m = x.size // k
    rows, warps = launch_shape(bits, n, k, m) or DEFAULT
    rows = rows_per_warp or rows
    warps = warps_per_block or warps
    n_warps = -(-n // rows)
    out = _get_kernel()(
        inputs=[x.reshape(m, k), w, scales, biases],
        template=[("T", x.dtype), ("M", m), ("N", n), ("K", k), ("BITS", bits), ("GS", group_size),
                  ("ROWS", rows), ("BF16", x.dtype == mx.bfloat16)],
        grid=(n_warps * 32, 1, 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(m, n)], output_dtypes=[x.dtype])[0]
    return out.reshape(*x.shape[:-1], n)
