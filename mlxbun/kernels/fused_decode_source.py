"""CUDA source of the fused decode kernels: a dense layer's one-token step in five launches.

Per layer of a standard pre-norm dense row (llama, qwen2, qwen3, mistral, ...), one token:

1. `QKV_ROPE`: RMSNorm of the hidden state, the q / k / v GEMVs (+ their biases), the q / k
   norms, RoPE, and the new key and value rows: written to `kv_new` and, in place, into the
   static K/V buffer (`INPLACE`, see `fused_decode`), and `next_pos` = pos + 1. One block per
   head (HQ query heads, then HKV key heads, then HKV value heads), so a head's norm and its
   RoPE pairs stay inside one block.
2. decode attention: `sdpa_decode`'s two launches (split-K, fixed-order merge).
3. `GEMV` with RESIDUAL: the output projection plus the residual.
4. `GEMV_SWIGLU`: RMSNorm, the gate and up GEMVs and silu(gate) * up.
5. `GEMV` with RESIDUAL: the down projection plus the residual.

and once per step `GEMV` with NORM: the final norm and the head.

Every GEMV is warp-per-row: a lane walks the row in 16-byte weight chunks (8 16-bit values, or 32
4-bit / 16 8-bit codes inside one quantization group: `scale * sum(q x) + bias * sum(x)` in float32),
and the warp adds its 32 lane sums with a fixed xor-shuffle tree. Block sums (the norms) add the
warps' sums in warp order. Nothing is atomic: the same inputs give the same bits on every run.
Rounding follows the exact path's dtypes where it rounds (a projection's output, the norm's
normalized value, the residual sum), but sums run in another order than MLX's: the fast path
measures its drift, it never claims bit-exactness.

Template constants (written in front of the body by `mx.fast.cuda_kernel`): T, BF16, K (input
width), N (output rows), BITS (16: 16-bit weights; 4 or 8: affine codes), GS (quantization group),
NW (warps per block), SPLIT (warps per output row: each takes every SPLIT-th 32 chunks, their sums
added in warp order), NORM, RESIDUAL, EPS_BITS (the norm's eps as float32 bits); QKV_ROPE also
HQ, HKV, D, QK_NORM, QK_EPS_BITS, BIAS, ROPE_TRAD, ROPE_SCALE_BITS, CAP (buffer positions), INPLACE.
"""

from mlxbun.kernels.qmv_source import HEADER as HALF_HEADER

__all__ = ["GEMV", "GEMV_SWIGLU", "HEADER", "QKV_ROPE"]

