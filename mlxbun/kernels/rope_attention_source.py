"""CUDA source of ROPE_ATTENTION: a layer's q / k norm, RoPE, K/V append, decode attention and the
merge of its splits, in one launch (the fused decode's kernels 2-4 of `fused_decode_source` as one).

It takes QKV_PROJ's float32 sums and runs `sdpa_decode_source`'s partial body (one block of NWARPS
warps per KV head and split of CHUNK positions, over the static buffer [2, HKV, CAP, D]) with:

- a prologue: the block computes its G query heads from the sums (+ bias, rounded to T, the
  per-head RMS norm, RoPE) into shared memory, where the partial body reads them; the block whose
  split holds position `pos` also computes its KV head's new key row (the same steps) and value row
  (+ bias) and writes both into the buffer in place (a const_cast: the decoder's own buffer, as
  ROPE_KV does), before its key loop reads them. No other block reads that row: the splits before
  it end earlier.
- an epilogue: each block publishes its split (o_part, ml), then counts itself in its KV head's
  slot of `counter` (an int per KV head, zero between launches); the block that counts last merges
  the head's splits in split order, exactly as `sdpa_decode`'s combine does (its MERGE helpers; the
  other blocks' splits read through the L2, `MlxbunLoadL2`), writes the output rows and sets the
  slot back to zero. Which block is last depends on timing; what it computes does not (the splits'
  values and the merge order are fixed): the same inputs give the same bits.

Every step repeats ROPE_KV's and the two attention launches' arithmetic in the same order, so the
output and the buffer equal theirs bit for bit (`benchmarks/gpu_fused.py --sections check` holds
it to that on the device). Template constants: the partial's (T, BF16, D, G, KV, H, CAP, CHUNK,
NWARPS, QBITS 0, GS, QF32 false, SCALE_BITS) and ROPE_KV's (QK_NORM, QK_EPS_BITS, BIAS, ROPE_TRAD,
ROPE_SCALE_BITS).
"""

from mlxbun.kernels.sdpa_decode_source import partial_body

__all__ = ["ROPE_ATTENTION"]

# inputs: sums, bias_q, bias_k, bias_v, q_norm, k_norm, inv_freq, pos, kv, counter;
# outputs: out [H * D], next_pos [1], o_part [H, splits, D], ml [H, splits, 2]
_SETUP = r"""
  const int mlxbun_length[1] = {pos[0] + 1};
  const int* length = mlxbun_length;
  const MlxbunRows<T, 0, D, GS, BF16> keys{kv, nullptr, nullptr};
  const MlxbunRows<T, 0, D, GS, BF16> values{kv + static_cast<size_t>(KV) * CAP * D, nullptr, nullptr};
"""

_PROLOGUE = r"""
  __shared__ float qsh[G][D];       // the queries after RoPE, as the partial body reads them
  __shared__ float heads[G + 1][D]; // before RoPE: the G query heads, then the key head
  __shared__ float inv_rms[G + 1];
  {
    const int p = pos[0];
    const bool owner = blockIdx.x == p / CHUNK;  // this split holds the new row
    const int nh = G + (owner ? 1 : 0);
    T* buffer = const_cast<T*>(kv);
    // a. + bias, rounded (ROPE_KV's first step); the value row straight into the buffer
    for (int e = threadIdx.x; e < nh * D; e += blockDim.x) {
      const int g = e / D;
      const int d = e % D;
      const bool is_k = g == G;
      float y = sums[is_k ? (H + kvh) * D + d : (head0 + g) * D + d];
      if constexpr (BIAS) {
        y += static_cast<float>(is_k ? bias_k[kvh * D + d] : bias_q[(head0 + g) * D + d]);
      }
      heads[g][d] = mlxbun_round<T>(y);
    }
    if (owner) {
      for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float y = sums[(H + KV + kvh) * D + d];
        if constexpr (BIAS) {
          y += static_cast<float>(bias_v[kvh * D + d]);
        }
        buffer[(static_cast<size_t>(KV + kvh) * CAP + p) * D + d] = static_cast<T>(y);
      }
    }
    __syncthreads();
    // b. the per-head RMS norm: ROPE_KV's block sum (32-value warp sums, added in order)
    if constexpr (QK_NORM) {
      for (int g = warp; g < nh; g += NWARPS) {
        float total = 0.0f;
#pragma unroll
        for (int c = 0; c < D / 32; ++c) {
          const float v = heads[g][c * 32 + lane];
          total += mlxbun_warp_sum(v * v);
        }
        if (lane == 0) {
          inv_rms[g] = rsqrtf(total / D + __int_as_float(QK_EPS_BITS));
        }
      }
      __syncthreads();
      for (int e = threadIdx.x; e < nh * D; e += blockDim.x) {
        const int g = e / D;
        const int d = e % D;
        const T* nw = g == G ? k_norm : q_norm;
        heads[g][d] = mlxbun_round<T>(mlxbun_round<T>(heads[g][d] * inv_rms[g]) * static_cast<float>(nw[d]));
      }
      __syncthreads();
    }
    // c. RoPE: the queries to shared memory, the key row into the buffer
    for (int e = threadIdx.x; e < nh * D; e += blockDim.x) {
      const int g = e / D;
      const int t = e % D;
      const float y = mlxbun_rope<T, ROPE_TRAD, D>(heads[g][t], heads[g], t, p, __int_as_float(ROPE_SCALE_BITS),
                                                    inv_freq);
      if (g < G) {
        qsh[g][t] = y;
      } else {
        buffer[(static_cast<size_t>(kvh) * CAP + p) * D + t] = static_cast<T>(y);
      }
    }
    if (blockIdx.x == 0 && kvh == 0 && threadIdx.x == 0) {
      next_pos[0] = p + 1;
    }
    __syncthreads();  // the queries and this block's new rows are written
  }
"""

_LOAD_Q = r"""#pragma unroll
      for (int j = 0; j < 8; ++j) {
        qf[g][j] = qsh[g][slot * 8 + j];
      }"""

_EPILOGUE = r"""
  // publish this split, count it; the last of the KV head's active splits merges them in order
  __threadfence();
  __syncthreads();
  __shared__ int mlxbun_last;
  const int ns = min(static_cast<int>(gridDim.x), (len + CHUNK - 1) / CHUNK);
  if (threadIdx.x == 0) {
    int* slot_count = const_cast<int*>(counter) + bk;
    mlxbun_last = atomicAdd(slot_count, 1) == ns - 1;
    if (mlxbun_last) {
      *slot_count = 0;  // every active split has counted: the next launch starts from zero
    }
  }
  __syncthreads();
  if (!mlxbun_last) {
    return;
  }
  __threadfence();
  for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
    const int bh = head0 + t / D;
    const int d = t % D;
    const float* mls = ml + static_cast<size_t>(bh) * gridDim.x * 2;
    const float m = mlxbun_splits_max(mls, ns, MlxbunLoadL2{});
    float l;
    const float o = mlxbun_splits_sum<D>(mls, o_part + static_cast<size_t>(bh) * gridDim.x * D + d, ns, m, &l,
                                         MlxbunLoadL2{});
    out[static_cast<size_t>(bh) * D + d] = static_cast<T>(o / l);
  }
"""

ROPE_ATTENTION = _SETUP + partial_body(load_q=_LOAD_Q, prologue=_PROLOGUE) + _EPILOGUE
