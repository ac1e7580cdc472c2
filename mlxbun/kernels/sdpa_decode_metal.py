"""Metal source of the TurboQuant decode attention kernel (`mx.fast.metal_kernel`): UNTESTED.

A port of `sdpa_decode_source.PARTIAL_TURBOQUANT` and `COMBINE` (same two launches, same split over
the sequence, same fixed-order merge, same reads of the packed codes: see that module) to the Metal
Shading Language. No Apple GPU or Metal compiler is reachable from this project's machines, so it
has never been compiled by Metal nor run: `sdpa_decode.METAL_TURBOQUANT_CHECKED` stays False (the
static cache runs its MLX path on Metal and the fast path says why) until
`python3 benchmarks/gpu_check.py --checks turboquant` passes on an Apple GPU. The CPU tests compile
it as C++ against a stand-in of the Metal types (`tests/test_kernels_metal.py`): syntax and types,
not Metal's semantics.

Only the TurboQuant variant is ported: on Metal, MLX's fused one-query SDPA takes an array mask and
`mx.quantized_matmul` reads packed 4/8-bit K/V, so the 16-bit and affine CUDA variants' reasons do
not hold there (benchmarks/gpu-h200-fast.md section 8.5).

MLX writes the signature: inputs as `const device T*`, outputs as `device T*`, the template
constants as template parameters, and the thread attributes the body names
(`threadgroup_position_in_grid`, `thread_position_in_threadgroup`, `thread_index_in_simdgroup`,
`simdgroup_index_in_threadgroup`). An Apple SIMD group is 32 threads, as a CUDA warp.
"""

__all__ = ["METAL_COMBINE", "METAL_HEADER", "METAL_PARTIAL_TURBOQUANT", "METAL_SHARED_LIMIT"]

METAL_SHARED_LIMIT = 32 * 1024  # threadgroup memory per threadgroup on Apple GPUs

METAL_HEADER = r"""
#define MLXBUN_LOG2E 1.4426950408889634f

// Eight consecutive coordinates (8 * slot ...) of one TurboQuant row: BITS-bit codeword indices
// packed little-endian (slot s starts at byte s * BITS), looked up in the codebook.
template <int BITS, int D>
inline void mlxbun_tq_load(const device uint8_t* codes, const threadgroup float* book, size_t row, int slot,
                           thread float* f) {
  constexpr int BYTES = D * BITS / 8;
  const device uint8_t* p = codes + row * BYTES + slot * BITS;
  ulong w = 0;
  if (BITS == 4) {
    w = *reinterpret_cast<const device uint32_t*>(p);
  } else if (BITS == 8) {
    const device uint32_t* u = reinterpret_cast<const device uint32_t*>(p);
    w = static_cast<ulong>(u[0]) | (static_cast<ulong>(u[1]) << 32);
  } else {
    for (int i = 0; i < BITS; ++i) {
      w |= static_cast<ulong>(p[i]) << (8 * i);
    }
  }
  for (int j = 0; j < 8; ++j) {
    f[j] = book[(w >> (BITS * j)) & ((1u << BITS) - 1u)];
  }
}
"""

