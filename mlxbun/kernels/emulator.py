"""mlxbun's CUDA kernels run on the CPU, to check their arithmetic where no GPU is.

    with emulating():                      # mx.fast.cuda_kernel is EmulatedKernel inside
        out = CudaFusedOps(inplace=True).gemv(x, w, norm=(norm_w, eps))

`EmulatedKernel` stands in for `mx.fast.cuda_kernel`: the kernel's translation unit (as
`mlxbun.kernels.render` writes it, the signature MLX writes) is compiled by g++ against SHIM, a
header that gives CUDA's names CPU meanings, and each launch runs every block in turn, its threads
as fibers on one OS thread (ucontext): `__syncthreads` and the warp shuffles switch fibers, so a
block's threads meet at each barrier as they do on the device, and a barrier that some of them
never reach (divergence) is an error, not a hang.

What it holds to the device and what it does not:
- The same operations in the same order per thread; float32 and the 16-bit types round as CUDA's
  (RNE; bfloat16 and half conversions written out / F16C), and FMA contraction is on (-mfma
  -ffp-contract=fast) where nvcc contracts too, though not always at the same places.
- rsqrtf, exp2f, expf and sincosf are the C library's (the device's approximations differ in the
  last bits), and blocks run one after another (so a race between blocks cannot show).
So it compares kernels with each other bit for bit (a change claimed to keep the bits, a knob
claimed to give the same ones) and with the reference ops within a bound
(tests/test_kernels_emulated.py; `benchmarks/gpu_fused.py --sections check --emulate`); the
device's own bits are that check on the device. It needs g++ and an x86 CPU with FMA and F16C;
the compiled kernels are kept under $MLXBUN_EMU_CACHE (default: the temporary directory's
mlxbun-cuda-emulator), one shared library per translation unit.

Inputs the kernel writes through a const_cast (the K/V buffer, the merge counters) are written
back into the MLX arrays passed in, as on the device.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlxbun.kernels import fused_decode, qmv, rope_attention, sdpa_decode, turboquant_quantize
from mlxbun.kernels.render import PRELUDE, _ctype, render

__all__ = ["EmulatedKernel", "emulating", "emulator_gap"]

SHIM = r"""
#include <cstdint>
#include <cstring>
#include <cmath>
#include <cstdio>
#include <atomic>
#include <type_traits>
#include <ucontext.h>
#include <immintrin.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct dim3 { unsigned x = 1, y = 1, z = 1; };
struct uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) int4 { int x, y, z, w; };

namespace cooperative_groups {}

inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }

struct __nv_bfloat16 {
  uint16_t x;
  __nv_bfloat16() = default;
  __nv_bfloat16(float f) {
    unsigned u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) { x = 0x7fff; return; }  // CUDA's canonical NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    x = static_cast<uint16_t>(u >> 16);
  }
  __nv_bfloat16(double d) : __nv_bfloat16(static_cast<float>(d)) {}
  __nv_bfloat16(int i) : __nv_bfloat16(static_cast<float>(i)) {}
  operator float() const { return __uint_as_float(static_cast<unsigned>(x) << 16); }
};

struct __half {
  uint16_t x;
  __half() = default;
  __half(float f) : x(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT)) {}
  __half(double d) : __half(static_cast<float>(d)) {}
  __half(int i) : __half(static_cast<float>(i)) {}
  operator float() const { return _cvtsh_ss(x); }
};

inline float __half2float(__half h) { return static_cast<float>(h); }
inline __half __float2half(float f) { return __half(f); }
inline __half __ushort_as_half(unsigned short s) { __half h; h.x = s; return h; }
inline float __bfloat162float(__nv_bfloat16 h) { return static_cast<float>(h); }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
template <typename T> inline T __ldcg(const T* p) { return *p; }
template <typename T> inline T __ldg(const T* p) { return *p; }
template <typename A, typename B> inline std::common_type_t<A, B> min(A a, B b) { return a < b ? a : b; }
template <typename A, typename B> inline std::common_type_t<A, B> max(A a, B b) { return a > b ? a : b; }
template <typename T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
inline void __threadfence() {}

