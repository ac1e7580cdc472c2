"""The fused decode's CUDA kernels, run on the CPU by mlxbun/kernels/emulator.py (g++ and fibers, no
GPU): each against its MLX-op reference within the device check's bound, the pairs that are
claimed to give the same bits (the two code conversions, one launch against three, the in-place
K/V write against a scatter) bit for bit, and a whole fused decode against the exact path. The
device's own bits stay benchmarks/gpu_fused.py's check; this runs in CI, on every change to a
kernel, where no device is."""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.factory import open_model
from mlxbun.fast.fused_plan import fused_plan
from mlxbun.kernels import fused_decode as fd
from mlxbun.kernels.emulator import EmulatedKernel, emulating
from mlxbun.kernels.fused_decode import CudaFusedOps, ReferenceFusedOps, _write
from tests.decode_steps import decode_both


def _cpu_has(*flags) -> bool:
    cpuinfo = Path("/proc/cpuinfo")
    words = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return all(f in words for f in flags)


pytestmark = pytest.mark.skipif(shutil.which("g++") is None or not _cpu_has("fma", "f16c"),
                                reason="the emulator compiles with g++ for an x86 CPU with FMA and F16C")

BOUND = 2.0 ** -6  # benchmarks/gpu_fused.py's CHECK_BOUND, in units of the reference's max |value|
CASES = [("llama", None, "bfloat16"), ("llama", 4, "bfloat16"), ("llama", 8, "float16"), ("qwen3", 4, "bfloat16"),
         ("qwen2", 4, "bfloat16")]  # plain, 4 / 8-bit codes, fp16; q/k norms; q/k/v biases


@pytest.fixture
def emulated():
    with emulating():
        yield


def _rel(got, ref) -> float:
    ref = ref.astype(mx.float32)
    return (mx.abs(got.astype(mx.float32) - ref).max() / mx.maximum(mx.abs(ref).max(), 1e-30)).item()


def _model(zoo, arch, quant, dtype):
    return open_model(zoo(arch, quant=quant, dtype=dtype, head_dim=64 if arch != "qwen2" else None))


@pytest.mark.parametrize("arch,quant,dtype", CASES)
def test_each_kernel_is_its_reference(emulated, zoo, arch, quant, dtype):
    plan = fused_plan(_model(zoo, arch, quant, dtype))
    layer, dt, cuda, ref = plan.layers[0], plan.dtype, CudaFusedOps(inplace=True), ReferenceFusedOps()
    x = mx.random.normal((plan.hidden,), key=mx.random.key(3)).astype(dt)
    res = mx.random.normal((plan.hidden,), key=mx.random.key(4)).astype(dt)
    proj = (layer.q, layer.k, layer.v)
    cases = {
        "o + residual": lambda ops: ops.gemv(mx.random.normal((layer.o.width,), key=mx.random.key(5)).astype(dt),
                                             layer.o, residual=res),
        "norm + head": lambda ops: ops.gemv(x, plan.head, norm=plan.final_norm),
        "norm + gate/up": lambda ops: ops.gemv_swiglu(x, layer.mlp_norm, layer.gate, layer.up),
        "down + residual": lambda ops: ops.gemv((mx.random.normal((layer.down.width,), key=mx.random.key(6))
                                                 * 0.1).astype(dt), layer.down, residual=res),
    }
    for name, run in cases.items():
        assert _rel(run(cuda), run(ref)) <= BOUND, name
    if quant is not None:  # CODES 1 (codes as subnormal floats) gives CODES 0's bits
        cases["q/k/v sums"] = lambda ops: ops.qkv_sums(x, layer.attn_norm, proj)
        for name, run in cases.items():
            by_codes = []
            for codes in (0, 1):
                fd.CODES = codes
                by_codes.append(run(cuda))
            fd.CODES = 1
            assert mx.array_equal(*by_codes), name
    buffer = (mx.random.normal((2, layer.attn.hkv, 256, layer.attn.head_dim), key=mx.random.key(7)) * 0.3).astype(dt)
    pos = mx.array([37], mx.int32)
    mine = buffer + 0
    q, written, next_pos, kv_new = cuda.qkv_rope(x, layer.attn_norm, proj, layer.attn.at(mine, pos))
    q_ref, _, _, kv_ref = ref.qkv_rope(x, layer.attn_norm, proj, layer.attn.at(buffer, pos))
    assert _rel(q, q_ref) <= BOUND and _rel(kv_new, kv_ref) <= BOUND and next_pos.item() == 38
    assert mx.array_equal(mine, _write(buffer, kv_new, pos, layer.attn))  # in place, as a scatter writes it
    length = mx.array([200], mx.int32)
    assert _rel(cuda.attention(q_ref, buffer, length, layer.attn), ref.attention(q_ref, buffer, length,
                                                                                  layer.attn)) <= BOUND


