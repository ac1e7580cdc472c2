"""mlxbun.cache.prompt_cache (save/load with identity + layout checks, prefix reuse)
and mlxbun.cache.arrays (ArraysCache vs mlx-lm's, spec rounds by snapshot/replay)."""

import json
import struct
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models import cache as o_cache
from mlx_lm.models import lfm2 as o_lfm2
from mlx_lm.models import llama as o_llama

from mlxbun.cache.arrays import ArraysCache, begin_spec_round, commit_spec_round
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.prompt_cache import (
    PromptCacheError,
    cache_layout,
    cached_tokens,
    check_save_path,
    common_prefix_length,
    load_prompt_cache,
    model_identity,
    reuse_prefix,
    save_prompt_cache,
)
from mlxbun.cache.quantized import QuantizedKVCache
from mlxbun.config import config_from_dict
from mlxbun.errors import MlxbunError
from tests.hybrid_models import MODELS as HYBRID_MODELS
from tests.hybrid_models import UNIVERSAL, IdTokenizer, open_hybrid

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5,
             vocab_size=256, tie_word_embeddings=False)


def same(a, b):
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, mx.array) or isinstance(b, mx.array):
        return (isinstance(a, mx.array) and isinstance(b, mx.array) and a.dtype == b.dtype
                and a.shape == b.shape and mx.array_equal(a, b).item())
    return a == b


def ids(n, seed):
    return mx.random.randint(0, 256, (1, n), key=mx.random.key(seed))


@pytest.fixture(scope="session")
def llama():
    mx.random.seed(3)
    model = o_llama.Model(o_llama.ModelArgs(**LLAMA))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="session")
def lfm2():
    mx.random.seed(4)
    model = o_lfm2.Model(o_lfm2.ModelArgs(
        model_type="lfm2", vocab_size=256, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, norm_eps=1e-5,
        conv_bias=False, conv_L_cache=3, block_dim=64, block_multiple_of=16,
        block_ffn_dim_multiplier=1.0, block_auto_adjust_ff_dim=False, block_ff_dim=128,
        layer_types=["conv", "full_attention"]))
    mx.eval(model.parameters())
    return model


IDENTITY = model_identity(config_from_dict(LLAMA))

# ================================================================== ArraysCache


def test_arrays_cache_logits_equal_in_mlx_lm_lfm2(lfm2):
    mine, ref = [ArraysCache(1), KVCache()], lfm2.make_cache()
    assert type(ref[0]).__name__ == "ArraysCache"
    for i, n in enumerate([6, 1, 1, 4, 1]):
        assert same(lfm2(ids(n, i), cache=mine), lfm2(ids(n, i), cache=ref)), i
    assert same(list(mine[0].state), list(ref[0].state)) and mine[0].nbytes == ref[0].nbytes
    assert mine[0].tokens_seen == 13 and not mine[0].empty() and mine[0].size() == 0


def test_arrays_cache_batching_helpers_match_mlx_lm():
    def pair(seed, left_padding=None):
        a, b = ArraysCache(2, left_padding), o_cache.ArraysCache(2, left_padding)
        for c in (a, b):
            c[0] = mx.random.normal((1, 3, 4), key=mx.random.key(seed))
            c[1] = mx.random.normal((1, 5), key=mx.random.key(seed + 1))
        return a, b

    (a1, b1), (a2, b2) = pair(0), pair(5)
    m, r = ArraysCache.merge([a1, a2]), o_cache.ArraysCache.merge([b1, b2])
    assert same(list(m.state), list(r.state)) and m.batch_size == r.batch_size == 2
    m.extend(a1), r.extend(b1)
    assert same(list(m.state), list(r.state))
    m.filter(mx.array([0, 2])), r.filter(mx.array([0, 2]))
    assert same(list(m.state), list(r.state))
    assert same(m.extract(1).cache, r.extract(1).cache)
    lp, lr = ArraysCache(1, [2, 0]), o_cache.ArraysCache(1, [2, 0])
    for c in (lp, lr):
        c.prepare(lengths=[3, 4])
        c.advance(1)
    assert same(lp.make_mask(4), lr.make_mask(4)) and same(list(lp.state), list(lr.state))
    lp.finalize()
    assert lp.make_mask(3) is None
    e = ArraysCache.merge([ArraysCache(1), ArraysCache(1)])
    assert e.empty() and same(e.left_padding, mx.array([0, 0]))
    clone = ArraysCache.from_state(m.state, m.meta_state)
    assert same(list(clone.state), list(m.state)) and not clone.is_trimmable()


