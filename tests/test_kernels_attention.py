"""The decode attention kernels on the CPU: their gaps (what they refuse, and why), their launch
shapes, the CUDA source they build (compiled with nvcc where it is installed), and their dispatch
in the compiled step's static caches, with a float32 emulation standing in for the CUDA kernel
(the kernel itself runs on the H200: `benchmarks/gpu_check.py`, `benchmarks/gpu_attention.py`)."""

from __future__ import annotations

import shutil
import struct

import mlx.core as mx
import pytest

import mlxbun.fast.static_cache as static_cache
import mlxbun.kernels.sdpa_decode as sdpa_mod
from mlxbun.cache.quantized import QuantizedKVCache
from mlxbun.factory import open_model
from mlxbun.fast import CompiledDecoder, enable_fast
from mlxbun.fast.linear import FastSwitch
from mlxbun.kernels.common import Gap, float_bits
from mlxbun.kernels.render import ptxas_report, render
from mlxbun.kernels.sdpa_decode import (HEADER, SHARED_LIMIT, decode_gap, decode_split, plan, shared_bytes,
                                        turboquant_decode_gap)
from mlxbun.tokenizer import load_tokenizer


def _q(B=1, H=8, L=1, D=64, dtype=mx.bfloat16):
    return mx.zeros((B, H, L, D), dtype)


