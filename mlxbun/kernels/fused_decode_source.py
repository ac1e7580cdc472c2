"""CUDA source of the fused decode kernels: a dense layer's one-token step in seven launches, five
where `rope_attention_source`'s one launch takes steps 2 and 3 (its device helpers come from here).

Per layer of a standard pre-norm dense row (llama, qwen2, qwen3, mistral, ...), one token:

1. `QKV_PROJ`: RMSNorm of the hidden state and the q / k / v GEMVs, as one GEMV over all their
   rows (float32 sums, every SM busy: a block per head left most of an H100 idle).
2. `ROPE_KV`: one block per head (HQ query heads, then HKV key heads, then HKV value heads): the
   biases, the q / k norms, RoPE, and the new key and value rows, written to `kv_new` and, in
   place, into the static K/V buffer (`INPLACE`, see `fused_decode`), and `next_pos` = pos + 1.
3. decode attention: `sdpa_decode`'s two launches (split-K, fixed-order merge).
4. `GEMV` with RESIDUAL: the output projection plus the residual.
5. `GEMV_SWIGLU`: RMSNorm, the gate and up GEMVs and silu(gate) * up.
6. `GEMV` with RESIDUAL: the down projection plus the residual.

and once per step `GEMV` with NORM: the final norm and the head.

Every GEMV gives a warp RW rows: a lane walks them in 16-byte weight chunks (8 16-bit values, or 32
4-bit / 16 8-bit codes inside one quantization group: `scale * sum(q x) + bias * sum(x)` in float32),
and the warp adds its 32 lane sums per row with a fixed xor-shuffle tree. Block sums (the norms) add
the warps' sums in warp order. Nothing is atomic: the same inputs give the same bits on every run.
Rounding follows the exact path's dtypes where it rounds (a projection's output, the norm's
normalized value, the residual sum), but sums run in another order than MLX's: the fast path
measures its drift, it never claims bit-exactness.

Template constants (written in front of the body by `mx.fast.cuda_kernel`): T, BF16, K (input
width), N (output rows), BITS (16: 16-bit weights; 4 or 8: affine codes), GS (quantization group),
NW (warps per block), SPLIT (warps per RW rows: each takes every SPLIT-th 32 chunks, their sums
added in warp order), RW (rows per warp), CODES (how `mlxbun_rows_dot` turns codes into floats),
QUNROLL (its code loop's unrolling, 0: its own choice), NORM_VEC (the norm's x and weight read once in
16-byte loads: `mlxbun_stage_x`), NORM, RESIDUAL, EPS_BITS (the norm's eps as float32 bits); QKV_PROJ
NQ and NKV (its q and k / v rows) instead of N; ROPE_KV T, NW, HQ, HKV, D, QK_NORM, QK_EPS_BITS, BIAS,
ROPE_TRAD, ROPE_SCALE_BITS, CAP (buffer positions), INPLACE.
"""

from mlxbun.kernels.qmv_source import HEADER as HALF_HEADER

__all__ = ["GEMV", "GEMV_SWIGLU", "HEADER", "HELPERS", "QKV_PROJ", "ROPE_KV"]