def test_arrays_spec_round_unit():
    c = ArraysCache(2)
    c[0], c[1] = mx.ones((1, 2)), mx.zeros((1, 3))
    c.advance(4)
    with pytest.raises(RuntimeError, match="spec_begin"):
        c.spec_commit(0)
    before = [mx.array(x) for x in c.cache]
    c.spec_begin()
    c[0][...] = 7.0  # an in-place write must not leak into the snapshot
    c[1] = c[1] + 1
    c.advance(3)
    assert c.spec_needs_replay(2) and not c.spec_needs_replay(3)
    with pytest.raises(ValueError, match="n_accepted=4 but 3 tokens"):
        c.spec_commit(4)
    assert c.spec_commit(3) == 0 and not c.in_spec_round  # all accepted: keep the state
    assert same(c[0], mx.full((1, 2), 7.0)) and c.tokens_seen == 7
    c2 = ArraysCache(2)
    c2.cache = [mx.array(x) for x in before]
    c2.spec_begin()
    c2[0][...] = 5.0
    c2.advance(3)
    assert c2.spec_commit(1) == 1  # restore + replay 1 token
    assert same(c2.cache, before) and c2.tokens_seen == 0 and not c2.in_spec_round
    c2.spec_begin()
    c2[1] = c2[1] - 1
    c2.spec_rollback()
    assert same(c2.cache, before)
    # a model that never calls advance: the caller says how many tokens the round added
    c3 = ArraysCache(1)
    c3.spec_begin()
    c3[0] = mx.ones((1, 1))
    with pytest.raises(ValueError, match="pass n_added"):
        c3.spec_commit(1)
    assert c3.spec_commit(1, n_added=2) == 1 and c3.empty()
    c3.spec_begin()
    c3.advance(2)
    with pytest.raises(ValueError, match="n_added=3 but the model advanced the cache by 2"):
        c3.spec_commit(1, n_added=3)


@pytest.mark.parametrize("n_acc", [0, 2, 4])
def test_hybrid_spec_round_replay_in_lfm2(lfm2, n_acc):
    """Verify 4 drafted tokens in one forward, accept n: after commit_spec_round (+ the
    replay it asks for) logits equal a cache that only ever saw the kept tokens."""
    prompt, draft = ids(6, 1), ids(4, 2)
    caches = [ArraysCache(1), KVCache()]
    lfm2(prompt, cache=caches)
    begin_spec_round(caches)
    lfm2(draft, cache=caches)
    replay = commit_spec_round(caches, n_acc)
    assert replay == (n_acc if 0 < n_acc < 4 else 0)
    if replay:
        assert caches[1].offset == 6  # the attention layer rolled back too
        lfm2(draft[:, :replay], cache=caches)
    ref = [ArraysCache(1), KVCache()]
    lfm2(prompt, cache=ref)
    if n_acc:
        lfm2(draft[:, :n_acc], cache=ref)
    assert caches[1].offset == ref[1].offset == 6 + n_acc
    for i in range(3):
        t = ids(1, 10 + i)
        assert same(lfm2(t, cache=caches), lfm2(t, cache=ref)), i


# ================================================================== save / load


def fill(caches, chunks=(9, 1, 1, 3)):
    for c in caches:
        for i, n in enumerate(chunks):
            k = mx.random.normal((1, 2, n, 32), key=mx.random.key(i))
            c.update_and_fetch(k, k * 2)
    return caches


