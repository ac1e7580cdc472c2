"""mlxbun.cache (KVCache, RotatingKVCache, spec rounds), mlxbun.attention masks and
mlxbun.models.base's mask/sdpa dispatch vs mlx-lm 0.32.2 as the live oracle."""

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models import base as o_base
from mlx_lm.models import cache as o_cache
from mlx_lm.models import llama as o_llama

from mlxbun import attention
from mlxbun.cache import KVCache, RotatingKVCache
from mlxbun.errors import UnsupportedModelError
from mlxbun.models import base

H, DK, DV = 2, 8, 6  # kv heads, key / value head dims (different on purpose)


def same(a, b):
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        return (isinstance(a, mx.array) and isinstance(b, mx.array) and a.dtype == b.dtype
                and a.shape == b.shape and mx.array_equal(a, b).item())
    return a == b


def kv(n, seed, dtype=mx.float32):
    k = mx.random.normal((1, H, n, DK), key=mx.random.key(seed)).astype(dtype)
    v = mx.random.normal((1, H, n, DV), key=mx.random.key(seed + 10_000)).astype(dtype)
    return k, v


def check_same_cache(mine, ref):
    assert mine.offset == ref.offset
    assert len(mine.state) == len(ref.state)
    for a, b in zip(mine.state, ref.state):
        assert same(a, b)
    assert mine.size() == ref.size() and mine.empty() == ref.empty()
    assert mine.nbytes == ref.nbytes and mine.is_trimmable() == ref.is_trimmable()
    if not mine.empty():
        for a, b in zip(mine.keys_and_values(), ref.keys_and_values()):
            assert same(a, b)


def check_masks(mine, ref, windows):
    for N in (1, 3, 20):
        for window in windows:
            for ra in (False, True):
                a = mine.make_mask(N, window_size=window, return_array=ra)
                b = ref.make_mask(N, window_size=window, return_array=ra)
                assert (a is None) == (b is None), (N, window, ra)
                if a is not None:
                    assert same(a, b), (N, window, ra)


def drive(mine, ref, plan, dtype, windows, trim_at=()):
    for step, n in enumerate(plan):
        k, v = kv(n, step, dtype)
        a, b = mine.update_and_fetch(k, v), ref.update_and_fetch(k, v)
        assert same(a[0], b[0]) and same(a[1], b[1]), (step, n)
        check_same_cache(mine, ref)
        check_masks(mine, ref, windows)
        if step in trim_at and ref.is_trimmable():
            assert mine.trim(2) == ref.trim(2)
            check_same_cache(mine, ref)


PLANS = {
    "prefill1": [1] + [1] * 20 + [5, 1, 1],
    "prefill7": [7] + [1] * 12 + [3] + [1] * 8,
    "prefill300": [300] + [1] * 5 + [220, 1, 1, 40],
}
DTYPES = {"f32": mx.float32, "bf16": mx.bfloat16}


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("plan", PLANS)
def test_kvcache_matches_mlx_lm(plan, dt):
    mine, ref = KVCache(), o_cache.KVCache()
    check_same_cache(mine, ref)
    drive(mine, ref, PLANS[plan], DTYPES[dt], windows=(None, 4), trim_at=(3, 7))
    assert mine.meta_state == ""


@pytest.mark.parametrize("keep", [0, 4])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("plan", PLANS)
def test_rotating_matches_mlx_lm(plan, dt, keep):
    mine, ref = RotatingKVCache(max_size=16, keep=keep), o_cache.RotatingKVCache(max_size=16, keep=keep)
    drive(mine, ref, PLANS[plan], DTYPES[dt], windows=(None, 4, 16), trim_at=(1, 3))
    assert mine.offset > 16  # crossed the wrap
    assert mine.meta_state == tuple(map(str, (ref.keep, ref.max_size, ref.offset, ref._idx)))


def test_state_roundtrip_and_from_state():
    mine = RotatingKVCache(max_size=16, keep=4)
    for i, n in enumerate([9, 1, 1, 12, 1]):
        mine.update_and_fetch(*kv(n, i))
    clone = RotatingKVCache.from_state(mine.state)
    check_same_cache(clone, mine)
    clone2 = RotatingKVCache(max_size=1)
    clone2.state = mine.state
    clone2.meta_state = mine.meta_state
    check_same_cache(clone2, mine)
    k = KVCache()
    k.update_and_fetch(*kv(5, 0))
    check_same_cache(KVCache.from_state(k.state), k)


def test_prompt_cache_file_roundtrip_via_mlx_lm(tmp_path):
    caches = [KVCache(), RotatingKVCache(max_size=16, keep=4)]
    for c in caches:
        for i, n in enumerate([7, 1, 12]):
            c.update_and_fetch(*kv(n, i))
    path = str(tmp_path / "c.safetensors")
    o_cache.save_prompt_cache(path, caches)
    loaded = o_cache.load_prompt_cache(path)  # class names match, so mlx-lm rebuilds its own
    for c, l in zip(caches, loaded):
        check_same_cache(c, l)


