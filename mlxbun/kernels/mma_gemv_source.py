"""CUDA source of the fused decode's 4-bit GEMVs on the tensor cores (`fused_decode.MMA`, off by
default): the same three kernels as `fused_decode_source`'s GEMV, GEMV_SWIGLU and QKV_PROJ, with the
products on `mma.sync.m16n8k16` (bf16 or half operands, float32 sums) instead of FFMAs.

Why: the FFMA loop spends about two instructions per code (one on the integer pipe, one FFMA) and
the 4-bit GEMVs of a Llama-3-8B step ran 1.7-1.8 TB/s on an H100 (raw 26), about half its HBM's. (On
that H100 these kernels then decoded no faster: the products were not the bound. benchmarks/
gpu-fused.md, raw 27.)
Here a warp takes 16 rows (A: 16 rows x 16 codes of one quantization group) and x (B: the same 16
values of x in each of its 8 columns, so every column of D is the 16 rows' sums and each lane holds
its rows' results without a shuffle). Lane (g = lane / 4, t = lane % 4) holds rows g and g + 8, and
the t-th quarter of each group: its code words w, two codes of a word become one 16-bit pair by one
LOP3, `(w >> 4i) & 0x000F000F | magic` (the float 2^7 + q in bf16, 2^10 + q in half), and one packed
FMA takes the magic off (exact). The pair (q_i, q_i+4) multiplies (x_i, x_i+4): x sits in shared
memory in that order (`mlxbun_pair_index`: each run of 8 as x0 x4 x1 x5 x2 x6 x3 x7), so one
16-byte load is the B fragments of a code word's two products.

Per group, in float32: `scale * sum(q x) + bias * sum(x over the group)`, the group sums of x taken
once per block. With MMA 2 (bf16 only) the magic stays in the codes (one instruction a pair fewer)
and comes out in the scale term, `scale * sum((2^7 + q) x) + (bias - 2^7 scale) * sum(x)`, which
cancels about 4 of float32's 24 bits (half's 2^10 would cancel 7: half keeps MMA 1's pairs).

A warp takes a run of GROUPS / SPLIT groups (SPLIT warps per 16 rows, their sums added in warp
order), U groups a trip with all their codes, scales and biases loaded before any is used. The sums
run in another order than the FFMA loop's (and the tensor core's accumulation is its own), so these
kernels have their own drift: `benchmarks/gpu_fused.py --sections check` holds them to the same
bound of the MLX-op reference. On the CPU emulator the mma sums exactly and rounds once
(`mlxbun.kernels.emulator`): its bits are not the device's.

Template constants: those of `fused_decode_source`'s GEMVs (RW, CODES, QUNROLL unused), MMA (1 or 2)
and MMA_EARLY (the first trip's loads before the stage of x).
"""

from mlxbun.kernels.fused_decode_source import HEADER as FUSED_HEADER

__all__ = ["HEADER", "GEMV_MMA", "GEMV_SWIGLU_MMA", "QKV_PROJ_MMA"]