def all_kinds():
    arr = ArraysCache(3)
    arr[0] = mx.random.normal((1, 2, 64), key=mx.random.key(1)).astype(mx.bfloat16)
    arr[2] = mx.arange(5)
    arr.left_padding = mx.array([1])
    return fill([KVCache(), RotatingKVCache(max_size=8, keep=2), QuantizedKVCache(32, 4)]) + \
        [arr, KVCache(), QuantizedKVCache(64, 8)]  # the last two: empty


def identity(n):
    return {**IDENTITY, "num_layers": str(n)}


def test_roundtrip_every_kind(tmp_path):
    caches = all_kinds()
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, caches, {"note": "x"}, model_identity=identity(6), tokens=[5, 6, 7])
    loaded, meta = load_prompt_cache(path, expect_identity=identity(6), expect_layout=caches)
    assert meta == {"note": "x", "tokens": "[5, 6, 7]"} and cached_tokens(meta) == [5, 6, 7]
    assert [type(c) for c in loaded] == [type(c) for c in caches]
    for a, b in zip(loaded, caches):
        assert same(a.state, b.state) and a.meta_state == b.meta_state
        assert a.nbytes == b.nbytes and a.empty() == b.empty()
    assert cache_layout(loaded) == ["KVCache", "RotatingKVCache(max_size=8, keep=2)",
                                    "QuantizedKVCache(bits=4, group_size=32)", "ArraysCache(size=3)",
                                    "KVCache", "QuantizedKVCache(bits=8, group_size=64)"]
    # loaded caches keep working exactly like the originals
    k = mx.random.normal((1, 2, 1, 32), key=mx.random.key(99))
    for a, b in zip(loaded[:3], caches[:3]):
        assert same(a.update_and_fetch(k, k), b.update_and_fetch(k, k))


def test_identity_mismatch_refuses(tmp_path):
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, fill([KVCache(), KVCache()]), model_identity=IDENTITY)
    other = model_identity(config_from_dict({**LLAMA, "num_key_value_heads": 4}))
    with pytest.raises(PromptCacheError, match=r"c.safetensors: saved for another model: "
                       r"num_kv_heads: file has '2', expected '4'; config_fingerprint") as e:
        load_prompt_cache(path, expect_identity=other)
    assert isinstance(e.value, MlxbunError) and "model_type" not in str(e.value)
    with pytest.raises(PromptCacheError, match="model_type: file has 'llama', expected 'qwen2'"):
        load_prompt_cache(path, expect_identity={"model_type": "qwen2"})
    load_prompt_cache(path, expect_identity={"model_type": "llama", "num_layers": 2})  # subset ok


def test_layout_mismatch_refuses(tmp_path):
    path = tmp_path / "c.safetensors"
    save_prompt_cache(path, fill([QuantizedKVCache(32, 4), RotatingKVCache(8)]), model_identity=IDENTITY)
    with pytest.raises(PromptCacheError, match=r"layer 0: file has QuantizedKVCache\(bits=4, "
                       r"group_size=32\), expected KVCache"):
        load_prompt_cache(path, expect_layout=[KVCache(), RotatingKVCache(8)])
    with pytest.raises(PromptCacheError, match=r"layer 0: .*expected QuantizedKVCache\(bits=8.*; "
                       r"layer 1: file has RotatingKVCache\(max_size=8, keep=0\), expected "
                       r"RotatingKVCache\(max_size=16"):
        load_prompt_cache(path, expect_layout=[QuantizedKVCache(32, 8), RotatingKVCache(16)])
    with pytest.raises(PromptCacheError, match="holds 2 cache layers, expected 3"):
        load_prompt_cache(path, expect_layout=["KVCache"] * 3)
    load_prompt_cache(path, expect_layout=["QuantizedKVCache(bits=4, group_size=32)",
                                           RotatingKVCache(8)])


