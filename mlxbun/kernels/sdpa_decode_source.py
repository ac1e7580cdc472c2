"""CUDA source of mlxbun's one-query (decode) attention over a static K/V buffer.

Two launches per attention call, split over the sequence (flash-decoding) with a fixed-order
reduction, so the same inputs give the same bits on every run:

1. `partial`: one block of NWARPS warps per (batch x KV head, split of CHUNK positions). The block
   holds the G query heads that share its KV head (GQA: K/V are read once for all of them). A
   key row is read by D/8 lanes, 8 values each (16-byte loads for 16-bit K/V; one or two words
   of codes plus the group's scale and bias for affine-quantized K/V, dequantized in float32 in
   registers, never written back; for TurboQuant K/V, BITS bytes of codeword indices looked up
   in the codebook, held in shared memory: the rotated-space unit vector, its norm applied once
   to the row's score and weight, so the queries come rotated and the output goes out in the
   value rotation's space). Scores go to shared memory in the log2 domain, the split's max and
   sum are taken per head (lane-strided, then a fixed xor-shuffle tree), and
   `p = 2^(s - max)` weights the value rows; the warps' sums meet in shared memory and are added
   in warp order. Per split: the float32 output row and (max, sum). Splits that start at or
   past `length` (a device array: the positions the buffer holds) write nothing.
2. `combine`: one block of D threads per (batch, query head) merges the splits holding keys in
   split order (and an attention sink's logit, when given) and writes the output in T.

Nothing is atomic and no sum's order depends on timing. Template constants (written in front of
the body by `mx.fast.cuda_kernel`): T, BF16, D, G (query heads per KV head), KV, H, CAP
(buffer positions), CHUNK, NWARPS (warps per block), QBITS (0: 16-bit K/V; 4 or 8: affine codes),
GS (quantization group), QF32 (float32 queries), KBITS / VBITS (TurboQuant's index widths),
SCALE_BITS (the softmax scale's float32 bits), PREFETCH (the split's rows asked of the L2 first),
and in `combine` SPLITS (`COMBINE_SINKS` also reads one float32 sink logit per query head).
"""

from mlxbun.kernels.qmv_source import HEADER as HALF_HEADER

__all__ = ["COMBINE", "COMBINE_SINKS", "HEADER", "MERGE", "PARTIAL_PLAIN", "PARTIAL_QUANTIZED", "PARTIAL_TURBOQUANT"]