# The fused kernels' device helpers (after the 16-bit unpacking of `qmv_source`): ROPE_ATTENTION
# puts them behind the decode attention's header.
HELPERS = r"""
// This lane's shares of R weight rows' dot products with one x: `w[r]` is row r (BITS 16: its K
// 16-bit values; BITS 4 / 8: its packed uint32 codes, with the per-group scales `s[r]` and biases
// `b[r]`, affine: w = s * q + b). A lane takes the 16-byte chunks start, start + STRIDE, ... (a
// warp's 32 lanes start at consecutive chunks; SPLIT warps of a row interleave theirs). Each chunk
// of x is read and converted once for all R rows, and the R rows' loads are in flight together.
// Codes become floats without an int-to-float conversion, from the 16 low bits of a word (the high
// half is shifted down first), in one of two ways (CODES):
// - 0: (q << 4i) | 0x4b000000 is the float 2^23 + q * 16^i; x comes pre-divided by 16^i (a power of
//   two: exact), so (that - 2^23) * x' is q * x exactly: three instructions per code (LOP3, FADD, FFMA).
// - 1: q << 4i alone is the subnormal float q * 16^i * 2^-149 (MLX's NVRTC keeps subnormals: no
//   -ftz); x comes multiplied by 2^(149 - SHIFT) / 16^i, so the FFMA's product is q * x * 2^-SHIFT
//   exactly and the sum runs scaled by 2^-SHIFT (a power of two: the same roundings), undone in the
//   scale: two instructions per code (LOP3, FFMA), the same bits as CODES 0 while |x| < 2^(SHIFT - 21)
//   and no product q * x is below 2^(SHIFT - 126) (there the scaled product would be subnormal).
// Either way each row's sums are the plain loop's: `scale * sum(q x) + bias * sum(x)` per chunk in
// float32.
template <int BITS, int K, int GS, bool BF16, int STRIDE, int R, int CODES, int QUNROLL, typename X, typename W,
          typename S>
__device__ __forceinline__ void mlxbun_rows_dot(const X* x, const W* const* w, const S* const* s, const S* const* b,
                                                int start, float* acc) {
  const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    acc[r] = 0.0f;
  }
  if constexpr (BITS == 16) {
    constexpr int UNROLL = R >= 2 ? 2 : 4;  // about 4 rows' chunks in flight per lane
#pragma unroll(UNROLL)
    for (int c = start; c < K / 8; c += STRIDE) {
      uint4 wq[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wq[r] = reinterpret_cast<const uint4*>(w[r])[c];
      }
      float xf[8];
      unpack8<BF16>(xv[c], xf);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float wf[8];
        unpack8<BF16>(wq[r], wf);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[r] += wf[j] * xf[j];
        }
      }
    }
  } else {
    constexpr int VALS = 128 / BITS;        // codes in one 16-byte chunk
    constexpr int PER_HALF = 16 / BITS;     // codes in 16 bits of a word
    constexpr unsigned int MASK = (1u << BITS) - 1u;
    constexpr unsigned int MAGIC = CODES == 0 ? 0x4b000000u : 0u;  // the float 2^23, or none (subnormal)
    constexpr unsigned int SHIFT = 80;  // CODES 1: the sums' scale 2^-SHIFT
    constexpr unsigned int X_EXP = CODES == 0 ? 127u : 127u + 149u - SHIFT;  // x's factor before / 16^i
    constexpr int UNROLL = QUNROLL > 0 ? QUNROLL : (R >= 2 ? 1 : 2);
#pragma unroll(UNROLL)
    for (int c = start; c < K / VALS; c += STRIDE) {
      const int k0 = c * VALS;
      uint4 wq[R];
#pragma unroll
      for (int r = 0; r < R; ++r) {
        wq[r] = reinterpret_cast<const uint4*>(w[r])[c];
      }
      float xf[VALS];
#pragma unroll
      for (int p = 0; p < VALS / 8; ++p) {
        unpack8<BF16>(xv[k0 / 8 + p], xf + 8 * p);
      }
      float sx = 0.0f;
#pragma unroll
      for (int j = 0; j < VALS; ++j) {
        sx += xf[j];
        xf[j] *= __uint_as_float((X_EXP - BITS * (j % PER_HALF)) << 23);  // a power of two: exact
      }
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const unsigned int words[4] = {wq[r].x, wq[r].y, wq[r].z, wq[r].w};
        float qx = 0.0f;
#pragma unroll
        for (int j = 0; j < VALS; ++j) {
          const unsigned int word = words[j / (2 * PER_HALF)];
          const unsigned int half = (j / PER_HALF) % 2 ? word >> 16 : word;
          const unsigned int bits = (half & (MASK << (BITS * (j % PER_HALF)))) | MAGIC;
          if constexpr (CODES == 0) {
            qx += (__uint_as_float(bits) - 8388608.0f) * xf[j];
          } else {
            qx += __uint_as_float(bits) * xf[j];
          }
        }
        if constexpr (CODES != 0) {
          qx *= __uint_as_float((127u + SHIFT) << 23);  // 2^SHIFT: back to the plain sum, exactly
        }
        acc[r] += static_cast<float>(s[r][k0 / GS]) * qx + static_cast<float>(b[r][k0 / GS]) * sx;
      }
    }
  }
}

__device__ __forceinline__ float mlxbun_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// Where each run of 8 values of x sits in shared memory for the tensor-core GEMVs (mma_gemv_source):
// x0 x4 x1 x5 x2 x6 x3 x7, so that one 16-byte load gives the mma's B pairs of a code word.
__device__ __forceinline__ int mlxbun_pair_index(int i) {
  return (i & ~7) | ((i & 3) << 1) | ((i >> 2) & 1);
}

// After every warp's sums are in `parts` (NW * R floats, warp-major): the SPLIT warps of each row
// group (warps g * SPLIT .. g * SPLIT + SPLIT - 1) added in warp order into `row_sums[g * R + r]`.
// Every thread must call it.
template <int NW, int SPLIT, int R>
__device__ __forceinline__ void mlxbun_add_splits(const float* parts, float* row_sums) {
  if constexpr (SPLIT > 1) {
    if (threadIdx.x < NW / SPLIT * R) {
      const int g = threadIdx.x / R, r = threadIdx.x % R;
      float total = parts[g * SPLIT * R + r];
#pragma unroll
      for (int i = 1; i < SPLIT; ++i) {
        total += parts[(g * SPLIT + i) * R + r];
      }
      row_sums[threadIdx.x] = total;
    }
    __syncthreads();
  }
}

// The SPLIT warps of each row group (warps g * SPLIT .. g * SPLIT + SPLIT - 1, R rows each) add their
// sums, in warp order, into `row_sums[g * R + r]` (lane 0 of each warp brings its warp's R sums `v`).
// `parts` holds NW * R floats. Every thread must call it.
template <int NW, int SPLIT, int R>
__device__ __forceinline__ void mlxbun_split_sums(const float* v, float* parts, float* row_sums) {
  const int warp = threadIdx.x >> 5;
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      (SPLIT == 1 ? row_sums : parts)[warp * R + r] = v[r];
    }
  }
  __syncthreads();
  mlxbun_add_splits<NW, SPLIT, R>(parts, row_sums);
}

// The block's sum of `v`, the same bits in every thread: each warp's xor tree, then the NW warp
// sums added in warp order. Every thread of the block must call it.
template <int NW>
__device__ __forceinline__ float mlxbun_block_sum(float v, float* red) {
  v = mlxbun_warp_sum(v);
  __syncthreads();  // an earlier call's readers are done with `red`
  if ((threadIdx.x & 31) == 0) {
    red[threadIdx.x >> 5] = v;
  }
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int i = 0; i < NW; ++i) {
    total += red[i];
  }
  return total;
}

// xs = rms_norm(x) * w over K values, into shared memory, rounded to T where MLX's RMSNorm rounds.
template <typename T, int K, int NW>
__device__ __forceinline__ void mlxbun_rms_to_shared(const T* x, const T* w, float eps, T* xs, float* red) {
  float ss = 0.0f;
  for (int i = threadIdx.x; i < K; i += NW * 32) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float inv = rsqrtf(mlxbun_block_sum<NW>(ss, red) / K + eps);
  for (int i = threadIdx.x; i < K; i += NW * 32) {
    const float n = static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * inv));
    xs[i] = static_cast<T>(n * static_cast<float>(w[i]));
  }
  __syncthreads();
}

template <typename T>
__device__ __forceinline__ float mlxbun_round(float v) {
  return static_cast<float>(static_cast<T>(v));
}

// x [K] into shared memory, 16 bytes a thread at a time; NORMED: rms_norm(x) * w instead, rounded to
// T where MLX's RMSNorm rounds (x and w read once, in one round of loads: `mlxbun_rms_to_shared`
// makes two passes of 2-byte loads, and adds the squares in another order). PAIRS (the tensor-core
// GEMVs, mma_gemv_source): each value at its `mlxbun_pair_index`, and gsum[G] = the sum over
// quantization group G (a group's chunks are consecutive lanes': an xor tree of GS / 8 lanes).
template <typename T, bool BF16, int K, int GS, int NW, bool NORMED, bool PAIRS>
__device__ __forceinline__ void mlxbun_stage_x(const T* x, const T* w, float eps, T* xs, float* gsum, float* red) {
  constexpr int CHUNKS = K / 8, PER = (CHUNKS + NW * 32 - 1) / (NW * 32);  // 16-byte chunks a thread
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  uint4 xr[PER], wr[PER];
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int c = threadIdx.x + p * NW * 32;
    if (c < CHUNKS) {
      xr[p] = xv[c];
      if constexpr (NORMED) {
        wr[p] = wv[c];
      }
    }
  }
  float inv = 1.0f;
  if constexpr (NORMED) {
    float ss = 0.0f;
#pragma unroll
    for (int p = 0; p < PER; ++p) {
      if (threadIdx.x + p * NW * 32 < CHUNKS) {
        float v[8];
        unpack8<BF16>(xr[p], v);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          ss += v[j] * v[j];
        }
      }
    }
    inv = rsqrtf(mlxbun_block_sum<NW>(ss, red) / K + eps);
  }
#pragma unroll
  for (int p = 0; p < PER; ++p) {
    const int c = threadIdx.x + p * NW * 32;
    float total = 0.0f;
    if (c < CHUNKS) {
      float v[8];
      unpack8<BF16>(xr[p], v);
      if constexpr (NORMED) {
        float g[8];
        unpack8<BF16>(wr[p], g);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          v[j] = mlxbun_round<T>(mlxbun_round<T>(v[j] * inv) * g[j]);
        }
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        xs[PAIRS ? mlxbun_pair_index(c * 8 + j) : c * 8 + j] = static_cast<T>(v[j]);
        total += v[j];
      }
    }
    if constexpr (PAIRS) {
#pragma unroll
      for (int o = GS / 16; o > 0; o >>= 1) {  // every lane: a warp's chunks are whole groups' or none
        total += __shfl_xor_sync(0xffffffffu, total, o);
      }
      if (c < CHUNKS && c % (GS / 8) == 0) {
        gsum[c / (GS / 8)] = total;
      }
    }
  }
  __syncthreads();
}

// The FFMA GEMVs' norm prologue: rms_norm(x) * w into shared memory in x's order, by
// `mlxbun_stage_x` (VEC: one pass of 16-byte loads) or `mlxbun_rms_to_shared` (two passes).
template <typename T, bool BF16, int K, int GS, int NW, bool VEC>
__device__ __forceinline__ void mlxbun_norm_to_shared(const T* x, const T* w, float eps, T* xs, float* red) {
  if constexpr (VEC) {
    mlxbun_stage_x<T, BF16, K, GS, NW, true, false>(x, w, eps, xs, nullptr, red);
  } else {
    mlxbun_rms_to_shared<T, K, NW>(x, w, eps, xs, red);
  }
}

// Element t of a head after RoPE at position `pos`: y (its value) rotated with its partner in
// `head` (the whole head's values: the traditional layout pairs neighbours, the other the halves),
// rounded to T.
template <typename T, bool TRAD, int D>
__device__ __forceinline__ float mlxbun_rope(float y, const float* head, int t, int pos, float scale,
                                             const float* inv_freq) {
  int i, partner;
  float sign;
  if constexpr (TRAD) {
    i = t / 2;
    partner = t ^ 1;
    sign = (t & 1) ? 1.0f : -1.0f;
  } else {
    i = t % (D / 2);
    partner = t < D / 2 ? t + D / 2 : t - D / 2;
    sign = t < D / 2 ? -1.0f : 1.0f;
  }
  const float theta = static_cast<float>(pos) * scale * inv_freq[i];
  float sn, cs;
  sincosf(theta, &sn, &cs);
  return mlxbun_round<T>(y * cs + sign * head[partner] * sn);
}
"""
HEADER = HALF_HEADER + HELPERS