def test_save_refusals(tmp_path):
    with pytest.raises(PromptCacheError, match="num_layers=2 but 3 caches"):
        save_prompt_cache(tmp_path / "a.safetensors", [KVCache()] * 3, model_identity=IDENTITY)
    with pytest.raises(PromptCacheError, match="lacks config_fingerprint"):
        save_prompt_cache(tmp_path / "a.safetensors", [KVCache()] * 2,
                          model_identity={k: v for k, v in IDENTITY.items() if k != "config_fingerprint"})
    with pytest.raises(PromptCacheError, match="layer 1 \\(KVCache\\): cache class is not registered"):
        save_prompt_cache(tmp_path / "a.safetensors", [KVCache(), o_cache.KVCache()], model_identity=IDENTITY)
    with pytest.raises(PromptCacheError, match="'tokens' is reserved"):
        save_prompt_cache(tmp_path / "a.safetensors", [KVCache()] * 2, {"tokens": "1"},
                          model_identity=IDENTITY, tokens=[1])


def test_save_path_is_checked_before_writing(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("x")
    for target, match in [(tmp_path / "missing" / "c.safetensors", r"directory .*missing does not exist"),
                          (tmp_path / "adir", r"adir: is a directory"),
                          (tmp_path / "afile" / "c.safetensors", r"directory .*afile is not a directory")]:
        with pytest.raises(PromptCacheError, match=match):
            check_save_path(target)
        with pytest.raises(PromptCacheError, match=match):
            save_prompt_cache(target, fill([KVCache(), KVCache()]), model_identity=IDENTITY)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["adir", "afile"]
    assert check_save_path(tmp_path / "c.safetensors") == tmp_path / "c.safetensors"


@pytest.mark.parametrize("fail", ["write", "replace"])
def test_a_failed_save_leaves_no_temp_file(tmp_path, monkeypatch, fail):
    import mlxbun.cache.prompt_cache as pc

    def half_written(file, *args):
        Path(file).write_bytes(b"partial")
        raise RuntimeError(f"[save_safetensors] Failed to write {file}")

    def refused(src, dst):
        raise PermissionError(13, "Permission denied", str(dst))

    if fail == "write":
        monkeypatch.setattr(pc.mx, "save_safetensors", half_written)
    else:
        monkeypatch.setattr(pc.os, "replace", refused)
    target = tmp_path / "c.safetensors"
    with pytest.raises(PromptCacheError, match=r"c\.safetensors: cannot write the prompt cache"):
        save_prompt_cache(target, fill([KVCache(), KVCache()]), model_identity=IDENTITY)
    assert list(tmp_path.iterdir()) == []


def test_corrupt_files_refuse_naming_the_file(tmp_path):
    good = tmp_path / "good.safetensors"
    save_prompt_cache(good, fill([KVCache(), QuantizedKVCache(32, 4)]), model_identity=IDENTITY)
    data = good.read_bytes()

    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(data[: len(data) - 100])
    with pytest.raises(PromptCacheError, match=r"truncated.safetensors.*run past the end"):
        load_prompt_cache(truncated)
    stub = tmp_path / "stub.safetensors"
    stub.write_bytes(data[:5])
    with pytest.raises(PromptCacheError, match="stub.safetensors"):
        load_prompt_cache(stub)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(data[:8] + b"\xff" * (len(data) - 8))
    with pytest.raises(PromptCacheError, match="garbage.safetensors: prompt cache unreadable.*header is not valid"):
        load_prompt_cache(garbage)
    with pytest.raises(PromptCacheError, match="missing.safetensors: no such"):
        load_prompt_cache(tmp_path / "missing.safetensors")

    # a valid safetensors file that is not ours (mlx-lm's own prompt-cache format)
    foreign = tmp_path / "mlxlm.safetensors"
    o_cache.save_prompt_cache(str(foreign), fill([o_cache.KVCache()]))
    with pytest.raises(PromptCacheError, match="mlxlm.safetensors: not an mlxbun prompt cache"):
        load_prompt_cache(foreign)

    # valid container, damaged metadata: rewrite the header with edits
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + hlen])

    def rewrite(name, edit):
        h = json.loads(json.dumps(header))
        edit(h["__metadata__"])
        raw = json.dumps(h).encode()
        p = tmp_path / name
        p.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + hlen :])
        return p

    with pytest.raises(PromptCacheError, match="v2.safetensors: prompt-cache format version '2'"):
        load_prompt_cache(rewrite("v2.safetensors", lambda m: m.update({"mlxbun.format_version": "2"})))
    with pytest.raises(PromptCacheError, match="nolayers.safetensors: metadata key 'mlxbun.layers' is missing"):
        load_prompt_cache(rewrite("nolayers.safetensors", lambda m: m.pop("mlxbun.layers")))
    with pytest.raises(PromptCacheError, match="count.safetensors: 2 layers stored but the identity"):
        load_prompt_cache(rewrite("count.safetensors", lambda m: m.update(
            {"mlxbun.identity": json.dumps({**IDENTITY, "num_layers": "3"})})))

    def drop_tensor(m):
        layers = json.loads(m["mlxbun.layers"])
        layers[1]["state"]["tuple"][0]["tuple"][0] = {"t": "layer.1.nope"}
        m["mlxbun.layers"] = json.dumps(layers)
    with pytest.raises(PromptCacheError, match=r"tensor.safetensors: layer 1 \(QuantizedKVCache\): "
                       r"tensor 'layer.1.nope' is missing"):
        load_prompt_cache(rewrite("tensor.safetensors", drop_tensor))


