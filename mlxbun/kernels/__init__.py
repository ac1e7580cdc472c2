"""mlxbun's own GPU kernels, the fast path's (`mlxbun.fast`) building blocks.

Each kernel is deterministic (same inputs, same bits, every run) and computes what an MLX op
computes in a different order, so a model running them is measured against the bit-exact
path (KLD, top-1 agreement), never called bit-exact. `kernel_gap` functions say why a kernel
does not apply to an input; callers fall back to MLX's op and say so once.
"""

from mlxbun.kernels import tuning
from mlxbun.kernels.qmv import MAX_ROWS, Gap, cuda_available, fast_quantized_matmul, kernel_gap

__all__ = ["MAX_ROWS", "Gap", "cuda_available", "fast_quantized_matmul", "kernel_gap", "tuning"]
