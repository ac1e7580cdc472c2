"""Launch shapes of the quantized GEMV kernel, and the shapes where MLX's own op is faster.

From the H200 sweep `python3 benchmarks/gpu_check.py --quick --sweep` (bf16, group 64, one row;
its table is in benchmarks/gpu-h200-fast.md): a value is (output rows per warp, warps per
block), None where no launch shape beat `mx.quantized_matmul` (the caller then runs MLX's op).
Shapes the sweep did not cover get DEFAULT. `MODE` is "tuned" (the table), "all" (the kernel on
every shape it supports, DEFAULT launch) or "off" (never): a knob for measuring, not for users.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["DEFAULT", "MODE", "TUNED", "launch_shape"]

DEFAULT = (1, 4)
MODE = "tuned"
# (bits, N, K) -> launch shape for one row, or None: MLX's op measured faster there
TUNED: dict[tuple[int, int, int], Optional[tuple[int, int]]] = {
    (4, 4096, 4096): None,  # best 0.99x
    (4, 1024, 4096): None,  # best 0.51x
    (4, 14336, 4096): (1, 2),  # 1.16x
    (4, 4096, 14336): (4, 8),  # 1.08x
    (4, 128256, 4096): (4, 4),  # 2.07x
    (8, 4096, 4096): None,  # 0.60x at DEFAULT
    (8, 1024, 4096): None,  # 0.36x
    (8, 14336, 4096): None,  # 0.66x
    (8, 4096, 14336): None,  # 0.81x
}


def launch_shape(bits: int, n: int, k: int, m: int) -> Optional[tuple[int, int]]:
    """(rows per warp, warps per block) for an [m, k] x [n, k] product, None for MLX's op."""
    if MODE == "off":
        return None
    if MODE == "all" or m != 1:
        return DEFAULT
    return TUNED.get((bits, n, k), DEFAULT)
