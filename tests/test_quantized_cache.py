"""mlxbun.cache.quantized vs mlx-lm 0.32.2's QuantizedKVCache / to_quantized /
maybe_quantize_kv_cache as the live oracle, plus the chunked quantized attention."""

import mlx.core as mx
import pytest
from mlx_lm.generate import maybe_quantize_kv_cache as o_maybe_quantize
from mlx_lm.models import base as o_base
from mlx_lm.models import cache as o_cache
from mlx_lm.models import llama as o_llama

from mlxbun.attention import backend_has_quantized_attention, chunked_quantized_sdpa, create_causal_mask
from mlxbun.cache.convert import maybe_quantize_kv_cache, quantize_cache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.quantized import KVQuantError, QuantizedKVCache
from mlxbun.errors import MlxbunError, UnsupportedModelError
from mlxbun.models.base import scaled_dot_product_attention as graph_sdpa

H, DK, DV = 2, 128, 64  # kv heads, key / value head dims (different on purpose)


def same(a, b):
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        return (isinstance(a, mx.array) and isinstance(b, mx.array) and a.dtype == b.dtype
                and a.shape == b.shape and mx.array_equal(a, b).item())
    return a == b


def kv(n, seed, dtype=mx.float32, dk=DK, dv=DV):
    k = mx.random.normal((1, H, n, dk), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, H, n, dv), key=mx.random.key(seed + 10_000)).astype(dtype)
    return k, v


def check_same(mine, ref):
    assert mine.offset == ref.offset and mine.size() == ref.offset
    assert same(list(mine.state), list(ref.state))
    assert mine.empty() == ref.empty() and mine.is_trimmable() == ref.is_trimmable()
    if not ref.empty():
        assert mine.nbytes == ref.nbytes
        assert same(mine.keys_and_values(), ref.keys_and_values())
    for N in (1, 4):
        for ra in (False, True):
            a = mine.make_mask(N, return_array=ra, window_size=None)
            b = ref.make_mask(N, return_array=ra, window_size=None)
            assert (a is None and b is None) or same(a, b)


PLAN = [7] + [1] * 5 + [260, 1, 1, 3]  # crosses the step-256 growth twice


@pytest.mark.parametrize("bits,group", [(4, 32), (4, 64), (8, 32), (8, 64)])
@pytest.mark.parametrize("dt", ["f32", "bf16"])
def test_matches_mlx_lm(bits, group, dt):
    dtype = {"f32": mx.float32, "bf16": mx.bfloat16}[dt]
    mine, ref = QuantizedKVCache(group_size=group, bits=bits), o_cache.QuantizedKVCache(group, bits)
    assert mine.nbytes == 0 and mine.empty() and mine.bits == bits
    for step, n in enumerate(PLAN):
        k, v = kv(n, step, dtype)
        a, b = mine.update_and_fetch(k, v), ref.update_and_fetch(k, v)
        assert same(a, b), step
        check_same(mine, ref)
        if step in (3, 6):
            assert mine.trim(2) == ref.trim(2)
            check_same(mine, ref)
    assert mine.meta_state == (str(ref.offset), str(group), str(bits))


def test_bits_5_6_at_head_dim_128_work_where_mlx_lm_breaks():
    # mlx-lm sizes the packed buffer as dim // (32 // bits): 25 words for 6 bits x 128, not 24
    k, v = kv(5, 1, dk=128, dv=128)
    with pytest.raises(ValueError):
        mx.eval(o_cache.QuantizedKVCache(64, 6).update_and_fetch(k, v))
    for bits in (3, 5, 6):
        c = QuantizedKVCache(64, bits)
        qk, qv = c.update_and_fetch(k, v)
        assert same(qk, mx.quantize(k, group_size=64, bits=bits))
        assert same(qv, mx.quantize(v, group_size=64, bits=bits))
        assert same(c.update_and_fetch(*kv(1, 2, dk=128, dv=128))[0][0][..., :5, :], qk[0])


def test_refuses_unsupported_settings():
    for bits, group in [(7, 64), (16, 64), (4, 16), (4, 256), (4.5, 64), (True, 64)]:
        with pytest.raises(KVQuantError, match="bits|group_size") as e:
            QuantizedKVCache(group_size=group, bits=bits)
        assert isinstance(e.value, MlxbunError)
    with pytest.raises(KVQuantError, match="head dim 48"):
        QuantizedKVCache(32, 4).update_and_fetch(*kv(3, 0, dk=48, dv=48))


def test_state_roundtrip_from_state():
    c = QuantizedKVCache(32, 4)
    for i, n in enumerate([9, 1, 1]):
        c.update_and_fetch(*kv(n, i))
    clone = QuantizedKVCache.from_state(c.state)
    check_same(clone, c)
    clone2 = QuantizedKVCache.from_state(c.state, c.meta_state)
    assert (clone2.offset, clone2.group_size, clone2.bits) == (11, 32, 4)