# ------------------------------------------------------------------ masks / sdpa (attention.py, base.py)


@pytest.mark.parametrize("N,offset,window", [(1, 0, None), (5, 0, None), (5, 7, None), (5, 7, 3), (9, 0, 4)])
def test_create_causal_mask(N, offset, window):
    assert same(attention.create_causal_mask(N, offset, window), o_base.create_causal_mask(N, offset, window))
    lp, rp = mx.array([0, 2]), mx.array([1, 0])
    a = attention.create_causal_mask(N, offset, window, right_padding=rp, left_padding=lp)
    assert same(a, o_base.create_causal_mask(N, offset, window, right_padding=rp, left_padding=lp))


def test_create_attention_mask_dispatch():
    for N in (1, 5, 12):
        h = mx.zeros((1, N, 8))
        for window in (None, 4, 32):
            for ra in (False, True):
                a = base.create_attention_mask(h, None, window, ra)
                b = o_base.create_attention_mask(h, None, window, ra)
                assert (a is None and b is None) or same(a, b)
                # with caches, both functions must defer to make_mask identically
                mc, rc = RotatingKVCache(16), o_cache.RotatingKVCache(16)
                for c in (mc, rc):
                    c.update_and_fetch(*kv(20, 1))
                for fn in (base.create_attention_mask, o_base.create_attention_mask):
                    x, y = fn(h, mc, window, ra), fn(h, rc, window, ra)
                    assert (x is None and y is None) or same(x, y)


@pytest.mark.parametrize("n_q", [2, 4])
@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float"])
def test_sdpa_dispatch(n_q, mask):
    L, S = 3, 11
    q = mx.random.normal((1, n_q, L, 32), key=mx.random.key(1))
    k = mx.random.normal((1, 2, S, 32), key=mx.random.key(2))
    v = mx.random.normal((1, 2, S, 32), key=mx.random.key(3))
    m = {"none": None, "causal": "causal",
         "bool": attention.create_causal_mask(L, S - L, window_size=5),
         "float": mx.random.normal((L, S), key=mx.random.key(4))}[mask]
    assert same(base.scaled_dot_product_attention(q, k, v, None, 0.125, m),
                o_base.scaled_dot_product_attention(q, k, v, None, 0.125, m))
    sinks = mx.random.normal((n_q,), key=mx.random.key(5))
    assert same(base.scaled_dot_product_attention(q, k, v, KVCache(), 0.125, m, sinks=sinks),
                o_base.scaled_dot_product_attention(q, k, v, o_cache.KVCache(), 0.125, m, sinks=sinks))
    # a cache with `bits` routes both to the quantized path
    qc = o_cache.QuantizedKVCache(group_size=32, bits=4)
    qk, qv = qc.update_and_fetch(k, v)
    # (the quantized path scales `queries` in place, `queries *= scale`, as the
    # oracle does: give each call its own copy)
    a = base.scaled_dot_product_attention(mx.array(q), qk, qv, qc, 0.125, m)
    b = o_base.scaled_dot_product_attention(mx.array(q), qk, qv, qc, 0.125, m)
    assert same(a, b)
    assert same(attention.quantized_scaled_dot_product_attention(mx.array(q), qk, qv, 0.125, m, 32, 4), b)
    with pytest.raises(ValueError, match="sinks"):
        base.scaled_dot_product_attention(q, qk, qv, qc, 0.125, m, sinks=sinks)


def test_mlxbun_cache_is_truthy_and_full_precision():
    # mlx-lm probes `if cache and hasattr(cache, "make_mask")` and `hasattr(cache, "bits")`
    for c in (KVCache(), RotatingKVCache(8)):
        assert bool(c) and hasattr(c, "make_mask") and not hasattr(c, "bits")


# ------------------------------------------------------------------ inside an mlx-lm model


def tiny_llama(**over):
    mx.random.seed(3)
    args = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
                tie_word_embeddings=False)
    args.update(over)
    model = o_llama.Model(o_llama.ModelArgs(**args))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def llama():
    return tiny_llama()


@pytest.fixture(scope="session")
def llama_swa():
    return tiny_llama(layer_types=["sliding_attention", "full_attention"], sliding_window=8)


def ids(n, seed):
    return mx.random.randint(0, 256, (1, n), key=mx.random.key(seed))


def run_steps(model, caches, chunks):
    return [model(ids(n, i), cache=caches) for i, n in enumerate(chunks)]