# out[n] = (residual[n] +) w[n] . (rms_norm(x) or x); RW rows per warp (SPLIT warps per RW rows).
GEMV = r"""
  constexpr int ROW_W = BITS == 16 ? K : K * BITS / 32;  // weight elements per row
  constexpr int GROUPS = BITS == 16 ? 1 : K / GS;
  constexpr int RPB = NW / SPLIT * RW;  // rows per block
  __shared__ __align__(16) T xs[NORM ? K : 8];
  __shared__ float red[32];
  __shared__ float parts[NW * RW];
  __shared__ float sums[RPB];
  const T* xin = x;
  if constexpr (NORM) {
    mlxbun_norm_to_shared<T, BF16, K, GS, NW, NORM_VEC>(x, norm_w, __int_as_float(EPS_BITS), xs, red);
    xin = xs;
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = blockIdx.x * RPB + warp / SPLIT * RW;
  decltype(w) wr[RW];
  const T* sr[RW];
  const T* br[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const size_t r = static_cast<size_t>(min(row0 + i, N - 1));  // rows past N: read row N - 1, unused
    wr[i] = w + r * ROW_W;
    sr[i] = scales + r * GROUPS;
    br[i] = biases + r * GROUPS;
  }
  float acc[RW];
  mlxbun_rows_dot<BITS, K, GS, BF16, 32 * SPLIT, RW, CODES, QUNROLL>(xin, wr, sr, br, (warp % SPLIT) * 32 + lane,
                                                                    acc);
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    acc[i] = mlxbun_warp_sum(acc[i]);
  }
  mlxbun_split_sums<NW, SPLIT, RW>(acc, parts, sums);
  const int out_row = blockIdx.x * RPB + threadIdx.x;
  if (threadIdx.x < RPB && out_row < N) {
    float y = mlxbun_round<T>(sums[threadIdx.x]);
    if constexpr (RESIDUAL) {
      y = static_cast<float>(residual[out_row]) + y;
    }
    out[out_row] = static_cast<T>(y);
  }
"""