# ------------------------------------------------------------------ conversion


def filled(mod, chunks=(7, 1, 1)):
    c = mod.KVCache()
    for i, n in enumerate(chunks):
        c.update_and_fetch(*kv(n, i))
    return c


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_quantize_cache_matches_to_quantized(bits, group):
    mine = quantize_cache(filled(__import__("mlxbun.cache.kv", fromlist=["x"])), group, bits)
    ref = filled(o_cache).to_quantized(group_size=group, bits=bits)
    assert isinstance(mine, QuantizedKVCache)
    check_same(mine, ref)
    # and both keep growing identically
    for i in range(4):
        k, v = kv(1, 40 + i)
        assert same(mine.update_and_fetch(k, v), ref.update_and_fetch(k, v))
    empty = quantize_cache(KVCache(), group, bits)
    assert empty.empty() and empty.offset == 0
    assert quantize_cache(mine, group, bits) is mine
    with pytest.raises(KVQuantError, match="already quantized"):
        quantize_cache(mine, group, 2)
    with pytest.raises(UnsupportedModelError, match="RotatingKVCache"):
        quantize_cache(RotatingKVCache(8), group, bits)


@pytest.mark.parametrize("start", [0, 5, 9, 10, 100])
def test_maybe_quantize_matches_mlx_lm(start):
    import mlxbun.cache.kv as mk
    mine = [filled(mk), filled(mk, (3,)), mk.KVCache()]
    ref = [filled(o_cache), filled(o_cache, (3,)), o_cache.KVCache()]
    maybe_quantize_kv_cache(mine, start, 32, 4)
    o_maybe_quantize(ref, start, 32, 4)
    for a, b in zip(mine, ref):
        assert type(a).__name__ == type(b).__name__
        if not b.empty():
            check_same(a, b)
        assert a.offset == b.offset
    before = list(mine)
    maybe_quantize_kv_cache(mine, 0, 32, None)  # kv_bits None: nothing happens
    assert all(a is b for a, b in zip(mine, before))


def test_maybe_quantize_rotating_refuses_like_mlx_lm():
    mine, ref = [KVCache(), RotatingKVCache(16)], [o_cache.KVCache(), o_cache.RotatingKVCache(16)]
    with pytest.raises(NotImplementedError):
        o_maybe_quantize(ref, 0, 64, 8)
    with pytest.raises(UnsupportedModelError, match="cache 1: .*RotatingKVCache"):
        maybe_quantize_kv_cache(mine, 0, 64, 8)
    rot = RotatingKVCache(16)
    rot.update_and_fetch(*kv(3, 0))
    caches = [rot]
    maybe_quantize_kv_cache(caches, 5, 64, 8)  # below the start: stays, as in mlx-lm
    assert caches[0] is rot


# ------------------------------------------------------------------ inside an mlx-lm model


@pytest.fixture(scope="session")
def llama():
    mx.random.seed(3)
    model = o_llama.Model(o_llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=256, tie_word_embeddings=False))
    mx.eval(model.parameters())
    return model


def ids(n, seed):
    return mx.random.randint(0, 256, (1, n), key=mx.random.key(seed))


CHUNKS = [7] + [1] * 5 + [3, 1, 1]


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64)])
def test_logits_equal_in_mlx_lm_llama(llama, bits, group):
    mine = [QuantizedKVCache(group, bits) for _ in range(2)]
    ref = [o_cache.QuantizedKVCache(group, bits) for _ in range(2)]
    for i, n in enumerate(CHUNKS):
        assert same(llama(ids(n, i), cache=mine), llama(ids(n, i), cache=ref)), i


@pytest.mark.parametrize("start", [0, 7])
def test_generation_with_conversion_matches_mlx_lm(llama, start):
    """generate_step's order (forward, then maybe_quantize) with both libraries."""
    mine, ref = [KVCache() for _ in range(2)], [o_cache.KVCache() for _ in range(2)]
    for i, n in enumerate(CHUNKS):
        a, b = llama(ids(n, i), cache=mine), llama(ids(n, i), cache=ref)
        assert same(a, b), i
        maybe_quantize_kv_cache(mine, start, 32, 4)
        o_maybe_quantize(ref, start, 32, 4)
        assert [type(c).__name__ for c in mine] == [type(c).__name__ for c in ref]
    assert isinstance(mine[0], QuantizedKVCache)


# ------------------------------------------------------------------ spec-round contract


