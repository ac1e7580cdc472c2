"""mlxbun's CUDA kernels, run on the CPU by mlxbun/kernels/emulator.py (g++ and fibers, no GPU):
each fused decode kernel against its MLX-op reference within the device check's bound, the pairs
that are claimed to give the same bits (the two code conversions, one launch against three, the
in-place K/V write against a scatter) bit for bit, a whole fused decode against the exact path,
the decode attention (16-bit, quantized and TurboQuant K/V, sinks) and the quantized GEMV against
MLX's ops, and the TurboQuant quantize kernel against its codec. The
device's own bits stay benchmarks/gpu_fused.py's check; this runs in CI, on every change to a
kernel, where no device is."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.factory import open_model
from mlxbun.fast.fused_plan import fused_plan
from mlxbun.kernels import fused_decode as fd
from mlxbun.kernels import rope_attention as ra
from mlxbun.kernels.emulator import EmulatedKernel, emulating, emulator_gap
from mlxbun.kernels.fused_decode import CudaFusedOps, ReferenceFusedOps, _write
from tests.decode_steps import decode_both


pytestmark = pytest.mark.skipif(emulator_gap() is not None, reason=f"the emulator cannot run here: {emulator_gap()}")

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


@pytest.mark.parametrize("arch,quant,dtype,norm_vec", [(*case, 0) for case in CASES] + [(*CASES[2], 1), (*CASES[3], 1)])
def test_each_kernel_is_its_reference(emulated, zoo, arch, quant, dtype, norm_vec, monkeypatch):
    """(NORM_VEC 1: the GEMVs' norm staged in one pass of 16-byte loads.)"""
    monkeypatch.setattr(fd, "NORM_VEC", norm_vec)
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
                monkeypatch.setattr(fd, "CODES", codes)
                by_codes.append(run(cuda))
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
@pytest.mark.parametrize("capacity,position", [(256, 37), (1024, 37), (1024, 1000), (4096, 4000)])
def test_one_launch_is_the_three_it_replaces(emulated, zoo, arch, quant, dtype, capacity, position, monkeypatch):
    """rope_attention (q/k norm, RoPE, the K/V write, the attention and the last block's merge of
    its splits in one launch) gives the three launches' output, buffer and next position bit for
    bit: in one split, in the last of several, and past the 16 splits it takes by default (its
    merge batches: what ROPE_ATTENTION_MAX_SPLITS=4096 measures on the device)."""
    monkeypatch.setattr(fd, "ROPE_ATTENTION_MAX_SPLITS", 4096)
    plan = fused_plan(_model(zoo, arch, quant, dtype))
    layer, dt, cuda = plan.layers[0], plan.dtype, CudaFusedOps(inplace=True)
    probe = layer.attn.at(mx.zeros((2, layer.attn.hkv, capacity, 1)), None)  # a buffer of `capacity`'s facts
    chunk = dict(ra.rope_attention_template(probe, dt))["CHUNK"]
    assert ra.rope_attention_gap(probe, 4096) is None  # the one launch runs
    assert (capacity > 1024) == (-(-capacity // chunk) > 16)  # the last case merges more than 16 splits
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


@pytest.mark.parametrize("arch,quant,dtype,mma", [(*CASES[0], 0), (*CASES[3], 0), (*CASES[3], 1), (*CASES[3], 2)])
def test_a_fused_decode_on_the_kernels_is_the_exact_paths(emulated, zoo, arch, quant, dtype, mma, monkeypatch):
    """Six greedy steps of the fused step on the emulated kernels: the exact path's tokens, logits
    within the half-precision rounding of other summation orders (with the 4-bit GEMVs on the FFMA
    loop, and on the tensor cores: MMA 1 and 2)."""
    monkeypatch.setattr(fd, "MMA", mma)
    class Emulated(CudaFusedOps):  # the attention's gap is "no CUDA device" here; the zoo's shapes are the kernels'
        attention_gap = staticmethod(lambda attn, dtype: None)

    model = _model(zoo, arch, quant, dtype)
    mx.disable_compile()  # the emulator reads its inputs' values: it cannot run inside a trace
    try:
        _, _, _, pairs = decode_both(model, ops=Emulated(inplace=True))
    finally:
        mx.enable_compile()
    assert any(mma_kernel for *_, mma_kernel in fd._kernels) == bool(mma)  # the tensor-core GEMVs ran
    for exact, fused in pairs:
        assert mx.argmax(exact).item() == mx.argmax(fused).item()
        assert mx.abs(exact.astype(mx.float32) - fused.astype(mx.float32)).max().item() < 0.1


def _affine4(rows, width, group, dtype, seed):
    q, s, b = mx.quantize(mx.random.normal((rows, width), key=mx.random.key(seed)) * 0.05, group_size=group, bits=4)
    return fd.Weights(q, s.astype(dtype), b.astype(dtype), 4, group)


@pytest.mark.parametrize("dtype,group,mma,split", [(mx.bfloat16, 32, 1, 4), (mx.bfloat16, 64, 2, 2),
                                                   (mx.float16, 128, 1, 1), (mx.float16, 32, 2, 4)])
def test_the_tensor_core_gemvs_are_their_references(emulated, dtype, group, mma, split, monkeypatch):
    """MMA 1 / 2 (fused_decode.MMA: the 4-bit GEMVs on mma.sync) within the device check's bound of
    the MLX-op reference: with a norm or without, the residual, the swiglu; 72 rows (the last tile
    half past the end), 1 to 4 warps a tile. Their q/k/v sums are the FFMA loop's within 2^-16 (MMA 2
    on bf16 takes the codes' 2^7 out in the scale term; half ignores it)."""
    monkeypatch.setattr(fd, "MMA", mma)
    K, N = 512, 72
    gate, up = _affine4(N, K, group, dtype, 1), _affine4(N, K, group, dtype, 2)
    assert fd.uses_mma(gate, fd.MMA_SWIGLU) and fd.mma_split(gate, N) == split
    x = mx.random.normal((K,), key=mx.random.key(3)).astype(dtype)
    norm = ((mx.random.normal((K,), key=mx.random.key(4)) * 0.2 + 1).astype(dtype), 1e-5)
    res = mx.random.normal((N,), key=mx.random.key(5)).astype(dtype)
    cuda, ref = CudaFusedOps(inplace=True), ReferenceFusedOps()
    cases = {"plain + residual": lambda ops: ops.gemv(x, gate, residual=res),
             "norm": lambda ops: ops.gemv(x, gate, norm=norm),
             "norm + gate/up": lambda ops: ops.gemv_swiglu(x, norm, gate, up)}
    for name, run in cases.items():
        assert _rel(run(cuda), run(ref)) <= BOUND, name
    proj = (gate, _affine4(24, K, group, dtype, 6), _affine4(24, K, group, dtype, 7))
    sums = cuda.qkv_sums(x, norm, proj)
    monkeypatch.setattr(fd, "MMA", 0)
    ffma = cuda.qkv_sums(x, norm, proj)
    assert sums.shape == (120,) and 0 < _rel(sums, ffma) <= 2.0 ** -16  # another order than the FFMA loop's


_MMA_PROBE = r"""
  // lane (g, t) loads its fragments from A [16, 16] and B [16, 8] (row-major, 16-bit) by the PTX ISA's
  // formulas for mma.m16n8k16 (9.7.14.5.8), and writes its D elements into d [16, 8]
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  const unsigned short* A = reinterpret_cast<const unsigned short*>(a);
  const unsigned short* B = reinterpret_cast<const unsigned short*>(b);
  auto pair = [](unsigned short lo, unsigned short hi) { return static_cast<unsigned>(lo) | (static_cast<unsigned>(hi) << 16); };
  unsigned af[4], bf[2];
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i & 1), col = 2 * t + 8 * (i >> 1);
    af[i] = pair(A[row * 16 + col], A[row * 16 + col + 1]);
  }
  for (int i = 0; i < 2; ++i) {
    const int k = 2 * t + 8 * i;
    bf[i] = pair(B[k * 8 + g], B[(k + 1) * 8 + g]);
  }
  float c[4], out[4];
  for (int i = 0; i < 4; ++i) c[i] = cin[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)];
  mlxbun_mma_m16n8k16<true>(out, af, bf, c);
  for (int i = 0; i < 4; ++i) d[(g + 8 * (i >> 1)) * 8 + 2 * t + (i & 1)] = out[i];
"""


def test_the_emulators_mma_is_the_matrix_product():
    """The emulator's warp-wide mma.m16n8k16, fed fragments laid out by the PTX ISA's formulas, is
    C + A B (exact sums rounded once: within float32's rounding of numpy's float64 product)."""
    rng = np.random.default_rng(0)
    a, b = (mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16) for shape in ((16, 16), (16, 8)))
    c = mx.array(rng.standard_normal((16, 8)).astype(np.float32))
    kernel = EmulatedKernel("mma_probe", ["a", "b", "cin"], ["d"], _MMA_PROBE)
    (d,) = kernel(inputs=[a, b, c], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(16, 8)],
                  output_dtypes=[mx.float32])
    want = np.array(c, np.float64) + np.array(a.astype(mx.float32), np.float64) @ np.array(b.astype(mx.float32),
                                                                                             np.float64)
    assert np.abs(np.array(d) - want).max() <= 2.0 ** -20 * np.abs(want).max()
    assert np.abs(np.array(d) - want[:, ::-1]).max() > 0.1  # a swapped column would show


# ------------------------------------------------------------------ the decode attention and the GEMV


def _attention_reference(q, k, v, length: int, scale: float, sinks=None):
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    return mx.fast.scaled_dot_product_attention(f32(q), f32(k[:, :, :length]), f32(v[:, :, :length]), scale=scale,
                                                sinks=None if sinks is None else f32(sinks))


@pytest.mark.parametrize("heads,kv_heads,head_dim,sinks", [(8, 2, 128, False), (8, 8, 64, True), (4, 1, 256, False),
                                                             (16, 2, 32, False)])
def test_the_decode_attention_is_softmax_attention(emulated, heads, kv_heads, head_dim, sinks):
    """Over a buffer longer than its length (the rows past it are never read: NaN there), in several
    splits, with and without sink logits."""
    from mlxbun.kernels.sdpa_decode import decode_attention

    q, k, v = (mx.random.normal(shape, key=mx.random.key(11 + 7 * i)).astype(mx.bfloat16)
               for i, shape in enumerate([(1, heads, 1, head_dim)] + [(1, kv_heads, 640, head_dim)] * 2))
    k, v = (mx.concatenate([a[:, :, :600], mx.full(a[:, :, 600:].shape, float("nan"), a.dtype)], axis=2)
            for a in (k, v))
    s = mx.random.normal((heads,), key=mx.random.key(99)) if sinks else None
    got = decode_attention(q, k, v, mx.array([600], mx.int32), head_dim ** -0.5, s)
    assert _rel(got, _attention_reference(q, k, v, 600, head_dim ** -0.5, s)) <= BOUND


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (4, 128)])
def test_the_quantized_decode_attention_is_attention_over_the_dequantized_rows(emulated, bits, group):
    from mlxbun.kernels.sdpa_decode import quantized_decode_attention

    q, k, v = (mx.random.normal(shape, key=mx.random.key(12 + 7 * i)).astype(mx.float16)
               for i, shape in enumerate([(1, 8, 1, 128)] + [(1, 2, 512, 128)] * 2))
    qk, qv = (mx.quantize(a, group_size=group, bits=bits) for a in (k, v))
    got = quantized_decode_attention(q, qk, qv, mx.array([500], mx.int32), 128 ** -0.5, group, bits)
    dk, dv = (mx.dequantize(*t, group_size=group, bits=bits) for t in (qk, qv))
    assert _rel(got, _attention_reference(q, dk, dv, 500, 128 ** -0.5)) <= BOUND