@pytest.mark.parametrize("kind", ["kv", "rot0", "rot4"])
def test_logits_equal_in_mlx_lm_llama(llama, kind):
    def make(mod):
        if kind == "kv":
            return [mod.KVCache() for _ in range(2)]
        return [mod.RotatingKVCache(max_size=16, keep=int(kind[3])) for _ in range(2)]

    chunks = [7] + [1] * 14 + [4, 1, 1]
    for a, b in zip(run_steps(llama, make(__import__("mlxbun.cache", fromlist=["x"])), chunks),
                    run_steps(llama, make(o_cache), chunks)):
        assert same(a, b)


def test_logits_equal_sliding_window_model(llama_swa):
    # sliding layer: window 8 < max_size 16 exercises the rolled decode mask
    def make(mod):
        return [mod.RotatingKVCache(max_size=16), mod.KVCache()]

    chunks = [5] + [1] * 20 + [3, 1]
    for a, b in zip(run_steps(llama_swa, make(__import__("mlxbun.cache", fromlist=["x"])), chunks),
                    run_steps(llama_swa, make(o_cache), chunks)):
        assert same(a, b)


def test_mlx_lm_caches_inside_an_mlxbun_graph(zoo):
    # mlx-lm caches have no `attention`: the graphs' sdpa then does what mlx-lm's does
    import mlxbun

    model = mlxbun.open_model(zoo("qwen3"))
    n = len(model.layers)
    chunks = [7] + [1] * 12 + [3, 1]
    for kind in ("kv", "rot2"):
        def make(mod):
            if kind == "kv":
                return [mod.KVCache() for _ in range(n)]
            return [mod.RotatingKVCache(max_size=12, keep=2) for _ in range(n)]

        for a, b in zip(run_steps(model, make(__import__("mlxbun.cache", fromlist=["x"])), chunks),
                        run_steps(model, make(o_cache), chunks)):
            assert same(a, b), kind


def test_generate_step_with_mlxbun_caches(llama):
    prompt = ids(9, 7)[0]
    out_ref = [(int(t), l) for t, l in generate_step(prompt, llama, max_tokens=6,
                                                     prompt_cache=[o_cache.KVCache() for _ in range(2)])]
    out = [(int(t), l) for t, l in generate_step(prompt, llama, max_tokens=6,
                                                 prompt_cache=[KVCache() for _ in range(2)])]
    assert [t for t, _ in out] == [t for t, _ in out_ref]
    assert all(same(a, b) for (_, a), (_, b) in zip(out, out_ref))


def test_generate_kv_bits_quantizes_mlxbun_caches_like_mlx_lms(llama):
    from mlxbun.cache.quantized import QuantizedKVCache

    wide = tiny_llama(num_attention_heads=2, num_key_value_heads=1)  # head_dim 32: quantizable
    prompt = ids(9, 7)[0]
    kw = dict(max_tokens=4, kv_bits=4, kv_group_size=32, quantized_kv_start=0)
    ours = [KVCache() for _ in range(2)]
    theirs = [o_cache.KVCache() for _ in range(2)]
    a = [(t, lp) for t, lp in generate_step(prompt, wide, prompt_cache=ours, **kw)]
    b = [(t, lp) for t, lp in generate_step(prompt, wide, prompt_cache=theirs, **kw)]
    assert [t for t, _ in a] == [t for t, _ in b]
    assert all(mx.array_equal(x, y) for (_, x), (_, y) in zip(a, b))
    assert all(isinstance(c, QuantizedKVCache) for c in ours)
    with pytest.raises(UnsupportedModelError):
        RotatingKVCache(8).to_quantized()


# ------------------------------------------------------------------ spec-round contract


def fresh(kind):
    return KVCache() if kind == "kv" else RotatingKVCache(max_size=16, keep=int(kind[3]))


def fed(kind, chunks):
    c = fresh(kind)
    for k, v in chunks:
        c.update_and_fetch(k, v)
    return c


def assert_equivalent(a, b):
    """Same visible keys/values, offset, ring position and masks."""
    assert a.offset == b.offset
    for x, y in zip(a.keys_and_values(), b.keys_and_values()):
        assert same(x, y)
    if isinstance(a, RotatingKVCache):
        assert a._idx == b._idx
    check_masks(a, b, (None, 4))


