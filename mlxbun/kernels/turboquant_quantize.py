"""TurboQuant's quantize step for new tokens in one launch (the fast path's static TurboQuant cache).

`TurboQuantCodec.quantize` (mlxbun.cache.turboquant_codec) is some 15 MLX kernels per K or V of a
decode step (the norm, the Hadamard transform, a gather and a compare per index bit, a gather and
shifts per packing slot): on the H200 those launches, not the attention, set the fast path's
TurboQuant decode speed (benchmarks/gpu-h200-fast.md section 7).
`turboquant_quantize(x, signs, midpoints, bits, eps)` computes the same state from the codec's
arrays (float16 norms, packed codeword indices; the caller makes the TurboQuantState: the kernels
sit below the caches) with one block per vector:

1. the norm: squares summed lane-strided, a fixed xor-shuffle tree per warp, the warps' sums in
   warp order (deterministic), float32;
2. the unit vector times the codec's signs, a Walsh-Hadamard butterfly in shared memory
   (Sylvester order, as `mx.hadamard_transform`), times 1 / sqrt(D);
3. each coordinate's index: the count of the codebook's midpoints below it (what the codec's
   search computes);
4. the indices packed little-endian, index i at bit i * BITS, spilling into the next word, as
   `pack_indices` packs them.

The sums run in another order than MLX's, so a coordinate within a rounding of a midpoint may take
the neighbouring index: the fast path measures its drift, it is never called bit-exact. Head dims
that are powers of two (the Hadamard codec) up to 256; any BITS 1-8; float16, bfloat16 or float32 input.
Metal: not implemented.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx

from mlxbun.kernels.common import Gap, cuda_available, float_bits

__all__ = ["CHECKED", "HEAD_DIMS", "SOURCE", "quantize_gap", "template", "turboquant_quantize"]

HEAD_DIMS = (32, 64, 128, 256)  # one thread per coordinate; powers of two (the Hadamard rotation)

# inputs: x [R, D], signs [D], mid [2^BITS - 1]; outputs: norms [R] (float16), codes [R, W]
SOURCE = r"""
  constexpr int NW = D / 32;
  constexpr int NMID = (1 << BITS) - 1;
  constexpr int W = (D * BITS + 31) / 32;
  __shared__ float buf[D];
  __shared__ float warp_sums[NW];
  __shared__ float mids[NMID];
  __shared__ unsigned char ids[D];
  const int t = threadIdx.x;
  const size_t row = blockIdx.x;
  for (int j = t; j < NMID; j += D) {
    mids[j] = mid[j];
  }
  const float v = static_cast<float>(x[row * D + t]);
  float ss = v * v;
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    ss += __shfl_xor_sync(0xffffffffu, ss, o);
  }
  if ((t & 31) == 0) {
    warp_sums[t >> 5] = ss;
  }
  __syncthreads();
  float total = warp_sums[0];
#pragma unroll
  for (int w = 1; w < NW; ++w) {
    total += warp_sums[w];
  }
  const float norm = sqrtf(total);
  buf[t] = v / fmaxf(norm, __int_as_float(EPS_BITS)) * signs[t];
#pragma unroll
  for (int len = 1; len < D; len <<= 1) {
    __syncthreads();
    const float a = buf[t];
    const float b = buf[t ^ len];
    __syncthreads();
    buf[t] = (t & len) ? (b - a) : (a + b);
  }
  const float r = buf[t] * __int_as_float(SCALE_BITS);
  int idx = 0;
  for (int j = 0; j < NMID; ++j) {
    idx += r > mids[j] ? 1 : 0;
  }
  ids[t] = static_cast<unsigned char>(idx);
  __syncthreads();
  if (t == 0) {
    norms[row] = __float2half(norm);
  }
  if (t < W) {
    uint32_t word = 0u;
    const int first = (32 * t) / BITS;
    const int last = min(D - 1, (32 * t + 31) / BITS);
    for (int i = first; i <= last; ++i) {
      const int at = i * BITS - 32 * t;  // negative: the index began in the word before
      const uint32_t q = ids[i];
      word |= at >= 0 ? (q << at) : (q >> (-at));
    }
    codes[row * W + t] = word;
  }
"""

# Whether the kernel has passed `benchmarks/gpu_check.py --checks turboquant`'s quantize cases on the
# H200 (raw 13 of benchmarks/gpu-h200-fast-raw: the codec's norms and indices exactly, deterministic,
# compiled-equal). Set it False to take the kernel out while a change to it awaits that check.
CHECKED = True

_kernel = None


def quantize_gap(x: mx.array, dim: int, hadamard: bool) -> Optional[Gap]:
    """Why the quantize kernel does not run for vectors `x` [..., D] under a codec of head dim `dim`
    (`hadamard`: its rotation is the signed Hadamard transform) (None: it does)."""
    if not cuda_available():
        return Gap("no CUDA device (the kernel is CUDA only)")
    if mx.default_device() != mx.gpu:
        return Gap(f"default device {mx.default_device()} (the kernel is CUDA only)")
    if not CHECKED:
        return Gap("the TurboQuant quantize kernel has not yet passed its GPU check (benchmarks/gpu_check.py "
                   "--checks turboquant)")
    if x.shape[-1] != dim or dim not in HEAD_DIMS or not hadamard:
        return Gap(f"vectors of {x.shape[-1]} under a codec of dim {dim} (the kernel does the Hadamard "
                   f"codec's dims {HEAD_DIMS})")
    if x.dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return Gap(f"{x.dtype} vectors (the kernel reads float16, bfloat16 and float32)")
    return None


def template(dtype, dim: int, bits: int, eps: float) -> list[tuple[str, object]]:
    """The kernel's template constants for `dtype` vectors of `dim` at `bits` (norm floor `eps`)."""
    return [("T", dtype), ("D", dim), ("BITS", bits), ("EPS_BITS", float_bits(eps)),
            ("SCALE_BITS", float_bits(1.0 / math.sqrt(dim)))]


def turboquant_quantize(x: mx.array, signs: mx.array, midpoints: mx.array, bits: int,
                        eps: float) -> tuple[mx.array, mx.array]:
    """(norms float16 [...], packed indices uint32 [..., D * bits / 32]) of vectors `x` [..., D]: a
    TurboQuant codec's `quantize` in one launch, from its `signs`, `midpoints`, `bits` and norm floor
    (see the module; callers check `quantize_gap` first)."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(name="mlxbun_turboquant_quantize", input_names=["x", "signs", "mid"],
                                      output_names=["norms", "codes"], source=SOURCE, ensure_row_contiguous=True)
    lead, dim = x.shape[:-1], x.shape[-1]
    rows, width = math.prod(lead), (dim * bits + 31) // 32
    norms, codes = _kernel(inputs=[x.reshape(rows, dim), signs, midpoints], template=template(x.dtype, dim, bits, eps),
                           grid=(rows * dim, 1, 1), threadgroup=(dim, 1, 1), output_shapes=[(rows,), (rows, width)],
                           output_dtypes=[mx.float16, mx.uint32])
    return norms.reshape(lead), codes.reshape(*lead, width)