MMA_HELPERS = r"""
#ifndef MLXBUN_EMULATED
// d = a b + c: one m16n8k16 product, bf16 or half a / b, float32 c / d (the PTX ISA's fragments:
// a lane holds a[0..3] = rows g, g + 8, g, g + 8 at k 2t, 2t + 1 (then + 8); b[0..1] = k 2t, 2t + 1
// (then + 8) of column g; d[0..3] = rows g, g, g + 8, g + 8 at columns 2t, 2t + 1).
template <bool BF16>
__device__ __forceinline__ void mlxbun_mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, const float* c) {
  if constexpr (BF16) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),
          "f"(c[3]));
  }
}

// Codes i and i + 4 of `word` (bits 4i and 16 + 4i) as a pair of 16-bit floats: q exactly, or with
// KEEP (bf16 only) 2^7 + q. The LOP3 is written out: from plain C nvcc emitted two instructions.
template <bool BF16, bool KEEP>
__device__ __forceinline__ unsigned mlxbun_codes_pair(unsigned word, int i) {
  const unsigned shifted = word >> (4 * i);
  unsigned pair;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(pair) : "r"(shifted), "r"(0x000F000Fu),
      "r"(BF16 ? 0x43004300u : 0x64006400u));  // (a & b) | c
  if constexpr (!KEEP) {
    if constexpr (BF16) {
      asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(pair) : "r"(pair), "r"(0x3f803f80u), "r"(0xc300c300u));
    } else {
      asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(pair) : "r"(pair), "r"(0x3c003c00u), "r"(0xe400e400u));
    }
  }
  return pair;
}
#endif

// `n` consecutive 16-bit values (n = 1, 2 or 4; `p` aligned to n of them) in one load, each value's
// bits in the low half of an out[] word (half_bits_to_float reads them).
template <int n, typename S>
__device__ __forceinline__ void mlxbun_load_n(const S* p, unsigned* out) {
  if constexpr (n == 4) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    out[0] = v.x & 0xffffu, out[1] = v.x >> 16, out[2] = v.y & 0xffffu, out[3] = v.y >> 16;
  } else if constexpr (n == 2) {
    const unsigned v = *reinterpret_cast<const unsigned*>(p);
    out[0] = v & 0xffffu, out[1] = v >> 16;
  } else {
    out[0] = *reinterpret_cast<const unsigned short*>(p);
  }
}

// `n` consecutive code words (n = 1, 2 or 4; `p` aligned to n of them) in one load.
template <int n>
__device__ __forceinline__ void mlxbun_load_words(const uint32_t* p, unsigned* out) {
  if constexpr (n == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  } else if constexpr (n == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(p);
    out[0] = v.x, out[1] = v.y;
  } else {
    out[0] = p[0];
  }
}

// This lane's sums of rows g and g + 8 (g = lane / 4) of M matrices' 16-row tiles over the RUN
// groups from `first`: acc[2 m] row g, acc[2 m + 1] row g + 8 of matrix m (w / s / b: the rows'
// codes, scales and biases, in that order). xs: x in the pairs' order; gsum: its group sums, both
// written by `stage()` (every thread calls it); EARLY: it runs while the first trip's loads are in
// flight (they do not depend on x).
template <int K, int GS, bool BF16, int MMA, int M, int RUN, bool EARLY, typename T, typename S, typename Stage>
__device__ __forceinline__ void mlxbun_mma_rows(const uint32_t* const* w, const S* const* s, const S* const* b,
                                                const T* xs, const float* gsum, int first, float* acc, Stage stage) {
  constexpr int WPL = GS / 32;  // code words a lane takes of a group (its quarter)
  constexpr int U = RUN % 4 == 0 ? 4 : (RUN % 2 == 0 ? 2 : 1);  // groups a trip
  constexpr int SU = (K / GS) % U == 0 ? U : 1;  // scales / biases a load (aligned runs only)
  constexpr bool KEEP = MMA == 2 && BF16;
  const int t = threadIdx.x & 3;
  const uint4* xv = reinterpret_cast<const uint4*>(xs);
#pragma unroll
  for (int i = 0; i < 2 * M; ++i) {
    acc[i] = 0.0f;
  }
  unsigned q[2 * M][U][WPL];
  unsigned sc[2 * M][U], bi[2 * M][U];  // 16-bit scales / biases
  const auto load = [&](int g0) {
#pragma unroll
    for (int i = 0; i < 2 * M; ++i) {
#pragma unroll
      for (int u = 0; u < U; ++u) {
        mlxbun_load_words<WPL>(w[i] + (g0 + u) * (GS / 8) + t * WPL, q[i][u]);
      }
#pragma unroll
      for (int u = 0; u < U; u += SU) {
        mlxbun_load_n<SU>(s[i] + g0 + u, sc[i] + u);
        mlxbun_load_n<SU>(b[i] + g0 + u, bi[i] + u);
      }
    }
  };
  if constexpr (EARLY) {  // the first trip's loads in flight during the stage (more registers live)
    load(first);
  }
  stage();
#pragma unroll 1
  for (int g0 = first; g0 < first + RUN; g0 += U) {
    if (!EARLY || g0 != first) {
      load(g0);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      float d[M][4];
#pragma unroll
      for (int m = 0; m < M; ++m) {
        d[m][0] = d[m][1] = d[m][2] = d[m][3] = 0.0f;
      }
#pragma unroll
      for (int j = 0; j < WPL; ++j) {
        const uint4 xr = xv[(g0 + u) * (GS / 8) + t * WPL + j];  // x0 x4 | x1 x5 | x2 x6 | x3 x7
        const unsigned b0[2] = {xr.x, xr.y}, b1[2] = {xr.z, xr.w};
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const unsigned lo = q[2 * m][u][j], hi = q[2 * m + 1][u][j];
          const unsigned a0[4] = {mlxbun_codes_pair<BF16, KEEP>(lo, 0), mlxbun_codes_pair<BF16, KEEP>(hi, 0),
                                  mlxbun_codes_pair<BF16, KEEP>(lo, 1), mlxbun_codes_pair<BF16, KEEP>(hi, 1)};
          mlxbun_mma_m16n8k16<BF16>(d[m], a0, b0, d[m]);
          const unsigned a1[4] = {mlxbun_codes_pair<BF16, KEEP>(lo, 2), mlxbun_codes_pair<BF16, KEEP>(hi, 2),
                                  mlxbun_codes_pair<BF16, KEEP>(lo, 3), mlxbun_codes_pair<BF16, KEEP>(hi, 3)};
          mlxbun_mma_m16n8k16<BF16>(d[m], a1, b1, d[m]);
        }
      }
      const float gs = gsum[g0 + u];
#pragma unroll
      for (int m = 0; m < M; ++m) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const float scale = half_bits_to_float<BF16>(sc[2 * m + h][u]);
          const float bias = half_bits_to_float<BF16>(bi[2 * m + h][u]);
          const float off = KEEP ? bias - 128.0f * scale : bias;  // KEEP: the codes' 2^7 out
          acc[2 * m + h] += scale * d[m][2 * h] + off * gs;
        }
      }
    }
  }
}

// The warps' tile sums (lane t = 0 of each row pair brings acc[2 m + h]) into `parts` (NW * 16 M
// floats: warp, matrix, row), then the SPLIT warps of each tile added in warp order into
// `row_sums[tile * 16 M + m * 16 + row]`. Every thread must call it.
template <int NW, int SPLIT, int M>
__device__ __forceinline__ void mlxbun_mma_split_sums(const float* acc, float* parts, float* row_sums) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  if ((lane & 3) == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        (SPLIT == 1 ? row_sums : parts)[warp * 16 * M + m * 16 + lane / 4 + 8 * h] = acc[2 * m + h];
      }
    }
  }
  __syncthreads();
  mlxbun_add_splits<NW, SPLIT, 16 * M>(parts, row_sums);
}
"""
HEADER = FUSED_HEADER + MMA_HELPERS