HEADER = HALF_HEADER + r"""
// This lane's share of one weight row's dot product with x: the 16-byte chunks start, start + STRIDE,
// ... (a warp's 32 lanes start at consecutive chunks; SPLIT warps of a row interleave theirs).
// BITS 16: `w_row` holds the row's K 16-bit values; BITS 4 / 8: its packed uint32 codes, with the
// row's per-group scales and biases (affine: w = s * q + b).
template <int BITS, int K, int GS, bool BF16, int STRIDE, typename X, typename W, typename S>
__device__ __forceinline__ float mlxbun_row_dot(const X* x, const W* w_row, const S* s_row, const S* b_row,
                                                int start) {
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* wv = reinterpret_cast<const uint4*>(w_row);
  float acc = 0.0f;
  if constexpr (BITS == 16) {
#pragma unroll 4
    for (int c = start; c < K / 8; c += STRIDE) {
      float xf[8], wf[8];
      unpack8<BF16>(xv[c], xf);
      unpack8<BF16>(wv[c], wf);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc += wf[j] * xf[j];
      }
    }
  } else {
    constexpr int VALS = 128 / BITS;           // codes in one 16-byte chunk
    constexpr int PIECES = VALS / 8;           // 8-value pieces of x per chunk
    constexpr int WORDS_PER_PIECE = BITS / 4;  // code words covering 8 values
#pragma unroll 2
    for (int c = start; c < K / VALS; c += STRIDE) {
      const int k0 = c * VALS;
      const float s = static_cast<float>(s_row[k0 / GS]);
      const float b = static_cast<float>(b_row[k0 / GS]);
      const uint4 q4 = wv[c];
      const unsigned int words[4] = {q4.x, q4.y, q4.z, q4.w};
      float qx = 0.0f, sx = 0.0f;
#pragma unroll
      for (int p = 0; p < PIECES; ++p) {
        float xf[8];
        unpack8<BF16>(xv[k0 / 8 + p], xf);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const unsigned int word = words[p * WORDS_PER_PIECE + (j * BITS) / 32];
          const unsigned int q = (word >> ((j * BITS) % 32)) & ((1u << BITS) - 1u);
          qx += static_cast<float>(q) * xf[j];
          sx += xf[j];
        }
      }
      acc += s * qx + b * sx;
    }
  }
  return acc;
}

// This lane's shares of two weight rows' dot products with the same x (gate and up): one pass
// over x, both rows' loads in flight together.
template <int BITS, int K, int GS, bool BF16, int STRIDE, typename X, typename W, typename S>
__device__ __forceinline__ float2 mlxbun_row_dot2(const X* x, const W* w0, const S* s0, const S* b0,
                                                  const W* w1, const S* s1, const S* b1, int start) {
  const uint4* xv = reinterpret_cast<const uint4*>(x);
  const uint4* wv0 = reinterpret_cast<const uint4*>(w0);
  const uint4* wv1 = reinterpret_cast<const uint4*>(w1);
  float acc0 = 0.0f, acc1 = 0.0f;
  if constexpr (BITS == 16) {
#pragma unroll 4
    for (int c = start; c < K / 8; c += STRIDE) {
      float xf[8], f0[8], f1[8];
      unpack8<BF16>(xv[c], xf);
      unpack8<BF16>(wv0[c], f0);
      unpack8<BF16>(wv1[c], f1);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        acc0 += f0[j] * xf[j];
        acc1 += f1[j] * xf[j];
      }
    }
  } else {
    constexpr int VALS = 128 / BITS;
    constexpr int PIECES = VALS / 8;
    constexpr int WORDS_PER_PIECE = BITS / 4;
#pragma unroll 2
    for (int c = start; c < K / VALS; c += STRIDE) {
      const int k0 = c * VALS;
      const uint4 qa = wv0[c];
      const uint4 qb = wv1[c];
      const unsigned int wa[4] = {qa.x, qa.y, qa.z, qa.w};
      const unsigned int wb[4] = {qb.x, qb.y, qb.z, qb.w};
      float qx0 = 0.0f, qx1 = 0.0f, sx = 0.0f;
#pragma unroll
      for (int p = 0; p < PIECES; ++p) {
        float xf[8];
        unpack8<BF16>(xv[k0 / 8 + p], xf);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int at = p * WORDS_PER_PIECE + (j * BITS) / 32;
          const int shift = (j * BITS) % 32;
          constexpr unsigned int MASK = (1u << BITS) - 1u;
          qx0 += static_cast<float>((wa[at] >> shift) & MASK) * xf[j];
          qx1 += static_cast<float>((wb[at] >> shift) & MASK) * xf[j];
          sx += xf[j];
        }
      }
      acc0 += static_cast<float>(s0[k0 / GS]) * qx0 + static_cast<float>(b0[k0 / GS]) * sx;
      acc1 += static_cast<float>(s1[k0 / GS]) * qx1 + static_cast<float>(b1[k0 / GS]) * sx;
    }
  }
  return make_float2(acc0, acc1);
}

__device__ __forceinline__ float mlxbun_warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    v += __shfl_xor_sync(0xffffffffu, v, o);
  }
  return v;
}

// The SPLIT warps of each row (warps r * SPLIT .. r * SPLIT + SPLIT - 1) add their sums, in warp order,
// into `row_sums[r]` (lane 0 of each warp brings its warp's sum `v`). Every thread must call it.
template <int NW, int SPLIT>
__device__ __forceinline__ void mlxbun_split_sums(float v, float* parts, float* row_sums) {
  const int warp = threadIdx.x >> 5;
  if (SPLIT == 1) {
    if ((threadIdx.x & 31) == 0) {
      row_sums[warp] = v;
    }
    __syncthreads();
    return;
  }
  if ((threadIdx.x & 31) == 0) {
    parts[warp] = v;
  }
  __syncthreads();
  if (threadIdx.x < NW / SPLIT) {
    float total = 0.0f;
#pragma unroll
    for (int i = 0; i < SPLIT; ++i) {
      total += parts[threadIdx.x * SPLIT + i];
    }
    row_sums[threadIdx.x] = total;
  }
  __syncthreads();
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
"""

# out[n] = (residual[n] +) w[n] . (rms_norm(x) or x); one warp per row.
GEMV = r"""
  constexpr int ROW_W = BITS == 16 ? K : K * BITS / 32;  // weight elements per row
  constexpr int GROUPS = BITS == 16 ? 1 : K / GS;
  constexpr int RPB = NW / SPLIT;  // rows per block: SPLIT warps per row share its chunks
  __shared__ __align__(16) T xs[NORM ? K : 8];
  __shared__ float red[32];
  __shared__ float sums[32];
  const T* xin = x;
  if constexpr (NORM) {
    mlxbun_rms_to_shared<T, K, NW>(x, norm_w, __int_as_float(EPS_BITS), xs, red);
    xin = xs;
  }
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row = blockIdx.x * RPB + warp / SPLIT;
  float acc = 0.0f;
  if (row < N) {
    const size_t r = static_cast<size_t>(row);
    acc = mlxbun_warp_sum(mlxbun_row_dot<BITS, K, GS, BF16, 32 * SPLIT>(
        xin, w + r * ROW_W, scales + r * GROUPS, biases + r * GROUPS, (warp % SPLIT) * 32 + lane));
  }
  mlxbun_split_sums<NW, SPLIT>(acc, red, sums);
  const int out_row = blockIdx.x * RPB + threadIdx.x;
  if (threadIdx.x < RPB && out_row < N) {
    float y = mlxbun_round<T>(sums[threadIdx.x]);
    if constexpr (RESIDUAL) {
      y = static_cast<float>(residual[out_row]) + y;
    }
    out[out_row] = static_cast<T>(y);
  }
"""