# ================================================================== prefix reuse


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0 and common_prefix_length([9], [1]) == 0
    assert common_prefix_length(mx.array([4, 5]).tolist(), (4, 5)) == 2


def test_prefix_reuse_gives_fresh_prefill_logits(llama, tmp_path):
    A = ids(12, 1)
    B = mx.concatenate([A[:, :8], ids(6, 2)], axis=1)
    caches = [KVCache(), KVCache()]
    llama(A, cache=caches)
    path = tmp_path / "p.safetensors"
    save_prompt_cache(path, caches, model_identity=IDENTITY, tokens=A[0].tolist())

    loaded, meta = load_prompt_cache(path, expect_identity=IDENTITY, expect_layout=["KVCache"] * 2)
    kept = reuse_prefix(loaded, cached_tokens(meta), B[0].tolist())
    assert kept == 8 and all(c.offset == 8 for c in loaded)
    out = llama(B[:, kept:], cache=loaded)

    # bit-exact vs the same steps without the file: saving/loading/trimming lose nothing
    mem = [KVCache(), KVCache()]
    llama(A, cache=mem)
    for c in mem:
        c.trim(4)
    assert same(out, llama(B[:, 8:], cache=mem))
    # vs a fresh prefill of B: K/V of the shared prefix came from a 12-token gemm
    # instead of a 14-token one, so float32 rounding differs (observed ~1e-6)
    fresh = llama(B, cache=[KVCache(), KVCache()])[:, 8:]
    assert mx.abs(out - fresh).max().item() < 1e-4
    assert same(out.argmax(-1), fresh.argmax(-1))
    # and decoding continues identically to the in-memory caches
    t = ids(1, 7)
    assert same(llama(t, cache=loaded), llama(t, cache=mem))