@pytest.mark.parametrize("kind", ["kv", "rot0", "rot4"])
@pytest.mark.parametrize("prefill", [10, 14, 40])
@pytest.mark.parametrize("round_shape", ["chunk", "steps", "mixed"])
def test_spec_rollback_restores_exactly(kind, prefill, round_shape):
    # a few decode steps first, so the ring is being written in place at spec_begin
    pre = [kv(prefill, 0)] + [kv(1, 50 + i) for i in range(3)]
    cache = fed(kind, pre)
    # copies: the round writes the live arrays in place (that is what spec_begin guards)
    before = [mx.array(x) if isinstance(x, mx.array) else x for x in cache.state]
    cache.spec_begin()
    assert cache.in_spec_round
    adds = {"chunk": [5], "steps": [1, 1, 1, 1, 1], "mixed": [1, 3, 1]}[round_shape]
    for i, n in enumerate(adds):
        cache.update_and_fetch(*kv(n, 100 + i))
    cache.spec_rollback()
    assert not cache.in_spec_round
    ref = fed(kind, pre)
    assert_equivalent(cache, ref)
    if isinstance(cache, RotatingKVCache):  # rotating restores its exact arrays and indices
        for a, b in zip(cache.state, before):
            assert same(a, b)
    # and keeps working identically afterwards
    for i in range(20):
        k, v = kv(1, 500 + i)
        a, b = cache.update_and_fetch(k, v), ref.update_and_fetch(k, v)
        assert same(a[0], b[0]) and same(a[1], b[1])


@pytest.mark.parametrize("kind", ["kv", "rot0", "rot4"])
@pytest.mark.parametrize("prefill", [10, 40])
@pytest.mark.parametrize("n_accepted", [0, 1, 3, 5])
@pytest.mark.parametrize("round_shape", ["chunk", "steps"])
def test_spec_commit_keeps_accepted(kind, prefill, n_accepted, round_shape):
    # a few decode steps first, so the ring is being written in place at spec_begin
    pre = [kv(prefill, 0)] + [kv(1, 50 + i) for i in range(3)]
    draft = kv(5, 100)
    if round_shape == "chunk":
        round_chunks = [draft]
    else:
        round_chunks = [(draft[0][..., i:i + 1, :], draft[1][..., i:i + 1, :]) for i in range(5)]
    cache = fed(kind, pre)
    cache.spec_begin()
    for k, v in round_chunks:
        cache.update_and_fetch(k, v)
    cache.spec_commit(n_accepted)
    assert not cache.in_spec_round
    # The reference is a cache that only ever saw what was kept: everything, as
    # fed, when all is accepted; else the accepted prefix as one chunk.
    accepted = (draft[0][..., :n_accepted, :], draft[1][..., :n_accepted, :])
    if n_accepted == 5:
        ref = fed(kind, pre + round_chunks)
    else:
        ref = fed(kind, pre + ([accepted] if n_accepted else []))
    assert_equivalent(cache, ref)
    for i in range(20):
        k, v = kv(1, 700 + i)
        a, b = cache.update_and_fetch(k, v), ref.update_and_fetch(k, v)
        assert same(a[0], b[0]) and same(a[1], b[1])
    assert_equivalent(cache, ref)


def test_spec_commit_matches_mlx_lm_trim_in_model(llama):
    """Verify 4 drafted tokens in one forward, accept 2: logits afterwards equal
    mlx-lm's own speculative path (forward the same chunk, trim_prompt_cache)."""
    for kind in ("kv", "rot4"):
        mine = [fresh(kind) for _ in range(2)]
        ref = [o_cache.KVCache() if kind == "kv" else o_cache.RotatingKVCache(16, keep=4) for _ in range(2)]
        llama(ids(6, 1), cache=mine), llama(ids(6, 1), cache=ref)
        for c in mine:
            c.spec_begin()
        a, b = llama(ids(4, 2), cache=mine), llama(ids(4, 2), cache=ref)
        assert same(a, b)
        for c in mine:
            c.spec_commit(2)
        assert o_cache.can_trim_prompt_cache(ref) and o_cache.trim_prompt_cache(ref, 2) == 2
        for i in range(6):
            t = ids(1, 10 + i)
            assert same(llama(t, cache=mine), llama(t, cache=ref))


def test_spec_errors():
    c = KVCache()
    with pytest.raises(RuntimeError, match="spec_begin"):
        c.spec_commit(0)
    with pytest.raises(RuntimeError, match="spec_begin"):
        RotatingKVCache(8).spec_rollback()
    c.update_and_fetch(*kv(3, 0))
    c.spec_begin()
    c.update_and_fetch(*kv(2, 1))
    with pytest.raises(ValueError, match="n_accepted=3"):
        c.spec_commit(3)
    with pytest.raises(TypeError):
        c.spec_commit(1.0)
    c.spec_commit(2)
    assert c.offset == 5


@pytest.mark.parametrize("kind", ["kv", "rot0"])
def test_spec_round_on_empty_cache(kind):
    c = fresh(kind)
    c.spec_begin()
    c.update_and_fetch(*kv(4, 1))
    c.spec_rollback()
    assert c.offset == 0 and (c.empty() or kind == "kv")
    c.spec_begin()
    c.update_and_fetch(*kv(4, 1))
    c.spec_commit(2)
    assert_equivalent(c, fed(kind, [tuple(x[..., :2, :] for x in kv(4, 1))]))