def test_spec_round_trims_exactly():
    def fed(chunks):
        c = QuantizedKVCache(32, 4)
        for k, v in chunks:
            c.update_and_fetch(k, v)
        return c

    pre = [kv(250, 0)] + [kv(1, 50 + i) for i in range(3)]  # the round crosses the 256 growth
    draft = kv(6, 100)
    for n_acc in (0, 2, 6):
        c = fed(pre)
        c.spec_begin()
        assert c.in_spec_round
        c.update_and_fetch(*draft)
        c.spec_commit(n_acc)
        assert not c.in_spec_round
        ref = fed(pre + [tuple(x[..., :n_acc, :] for x in draft)] if n_acc else pre)
        assert c.offset == ref.offset and same(c.keys_and_values(), ref.keys_and_values())
        k, v = kv(1, 9)
        assert same(c.update_and_fetch(k, v), ref.update_and_fetch(k, v))
    c = fed(pre)
    c.spec_begin()
    c.update_and_fetch(*draft)
    c.spec_rollback()
    ref = fed(pre)
    assert c.offset == ref.offset and same(c.keys_and_values(), ref.keys_and_values())
    with pytest.raises(RuntimeError, match="spec_begin"):
        c.spec_rollback()
    c.spec_begin()
    c.update_and_fetch(*kv(2, 3))
    with pytest.raises(ValueError, match="n_accepted=3"):
        c.spec_commit(3)


# ------------------------------------------------------------------ attention


def qkv(n_q, L, S, dtype, bits, group, seed=0, D=64):
    q = mx.random.normal((1, n_q, L, D), key=mx.random.key(seed)).astype(dtype)
    k = mx.random.normal((1, 2, S, D), key=mx.random.key(seed + 1)).astype(dtype)
    v = mx.random.normal((1, 2, S, D), key=mx.random.key(seed + 2)).astype(dtype)
    return q, mx.quantize(k, group, bits), mx.quantize(v, group, bits)


def masks(L, S):
    return {"none": None, "causal": "causal",
            "window": create_causal_mask(L, S - L, window_size=7),
            "additive": mx.random.normal((L, S), key=mx.random.key(4)),
            "batched": create_causal_mask(L, S - L, window_size=9)[None, None]}


# Stated tolerances (max |chunked - unchunked| on outputs of size ~0.1-1): float32
# differs only by summation order; fp16 by the unchunked path rounding its softmax
# to fp16 before the value matmul, which the chunked one does per chunk.
TOL = {mx.float32: 2e-6, mx.float16: 4e-3}  # observed: 4.8e-7, 2.9e-3


