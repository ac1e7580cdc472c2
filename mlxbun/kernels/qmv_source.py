"""CUDA source of mlxbun's quantized matrix-vector kernel (affine, 4 or 8 bits).

`out[m, n] = sum_k x[m, k] * (scale[n, g(k)] * q[n, k] + bias[n, g(k)])` for M <= 16 rows of x
(a decode step, a speculative verify). One warp owns ROWS output rows: each lane walks the row
in 16-byte weight chunks (32 4-bit or 16 8-bit values, always inside one quantization group),
keeps `scale * sum(q x) + bias * sum(x)` per chunk in float32, and the warp adds the 32 lane
sums with a fixed xor-shuffle tree. Nothing is atomic and no reduction order depends on timing,
so the same inputs give the same bits on every run (the determinism MLX's own 1-row 4-bit
kernel lacks on the 8B shapes, see benchmarks/gpu-h200.md).

The body below is handed to `mx.fast.cuda_kernel`, which writes the signature
(`const T* x, const uint32_t* w, const T* scales, const T* biases, T* out`) and the template
constants (T, M, N, K, BITS, GS, ROWS, BF16) in front of it.
"""

HEADER = r"""
template <bool BF16>
__device__ __forceinline__ float half_bits_to_float(unsigned int h) {
  if constexpr (BF16) {
    return __uint_as_float(h << 16);
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
  }
}

// Eight consecutive 16-bit floats (one uint4) as floats.
template <bool BF16>
__device__ __forceinline__ void unpack8(const uint4 v, float* f) {
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = half_bits_to_float<BF16>(w[i] & 0xffffu);
    f[2 * i + 1] = half_bits_to_float<BF16>(w[i] >> 16);
  }
}
"""

SOURCE = r"""
  constexpr int VALS = 128 / BITS;          // values in one 16-byte weight chunk
  constexpr int CHUNKS = K / VALS;          // chunks per weight row
  constexpr int WORDS = K * BITS / 32;      // uint32 words per weight row
  constexpr int GROUPS = K / GS;            // scales per row
  constexpr int PIECES = VALS / 8;          // 8-value pieces per chunk (one uint4 of x each)
  constexpr int WORDS_PER_PIECE = BITS / 4; // weight words covering 8 values

  const int lane = threadIdx.x & 31;
  const int warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
  const int row0 = warp * ROWS;
  if (row0 >= N) {
    return;
  }

  float acc[ROWS][M];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      acc[r][m] = 0.0f;
    }
  }

  const uint4* xv = reinterpret_cast<const uint4*>(x);
#pragma unroll 2
  for (int c = lane; c < CHUNKS; c += 32) {
    const int k0 = c * VALS;
    const int g = k0 / GS;
    uint4 wv[ROWS];
    float s[ROWS], b[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      const int row = min(row0 + r, N - 1);
      wv[r] = reinterpret_cast<const uint4*>(w + static_cast<size_t>(row) * WORDS)[c];
      s[r] = static_cast<float>(scales[static_cast<size_t>(row) * GROUPS + g]);
      b[r] = static_cast<float>(biases[static_cast<size_t>(row) * GROUPS + g]);
    }
    float qx[ROWS][M];
    float sx[M];
#pragma unroll
    for (int m = 0; m < M; ++m) {
      sx[m] = 0.0f;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        qx[r][m] = 0.0f;
      }
    }
#pragma unroll
    for (int p = 0; p < PIECES; ++p) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[8];
        unpack8<BF16>(xv[(m * K + k0) / 8 + p], xf);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          sx[m] += xf[j];
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
          const unsigned int words[4] = {wv[r].x, wv[r].y, wv[r].z, wv[r].w};
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            const unsigned int word = words[p * WORDS_PER_PIECE + (j * BITS) / 32];
            const unsigned int q = (word >> ((j * BITS) % 32)) & ((1u << BITS) - 1u);
            qx[r][m] += static_cast<float>(q) * xf[j];
          }
        }
      }
    }
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
#pragma unroll
      for (int m = 0; m < M; ++m) {
        acc[r][m] += s[r] * qx[r][m] + b[r] * sx[m];
      }
    }
  }

#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
#pragma unroll
    for (int m = 0; m < M; ++m) {
      float v = acc[r][m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
      }
      if (lane == 0 && row0 + r < N) {
        out[static_cast<size_t>(m) * N + row0 + r] = static_cast<T>(v);
      }
    }
  }
"""