// ---------------------------------------------------------------- fibers: a block's threads
namespace mlxbun_emu {
enum State { READY, AT_BLOCK, AT_WARP, DONE };
struct Fiber { ucontext_t ctx; State state; int site; dim3 tid; };
inline Fiber* fibers = nullptr;
inline int nthreads = 0, current = 0;
inline ucontext_t scheduler;
inline dim3 block_idx, block_dim, grid_dim;
inline uint64_t warp_slot[1024];
inline char error[512];
inline void (*body)() = nullptr;

inline void wait(State s, int site) {  // site: the barrier's source line
  fibers[current].state = s;
  fibers[current].site = site;
  swapcontext(&fibers[current].ctx, &scheduler);
}
inline void entry() {
  body();
  fibers[current].state = DONE;
  swapcontext(&fibers[current].ctx, &scheduler);
}
// Release the barrier every live fiber (of the block, or of one warp) waits at. Threads that have
// returned are not waited for (as on the device); live threads waiting at different barriers, or
// some at the block's and some at their warp's, are a divergence: the block stops with `error`.
inline bool release_group(int first, int last, State s) {
  int site = 0;
  bool seen = false;
  for (int i = first; i < last; ++i) {
    if (fibers[i].state == DONE) continue;
    if (fibers[i].state != s) return false;
    if (seen && fibers[i].site != site) {
      std::snprintf(error, sizeof error, "threads %d and %d wait at different %s barriers (source lines %d and %d)",
                    first, i, s == AT_BLOCK ? "block" : "warp", site, fibers[i].site);
      return false;
    }
    site = fibers[i].site;
    seen = true;
  }
  if (!seen) return false;
  for (int i = first; i < last; ++i) if (fibers[i].state == s) fibers[i].state = READY;
  return true;
}
inline bool release() {
  if (release_group(0, nthreads, AT_BLOCK)) return true;
  bool any = false;
  for (int w = 0; w * 32 < nthreads; ++w) any |= release_group(w * 32, w * 32 + 32 < nthreads ? w * 32 + 32 : nthreads, AT_WARP);
  return any;
}
}  // namespace mlxbun_emu

#define threadIdx (mlxbun_emu::fibers[mlxbun_emu::current].tid)
#define blockIdx (mlxbun_emu::block_idx)
#define blockDim (mlxbun_emu::block_dim)
#define gridDim (mlxbun_emu::grid_dim)

#define __syncthreads() mlxbun_emu::wait(mlxbun_emu::AT_BLOCK, __LINE__)
#define __syncwarp(...) mlxbun_emu::wait(mlxbun_emu::AT_WARP, __LINE__)
#define __shfl_xor_sync(mask, v, ...) mlxbun_emu::shfl_xor(__LINE__, v, __VA_ARGS__)
namespace mlxbun_emu {
template <typename T>
inline T shfl_xor(int site, T v, int lane_mask, int = 32) {
  static_assert(sizeof(T) <= 8, "shuffles of at most 8 bytes");
  const int me = current;
  std::memcpy(&warp_slot[me], &v, sizeof(T));
  wait(AT_WARP, site);
  T out;
  std::memcpy(&out, &warp_slot[(me & ~31) | ((me & 31) ^ lane_mask)], sizeof(T));
  wait(AT_WARP, -2 - site);  // the shuffle's second meeting: all have read before any writes again
  return out;
}
}  // namespace mlxbun_emu