# out[n] = silu(gate[n] . rms_norm(x)) * (up[n] . rms_norm(x)); RW rows of both per warp.
GEMV_SWIGLU = r"""
  constexpr int ROW_W = BITS == 16 ? K : K * BITS / 32;
  constexpr int GROUPS = BITS == 16 ? 1 : K / GS;
  constexpr int RPB = NW / SPLIT * RW;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  __shared__ float parts[NW * 2 * RW];
  __shared__ float sums[2 * RPB];  // per row group: RW gate sums, then RW up sums
  mlxbun_norm_to_shared<T, BF16, K, GS, NW, NORM_VEC>(x, norm_w, __int_as_float(EPS_BITS), xs, red);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = blockIdx.x * RPB + warp / SPLIT * RW;
  decltype(wg) wr[2 * RW];
  const T* sr[2 * RW];
  const T* br[2 * RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const size_t r = static_cast<size_t>(min(row0 + i, N - 1));
    wr[i] = wg + r * ROW_W;
    sr[i] = sg + r * GROUPS;
    br[i] = bg + r * GROUPS;
    wr[RW + i] = wu + r * ROW_W;
    sr[RW + i] = su + r * GROUPS;
    br[RW + i] = bu + r * GROUPS;
  }
  float acc[2 * RW];
  mlxbun_rows_dot<BITS, K, GS, BF16, 32 * SPLIT, 2 * RW, CODES, QUNROLL>(xs, wr, sr, br, (warp % SPLIT) * 32 + lane,
                                                                       acc);
#pragma unroll
  for (int i = 0; i < 2 * RW; ++i) {
    acc[i] = mlxbun_warp_sum(acc[i]);
  }
  mlxbun_split_sums<NW, SPLIT, 2 * RW>(acc, parts, sums);
  const int out_row = blockIdx.x * RPB + threadIdx.x;
  if (threadIdx.x < RPB && out_row < N) {
    const int g = threadIdx.x / RW, i = threadIdx.x % RW;
    const float gt = mlxbun_round<T>(sums[g * 2 * RW + i]);
    const float act = mlxbun_round<T>(gt / (1.0f + expf(-gt)));
    out[out_row] = static_cast<T>(act * mlxbun_round<T>(sums[g * 2 * RW + RW + i]));
  }
"""