HEADER = HALF_HEADER + r"""
#define MLXBUN_NEG_INF __int_as_float(0xff800000)
#define MLXBUN_LOG2E 1.4426950408889634f

__device__ __forceinline__ void mlxbun_prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

// Eight consecutive values (8 * slot ...) of one K or V row as floats.
template <typename T, int QBITS, int D, int GS, bool BF16>
struct MlxbunRows {
  const void* codes;
  const T* scales;
  const T* biases;

  __device__ __forceinline__ float row_scale(size_t) const {
    return 1.0f;
  }

  // Asks the L2 for what `load(row, slot)` reads.
  __device__ __forceinline__ void prefetch(size_t row, int slot) const {
    if constexpr (QBITS == 0) {
      mlxbun_prefetch_l2(static_cast<const T*>(codes) + row * D + slot * 8);
    } else {
      mlxbun_prefetch_l2(static_cast<const uint32_t*>(codes) + row * (D * QBITS / 32) + slot * (QBITS / 4));
      if ((slot * 8) % GS == 0) {
        mlxbun_prefetch_l2(scales + row * (D / GS) + (slot * 8) / GS);
        mlxbun_prefetch_l2(biases + row * (D / GS) + (slot * 8) / GS);
      }
    }
  }

  __device__ __forceinline__ void load(size_t row, int slot, float* f) const {
    if constexpr (QBITS == 0) {
      const uint4 v = reinterpret_cast<const uint4*>(static_cast<const T*>(codes) + row * D)[slot];
      unpack8<BF16>(v, f);
    } else {
      constexpr int WORDS = D * QBITS / 32;
      const size_t g = row * (D / GS) + (slot * 8) / GS;
      const float s = static_cast<float>(scales[g]);
      const float b = static_cast<float>(biases[g]);
      const uint32_t* w = static_cast<const uint32_t*>(codes) + row * WORDS;
      if constexpr (QBITS == 4) {
        const uint32_t q = w[slot];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          f[j] = s * static_cast<float>((q >> (4 * j)) & 15u) + b;
        }
      } else {
        const uint2 q = reinterpret_cast<const uint2*>(w)[slot];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          f[j] = s * static_cast<float>((q.x >> (8 * j)) & 255u) + b;
          f[4 + j] = s * static_cast<float>((q.y >> (8 * j)) & 255u) + b;
        }
      }
    }
  }
};

// Eight consecutive query values (8 * slot ...): 16-bit (one uint4) or float32 (two float4s:
// TurboQuant's queries come rotated, in float32).
template <bool QF32, bool BF16, typename QT>
__device__ __forceinline__ void mlxbun_load_q8(const QT* q, int slot, float* f) {
  if constexpr (QF32) {
    const float4* p = reinterpret_cast<const float4*>(q) + 2 * slot;
    const float4 a = p[0];
    const float4 b = p[1];
    f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
    f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
  } else {
    unpack8<BF16>(reinterpret_cast<const uint4*>(q)[slot], f);
  }
}

// Eight consecutive coordinates of one TurboQuant row, c[idx] in the rotation's space (the row's
// float16 norm |x| is its `row_scale`, applied once per row to its score or its softmax weight):
// BITS-bit codeword indices packed little-endian (index i at bit i * BITS, a row D * BITS / 8
// bytes: 8 indices fill BITS whole bytes, so slot s starts at byte s * BITS), and the codebook
// (2^BITS floats) in shared memory.
template <int BITS, int D>
struct MlxbunCodeRows {
  const uint8_t* codes;
  const __half* norms;
  const float* book;

  __device__ __forceinline__ float row_scale(size_t row) const {
    return __half2float(norms[row]);
  }

  __device__ __forceinline__ void prefetch(size_t row, int slot) const {
    mlxbun_prefetch_l2(codes + row * (D * BITS / 8) + slot * BITS);
    if (slot == 0) {
      mlxbun_prefetch_l2(norms + row);
    }
  }

  __device__ __forceinline__ void load(size_t row, int slot, float* f) const {
    constexpr int BYTES = D * BITS / 8;
    const uint8_t* p = codes + row * BYTES + slot * BITS;
    uint64_t w = 0;
    if constexpr (BITS == 4) {  // 4-byte aligned: rows start on words, slots on 4 bytes
      w = *reinterpret_cast<const uint32_t*>(p);
    } else if constexpr (BITS == 8) {
      const uint32_t* u = reinterpret_cast<const uint32_t*>(p);
      w = static_cast<uint64_t>(u[0]) | (static_cast<uint64_t>(u[1]) << 32);
    } else {
#pragma unroll
      for (int i = 0; i < BITS; ++i) {
        w |= static_cast<uint64_t>(p[i]) << (8 * i);
      }
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      f[j] = book[(w >> (BITS * j)) & ((1u << BITS) - 1u)];
    }
  }
};
"""