// ---------------------------------------------------------------- the tensor-core GEMVs' helpers
// (mma_gemv_source: its inline PTX stands behind #ifndef MLXBUN_EMULATED)
#define MLXBUN_EMULATED 1
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return uint4{x, y, z, w}; }
namespace mlxbun_emu {
inline unsigned mma_a[1024][4], mma_b[1024][2];
inline double half_value(unsigned bits, bool bf16) {
  return bf16 ? static_cast<double>(__uint_as_float(bits << 16)) : static_cast<double>(_cvtsh_ss(bits));
}
}  // namespace mlxbun_emu
// mma.sync m16n8k16 (row.col, f32 accumulate) over the warp, with the PTX ISA's fragment layout: each
// lane's D elements are C plus the exact sum of its 16 products, rounded to float32 once (the tensor
// core's own accumulation order and rounding are not modelled: the device check holds those).
template <bool BF16>
inline void mlxbun_mma_m16n8k16(float* d, const unsigned* a, const unsigned* b, const float* c) {
  using namespace mlxbun_emu;
  const int me = current, base = me & ~31, g = (me & 31) >> 2, t = me & 3;
  for (int i = 0; i < 4; ++i) mma_a[me][i] = a[i];
  for (int i = 0; i < 2; ++i) mma_b[me][i] = b[i];
  wait(AT_WARP, -1000);
  auto half16 = [](unsigned word, int k) { return (k & 1) ? word >> 16 : word & 0xffffu; };
  float out[4];
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    double sum = c[e];
    for (int k = 0; k < 16; ++k) {
      const unsigned aw = mma_a[base + (row & 7) * 4 + ((k & 7) >> 1)][(row >= 8) + 2 * (k >= 8)];
      const unsigned bw = mma_b[base + col * 4 + ((k & 7) >> 1)][k >= 8];
      sum += half_value(half16(aw, k), BF16) * half_value(half16(bw, k), BF16);
    }
    out[e] = static_cast<float>(sum);
  }
  wait(AT_WARP, -1001);  // all have read the fragments before any lane writes its next ones
  for (int e = 0; e < 4; ++e) d[e] = out[e];
}
// Codes i and i + 4 of `word` as a pair of 16-bit floats: q, or with KEEP 2^7 + q (bf16).
template <bool BF16, bool KEEP>
inline unsigned mlxbun_codes_pair(unsigned word, int i) {
  unsigned bits[2];
  for (int h = 0; h < 2; ++h) {
    const float q = static_cast<float>((word >> (4 * i + 16 * h)) & 0xfu) + (KEEP ? 128.0f : 0.0f);
    bits[h] = BF16 ? __nv_bfloat16(q).x : __half(q).x;
  }
  return bits[0] | (bits[1] << 16);
}
"""

_LAUNCH = r"""
extern "C" const char* mlxbun_emu_error() { return mlxbun_emu::error; }