@pytest.mark.parametrize("arch,quant,dtype", [CASES[1], CASES[3]])
@pytest.mark.parametrize("capacity,position", [(256, 37), (1024, 37), (1024, 1000)])
def test_one_launch_is_the_three_it_replaces(emulated, zoo, arch, quant, dtype, capacity, position, monkeypatch):
    """rope_attention (q/k norm, RoPE, the K/V write, the attention and the last block's merge of
    its splits in one launch) gives the three launches' output, buffer and next position bit for
    bit: in one split, and in the last of several."""
    plan = fused_plan(_model(zoo, arch, quant, dtype))
    layer, dt, cuda = plan.layers[0], plan.dtype, CudaFusedOps(inplace=True)
    x = mx.random.normal((plan.hidden,), key=mx.random.key(3)).astype(dt)
    buffer = (mx.random.normal((2, layer.attn.hkv, capacity, layer.attn.head_dim), key=mx.random.key(7))
              * 0.3).astype(dt)
    pos = mx.array([position], mx.int32)
    outs = []
    for one_launch in (False, True):
        monkeypatch.setattr(fd, "ROPE_ATTENTION", one_launch)
        mine = buffer + 0
        outs.append(cuda.qkv_attention(x, layer.attn_norm, (layer.q, layer.k, layer.v), layer.attn.at(mine, pos)))
    (o3, b3, n3), (o1, b1, n1) = outs
    assert mx.array_equal(o1, o3) and mx.array_equal(b1, b3) and n1.item() == n3.item() == position + 1


@pytest.mark.parametrize("arch,quant,dtype", [CASES[0], CASES[3]])
def test_a_fused_decode_on_the_kernels_is_the_exact_paths(emulated, zoo, arch, quant, dtype):
    """Six greedy steps of the fused step on the emulated kernels: the exact path's tokens, logits
    within the half-precision rounding of other summation orders."""
    class Emulated(CudaFusedOps):  # the attention's gap is "no CUDA device" here; the zoo's shapes are the kernels'
        attention_gap = staticmethod(lambda attn, dtype: None)

    model = _model(zoo, arch, quant, dtype)
    mx.disable_compile()  # the emulator reads its inputs' values: it cannot run inside a trace
    try:
        _, _, _, pairs = decode_both(model, ops=Emulated(inplace=True))
    finally:
        mx.enable_compile()
    for exact, fused in pairs:
        assert mx.argmax(exact).item() == mx.argmax(fused).item()
        assert mx.abs(exact.astype(mx.float32) - fused.astype(mx.float32)).max().item() < 0.1


# ------------------------------------------------------------------ the emulator itself

_SUM = r"""
  __shared__ float red[32];
  const int t = threadIdx.x;
  float v = x[blockIdx.x * blockDim.x + t];
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((t & 31) == 0) red[t >> 5] = v;
  __syncthreads();
  if (t == 0) {
    float s = 0.0f;
    for (int i = 0; i < blockDim.x / 32; ++i) s += red[i];
    out[blockIdx.x] = s;
  }
"""


def test_the_emulator_runs_warps_and_blocks_as_the_device():
    x = mx.random.normal((3, 128), key=mx.random.key(0))
    (out,) = EmulatedKernel("sums", ["x"], ["out"], _SUM)(inputs=[x], grid=(384, 1, 1), threadgroup=(128, 1, 1),
                                                         output_shapes=[(3,)], output_dtypes=[mx.float32])
    # the warp's xor tree, then the warps in order: numpy adds the same pairs
    v = np.array(x).reshape(3, 4, 32)
    for o in (16, 8, 4, 2, 1):
        v = v + v[..., np.arange(32) ^ o]
    want = np.zeros(3, np.float32)
    for w in range(4):
        want = want + v[:, w, 0]
    assert np.array_equal(np.array(out), want)


def test_the_emulator_refuses_a_divergent_barrier_and_shows_unwritten_outputs():
    divergent = "if (threadIdx.x < 16) { __syncthreads(); }\n  __syncthreads();\n  out[threadIdx.x] = 1.0f;"
    kernel = EmulatedKernel("divergent", ["x"], ["out"], divergent)
    with pytest.raises(RuntimeError, match="threads 0 and 16 wait at different block barriers"):
        kernel(inputs=[mx.zeros((1,))], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,)],
               output_dtypes=[mx.float32])
    half = EmulatedKernel("half", ["x"], ["out"], "if (threadIdx.x % 2 == 0) { out[threadIdx.x] = x[0]; }")
    (out,) = half(inputs=[mx.ones((1,))], grid=(8, 1, 1), threadgroup=(8, 1, 1), output_shapes=[(8,)],
                  output_dtypes=[mx.float32])
    assert np.array(out)[::2].tolist() == [1.0] * 4 and np.isnan(np.array(out)[1::2]).all()


def test_bfloat16_and_half_round_as_cudas():
    """Float -> bfloat16 / half: round to nearest even (MLX's astype rounds the same way)."""
    kernel = EmulatedKernel("cast", ["x"], ["b", "h"], "b[threadIdx.x] = static_cast<__nv_bfloat16>(x[threadIdx.x]);"
                                                        " h[threadIdx.x] = static_cast<__half>(x[threadIdx.x]);")
    x = mx.array(np.concatenate([np.random.default_rng(0).standard_normal(60).astype(np.float32) * 1e3,
                                 np.float32([1 + 2 ** -8, 1 + 3 * 2 ** -8, 65504.0, 1e-6])]))
    b, h = kernel(inputs=[x], grid=(64, 1, 1), threadgroup=(64, 1, 1), output_shapes=[(64,), (64,)],
                  output_dtypes=[mx.bfloat16, mx.float16])
    assert mx.array_equal(b, x.astype(mx.bfloat16)) and mx.array_equal(h, x.astype(mx.float16))
