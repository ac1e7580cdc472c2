"""Launch shapes of the quantized GEMV kernel, and the shapes where MLX's own op is faster.

From the H200 sweeps (bf16, group 64, one row; tables in benchmarks/gpu-h200-fast.md): a value is
(output rows per warp, warps per block), None where no launch shape beat `mx.quantized_matmul`
(the caller then runs MLX's op). The values are the second session's, timed with the weights
cycled past the 50 MiB L2 (`gpu_check.py --hbm`): the first session's timings re-read one weight
from the L2 and overstated the kernel. Shapes the sweeps did not cover get DEFAULT.

`MODE` is "off" (never: the default), "tuned" (the table) or "all" (the kernel on every shape it
supports, DEFAULT launch): a knob for measuring. It is off by default because inside the decode
step the kernel lost to MLX's op even on the shapes where it wins alone (H200, compiled step:
Llama-3-8B 4-bit tuned 153 vs off 157 tok/s, Llama-3.2-1B 4-bit 304 vs 365;
benchmarks/gpu-h200-fast.md section 4).
"""

from __future__ import annotations

from typing import Optional

__all__ = ["DEFAULT", "MODE", "TUNED", "launch_shape"]

DEFAULT = (1, 4)
MODE = "off"
# (bits, N, K) -> launch shape for one row, or None: MLX's op measured faster there (from HBM)
TUNED: dict[tuple[int, int, int], Optional[tuple[int, int]]] = {
    (4, 4096, 4096): None,  # best 0.71x
    (4, 1024, 4096): None,  # best 0.77x
    (4, 14336, 4096): (1, 4),  # 1.11x
    (4, 4096, 14336): (4, 8),  # 1.37x
    (4, 128256, 4096): (4, 4),  # 2.24x
    (4, 2048, 2048): None,  # best 0.64x
    (4, 512, 2048): None,  # best 0.25x
    (4, 8192, 2048): None,  # best 0.69x
    (4, 2048, 8192): None,  # best 0.96x
    (4, 128256, 2048): (4, 8),  # 1.77x
    (8, 4096, 4096): None,  # best 0.61x
    (8, 1024, 4096): None,  # best 0.46x
    (8, 14336, 4096): None,  # best 0.86x
    (8, 4096, 14336): None,  # best 0.80x
    (8, 128256, 4096): (4, 4),  # 1.48x
    (8, 2048, 2048): None,  # best 0.41x
    (8, 512, 2048): None,  # best 0.39x
    (8, 8192, 2048): None,  # best 0.88x
    (8, 2048, 8192): None,  # best 0.65x
    (8, 128256, 2048): (4, 4),  # 1.40x
}


def launch_shape(bits: int, n: int, k: int, m: int) -> Optional[tuple[int, int]]:
    """(rows per warp, warps per block) for an [m, k] x [n, k] product, None for MLX's op."""
    if MODE == "off":
        return None
    if MODE == "all" or m != 1:
        return DEFAULT
    return TUNED.get((bits, n, k), DEFAULT)