# sums[n] = w[n] . rms_norm(x) in float32 for the rows of q, then k, then v (NQ, NKV, NKV rows), RW
# rows per warp: the q / k / v projections as one GEMV over every SM (their bias, norms and RoPE
# follow in ROPE_KV, which needs a whole head).
QKV_PROJ = r"""
  constexpr int ROW_W = BITS == 16 ? K : K * BITS / 32;
  constexpr int GROUPS = BITS == 16 ? 1 : K / GS;
  constexpr int N = NQ + 2 * NKV;
  constexpr int RPB = NW / SPLIT * RW;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  __shared__ float parts[NW * RW];
  __shared__ float rows[RPB];
  mlxbun_norm_to_shared<T, BF16, K, GS, NW, NORM_VEC>(x, norm_w, __int_as_float(EPS_BITS), xs, red);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row0 = blockIdx.x * RPB + warp / SPLIT * RW;
  decltype(wq) wr[RW];
  const T* sr[RW];
  const T* br[RW];
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    const int n = min(row0 + i, N - 1);  // rows past N: read row N - 1, unused
    const int kind = n < NQ ? 0 : (n < NQ + NKV ? 1 : 2);
    const size_t r = static_cast<size_t>(kind == 0 ? n : (kind == 1 ? n - NQ : n - NQ - NKV));
    wr[i] = (kind == 0 ? wq : (kind == 1 ? wk : wv)) + r * ROW_W;
    sr[i] = (kind == 0 ? sq : (kind == 1 ? sk : sv)) + r * GROUPS;
    br[i] = (kind == 0 ? bq : (kind == 1 ? bk : bv)) + r * GROUPS;
  }
  float acc[RW];
  mlxbun_rows_dot<BITS, K, GS, BF16, 32 * SPLIT, RW, CODES, QUNROLL>(xs, wr, sr, br, (warp % SPLIT) * 32 + lane,
                                                                   acc);
#pragma unroll
  for (int i = 0; i < RW; ++i) {
    acc[i] = mlxbun_warp_sum(acc[i]);
  }
  mlxbun_split_sums<NW, SPLIT, RW>(acc, parts, rows);
  const int out_row = blockIdx.x * RPB + threadIdx.x;
  if (threadIdx.x < RPB && out_row < N) {
    sums[out_row] = rows[threadIdx.x];
  }
"""

