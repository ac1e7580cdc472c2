"""The TurboQuant quantize kernel on the CPU: what it refuses, the CUDA source it builds (compiled
with nvcc where installed), its algorithm transcribed in numpy against the codec (the butterfly's
order, the index count, the word packing), and its dispatch in the static TurboQuant cache (the
kernel runs on the H200: `benchmarks/gpu_check.py --checks turboquant`)."""

from __future__ import annotations

import math
import shutil

import mlx.core as mx
import numpy as np
import pytest

import mlxbun.fast.static_cache as static_cache
import mlxbun.kernels.turboquant_quantize as tq_mod
from mlxbun.cache.turboquant_codec import EPS, TurboQuantCodec, pack_indices, unpack_indices
from mlxbun.fast import CompiledDecoder, enable_fast
from mlxbun.factory import open_model
from mlxbun.fast.linear import FastSwitch
from mlxbun.kernels.common import Gap
from mlxbun.kernels.render import ptxas_report, render
from mlxbun.kernels.turboquant_quantize import SOURCE, quantize_gap, template


def _butterfly(u: np.ndarray) -> np.ndarray:
    """The kernel's in-place Walsh-Hadamard butterfly: thread t keeps a + b, or b - a where its bit
    `len` is set (a its own value, b its partner t ^ len)."""
    buf, dim, step = u.copy(), u.shape[-1], 1
    lanes = np.arange(dim)
    while step < dim:
        a, b = buf[..., lanes], buf[..., lanes ^ step]
        buf = np.where(lanes & step, b - a, a + b)
        step <<= 1
    return buf