def test_prefix_reuse_edges(tmp_path):
    caches = fill([KVCache(), KVCache()], chunks=(5,))
    toks = [1, 2, 3, 4, 5]
    assert reuse_prefix(caches, toks, toks) == 4  # identical prompt: re-feed the last token
    assert caches[0].offset == 4
    caches = fill([KVCache(), KVCache()], chunks=(5,))
    assert reuse_prefix(caches, toks, toks + [6, 7]) == 5 and caches[1].offset == 5
    with pytest.raises(PromptCacheError, match="layer 0 holds 5 tokens but 3 cached"):
        reuse_prefix(caches, [1, 2, 3], [1, 2])
    arr = ArraysCache(1)
    arr[0] = mx.zeros((1, 2))
    mixed = [arr] + fill([KVCache()], chunks=(5,))
    with pytest.raises(PromptCacheError, match=r"layer 0 \(ArraysCache\) cannot drop its last 3"):
        reuse_prefix(mixed, toks, [1, 2, 9])
    assert mixed[1].offset == 5  # nothing was trimmed
    assert reuse_prefix(mixed, toks, toks + [8]) == 5  # full reuse needs no trim
    rot = fill([RotatingKVCache(max_size=4)], chunks=(6,))
    with pytest.raises(PromptCacheError, match="RotatingKVCache"):
        reuse_prefix(rot, [1, 2, 3, 4, 5, 6], [1, 2])


# ================================================================== hybrids: recurrent state


def test_spec_marks_restore_one_token_states_exactly(lfm2):
    """A drafter feeding one token per call marks each step: committing n restores the state
    after n tokens bit for bit, no replay asked."""
    toks = [ids(1, 20 + i) for i in range(4)]
    for n in range(4):
        caches = [ArraysCache(1), KVCache()]
        lfm2(ids(6, 1), cache=caches)
        begin_spec_round(caches)
        for t in toks[:3]:
            lfm2(t, cache=caches)
            caches[0].spec_mark()
        lfm2(toks[3], cache=caches)
        assert not caches[0].spec_needs_replay(n) and commit_spec_round(caches, n) == 0
        ref = [ArraysCache(1), KVCache()]
        lfm2(ids(6, 1), cache=ref)
        for t in toks[:n]:
            lfm2(t, cache=ref)
        assert same(list(caches[0].state), list(ref[0].state)) and caches[1].offset == 6 + n
        assert caches[0].tokens_seen == ref[0].tokens_seen == 6 + n
        assert same(lfm2(ids(1, 9), cache=caches), lfm2(ids(1, 9), cache=ref)), n


@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_generation_caches_of_a_hybrid_match_mlx_lms_own(name):
    """make_generation_cache turns mlx-lm's ArraysCache (and falcon_h1's CacheList of it and a
    KVCache) into mlxbun's: the logits stay mlx-lm's bit for bit, chunk after chunk."""
    from mlxbun.cache.cache_list import CacheList
    from mlxbun.generation_caches import make_generation_cache

    model = open_hybrid(name)
    mine, ref = make_generation_cache(model), model.module.make_cache()
    assert all(type(c).__module__.startswith("mlxbun.cache") for c in mine)
    assert any(isinstance(c, (ArraysCache, CacheList)) for c in mine)
    for i, n in enumerate([6, 1, 1, 4, 1]):
        assert same(model(ids(n, i), cache=mine), model(ids(n, i), cache=ref)), i


def _hybrid_identity(name, caches):
    return {"model_type": name, "num_layers": str(len(caches)), "num_kv_heads": "1", "head_dim": "32",
            "config_fingerprint": f"tests/hybrid_models.py:{name}"}