# out[n] = silu(gate[n] . rms_norm(x)) * (up[n] . rms_norm(x)); one warp per row of both.
GEMV_SWIGLU = r"""
  constexpr int ROW_W = BITS == 16 ? K : K * BITS / 32;
  constexpr int GROUPS = BITS == 16 ? 1 : K / GS;
  constexpr int RPB = NW / SPLIT;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  __shared__ float gsum[32];
  __shared__ float usum[32];
  mlxbun_rms_to_shared<T, K, NW>(x, norm_w, __int_as_float(EPS_BITS), xs, red);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int row = blockIdx.x * RPB + warp / SPLIT;
  float2 gu = make_float2(0.0f, 0.0f);
  if (row < N) {
    const size_t r = static_cast<size_t>(row);
    gu = mlxbun_row_dot2<BITS, K, GS, BF16, 32 * SPLIT>(xs, wg + r * ROW_W, sg + r * GROUPS, bg + r * GROUPS,
                                                        wu + r * ROW_W, su + r * GROUPS, bu + r * GROUPS,
                                                        (warp % SPLIT) * 32 + lane);
  }
  mlxbun_split_sums<NW, SPLIT>(mlxbun_warp_sum(gu.x), red, gsum);
  mlxbun_split_sums<NW, SPLIT>(mlxbun_warp_sum(gu.y), red, usum);
  const int out_row = blockIdx.x * RPB + threadIdx.x;
  if (threadIdx.x < RPB && out_row < N) {
    const float gt = mlxbun_round<T>(gsum[threadIdx.x]);
    const float act = mlxbun_round<T>(gt / (1.0f + expf(-gt)));
    out[out_row] = static_cast<T>(act * mlxbun_round<T>(usum[threadIdx.x]));
  }
"""

# One block per head: HQ query heads, HKV key heads, HKV value heads (kind 0 / 1 / 2).
QKV_ROPE = r"""
  constexpr int ROW_W = BITS == 16 ? K : K * BITS / 32;
  constexpr int GROUPS = BITS == 16 ? 1 : K / GS;
  __shared__ __align__(16) T xs[K];
  __shared__ float red[32];
  __shared__ float head[D + 32];
  mlxbun_rms_to_shared<T, K, NW>(x, norm_w, __int_as_float(EPS_BITS), xs, red);
  const int h = blockIdx.x;
  const int kind = h < HQ ? 0 : (h < HQ + HKV ? 1 : 2);
  const int hh = kind == 0 ? h : (kind == 1 ? h - HQ : h - HQ - HKV);
  const auto* w = kind == 0 ? wq : (kind == 1 ? wk : wv);
  const auto* s = kind == 0 ? sq : (kind == 1 ? sk : sv);
  const auto* b = kind == 0 ? bq : (kind == 1 ? bk : bv);
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  constexpr int RPB = NW / SPLIT;  // rows in flight: SPLIT warps per row
  __shared__ float parts[32];
  for (int r0 = 0; r0 < D; r0 += RPB) {
    const int rr = r0 + warp / SPLIT;
    const size_t r = static_cast<size_t>(hh) * D + rr;
    const float acc = rr < D ? mlxbun_warp_sum(mlxbun_row_dot<BITS, K, GS, BF16, 32 * SPLIT>(
        xs, w + r * ROW_W, s + r * GROUPS, b + r * GROUPS, (warp % SPLIT) * 32 + lane)) : 0.0f;
    mlxbun_split_sums<NW, SPLIT>(acc, parts, head + r0);  // head has D + RPB slots
  }
  const int t = threadIdx.x;
  float y = 0.0f;
  if (t < D) {
    y = head[t];
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
      int i, partner;
      float sign;
      if constexpr (ROPE_TRAD) {
        i = t / 2;
        partner = t ^ 1;
        sign = (t & 1) ? 1.0f : -1.0f;
      } else {
        i = t % (D / 2);
        partner = t < D / 2 ? t + D / 2 : t - D / 2;
        sign = t < D / 2 ? -1.0f : 1.0f;
      }
      const float theta = static_cast<float>(pos[0]) * __int_as_float(ROPE_SCALE_BITS) * inv_freq[i];
      float sn, cs;
      sincosf(theta, &sn, &cs);
      y = mlxbun_round<T>(y * cs + sign * head[partner] * sn);
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