# The shared front of the three bodies: `stage` (x, normed or not, into shared memory in the pairs'
# order, and its group sums: mlxbun_mma_rows runs it, before or after its first loads by MMA_EARLY)
# and this lane's first row (rows past the last read the last row: unused). GEMV without NORM gets no
# norm weight and no eps: `norm_w` is x again (fused_decode.CudaFusedOps.gemv), unread.
_FRONT = r"""
  constexpr int ROW_W = K / 8;
  constexpr int GROUPS = K / GS;
  constexpr int RUN = GROUPS / SPLIT;  // groups a warp takes
  constexpr int RPB = NW / SPLIT * 16;  // rows (of each matrix) a block takes
  __shared__ __align__(16) T xs[K];
  __shared__ float gsum[GROUPS];
  __shared__ float red[32];
  __shared__ float parts[NW * 16 * MATRICES];
  __shared__ float tile_sums[RPB * MATRICES];
  const auto stage = [&] {
    mlxbun_stage_x<T, BF16, K, GS, NW, NORMED, true>(x, norm_w, __int_as_float(EPS_BITS), xs, gsum, red);
  };
  const int warp = threadIdx.x >> 5;
  const int first = (warp % SPLIT) * RUN;
  const int row0 = blockIdx.x * RPB + warp / SPLIT * 16 + (threadIdx.x & 31) / 4;
"""