_BODY_TEMPLATE = r"""
  constexpr int LPK = D / 8;          // lanes per key row
  constexpr int KPW = 32 / LPK;       // key rows per warp at a time
  constexpr int KPB = NWARPS * KPW;   // key rows per block at a time

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int slot = lane % LPK;
  const int kw = lane / LPK;
  const int split = blockIdx.x;
  const int bk = blockIdx.y;          // batch * KV + KV head
  const int b = bk / KV;
  const int kvh = bk % KV;
  const int len = length[0];
  const int start = split * CHUNK;
  if (start >= len) {
    return;
  }
  const int n = min(CHUNK, len - start);
  const size_t row0 = static_cast<size_t>(bk) * CAP + start;
  const int head0 = b * H + kvh * G;  // first query head of this KV head
  if constexpr (PREFETCH) {  // the split's key and value rows stream into the L2 from here on
    for (int i = warp * KPW + kw; i < n; i += KPB) {
      keys.prefetch(row0 + i, slot);
      values.prefetch(row0 + i, slot);
    }
  }
MLXBUN_PROLOGUE
  __shared__ float sc[G][CHUNK];
  __shared__ float red[NWARPS][G][D];

  // 1. scores, log2 domain: (q * scale * log2 e) . k
  {
    const float qs = __int_as_float(SCALE_BITS) * MLXBUN_LOG2E;
    float qf[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
MLXBUN_LOAD_Q
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        qf[g][j] *= qs;
      }
    }
#pragma unroll 4
    for (int i0 = warp * KPW; i0 < n; i0 += KPB) {
      const int i = i0 + kw;
      float kf[8];
      if (i < n) {
        keys.load(row0 + i, slot, kf);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          kf[j] = 0.0f;
        }
      }
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          s += qf[g][j] * kf[j];
        }
#pragma unroll
        for (int o = LPK / 2; o > 0; o >>= 1) {
          s += __shfl_xor_sync(0xffffffffu, s, o);
        }
        if (slot == 0 && i < n) {
          sc[g][i] = s * keys.row_scale(row0 + i);
        }
      }
    }
  }
  __syncthreads();

  // 2. per head: the split's max and sum; scores become weights 2^(s - max)
  for (int g = warp; g < G; g += NWARPS) {
    float m = MLXBUN_NEG_INF;
    for (int i = lane; i < n; i += 32) {
      m = fmaxf(m, sc[g][i]);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    }
    float l = 0.0f;
    for (int i = lane; i < n; i += 32) {
      const float p = exp2f(sc[g][i] - m);
      sc[g][i] = p;
      l += p;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      l += __shfl_xor_sync(0xffffffffu, l, o);
    }
    if (lane == 0) {
      float* dst = ml + (static_cast<size_t>(head0 + g) * gridDim.x + split) * 2;
      dst[0] = m;
      dst[1] = l;
    }
  }
  __syncthreads();

  // 3. weighted value rows
  float acc[G][8];
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      acc[g][j] = 0.0f;
    }
  }
#pragma unroll 4
  for (int i0 = warp * KPW; i0 < n; i0 += KPB) {
    const int i = i0 + kw;
    if (i < n) {
      float vf[8];
      values.load(row0 + i, slot, vf);
      const float vs = values.row_scale(row0 + i);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float p = sc[g][i] * vs;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          acc[g][j] += p * vf[j];
        }
      }
    }
  }
#pragma unroll
  for (int g = 0; g < G; ++g) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int o = LPK; o < 32; o <<= 1) {
        acc[g][j] += __shfl_xor_sync(0xffffffffu, acc[g][j], o);
      }
    }
  }
  if (kw == 0) {
#pragma unroll
    for (int g = 0; g < G; ++g) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        red[warp][g][slot * 8 + j] = acc[g][j];
      }
    }
  }
  __syncthreads();
  for (int t = threadIdx.x; t < G * D; t += blockDim.x) {
    const int g = t / D;
    const int d = t % D;
    float o = red[0][g][d];
#pragma unroll
    for (int w = 1; w < NWARPS; ++w) {
      o += red[w][g][d];
    }
    o_part[(static_cast<size_t>(head0 + g) * gridDim.x + split) * D + d] = o;
  }
"""


def partial_body(load_q: str = "", prologue: str = "") -> str:
    """The partial kernel's body with its query load (`load_q`: code that fills `qf[g][0..8)` with
    head g's eight values at `slot`; default: from the `q` input) and `prologue` (code run by every
    active block after the setup, before the scores) put in."""
    return (_BODY_TEMPLATE.replace("MLXBUN_LOAD_Q", load_q or _LOAD_Q)
            .replace("MLXBUN_PROLOGUE", prologue))


_LOAD_Q = "      mlxbun_load_q8<QF32, BF16>(q + static_cast<size_t>(head0 + g) * D, slot, qf[g]);"
_BODY = partial_body()

# inputs: q, k, v, length; outputs: o_part, ml
PARTIAL_PLAIN = r"""
  const MlxbunRows<T, 0, D, GS, BF16> keys{k, nullptr, nullptr};
  const MlxbunRows<T, 0, D, GS, BF16> values{v, nullptr, nullptr};
""" + _BODY

# inputs: q, k_codes, k_scales, k_biases, v_codes, v_scales, v_biases, length; outputs: o_part, ml
PARTIAL_QUANTIZED = r"""
  const MlxbunRows<T, QBITS, D, GS, BF16> keys{k_codes, k_scales, k_biases};
  const MlxbunRows<T, QBITS, D, GS, BF16> values{v_codes, v_scales, v_biases};
""" + _BODY