# inputs: q (rotated, float32), k_norms, k_codes, k_book, v_norms, v_codes, v_book, length;
# outputs: o_part, ml. Template: D, G, KV, H, CAP, CHUNK, NWARPS, KBITS, VBITS, SCALE_BITS.
METAL_PARTIAL_TURBOQUANT = r"""
  constexpr int LPK = D / 8;          // lanes per key row
  constexpr int KPW = 32 / LPK;       // key rows per SIMD group at a time
  constexpr int KPB = NWARPS * KPW;   // key rows per threadgroup at a time

  threadgroup float kbook[1 << KBITS];
  threadgroup float vbook[1 << VBITS];
  threadgroup float sc[G][CHUNK];
  threadgroup float red[NWARPS][G][D];

  const int tid = static_cast<int>(thread_position_in_threadgroup.x);
  const int lane = static_cast<int>(thread_index_in_simdgroup);
  const int warp = static_cast<int>(simdgroup_index_in_threadgroup);
  const int slot = lane % LPK;
  const int kw = lane / LPK;
  const int split = static_cast<int>(threadgroup_position_in_grid.x);
  const int bk = static_cast<int>(threadgroup_position_in_grid.y);  // batch * KV + KV head
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
  const int nthreads = 32 * NWARPS;
  const device uint8_t* kc = reinterpret_cast<const device uint8_t*>(k_codes);
  const device uint8_t* vc = reinterpret_cast<const device uint8_t*>(v_codes);

  for (int t = tid; t < (1 << KBITS); t += nthreads) {
    kbook[t] = k_book[t];
  }
  for (int t = tid; t < (1 << VBITS); t += nthreads) {
    vbook[t] = v_book[t];
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 1. scores, log2 domain: (q * scale * log2 e) . k, times the row's norm
  {
    const float qs = as_type<float>(SCALE_BITS) * MLXBUN_LOG2E;
    float qf[G][8];
    for (int g = 0; g < G; ++g) {
      const device float* qrow = q + static_cast<size_t>(head0 + g) * D + slot * 8;
      for (int j = 0; j < 8; ++j) {
        qf[g][j] = qrow[j] * qs;
      }
    }
    for (int i0 = warp * KPW; i0 < n; i0 += KPB) {
      const int i = i0 + kw;
      float kf[8];
      if (i < n) {
        mlxbun_tq_load<KBITS, D>(kc, kbook, row0 + i, slot, kf);
      } else {
        for (int j = 0; j < 8; ++j) {
          kf[j] = 0.0f;
        }
      }
      for (int g = 0; g < G; ++g) {
        float s = 0.0f;
        for (int j = 0; j < 8; ++j) {
          s += qf[g][j] * kf[j];
        }
        for (ushort o = LPK / 2; o > 0; o >>= 1) {
          s += simd_shuffle_xor(s, o);
        }
        if (slot == 0 && i < n) {
          sc[g][i] = s * static_cast<float>(k_norms[row0 + i]);
        }
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 2. per head: the split's max and sum; scores become weights 2^(s - max)
  for (int g = warp; g < G; g += NWARPS) {
    float m = -INFINITY;
    for (int i = lane; i < n; i += 32) {
      m = fmax(m, sc[g][i]);
    }
    for (ushort o = 16; o > 0; o >>= 1) {
      m = fmax(m, simd_shuffle_xor(m, o));
    }
    float l = 0.0f;
    for (int i = lane; i < n; i += 32) {
      const float p = exp2(sc[g][i] - m);
      sc[g][i] = p;
      l += p;
    }
    for (ushort o = 16; o > 0; o >>= 1) {
      l += simd_shuffle_xor(l, o);
    }
    if (lane == 0) {
      device float* dst = ml + (static_cast<size_t>(head0 + g) * SPLITS + split) * 2;
      dst[0] = m;
      dst[1] = l;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. weighted value rows (the row's norm on its weight)
  float acc[G][8];
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < 8; ++j) {
      acc[g][j] = 0.0f;
    }
  }
  for (int i0 = warp * KPW; i0 < n; i0 += KPB) {
    const int i = i0 + kw;
    if (i < n) {
      float vf[8];
      mlxbun_tq_load<VBITS, D>(vc, vbook, row0 + i, slot, vf);
      const float vs = static_cast<float>(v_norms[row0 + i]);
      for (int g = 0; g < G; ++g) {
        const float p = sc[g][i] * vs;
        for (int j = 0; j < 8; ++j) {
          acc[g][j] += p * vf[j];
        }
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    for (int j = 0; j < 8; ++j) {
      for (ushort o = LPK; o < 32; o <<= 1) {
        acc[g][j] += simd_shuffle_xor(acc[g][j], o);
      }
    }
  }
  if (kw == 0) {
    for (int g = 0; g < G; ++g) {
      for (int j = 0; j < 8; ++j) {
        red[warp][g][slot * 8 + j] = acc[g][j];
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int t = tid; t < G * D; t += nthreads) {
    const int g = t / D;
    const int d = t % D;
    float o = red[0][g][d];
    for (int w = 1; w < NWARPS; ++w) {
      o += red[w][g][d];
    }
    o_part[(static_cast<size_t>(head0 + g) * SPLITS + split) * D + d] = o;
  }
"""

# inputs: o_part, ml, length; output: out [B * H, D] (float32). Template: D, SPLITS, CHUNK.
METAL_COMBINE = r"""
  const int bh = static_cast<int>(threadgroup_position_in_grid.x);
  const int d = static_cast<int>(thread_position_in_threadgroup.x);
  const int len = length[0];
  const int ns = min(SPLITS, (len + CHUNK - 1) / CHUNK);
  const device float* mls = ml + static_cast<size_t>(bh) * SPLITS * 2;
  float m = -INFINITY;
  for (int s = 0; s < ns; ++s) {
    m = fmax(m, mls[2 * s]);
  }
  float l = 0.0f;
  float o = 0.0f;
  for (int s = 0; s < ns; ++s) {
    const float w = exp2(mls[2 * s] - m);
    l += mls[2 * s + 1] * w;
    o += o_part[(static_cast<size_t>(bh) * SPLITS + s) * D + d] * w;
  }
  out[static_cast<size_t>(bh) * D + d] = o / l;
"""