def _pack(ids: np.ndarray, bits: int) -> np.ndarray:
    """The kernel's packing: word t ORs index i shifted to bit i * bits - 32 t (right for an index
    that began in the word before), bits above 31 dropped."""
    dim = ids.shape[-1]
    words = np.zeros((*ids.shape[:-1], (dim * bits + 31) // 32), np.uint64)
    for t in range(words.shape[-1]):
        for i in range(32 * t // bits, min(dim - 1, (32 * t + 31) // bits) + 1):
            at, q = i * bits - 32 * t, ids[..., i].astype(np.uint64)
            words[..., t] |= (q << np.uint64(at)) if at >= 0 else (q >> np.uint64(-at))
    return (words & np.uint64(0xFFFFFFFF)).astype(np.uint32)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_the_kernels_packing_is_the_codecs(bits, dim):
    ids = np.random.default_rng(bits * dim).integers(0, 1 << bits, size=(3, dim))
    assert np.array_equal(_pack(ids, bits), np.array(pack_indices(mx.array(ids.astype(np.uint32)), bits)))


@pytest.mark.parametrize("bits,dim", [(3, 128), (4, 64), (1, 256), (8, 32), (5, 128)])
def test_the_kernels_algorithm_gives_the_codecs_state(bits, dim):
    """norm, unit vector, signs, butterfly, 1/sqrt(D), midpoint count, packing: the codec's norms and
    all but a rounding's worth of its indices (a coordinate at a midpoint may take its neighbour)."""
    codec = TurboQuantCodec(dim, bits, seed=5)
    x = np.random.default_rng(dim + bits).standard_normal((64, dim)).astype(np.float32)
    norm = np.sqrt((x * x).sum(-1, keepdims=True))
    r = _butterfly(x / np.maximum(norm, EPS) * np.array(codec.signs)) * np.float32(1 / math.sqrt(dim))
    ids = (r[..., None] > np.array(codec.midpoints)).sum(-1)
    want = codec.quantize(mx.array(x))
    assert np.array_equal(norm[:, 0].astype(np.float16), np.array(want.norms))
    theirs = np.array(unpack_indices(want.indices, bits, dim)).astype(np.int64)
    assert (ids != theirs).mean() < 1e-3 and np.abs(ids - theirs).max() <= 1
    assert np.array_equal(_pack(theirs, bits), np.array(want.indices))


@pytest.fixture
def on_gpu(monkeypatch):
    monkeypatch.setattr(tq_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)


def test_quantize_gap_says_what_the_kernel_lacks(on_gpu, monkeypatch):
    codec = TurboQuantCodec(128, 3, 0)
    monkeypatch.setattr(tq_mod, "CHECKED", False)
    def gap(x, c=codec):
        return quantize_gap(x, c.dim, c.use_hadamard)

    assert "not yet passed its GPU check" in gap(mx.zeros((1, 2, 1, 128))).reason
    monkeypatch.setattr(tq_mod, "CHECKED", True)
    assert gap(mx.zeros((1, 2, 1, 128), mx.bfloat16)) is None
    assert "vectors of 64" in gap(mx.zeros((1, 2, 1, 64))).reason
    assert "dims" in gap(mx.zeros((1, 2, 1, 80)), TurboQuantCodec(80, 3, 0)).reason  # a QR rotation
    assert "int32 vectors" in gap(mx.zeros((1, 2, 1, 128), mx.int32)).reason


def test_quantize_gap_refuses_the_cpu():
    assert quantize_gap(mx.zeros((1, 128)), 128, True) == Gap("no CUDA device (the kernel is CUDA only)")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("bits,dim,dtype", [(3, 128, mx.float16), (4, 64, mx.bfloat16), (8, 256, mx.float32),
                                            (1, 32, mx.float16)])
def test_the_quantize_kernel_compiles_for_hopper_without_spilling(bits, dim, dtype):
    unit = render("mlxbun_turboquant_quantize", "", SOURCE, [("x", dtype), ("signs", mx.float32), ("mid", mx.float32)],
                  [("norms", mx.float16), ("codes", mx.uint32)], template(dtype, dim, bits, EPS))
    report = ptxas_report(unit)
    assert "Used" in report and "spill" not in report.replace("0 bytes spill", "")


def _turboquant_model(zoo, bits=3.5):
    from mlxbun.generation_caches import kv_quantizer, make_generation_cache

    model = open_model(zoo("llama", head_dim=32))
    cache = make_generation_cache(model, kv_bits=bits, kv_scheme="turboquant")
    model(mx.array([[1, 2, 3, 4, 5, 6]]), cache=cache)
    kv_quantizer("turboquant", bits, 64, 0)(cache)
    return model, cache


def _emulated_quantize(x, signs, midpoints, bits, eps):
    """The kernel's steps in MLX ops (the codec's arrays in, norms and packed indices out)."""
    xf = x.astype(mx.float32)
    norms = mx.sqrt((xf * xf).sum(-1))
    r = mx.hadamard_transform(xf / mx.maximum(norms[..., None], eps) * signs, scale=1 / math.sqrt(x.shape[-1]))
    ids = (r[..., None] > midpoints).astype(mx.uint32).sum(-1)
    return norms.astype(mx.float16), pack_indices(ids, bits)


def test_the_static_turboquant_cache_quantizes_new_tokens_through_the_kernel(zoo, monkeypatch):
    """With the kernel emulated, the switch's static cache quantizes K and V of every TurboQuant layer
    through it (per trace), and decodes the exact path's greedy tokens."""
    calls = []
    monkeypatch.setattr(static_cache, "quantize_gap", lambda x, dim, hadamard: None)
    monkeypatch.setattr(static_cache, "turboquant_quantize",
                        lambda x, signs, mid, bits, eps: calls.append(bits)
                        or _emulated_quantize(x, signs, mid, bits, eps))
    model, cache = _turboquant_model(zoo)
    _, exact = _turboquant_model(zoo)
    switch = FastSwitch()
    dec = CompiledDecoder(model, cache, room=4, kernels=switch)
    for t in (7, 8, 9):
        y = mx.array([[t]])
        assert mx.array_equal(mx.argmax(dec(y), -1), mx.argmax(model(y, cache=exact)[:, -1, :], -1))
    n_tq = sum(type(c).__name__ == "TurboQuantKVCache" for c in cache)
    assert n_tq and calls and len(calls) % (2 * n_tq) == 0 and len(calls) < 10 * n_tq  # per trace, K and V
    assert set(calls) == {3, 4} and switch.quantize_calls == len(calls) and not switch.quantize_gaps


def test_the_fast_path_says_why_the_quantize_kernel_did_not_run(zoo):
    model, cache = _turboquant_model(zoo)
    fast = enable_fast(model)
    dec = CompiledDecoder(model, cache, room=2, kernels=fast.switch)
    with fast.on():
        dec(mx.array([[7]]))
    fast.collect_kernel_gaps()
    assert "TurboQuant quantize kernel not used: no CUDA device (the kernel is CUDA only); the codec's MLX ops " \
           "ran" in fast.notes