extern "C" int mlxbun_emu_launch(void** args, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                 unsigned bz) {
  using namespace mlxbun_emu;
  static void** launch_args;
  launch_args = args;
  body = [] { mlx::core::cu::KERNEL_NAME(ARGS); };
  nthreads = static_cast<int>(bx * by * bz);
  if (nthreads > 1024) { std::snprintf(error, sizeof error, "%d threads a block (at most 1024)", nthreads); return 1; }
  grid_dim = {gx, gy, gz};
  block_dim = {bx, by, bz};
  static Fiber pool[1024];
  constexpr size_t STACK = 256 * 1024;
  static char* stacks = new char[STACK * 1024];
  fibers = pool;
  error[0] = 0;
  for (unsigned z = 0; z < gz; ++z) for (unsigned y = 0; y < gy; ++y) for (unsigned x = 0; x < gx; ++x) {
    block_idx = {x, y, z};
    for (int i = 0; i < nthreads; ++i) {
      Fiber& f = pool[i];
      f.tid = {i % bx, (i / bx) % by, i / (bx * by)};
      f.state = READY;
      getcontext(&f.ctx);
      f.ctx.uc_stack.ss_sp = stacks + i * STACK;
      f.ctx.uc_stack.ss_size = STACK;
      f.ctx.uc_link = nullptr;
      makecontext(&f.ctx, entry, 0);
    }
    for (;;) {
      bool ran = false;
      for (int i = 0; i < nthreads; ++i) {
        if (pool[i].state != READY) continue;
        current = i;
        swapcontext(&scheduler, &pool[i].ctx);
        ran = true;
      }
      if (!ran && !release()) break;
    }
    for (int i = 0; i < nthreads; ++i) {
      if (pool[i].state != DONE) {
        char why[512];
        std::snprintf(why, sizeof why, "%s", error[0] ? error : "a barrier that other threads never reach");
        std::snprintf(error, sizeof error, "block (%u, %u, %u): thread %d waits at a %s barrier: %s", x, y, z, i,
                      pool[i].state == AT_BLOCK ? "block" : "warp", why);
        return 2;
      }
    }
  }
  return 0;
}
"""

# the one inline PTX the kernels hold outside `#ifndef MLXBUN_EMULATED` (sdpa_decode_source.MlxbunPrefetchL2;
# mma_gemv_source's stands behind it, SHIM defines it); any other asm fails to compile
_PREFETCH = re.compile(r'asm volatile\("prefetch\.global\.L2 \[%0\];" ::"l"\(\w+\)\);')
_NP = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32,
       mx.uint32: np.uint32, mx.uint8: np.uint8, mx.int64: np.int64, mx.uint16: np.uint16}
_CACHE = Path(os.environ.get("MLXBUN_EMU_CACHE", Path(tempfile.gettempdir()) / "mlxbun-cuda-emulator"))


def emulator_gap() -> str | None:
    """Why the emulator cannot run here (None where it can): it compiles with g++ for an x86 CPU
    with FMA and F16C (the half conversions and the contracted FMAs)."""
    if shutil.which("g++") is None:
        return "g++ is not on PATH"
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    missing = [f for f in ("fma", "f16c") if f not in flags]
    return f"the CPU lacks {', '.join(missing)} (/proc/cpuinfo)" if missing else None


def _compile(unit: str) -> ctypes.CDLL:
    digest = hashlib.sha256(unit.encode()).hexdigest()[:24]
    lib = _CACHE / f"{digest}.so"
    if not lib.exists():
        _CACHE.mkdir(parents=True, exist_ok=True)
        src = _CACHE / f"{digest}.{os.getpid()}.cpp"
        src.write_text(unit)
        tmp = lib.with_suffix(f".{os.getpid()}.so")
        run = subprocess.run(["g++", "-std=c++20", "-O1", "-mfma", "-mf16c", "-ffp-contract=fast",
                              "-fPIC", "-shared", "-w", "-o", str(tmp), str(src)], capture_output=True, text=True)
        src.unlink()
        if run.returncode:
            raise RuntimeError(f"g++ failed on the emulated kernel:\n{run.stderr[-4000:]}")
        os.replace(tmp, lib)  # atomic: another xdist worker may compile the same unit
    dll = ctypes.CDLL(str(lib))
    dll.mlxbun_emu_launch.restype = ctypes.c_int
    dll.mlxbun_emu_error.restype = ctypes.c_char_p
    return dll


def _host(a: mx.array) -> np.ndarray:
    """A C-contiguous numpy copy of `a`, 16-bit floats as their bits (bfloat16: uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.ascontiguousarray(np.array(a))


def _device(h: np.ndarray, dtype) -> mx.array:
    out = mx.array(h)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


class EmulatedKernel:
    """What `mx.fast.cuda_kernel(...)` returns, run by the emulator: call it as MLX's."""

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False):
        if not ensure_row_contiguous:
            raise NotImplementedError("the emulator takes row-contiguous kernels only")
        if (gap := emulator_gap()) is not None:
            raise RuntimeError(f"the CUDA kernel emulator cannot run here: {gap}")
        self.name, self.inputs, self.outputs = name, list(input_names), list(output_names)
        self.source, self.header = source, header
        self._libs: dict[str, ctypes.CDLL] = {}

    def __call__(self, *, inputs, template=(), grid, threadgroup, output_shapes, output_dtypes, **_):
        ins = [(n, a.dtype) for n, a in zip(self.inputs, inputs)]
        outs = list(zip(self.outputs, output_dtypes))
        unit = render(self.name, self.header, self.source, ins, outs, list(template)).replace(PRELUDE, SHIM)
        unit = _PREFETCH.sub("/* an L2 prefetch: a hint, no value */", unit)
        cast = [f"(const {_ctype(d)}*)launch_args[{i}]" for i, (_, d) in enumerate(ins)]
        cast += [f"({_ctype(d)}*)launch_args[{len(ins) + i}]" for i, (_, d) in enumerate(outs)]
        unit += _LAUNCH.replace("KERNEL_NAME", self.name).replace("ARGS", ", ".join(cast))
        if unit not in self._libs:
            self._libs[unit] = _compile(unit)
        lib = self._libs[unit]
        arrays = [mx.contiguous(a) for a in inputs]
        mx.eval(arrays)
        hosts = [_host(a) for a in arrays]
        before = [h.copy() for h in hosts]
        results = []
        for shape, dtype in zip(output_shapes, output_dtypes):
            h = np.empty(shape, _NP[dtype])
            h.view(np.uint8)[...] = 0xFF  # NaN / -1: an element the kernel never writes shows
            results.append(h)
        ptrs = (ctypes.c_void_p * (len(hosts) + len(results)))(*[h.ctypes.data for h in hosts + results])
        blocks = [g // t for g, t in zip(grid, threadgroup)]
        if any(g % t for g, t in zip(grid, threadgroup)):
            raise ValueError(f"{self.name}: grid {grid} is not a multiple of the threadgroup {threadgroup}")
        code = lib.mlxbun_emu_launch(ptrs, *[ctypes.c_uint(v) for v in (*blocks, *threadgroup)])
        if code:
            raise RuntimeError(f"{self.name}: {lib.mlxbun_emu_error().decode()}")
        # writes through a const_cast go into the caller's array (the kernels write only into
        # row-contiguous buffers; on the device a copy made for a strided one would take them)
        for a, h, b in zip(inputs, hosts, before):
            if not np.array_equal(h.view(np.uint8), b.view(np.uint8)):
                _write_back(a, _device(h, a.dtype))
        return [_device(h, d) for h, d in zip(results, output_dtypes)]


def _write_back(target: mx.array, value: mx.array) -> None:
    """Overwrite `target`'s data with `value` (the same shape and dtype): the device kernel's
    in-place write, which MLX's graph does not see either."""
    mx.eval(target, value)
    dst = np.frombuffer(memoryview(target.view(mx.uint8) if target.dtype == mx.bfloat16 else target).cast("B"),
                        np.uint8)
    if dst.flags.writeable is False:
        raise RuntimeError("the emulator cannot write into this MLX array's buffer")
    dst[...] = np.frombuffer(memoryview(value.view(mx.uint8) if value.dtype == mx.bfloat16 else value).cast("B"),
                             np.uint8)


@contextmanager
def emulating():
    """`mx.fast.cuda_kernel` is `EmulatedKernel` inside the block (the kernels made before it, and in
    it, are forgotten on the way in and out: none crosses between the device and the emulator)."""
    def forget():
        for cache in (fused_decode._kernels, rope_attention._kernels, sdpa_decode._kernels):
            cache.clear()
        qmv._kernel = turboquant_quantize._kernel = None

    saved = mx.fast.cuda_kernel
    forget()
    mx.fast.cuda_kernel = EmulatedKernel
    try:
        yield
    finally:
        mx.fast.cuda_kernel = saved
        forget()