@pytest.mark.parametrize("n_q", [2, 8])
@pytest.mark.parametrize("L,S,chunk", [(1, 300, 64), (5, 300, 128), (5, 37, 8)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_chunked_matches_unchunked(n_q, L, S, chunk, dtype):
    q, qk, qv = qkv(n_q, L, S, dtype, 8, 64)
    for name, m in masks(L, S).items():
        ref = o_base.quantized_scaled_dot_product_attention(mx.array(q), qk, qv, 0.125, m, 64, 8)
        out = chunked_quantized_sdpa(q, qk, qv, 0.125, m, 64, 8, chunk_size=chunk)
        assert out.shape == ref.shape and out.dtype == ref.dtype
        err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
        assert err <= TOL[dtype], (name, err)
    # a single chunk covering everything is the same computation up to rounding too
    one = chunked_quantized_sdpa(q, qk, qv, 0.125, "causal", 64, 8, chunk_size=S)
    ref = o_base.quantized_scaled_dot_product_attention(mx.array(q), qk, qv, 0.125, "causal", 64, 8)
    assert mx.abs(one.astype(mx.float32) - ref.astype(mx.float32)).max().item() <= TOL[dtype]


def test_cache_attention_dispatch():
    k, v = kv(40, 0, dk=64, dv=64)
    q = mx.random.normal((1, 4, 3, 64), key=mx.random.key(9))
    plain, chunked = QuantizedKVCache(64, 4), QuantizedKVCache(64, 4, attention_chunk=16)
    kk, vv = plain.update_and_fetch(k, v)
    chunked.update_and_fetch(k, v)
    ref = o_base.quantized_scaled_dot_product_attention(mx.array(q), kk, vv, 0.1, "causal", 64, 4)
    assert same(plain.attention(mx.array(q), kk, vv, 0.1, "causal"), ref)  # default: bit-exact
    # the graphs' sdpa asks the cache
    assert same(graph_sdpa(mx.array(q), kk, vv, plain, 0.1, "causal"), ref)
    with pytest.raises(UnsupportedModelError, match="sinks"):
        graph_sdpa(mx.array(q), kk, vv, plain, 0.1, "causal", sinks=mx.zeros((4,)))
    assert same(chunked.attention(q, kk, vv, 0.1, "causal"),
                chunked_quantized_sdpa(q, kk, vv, 0.1, "causal", 64, 4, 16))
    short = tuple(x[..., :16, :] for x in kk), tuple(x[..., :16, :] for x in vv)
    assert same(chunked.attention(mx.array(q), *short, 0.1, "causal"),
                o_base.quantized_scaled_dot_product_attention(mx.array(q), *short, 0.1, "causal", 64, 4))
    with pytest.raises(KVQuantError, match="attention_chunk"):
        QuantizedKVCache(64, 4, attention_chunk=0)


def test_generate_step_with_mlxbun_quantized_caches(llama):
    from mlx_lm.generate import generate_step
    prompt = ids(9, 7)[0]
    ref = list(generate_step(prompt, llama, max_tokens=5,
                             prompt_cache=[o_cache.QuantizedKVCache(32, 4) for _ in range(2)]))
    out = list(generate_step(prompt, llama, max_tokens=5,
                             prompt_cache=[QuantizedKVCache(32, 4) for _ in range(2)]))
    assert [int(t) for t, _ in out] == [int(t) for t, _ in ref]
    assert all(same(a, b) for (_, a), (_, b) in zip(out, ref))


def test_spec_commit_matches_mlx_lm_trim_in_model(llama):
    """Verify 4 drafted tokens in one forward, accept 2: the logits afterwards equal
    mlx-lm's speculative path (same chunk forward, then trim_prompt_cache)."""
    mine = [QuantizedKVCache(64, 8) for _ in range(2)]
    ref = [o_cache.QuantizedKVCache(64, 8) for _ in range(2)]
    llama(ids(6, 1), cache=mine), llama(ids(6, 1), cache=ref)
    for c in mine:
        c.spec_begin()
    assert same(llama(ids(4, 2), cache=mine), llama(ids(4, 2), cache=ref))
    for c in mine:
        c.spec_commit(2)
    assert o_cache.trim_prompt_cache(ref, 2) == 2
    for i in range(4):
        t = ids(1, 10 + i)
        assert same(llama(t, cache=mine), llama(t, cache=ref)), i


# ------------------------------------------------------------------ CUDA path (dequantize + SDPA)


def test_cuda_path_routes_to_dequantized_sdpa_and_agrees(monkeypatch):
    import mlxbun.cache.quantized as Q

    mx.random.seed(11)
    q = mx.random.normal((1, 4, 1, 64))
    k, v = mx.random.normal((1, 2, 37, 64)), mx.random.normal((1, 2, 37, 64))
    cache = Q.QuantizedKVCache(group_size=32, bits=8)
    qk, qv = cache.update_and_fetch(k, v)
    # mlx-lm's quantized sdpa scales the queries in place (`queries *= scale`): fresh copies each call
    exact = cache.attention(mx.array(q), qk, qv, scale=0.125, mask=None)
    monkeypatch.setattr(Q, "backend_has_quantized_attention", lambda: False)
    calls = []
    real = Q.dequantized_sdpa
    monkeypatch.setattr(Q, "dequantized_sdpa", lambda *a: calls.append(1) or real(*a))
    cuda_like = cache.attention(mx.array(q), qk, qv, scale=0.125, mask=None)
    assert calls == [1]
    # Same math, different rounding order: float32 agreement to 1e-5 (observed ~1e-7).
    assert mx.allclose(exact, cuda_like, atol=1e-5).item()
    assert not mx.array_equal(exact, exact * 1.001)  # the comparison is not vacuous


def test_backend_probe_is_true_on_this_cpu():
    assert backend_has_quantized_attention() is True


@pytest.mark.parametrize("mask", [None, "causal"])
def test_cuda_path_chunks_long_caches_and_agrees(monkeypatch, mask):
    import mlxbun.cache.quantized as Q

    mx.random.seed(12)
    L = 3 if mask else 1
    q = mx.random.normal((1, 8, L, 64))
    k, v = mx.random.normal((1, 2, 300, 64)), mx.random.normal((1, 2, 300, 64))
    cache = Q.QuantizedKVCache(group_size=32, bits=4)
    qk, qv = cache.update_and_fetch(k, v)
    exact = cache.attention(mx.array(q), qk, qv, scale=0.125, mask=mask)
    monkeypatch.setattr(Q, "backend_has_quantized_attention", lambda: False)
    monkeypatch.setattr(Q, "CUDA_ATTENTION_CHUNK", 64)
    calls = []
    real = Q.chunked_quantized_sdpa
    monkeypatch.setattr(Q, "chunked_quantized_sdpa", lambda *a, **k: calls.append(k) or real(*a, **k))
    chunked = cache.attention(mx.array(q), qk, qv, scale=0.125, mask=mask)
    assert calls == [{"dequantize": True}]
    # online softmax over 5 chunks in float32 vs quantized matmuls: rounding only (observed ~1e-7)
    assert mx.allclose(exact, chunked, atol=1e-5).item()