# One block per head of QKV_PROJ's sums (HQ query heads, then HKV key heads, then HKV value heads:
# kind 0 / 1 / 2), a thread per element: + bias, rounded; q / k: the per-head RMS norm and RoPE; the
# queries to q_out, the new key and value rows to kv_new and, in place, into the static K/V buffer
# (`INPLACE`); next_pos = pos + 1.
ROPE_KV = r"""
  __shared__ float red[32];
  __shared__ float head[D];
  const int h = blockIdx.x;
  const int kind = h < HQ ? 0 : (h < HQ + HKV ? 1 : 2);
  const int hh = kind == 0 ? h : (kind == 1 ? h - HQ : h - HQ - HKV);
  const int t = threadIdx.x;
  float y = 0.0f;
  if (t < D) {
    y = sums[h * D + t];
    if constexpr (BIAS) {
      const T* bias = kind == 0 ? bias_q : (kind == 1 ? bias_k : bias_v);
      y += static_cast<float>(bias[hh * D + t]);
    }
    y = mlxbun_round<T>(y);
  }
  if (kind < 2) {  // the same for the whole block: the q / k norm and RoPE
    if constexpr (QK_NORM) {
      const float ss = mlxbun_block_sum<NW>(t < D ? y * y : 0.0f, red);
      if (t < D) {
        const float inv = rsqrtf(ss / D + __int_as_float(QK_EPS_BITS));
        const T* nw = kind == 0 ? q_norm : k_norm;
        y = mlxbun_round<T>(mlxbun_round<T>(y * inv) * static_cast<float>(nw[t]));
      }
    }
    __syncthreads();  // every read of head[] above is done
    if (t < D) {
      head[t] = y;
    }
    __syncthreads();
    if (t < D) {
      y = mlxbun_rope<T, ROPE_TRAD, D>(y, head, t, pos[0], __int_as_float(ROPE_SCALE_BITS), inv_freq);
    }
  }
  if (t < D) {
    const T v = static_cast<T>(y);
    if (kind == 0) {
      q_out[hh * D + t] = v;
    } else {
      const int part = kind - 1;  // 0: keys, 1: values
      kv_new[(part * HKV + hh) * D + t] = v;
      if constexpr (INPLACE) {
        // the decoder's own K/V buffer (fused_decode.py says why no other array can see it)
        T* buffer = const_cast<T*>(kv);
        buffer[(static_cast<size_t>(part * HKV + hh) * CAP + pos[0]) * D + t] = v;
      }
    }
  }
  if (h == 0 && t == 0) {
    next_pos[0] = pos[0] + 1;
  }
"""