@pytest.fixture
def on_gpu(monkeypatch):
    """decode_gap as on a CUDA device."""
    monkeypatch.setattr(sdpa_mod, "cuda_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)


# ------------------------------------------------------------------ gaps


def test_decode_gap_refuses_the_cpu_with_its_reason():
    assert decode_gap(_q(), (1, 2, 256, 64), mx.bfloat16, values_shape=(1, 2, 256, 64)) == \
        Gap("no CUDA device (the kernel is CUDA only)")


@pytest.mark.parametrize("q,kv,dtype,extra,reason", [
    (_q(dtype=mx.float32), (1, 2, 256, 64), mx.float32, {}, "float32 queries"),
    (_q(), (1, 2, 256, 64), mx.float16, {}, "float16 K/V"),
    (_q(D=80), (1, 2, 256, 80), mx.bfloat16, {}, "head dim 80"),
    (_q(H=32), (1, 2, 256, 64), mx.bfloat16, {}, "16 query heads per KV head"),
    (_q(H=6), (1, 4, 256, 64), mx.bfloat16, {}, "a multiple of the KV heads"),
    (_q(B=2), (1, 2, 256, 64), mx.bfloat16, {}, "the same batch"),
    (_q(), (1, 2, 256, 64), mx.bfloat16, {"values_shape": (1, 2, 256, 32)}, "values (1, 2, 256, 32)"),
    (_q(), (1, 2, 256, 8), mx.bfloat16, {"head_dim": 64, "bits": 3, "group_size": 64}, "3-bit K/V"),
    (_q(), (1, 2, 256, 16), mx.bfloat16, {"head_dim": 64, "bits": 8, "group_size": 16}, "groups of 16"),
    (_q(), (1, 2, 256, 64), mx.bfloat16, {"sinks": mx.zeros((4,))}, "sinks of shape (4,)"),
])
def test_decode_gap_names_what_the_kernel_lacks(on_gpu, q, kv, dtype, extra, reason):
    extra = {"values_shape": kv, **extra}
    gap = decode_gap(q, kv, dtype, **extra)
    assert gap is not None and reason in gap.reason and not gap.by_design


def test_decode_gap_accepts_decode_shapes_and_leaves_prefill_to_mlx(on_gpu):
    assert decode_gap(_q(H=32, D=128), (1, 8, 768, 128), mx.bfloat16, values_shape=(1, 8, 768, 128)) is None
    assert decode_gap(_q(H=32, D=128), (1, 8, 768, 16), mx.bfloat16, values_shape=(1, 8, 768, 16),
                      head_dim=128, bits=4, group_size=32, sinks=mx.zeros((32,))) is None
    prefill = decode_gap(_q(L=5), (1, 2, 256, 64), mx.bfloat16, values_shape=(1, 2, 256, 64))
    assert prefill.by_design and "5 queries" in prefill.reason


def test_turboquant_decode_gap_waits_for_the_kernels_gpu_check(on_gpu, monkeypatch):
    monkeypatch.setattr(sdpa_mod, "TURBOQUANT_CHECKED", False)
    gap = turboquant_decode_gap(_q(H=8, D=64), (1, 2, 256), 64, 64, 3, 4)
    assert not gap.by_design and "not yet passed its GPU check" in gap.reason


def test_turboquant_decode_gap_names_what_the_kernel_lacks(on_gpu, monkeypatch):
    monkeypatch.setattr(sdpa_mod, "TURBOQUANT_CHECKED", True)
    norms = (1, 2, 256)
    assert turboquant_decode_gap(_q(H=8, D=64), norms, 64, 64, 3, 4) is None
    assert turboquant_decode_gap(_q(H=8, D=64, dtype=mx.float32), norms, 64, 64, 8, 1) is None  # any query dtype
    for q, dims, bits, sinks, reason in [
        (_q(D=80), (80, 80), (3, 4), None, "head dim 80"),
        (_q(), (64, 32), (3, 4), None, "values of 32"),
        (_q(), (64, 64), (0, 4), None, "keys 0 / values 4"),
        (_q(), (64, 64), (3, 4), mx.zeros((8,)), "attention sinks"),
        (_q(H=32), (64, 64), (3, 4), None, "16 query heads per KV head"),
    ]:
        gap = turboquant_decode_gap(q, norms, *dims, *bits, sinks=sinks)
        assert gap is not None and reason in gap.reason and not gap.by_design, (reason, gap)
    prefill = turboquant_decode_gap(_q(L=3), norms, 64, 64, 3, 4)
    assert prefill.by_design and "3 queries" in prefill.reason


def test_turboquant_decode_gap_refuses_the_cpu():
    assert turboquant_decode_gap(_q(), (1, 2, 256), 64, 64, 3, 4) == Gap("no CUDA device (the kernel is CUDA only)")


# ------------------------------------------------------------------ launch shapes and source


@pytest.mark.parametrize("capacity,bkv,group,dim,expect", [
    (768, 8, 4, 128, (64, 12)),  # Llama-3-8B at pp512 + tg128: the smallest chunk
    (16640, 4, 4, 128, (128, 130)),  # 16k context, 4 KV heads: ~4 blocks per SM
    (16640, 8, 4, 128, (256, 65)),
    (100000, 1, 8, 256, (256, 391)),  # the largest chunk whose shared memory fits (40 KiB)
])
def test_decode_split_depends_on_the_capacity_only(capacity, bkv, group, dim, expect):
    chunk, splits = decode_split(capacity, bkv, group, dim)
    assert (chunk, splits) == expect
    assert chunk * splits >= capacity > chunk * (splits - 1)
    assert shared_bytes(chunk, group, dim) <= SHARED_LIMIT
    with pytest.raises(ValueError, match="capacity 0"):
        decode_split(0, bkv, group, dim)


def test_float_bits_is_the_float32_pattern():
    assert struct.unpack("<f", struct.pack("<i", float_bits(128 ** -0.5)))[0] == pytest.approx(128 ** -0.5)
    assert float_bits(1.0) == 0x3F800000


def test_plan_launches_one_block_per_split_and_kv_head_then_one_per_query_head():
    partial, combine = plan((2, 32, 1, 128), mx.bfloat16, 8, 768, 0.125)
    assert partial.grid == (12 * 128, 16, 1) and partial.threadgroup == (128, 1, 1)
    assert [n for n, _ in partial.inputs] == ["q", "k", "v", "length"]
    assert [s for _, _, s in partial.outputs] == [(64, 12, 128), (64, 12, 2)]
    assert dict(partial.template)["G"] == 4 and dict(partial.template)["SCALE_BITS"] == float_bits(0.125)
    assert combine.grid == (2 * 32 * 128, 1, 1) and combine.threadgroup == (128, 1, 1)
    assert combine.outputs[0][2] == (2, 32, 1, 128) and dict(combine.template)["SPLITS"] == 12
    qp, qc = plan((1, 16, 1, 128), mx.float16, 4, 2048, 0.1, bits=4, group_size=32, sinks=True)
    assert [(n, d) for n, d in qp.inputs][1:4] == [("k_codes", mx.uint32), ("k_scales", mx.float16),
                                                   ("k_biases", mx.float16)]
    assert dict(qp.template)["QBITS"] == 4 and dict(qp.template)["GS"] == 32
    assert qc.inputs[-1][0] == "sinks" and "sinks[bh % H]" in qc.source


def test_the_turboquant_plan_takes_rotated_float32_queries_and_both_codebooks():
    partial, combine = plan((1, 32, 1, 128), mx.bfloat16, 8, 16640, 1.0, turboquant=(3, 4))
    assert partial.name == "mlxbun_sdpa_decode_tq"
    assert partial.inputs == (("q", mx.float32), ("k_norms", mx.float16), ("k_codes", mx.uint32),
                              ("k_book", mx.float32), ("v_norms", mx.float16), ("v_codes", mx.uint32),
                              ("v_book", mx.float32), ("length", mx.int32))
    t = dict(partial.template)
    assert (t["KBITS"], t["VBITS"], t["QF32"], t["SCALE_BITS"]) == (3, 4, True, float_bits(1.0))
    assert combine.outputs[0][1] == mx.float32  # the value rotation's space: the caller rotates back
    # the codebooks take shared memory: the split is chosen with them counted
    assert decode_split(16640, 8, 4, 128, book_floats=8 + 16) == (t["CHUNK"], partial.grid[0] // 128)
    assert shared_bytes(256, 4, 128, book_floats=24) == shared_bytes(256, 4, 128) + 96


def _unit(call):
    return render(call.name, HEADER, call.source, call.inputs, [(n, d) for n, d, _ in call.outputs], call.template)


def test_render_writes_the_signature_mlx_writes():
    partial, _ = plan((1, 32, 1, 128), mx.bfloat16, 8, 768, 0.125)
    unit = _unit(partial)
    assert "__global__ void mlxbun_sdpa_decode(\n    const __nv_bfloat16* q,\n" in unit
    assert "    const int32_t* length,\n    float* o_part,\n    float* ml) {" in unit
    assert "  constexpr int CAP = 768;\n" in unit and "  using T = __nv_bfloat16;\n" in unit


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("bits,sinks", [(0, True), (4, False)])
def test_the_kernels_compile_for_hopper_without_spilling(bits, sinks):
    for call in plan((1, 32, 1, 128), mx.bfloat16, 8, 768, 0.125, bits=bits, group_size=64, sinks=sinks):
        report = ptxas_report(_unit(call))
        assert "Used" in report and "spill" not in report.replace("0 bytes spill", "")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("widths,head_dim", [((3, 4), 128), ((4, 3), 64), ((1, 8), 128), ((5, 2), 256)])
def test_the_turboquant_kernel_compiles_for_hopper_without_spilling(widths, head_dim):
    for call in plan((1, 32, 1, head_dim), mx.float16, 8, 16640, 1.0, turboquant=widths):
        report = ptxas_report(_unit(call))
        assert "Used" in report and "spill" not in report.replace("0 bytes spill", "")


# ------------------------------------------------------------------ dispatch in the static caches


def _emulated(q, keys, values, length, scale, sinks=None):
    """The kernel's result in MLX ops: attention over the first `length` positions."""
    mask = (mx.arange(keys.shape[2]) < length)[None]
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)


def _emulated_quantized(q, q_keys, q_values, length, scale, group_size, bits, sinks=None):
    keys, values = (mx.dequantize(*t, group_size=group_size, bits=bits).astype(q.dtype) for t in (q_keys, q_values))
    return _emulated(q, keys, values, length, scale, sinks)


@pytest.fixture
def emulated_attention(monkeypatch):
    calls = []
    monkeypatch.setattr(static_cache, "decode_gap", lambda *a, **k: None)
    monkeypatch.setattr(static_cache, "decode_attention", lambda *a, **k: calls.append("kv") or _emulated(*a, **k))
    monkeypatch.setattr(static_cache, "quantized_decode_attention",
                        lambda *a, **k: calls.append("qkv") or _emulated_quantized(*a, **k))
    return calls


def _decode_pair(path, kernels, quantized=None, steps=5, prompt=(3, 1, 4, 1, 5, 9, 2)):
    model = open_model(path)
    ids = mx.array([list(prompt)])
    exact, static = model.make_cache(), model.make_cache()
    if quantized:
        exact = [QuantizedKVCache(*quantized) for _ in exact]
        static = [QuantizedKVCache(*quantized) for _ in static]
    model(ids, cache=exact)
    model(ids, cache=static)
    dec = CompiledDecoder(model, static, room=steps, kernels=kernels)
    y, pairs = mx.array([[7]]), []
    for _ in range(steps):
        e = model(y, cache=exact)[:, -1, :]
        pairs.append((e, dec(y)))
        y = mx.argmax(e, axis=-1)[:, None]
    dec.write_back()
    return model, exact, static, pairs


@pytest.mark.parametrize("quantized", [None, (32, 8), (32, 4)])  # (group, bits)
def test_the_compiled_step_runs_the_kernel_in_every_static_cache(zoo, emulated_attention, quantized):
    switch = FastSwitch()
    model, exact, static, pairs = _decode_pair(zoo("llama", head_dim=32), switch, quantized)
    layers = len(exact)
    # every layer, in each trace mx.compile makes (it traces more than once), and never per token
    assert set(emulated_attention) == {"qkv" if quantized else "kv"} and len(emulated_attention) % layers == 0
    assert len(emulated_attention) < 5 * layers
    assert switch.attention_calls == len(emulated_attention) and not switch.attention_gaps
    for e, f in pairs:  # the emulation sums the filled part in another order: close, the same argmax
        assert mx.abs(e - f).max().item() < 1e-4 and mx.array_equal(mx.argmax(e, -1), mx.argmax(f, -1))
    y = mx.array([[11]])
    assert mx.abs(model(y, cache=exact) - model(y, cache=static)).max().item() < 1e-4  # the state came back


def test_the_quantized_static_cache_stores_what_quantizedkvcache_stores(zoo):
    # no kernels: the stand-in quantizes new tokens with the same op, and writes them back whole
    model, exact, static, pairs = _decode_pair(zoo("llama", head_dim=32), None, (32, 4))
    assert all(type(c) is QuantizedKVCache and c.offset == exact[0].offset for c in static)
    for a, b in zip(exact, static):
        for x, y in zip((*a.keys_and_values()[0], *a.keys_and_values()[1]),
                        (*b.keys_and_values()[0], *b.keys_and_values()[1])):
            assert mx.array_equal(x, y)
    assert all(mx.array_equal(mx.argmax(e, -1), mx.argmax(f, -1)) for e, f in pairs)


def test_without_a_switch_or_with_it_off_the_static_caches_attend_as_before(zoo, emulated_attention):
    _decode_pair(zoo("llama", head_dim=32), None)
    _decode_pair(zoo("llama", head_dim=32), FastSwitch(enabled=False))
    assert not emulated_attention


def test_a_mask_the_cache_did_not_make_falls_back_and_is_counted(emulated_attention):
    switch = FastSwitch()
    cache = static_cache.StaticKVCache(mx.zeros((1, 2, 256, 32)), mx.zeros((1, 2, 256, 32)),
                                       mx.array(3, mx.int32), switch)
    q = mx.ones((1, 4, 1, 32))
    k, v = cache.update_and_fetch(mx.ones((1, 2, 1, 32)), mx.ones((1, 2, 1, 32)))
    cache.attention(q, k, v, scale=0.1, mask=mx.ones((1, 4, 1, 256), mx.bool_))  # per-head: not its own
    assert not emulated_attention and len(switch.attention_gaps) == 1
    assert "did not make" in next(iter(switch.attention_gaps))
    cache.attention(q, k, v, scale=0.1, mask=cache.make_mask(1))
    assert emulated_attention == ["kv"]


def test_the_ring_attends_over_the_filled_slots_only():
    ring = static_cache.StaticRotatingKVCache(mx.zeros((1, 1, 8, 4)), mx.zeros((1, 1, 8, 4)), mx.array(3, mx.int32))
    ring.update_and_fetch(mx.ones((1, 1, 1, 4)), mx.ones((1, 1, 1, 4)))
    assert ring.filled().item() == 4
    ring.offset = mx.array(20, mx.int32)
    assert ring.filled().item() == 8


def test_the_fast_path_says_once_why_the_kernel_did_not_run(zoo):
    path = zoo("llama", quant=4)
    model, tok = open_model(path), load_tokenizer(path)
    from mlxbun.generate import stream_generate

    fast = enable_fast(model)
    exact = [r.token for r in stream_generate(model, tok, [1, 2, 3, 4], max_tokens=6)]
    got = [r.token for r in stream_generate(model, tok, [1, 2, 3, 4], max_tokens=6, fast=fast)]
    fast.collect_kernel_gaps()
    notes = [n for n in fast.notes if n.startswith("decode attention kernel not used")]
    assert got == exact and notes == ["decode attention kernel not used: no CUDA device (the kernel is CUDA "
                                      "only); MLX's attention ran"]


def test_enabling_the_fast_path_leaves_the_quantized_cache_bit_exact(zoo):
    path = zoo("llama", head_dim=32)
    model = open_model(path)
    ids, y = mx.array([[3, 1, 4, 1, 5]]), mx.array([[9]])

    def decode():
        cache = [QuantizedKVCache(32, 4) for _ in model.make_cache()]
        model(ids, cache=cache)
        return [model(y, cache=cache) for _ in range(3)]

    before = decode()
    enable_fast(model)  # switch off outside FastPath.on(): QuantizedKVCache.attention is untouched
    assert all(mx.array_equal(a, b) for a, b in zip(before, decode()))


# ------------------------------------------------------------------ TurboQuant: the kernel's reads, its dispatch


def _kernel_rows(state, book):
    """|x| * c[idx] of every row, decoded as the TurboQuant kernel reads the packed words: slot s of a
    row (coordinates 8s .. 8s + 7) is its bytes s * BITS .. s * BITS + BITS - 1, little-endian, and
    index j of the slot is bits BITS * j .. of them (in MLX ops: it runs inside a compiled step)."""
    norms, codes = state
    bits = int(book.shape[0]).bit_length() - 1
    data = mx.view(codes, mx.uint8)
    dim = data.shape[-1] * 8 // bits
    slots = data.reshape(*data.shape[:-1], dim // 8, bits).astype(mx.uint64)
    word = slots[..., 0]
    for i in range(1, bits):
        word = word | mx.left_shift(slots[..., i], mx.array(8 * i, mx.uint64))
    shifts = mx.array([bits * j for j in range(8)], mx.uint64)
    idx = mx.right_shift(word[..., None], shifts) & mx.array((1 << bits) - 1, mx.uint64)
    idx = idx.reshape(*data.shape[:-1], dim).astype(mx.int32)
    return mx.take(book, idx) * norms.astype(mx.float32)[..., None]


def _emulated_turboquant(rotated_queries, keys, values, key_book, value_book, length):
    """The TurboQuant kernel's result in MLX ops (another summation order): attention in the
    rotations' space over the first `length` positions, float32."""
    k, v = _kernel_rows(keys, key_book), _kernel_rows(values, value_book)
    B, H, _, D = rotated_queries.shape
    KV, cap = k.shape[1], k.shape[2]
    q = rotated_queries.astype(mx.float32).reshape(B, KV, H // KV, 1, D)
    s = q @ k[:, :, None].swapaxes(-1, -2)
    s = mx.where(mx.arange(cap) < length, s, -mx.inf)
    return (mx.softmax(s, axis=-1) @ v[:, :, None]).reshape(B, H, 1, D)


@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_the_kernels_byte_reads_decode_what_the_codec_packed(bits, dim):
    from mlxbun.cache.turboquant_codec import TurboQuantCodec

    codec = TurboQuantCodec(dim, bits, seed=3)
    x = mx.random.normal((1, 2, 5, dim), key=mx.random.key(bits))
    state = codec.quantize(x)
    want = codec.codewords(state) * state.norms.astype(mx.float32)[..., None]
    assert mx.array_equal(_kernel_rows(state, codec.codebook), want)


@pytest.fixture
def emulated_turboquant(monkeypatch):
    calls = []
    monkeypatch.setattr(static_cache, "turboquant_decode_gap", lambda *a, **k: None)
    monkeypatch.setattr(static_cache, "turboquant_decode_attention",
                        lambda *a, **k: calls.append("tq") or _emulated_turboquant(*a, **k))
    return calls


@pytest.mark.parametrize("kv_bits", [3.5, 4])
def test_the_compiled_step_runs_the_turboquant_kernel_with_the_rotations_around_it(zoo, emulated_turboquant,
                                                                                   kv_bits):
    """The static TurboQuant cache hands the kernel the scaled queries in the keys' rotation and turns
    its output back from the values' (different seeds: a rotation left out or swapped is no small
    error): with the kernel emulated, the exact path's greedy ids and its logits within 1e-4."""
    from mlxbun.cache.turboquant import TurboQuantKVCache
    from mlxbun.generation_caches import kv_quantizer, make_generation_cache

    model = open_model(zoo("llama", head_dim=32))
    hook = kv_quantizer("turboquant", kv_bits, 64, 0)
    prompt = mx.array([[(i * 5) % 40 + 1 for i in range(12)]])
    exact, static = (make_generation_cache(model, kv_bits=kv_bits, kv_scheme="turboquant") for _ in range(2))
    for cache in (exact, static):
        model(prompt, cache=cache)
        hook(cache)
    n_tq = sum(isinstance(c, TurboQuantKVCache) for c in static)
    assert n_tq >= 1
    switch = FastSwitch()
    dec = CompiledDecoder(model, static, room=12, kernels=switch)
    y, worst = mx.array([[7]]), 0.0
    for _ in range(12):
        e, f = model(y, cache=exact)[:, -1, :], dec(y)
        worst = max(worst, mx.abs(e - f).max().item())
        assert mx.array_equal(mx.argmax(e, -1), mx.argmax(f, -1))
        y = mx.argmax(e, axis=-1)[:, None]
    assert 0 < worst < 1e-4  # another order of sums than the exact path's: close, not equal
    assert emulated_turboquant and len(emulated_turboquant) % n_tq == 0  # every TurboQuant layer, per trace
    assert len(emulated_turboquant) < 5 * n_tq  # traced, not called per token


def test_without_the_switch_the_static_turboquant_cache_attends_as_before(zoo, emulated_turboquant):
    from mlxbun.generation_caches import kv_quantizer, make_generation_cache

    model = open_model(zoo("llama", head_dim=32))
    cache = make_generation_cache(model, kv_bits=3.5, kv_scheme="turboquant")
    model(mx.array([[1, 2, 3, 4]]), cache=cache)
    kv_quantizer("turboquant", 3.5, 64, 0)(cache)
    dec = CompiledDecoder(model, cache, room=3)
    dec(mx.array([[5]]))
    assert not emulated_turboquant