@pytest.mark.parametrize("bits,group,rows", [(4, 64, 1), (8, 32, 1), (4, 128, 4)])
def test_the_quantized_gemv_is_quantized_matmul(emulated, bits, group, rows):
    from mlxbun.kernels.qmv import launch_qmv

    key = mx.random.key(13)
    w = mx.random.normal((384, 1024), key=key) * 0.05
    wq, scales, biases = mx.quantize(w.astype(mx.bfloat16), group_size=group, bits=bits)
    x = mx.random.normal((rows, 1024), key=mx.random.key(14)).astype(mx.bfloat16)
    got = launch_qmv(x, wq, scales, biases, group, bits)
    want = mx.quantized_matmul(x.astype(mx.float32), wq, scales.astype(mx.float32), biases.astype(mx.float32),
                               transpose=True, group_size=group, bits=bits)
    assert got.shape == (rows, 384) and _rel(got, want) <= BOUND


@pytest.mark.parametrize("widths,head_dim,kv_heads", [((3, 4), 128, 2), ((4, 3), 64, 4), ((1, 8), 128, 1)])
def test_the_turboquant_decode_is_rotated_attention_over_the_codes(emulated, widths, head_dim, kv_heads):
    """The TurboQuant kernel with the rotations around it (as the static cache runs it) against the
    codes' attention in float32; the positions past the length hold large vectors (a read shows)."""
    from mlxbun.cache.turboquant_codec import TurboQuantCodec, TurboQuantState
    from mlxbun.kernels.sdpa_decode import turboquant_decode_attention

    cap, n, heads = 640, 600, 8
    kc, vc = TurboQuantCodec(head_dim, widths[0], 1).prepare(), TurboQuantCodec(head_dim, widths[1], 2).prepare()
    q = mx.random.normal((1, heads, 1, head_dim), key=mx.random.key(21)).astype(mx.float16)
    tail = mx.arange(cap)[None, None, :, None] >= n
    k, v = (codec.quantize(mx.where(tail, 100.0, mx.random.normal((1, kv_heads, cap, head_dim),
                                                                  key=mx.random.key(22 + i))).astype(mx.float16))
            for i, codec in enumerate((kc, vc)))
    scale = head_dim ** -0.5
    got = vc.unrotate(turboquant_decode_attention(kc.rotate(q * scale), k, v, kc.codebook, vc.codebook,
                                                  mx.array([n], mx.int32)))
    kn, vn = (TurboQuantState(s.norms[..., :n], s.indices[..., :n, :]) for s in (k, v))
    q_rot = kc.rotate(q * scale).reshape(1, kv_heads, heads // kv_heads, 1, head_dim)
    w = mx.softmax(mx.einsum("bhmld,bhtd->bhmlt", q_rot, kc.codewords(kn))
                   * kn.norms.astype(mx.float32)[:, :, None, None, :], axis=-1)
    want = vc.unrotate(mx.einsum("bhmlt,bht,bhtd->bhmld", w, vn.norms.astype(mx.float32), vc.codewords(vn)))
    assert _rel(got, want.reshape(1, heads, 1, head_dim)) <= 2 ** -14  # float32 sums in another order


@pytest.mark.parametrize("bits,head_dim,dtype", [(3, 128, mx.float16), (4, 64, mx.bfloat16), (8, 256, mx.float16)])
def test_the_turboquant_quantize_kernel_is_the_codecs_quantize(emulated, bits, head_dim, dtype):
    """Norms within a float16 step, indices the codec's but for coordinates a rounding from a
    midpoint (at most 1 in 1000, one codeword off): the device check's bound."""
    from mlxbun.cache.turboquant_codec import EPS, TurboQuantCodec, unpack_indices
    from mlxbun.kernels.turboquant_quantize import turboquant_quantize

    codec = TurboQuantCodec(head_dim, bits, seed=1)
    x = mx.random.normal((1, 4, 33, head_dim), key=mx.random.key(bits)).astype(dtype)
    norms, codes = turboquant_quantize(x, codec.signs, codec.midpoints, bits, EPS)
    want = codec.quantize(x)
    rel = mx.abs(norms.astype(mx.float32) - want.norms.astype(mx.float32)) / mx.abs(want.norms.astype(mx.float32))
    assert rel.max().item() <= 2 ** -10
    ids, ref = (unpack_indices(c, bits, head_dim).astype(mx.int32) for c in (codes, want.indices))
    assert (ids != ref).astype(mx.float32).mean().item() <= 1e-3 and mx.abs(ids - ref).max().item() <= 1


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