# inputs: q (rotated, float32), k_norms, k_codes, k_book, v_norms, v_codes, v_book, length;
# outputs: o_part, ml (in the value rotation's space: the caller rotates the output back)
PARTIAL_TURBOQUANT = r"""
  __shared__ float kbook[1 << KBITS];
  __shared__ float vbook[1 << VBITS];
  for (int t = threadIdx.x; t < (1 << KBITS); t += blockDim.x) {
    kbook[t] = k_book[t];
  }
  for (int t = threadIdx.x; t < (1 << VBITS); t += blockDim.x) {
    vbook[t] = v_book[t];
  }
  __syncthreads();
  const MlxbunCodeRows<KBITS, D> keys{reinterpret_cast<const uint8_t*>(k_codes), k_norms, kbook};
  const MlxbunCodeRows<VBITS, D> values{reinterpret_cast<const uint8_t*>(v_codes), v_norms, vbook};
""" + _BODY

# The merge of `ns` splits (their (max, sum) pairs at `mls`, their rows of D floats at `parts`) in split
# order, for element d of one head: the largest max m, then l and o. The loads come MLXBUN_BATCH splits
# at a time, all in flight together (the plain loops waited on each load in turn); the arithmetic is
# the plain loops', in their order.
MERGE = r"""
#define MLXBUN_BATCH 16
template <typename LOAD>
__device__ __forceinline__ float mlxbun_splits_max(const float* mls, int ns, LOAD ld) {
  float m = MLXBUN_NEG_INF;
  for (int s0 = 0; s0 < ns; s0 += MLXBUN_BATCH) {
    float mv[MLXBUN_BATCH];
#pragma unroll
    for (int j = 0; j < MLXBUN_BATCH; ++j) {
      mv[j] = s0 + j < ns ? ld(mls + 2 * (s0 + j)) : MLXBUN_NEG_INF;
    }
#pragma unroll
    for (int j = 0; j < MLXBUN_BATCH; ++j) {
      m = fmaxf(m, mv[j]);
    }
  }
  return m;
}

// sum over the splits of parts[s * D] * 2^(mls[2 s] - m), and (`l`) of mls[2 s + 1] * the same weight
template <int D, typename LOAD>
__device__ __forceinline__ float mlxbun_splits_sum(const float* mls, const float* parts, int ns, float m, float* l,
                                                   LOAD ld) {
  float o = 0.0f;
  float lsum = 0.0f;
  for (int s0 = 0; s0 < ns; s0 += MLXBUN_BATCH) {
    float mv[MLXBUN_BATCH], lv[MLXBUN_BATCH], ov[MLXBUN_BATCH];
#pragma unroll
    for (int j = 0; j < MLXBUN_BATCH; ++j) {
      if (s0 + j < ns) {
        mv[j] = ld(mls + 2 * (s0 + j));
        lv[j] = ld(mls + 2 * (s0 + j) + 1);
        ov[j] = ld(parts + static_cast<size_t>(s0 + j) * D);
      }
    }
#pragma unroll
    for (int j = 0; j < MLXBUN_BATCH; ++j) {
      if (s0 + j < ns) {
        const float w = exp2f(mv[j] - m);
        lsum += lv[j] * w;
        o += ov[j] * w;
      }
    }
  }
  *l = lsum;
  return o;
}

struct MlxbunLoad {
  __device__ __forceinline__ float operator()(const float* p) const {
    return *p;
  }
};

// for splits other blocks of the same launch wrote (past the L1, which is not coherent across SMs)
struct MlxbunLoadL2 {
  __device__ __forceinline__ float operator()(const float* p) const {
    return __ldcg(p);
  }
};
"""
HEADER += MERGE

# inputs: o_part, ml, length[, sinks]; output: out [B * H, D]
_COMBINE = r"""
  const int bh = blockIdx.x;
  const int d = threadIdx.x;
  const int len = length[0];
  const int ns = min(SPLITS, (len + CHUNK - 1) / CHUNK);
  const float* mls = ml + static_cast<size_t>(bh) * SPLITS * 2;
  float m = mlxbun_splits_max(mls, ns, MlxbunLoad{});
%(sink_max)s
  float l;
  float o = mlxbun_splits_sum<D>(mls, o_part + static_cast<size_t>(bh) * SPLITS * D + d, ns, m, &l, MlxbunLoad{});
%(sink_sum)s
  out[static_cast<size_t>(bh) * D + d] = static_cast<T>(o / l);
"""
COMBINE = _COMBINE % {"sink_max": "", "sink_sum": ""}
COMBINE_SINKS = _COMBINE % {
    "sink_max": "  const float sink = sinks[bh % H] * MLXBUN_LOG2E;\n  m = fmaxf(m, sink);",
    "sink_sum": "  l += exp2f(sink - m);"}