@pytest.mark.parametrize("name", HYBRID_MODELS + UNIVERSAL)
def test_hybrid_prompt_cache_round_trip_and_prefix_reuse_are_exact(tmp_path, name):
    """Every hybrid's caches (recurrent state arrays included) saved after prompt A and loaded:
    the arrays come back bit for bit; reusing the saved prefix for prompt A + B gives the logits
    of the same forwards on caches that never left memory, bit for bit; generation from the
    loaded cache streams the same log-probabilities; a prompt leaving A refuses (a recurrent
    state cannot drop tokens)."""
    from mlxbun.generate import stream_generate
    from mlxbun.generation_caches import make_generation_cache

    model = open_hybrid(name)
    a, b = [(5 * i + 2) % 256 for i in range(10)], [(9 * i + 7) % 256 for i in range(5)]
    mem = make_generation_cache(model)
    assert any(isinstance(x, ArraysCache) for c in mem for x in getattr(c, "caches", [c]))  # falcon_h1: CacheList
    model(mx.array([a]), cache=mem)
    path = tmp_path / "h.safetensors"
    save_prompt_cache(path, mem, model_identity=_hybrid_identity(name, mem), tokens=a)
    loaded, meta = load_prompt_cache(path, expect_identity=_hybrid_identity(name, mem), expect_layout=mem)
    for x, y in zip(loaded, mem):
        assert type(x) is type(y) and same(x.state, y.state) and x.nbytes == y.nbytes
    keep = reuse_prefix(loaded, cached_tokens(meta), a + b)
    assert keep == len(a)
    assert same(model(mx.array([(a + b)[keep:]]), cache=loaded), model(mx.array([b]), cache=mem))
    # generation continues identically from a loaded cache
    c1 = load_prompt_cache(path)[0]
    c2 = make_generation_cache(model)
    model(mx.array([a]), cache=c2)
    s1 = list(stream_generate(model, IdTokenizer(), b, prompt_cache=c1, max_tokens=6))
    s2 = list(stream_generate(model, IdTokenizer(), b, prompt_cache=c2, max_tokens=6))
    assert all(same(x.logprobs, y.logprobs) for x, y in zip(s1, s2)) and len(s1) == 6
    with pytest.raises(PromptCacheError, match=r"\((ArraysCache|CacheList)\) cannot drop its last 4"):
        reuse_prefix(load_prompt_cache(path)[0], a, a[:6] + b)


def _batch_caches(model, left_padding, arrays_cls, ssm_mask=True):
    """mlx-lm's batched caches (BatchKVCache for attention) with `arrays_cls` for the recurrent
    layers (given the padding unless not ssm_mask)."""
    def batched(c):
        if type(c).__name__ == "ArraysCache":
            return arrays_cls(len(c.cache), left_padding=left_padding if ssm_mask else None)
        if type(c).__name__ == "CacheList":  # falcon_h1
            return o_cache.CacheList(*(batched(x) for x in c.caches))
        return o_cache.BatchKVCache(left_padding)

    return [batched(c) for c in model.make_cache()]


@pytest.mark.parametrize("name", HYBRID_MODELS)
def test_hybrid_batch_of_two_left_padded(name):
    """A batch of two prompts (7 and 4 tokens, the short one left-padded by 3) + 3 decode steps:
    with mlxbun's ArraysCache the logits equal mlx-lm's ArraysCache bit for bit (the ssm mask from
    left_padding, advance). Each row matches its batch-1 run as closely as mlx-lm's own model does:
    not bit for bit (the batched matmuls round differently, ~4e-6 here, even on the unpadded row),
    same argmax; without the padding mask the padded row is far off."""
    model = open_hybrid(name).module
    a, b = [(5 * i + 1) % 256 for i in range(7)], [(11 * i + 3) % 256 for i in range(4)]
    x = mx.array([a, [0, 0, 0] + b])
    steps = [mx.array([[10 + s], [20 + s]]) for s in range(3)]

    def run(caches):
        outs = [model(x, cache=caches)[:, -1]] + [model(t, cache=caches)[:, -1] for t in steps]
        return mx.stack(outs, 1)

    mine, ref = run(_batch_caches(model, [0, 3], ArraysCache)), run(_batch_caches(model, [0, 3], o_cache.ArraysCache))
    assert same(mine, ref)
    for row, prompt in enumerate((a, b)):
        caches = model.make_cache()
        outs = [model(mx.array([prompt]), cache=caches)[:, -1]]
        outs += [model(t[row:row + 1], cache=caches)[:, -1] for t in steps]
        one = mx.stack(outs, 1)[0]
        assert mx.abs(one - mine[row]).max().item() < 1e-4 and same(one.argmax(-1), mine[row].argmax(-1))
        if row == 1:
            unmasked = run(_batch_caches(model, [0, 3], ArraysCache, ssm_mask=False))[1]
            assert mx.abs(one - unmasked).max().item() > 1e-2