# out[n] = (residual[n] +) w[n] . (rms_norm(x) or x): 16 rows a warp tile.
GEMV_MMA = "  constexpr int MATRICES = 1;\n  constexpr bool NORMED = NORM;\n" + _FRONT + r"""
  const uint32_t* wr[2];
  const T* sr[2];
  const T* br[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const size_t r = static_cast<size_t>(min(row0 + 8 * h, N - 1));
    wr[h] = w + r * ROW_W;
    sr[h] = scales + r * GROUPS;
    br[h] = biases + r * GROUPS;
  }
  float acc[2];
  mlxbun_mma_rows<K, GS, BF16, MMA, 1, RUN, MMA_EARLY>(wr, sr, br, xs, gsum, first, acc, stage);
  mlxbun_mma_split_sums<NW, SPLIT, 1>(acc, parts, tile_sums);
  const int out_row = blockIdx.x * RPB + threadIdx.x;
  if (threadIdx.x < RPB && out_row < N) {
    float y = mlxbun_round<T>(tile_sums[threadIdx.x]);
    if constexpr (RESIDUAL) {
      y = static_cast<float>(residual[out_row]) + y;
    }
    out[out_row] = static_cast<T>(y);
  }
"""

# out[n] = silu(gate[n] . rms_norm(x)) * (up[n] . rms_norm(x)): a warp tile is 16 gate and 16 up rows.
GEMV_SWIGLU_MMA = "  constexpr int MATRICES = 2;\n  constexpr bool NORMED = true;\n" + _FRONT + r"""
  const uint32_t* wr[4];
  const T* sr[4];
  const T* br[4];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const size_t r = static_cast<size_t>(min(row0 + 8 * h, N - 1));
    wr[h] = wg + r * ROW_W;
    sr[h] = sg + r * GROUPS;
    br[h] = bg + r * GROUPS;
    wr[2 + h] = wu + r * ROW_W;
    sr[2 + h] = su + r * GROUPS;
    br[2 + h] = bu + r * GROUPS;
  }
  float acc[4];
  mlxbun_mma_rows<K, GS, BF16, MMA, 2, RUN, MMA_EARLY>(wr, sr, br, xs, gsum, first, acc, stage);
  mlxbun_mma_split_sums<NW, SPLIT, 2>(acc, parts, tile_sums);
  const int out_row = blockIdx.x * RPB + threadIdx.x;
  if (threadIdx.x < RPB && out_row < N) {
    const int tile = threadIdx.x / 16, i = threadIdx.x % 16;
    const float gt = mlxbun_round<T>(tile_sums[tile * 32 + i]);
    const float act = mlxbun_round<T>(gt / (1.0f + expf(-gt)));
    out[out_row] = static_cast<T>(act * mlxbun_round<T>(tile_sums[tile * 32 + 16 + i]));
  }
"""

# sums[n] = w[n] . rms_norm(x) in float32 for the rows of q, then k, then v (NQ, NKV, NKV rows).
QKV_PROJ_MMA = ("  constexpr int N = NQ + 2 * NKV;\n  constexpr int MATRICES = 1;\n  constexpr bool NORMED = true;\n"
                + _FRONT + r"""
  const uint32_t* wr[2];
  const T* sr[2];
  const T* br[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int n = min(row0 + 8 * h, N - 1);
    const int kind = n < NQ ? 0 : (n < NQ + NKV ? 1 : 2);
    const size_t r = static_cast<size_t>(kind == 0 ? n : (kind == 1 ? n - NQ : n - NQ - NKV));
    wr[h] = (kind == 0 ? wq : (kind == 1 ? wk : wv)) + r * ROW_W;
    sr[h] = (kind == 0 ? sq : (kind == 1 ? sk : sv)) + r * GROUPS;
    br[h] = (kind == 0 ? bq : (kind == 1 ? bk : bv)) + r * GROUPS;
  }
  float acc[2];
  mlxbun_mma_rows<K, GS, BF16, MMA, 1, RUN, MMA_EARLY>(wr, sr, br, xs, gsum, first, acc, stage);
  mlxbun_mma_split_sums<NW, SPLIT, 1>(acc, parts, tile_sums);
  const int out_row = blockIdx.x * RPB + threadIdx.x;
  if (threadIdx.x < RPB && out_row < N) {
    sums[out_row] = tile_sums[threadIdx.x];
  }
""")
