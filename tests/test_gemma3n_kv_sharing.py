"""gemma3n's KV-shared layers under every cache mlxbun offers, against mlx-lm 0.32.2 live.

In mlx-lm's gemma3n the cache list holds one cache per layer before the last
num_kv_shared_layers (the zoo's: 5 layers, caches for layers 0-2: rotating, full, rotating); a
shared layer projects only queries and attends over `cache.keys_and_values()` of the last earlier
layer of its kind (layer 3 reads cache 2, layer 4 reads cache 1), after its owner wrote this
forward's keys. So every cache setting acts on owner caches and the sharing follows: each run is
compared, every step's log-probabilities bit for bit, with mlx-lm's module run by mlxbun's
generate on mlxbun's caches (the same cache code, mlx-lm's graph), and where mlx-lm has the cache
kind itself with mlx-lm's own caches: its stream_generate (plain caches), and a quantized owner
cache stepped by hand (mlx-lm's QuantizedKVCache, from the start and converted mid-decode), which
mlx-lm's generate cannot reach for gemma3n (its window caches refuse kv_bits).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import GenerationError
from mlxbun.generate import stream_generate
from mlxbun.generation_caches import make_generation_cache
from tests.kv_sharing import PROMPT, N, changed, oracle_stream, same_stream


@pytest.fixture(scope="module")
def wide_gemma3n(zoo_root) -> Path:
    """The zoo's gemma3n with heads of 32 (`zoo:gemma3n,head_dim=32`): quantized KV needs a group
    of 32+ dividing head_dim, and the zoo's heads are 16."""
    from mlxbun.zoo import cached_checkpoint

    return cached_checkpoint("gemma3n", head_dim=32, root=zoo_root)


@pytest.fixture(scope="module")
def sides(wide_gemma3n):
    """(mlxbun's graph, mlx-lm's module (for mlxbun's generate), mlx-lm's model for its own
    generate, tokenizer, mlx-lm's tokenizer wrapper)."""
    import mlx_lm

    import mlxbun
    from mlxbun.tokenizer import load_tokenizer

    path = wide_gemma3n
    ours = mlxbun.open_model(path)
    module = mlx_lm.load(str(path))[0]
    oracle, otok = mlx_lm.load(str(path))
    assert ours.args.cache_idx == (0, 1, 2, 2, 1) and ours.args.first_kv_shared == 3
    assert ours.args.head_dim == 32
    return ours, module, oracle, load_tokenizer(path), otok


def test_the_cache_list_holds_the_owners_only_as_mlx_lms(sides):
    ours, module, _, _, _ = sides
    kinds = lambda cs: [(type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None)) for c in cs]
    assert kinds(ours.make_cache()) == kinds(module.make_cache()) == [
        ("RotatingKVCache", 16, 0), ("KVCache", None, None), ("RotatingKVCache", 16, 0)]
    assert ours.cache_layers == [0, 1, 2]
    assert [type(c) for c in make_generation_cache(ours, max_kv_size=24)] == [RotatingKVCache] * 3


def test_plain_caches_equal_mlx_lms_own_generate(sides):
    ours, module, oracle, tok, otok = sides
    got = list(stream_generate(ours, tok, PROMPT, max_tokens=N))
    same_stream(got, list(stream_generate(module, tok, PROMPT, max_tokens=N)))
    same_stream(got, oracle_stream(oracle, otok))


SETTINGS = {
    # the full layer's cache becomes a ring of 16 (keep 4): layer 4 reads it
    "rotating": dict(max_kv_size=16),
    # TurboQuant converts full-attention KVCaches but the last cache: cache 1, read by layer 4
    "turboquant": dict(kv_bits=3.5, kv_scheme="turboquant"),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_cache_settings_keep_mlx_lms_sharing(sides, name):
    ours, module, _, tok, _ = sides
    options = SETTINGS[name]
    got = list(stream_generate(ours, tok, PROMPT, max_tokens=N, **options))
    same_stream(got, list(stream_generate(module, tok, PROMPT, max_tokens=N, **options)))
    assert changed(got, list(stream_generate(ours, tok, PROMPT, max_tokens=N)))  # the setting ran


def test_a_mixed_plan_quantizing_a_shared_owner(sides):
    """A per-layer plan quantizing cache 1 (layer 1's, which layer 4 reads): both read the
    quantized cache through its own attention."""
    from mlxbun.cache.mixed import KVPlan
    from mlxbun.cache.quantized import QuantizedKVCache

    ours, module, _, tok, _ = sides
    plan = KVPlan.from_args(bits=4, group_size=32, layers=[1], num_layers=3)
    cache = make_generation_cache(ours, kv_config=plan)
    got = list(stream_generate(ours, tok, PROMPT, max_tokens=N, prompt_cache=cache, kv_config=plan))
    assert [type(c) for c in cache] == [RotatingKVCache, QuantizedKVCache, RotatingKVCache]
    same_stream(got, list(stream_generate(module, tok, PROMPT, max_tokens=N, kv_config=plan)))
    assert changed(got, list(stream_generate(ours, tok, PROMPT, max_tokens=N)))


def test_a_plan_naming_a_window_cache_refuses(sides):
    from mlxbun.cache.mixed import KVPlan, KVPlanError

    ours, _, _, _, _ = sides
    with pytest.raises(KVPlanError, match="layer 2: is a sliding-window layer"):
        make_generation_cache(ours, kv_config=KVPlan.from_args(bits=4, group_size=32, layers=[2], num_layers=3))


def test_uniform_kv_bits_refuses_as_mlx_lm_fails(sides):
    """kv_bits quantizes every cache: gemma3n's window caches cannot (mlx-lm's RotatingKVCache
    raises NotImplementedError in its generate); mlxbun refuses naming the cache."""
    ours, _, oracle, tok, otok = sides
    with pytest.raises(GenerationError, match="cache 0: quantize_cache: RotatingKVCache"):
        list(stream_generate(ours, tok, PROMPT, max_tokens=N, kv_bits=4, kv_group_size=32))
    with pytest.raises(NotImplementedError, match="RotatingKVCache Quantization NYI"):
        oracle_stream(oracle, otok, kv_bits=4, kv_group_size=32)


@pytest.mark.parametrize("when", ["from_the_start", "mid_decode"])
def test_a_quantized_owner_cache_equals_mlx_lms_own(sides, when):
    """mlx-lm's own caches against mlxbun's, stepped by hand: cache 1 (read by layer 4) is an
    mlx-lm QuantizedKVCache on one side, mlxbun's on the other; every step's logits bit for bit."""
    from mlx_lm.models.cache import QuantizedKVCache as TheirQuantized

    from mlxbun.cache.convert import quantize_cache
    from mlxbun.cache.quantized import QuantizedKVCache

    ours, module, _, tok, _ = sides
    theirs_c, ours_c = module.make_cache(), ours.make_cache()
    if when == "from_the_start":
        theirs_c[1], ours_c[1] = TheirQuantized(group_size=32, bits=4), QuantizedKVCache(group_size=32, bits=4)
    ids = mx.array([tok.encode_prompt(PROMPT)])
    want, got = module(ids, cache=theirs_c), ours(ids, cache=ours_c)
    assert mx.array_equal(want, got).item()
    if when == "mid_decode":
        theirs_c[1], ours_c[1] = theirs_c[1].to_quantized(group_size=32, bits=4), quantize_cache(ours_c[1], 32, 4)
    plain = ours.make_cache()
    ours(ids, cache=plain)
    token, differs = mx.argmax(want[:, -1], -1)[:, None], False
    for step in range(N):
        want, got = module(token, cache=theirs_c), ours(token, cache=ours_c)
        assert mx.array_equal(want, got).item(), f"step {step}"
        differs |= not mx.array_equal(got, ours(token, cache=plain)).item()
        token = mx.argmax(want[:, -1], -1)[:, None]
    assert differs and type(ours_c[1]) is QuantizedKVCache and ours_c[1].offset == ids.shape[1] + N


def test_a_saved_prompt_cache_continues_the_sharing(sides, tmp_path):
    from mlxbun.cache import prompt_cache as pc
    from mlxbun.generation_caches import model_identity_of

    ours, module, _, tok, _ = sides
    ids = tok.encode_prompt(PROMPT)
    head, tail = ids[:9], ids[9:]
    file = tmp_path / "gemma3n.safetensors"
    live = make_generation_cache(ours)
    list(stream_generate(ours, tok, head, max_tokens=2, prompt_cache=live))
    assert [type(c) for c in live] == [RotatingKVCache, KVCache, RotatingKVCache]
    assert all(c.offset == len(head) + 2 for c in live)
    pc.save_prompt_cache(file, live, model_identity=model_identity_of(ours))
    continued = list(stream_generate(ours, tok, tail, max_tokens=N, prompt_cache=live))
    from_file = list(stream_generate(ours, tok, tail, max_tokens=N, prompt_cache=str(file)))
    same_stream(from_file, continued)
    ref = make_generation_cache(module)
    list(stream_generate(module, tok, head, max_tokens=2, prompt_cache=ref))
    same_stream(continued, list(stream_generate(module, tok, tail, max_tokens=N, prompt_cache=ref)))


def test_layer_skip_cuts_at_every_depth_keep_the_sharing(sides):
    """Speculative greedy equals plain greedy when the self-draft keeps 1..5 layers: self:3 keeps
    the owners only, self:4 a shared layer reading cache 2 (in the draft's view), self:5 all; the
    target's rollback trims only owner caches."""
    from mlxbun.speculative.drafters import LayerSkipDrafter
    from mlxbun.speculative.engine import speculative_generate

    ours, _, _, tok, _ = sides
    plain = list(stream_generate(ours, tok, PROMPT, max_tokens=N))
    for layers in (1, 2, 3, 4, 5):
        for k in (1, 3):
            spec = list(speculative_generate(ours, tok, PROMPT, drafter=LayerSkipDrafter(layers), num_draft=k,
                                             max_tokens=N))
            assert [r.token for r in spec] == [r.token for r in plain], (layers, k)
            # tests/test_speculative.py's LOGPROB_TOL: a batched verify forward rounds differently
            assert max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain)) < 1e-4
            if layers == 5:
                assert spec[-1].stats.draft_acceptance_rate == 1.0


@pytest.mark.parametrize("name", ["plan", "turboquant", "rotating"])
def test_speculative_rounds_on_quantized_and_ring_owners_equal_plain(sides, name):
    """Speculative greedy under a KV setting equals plain greedy under the same setting: the
    rounds roll back (trim / snapshot) the owner caches the shared layers read; the n-gram
    drafter and a self-draft that keeps shared layer 3 (reading cache 2)."""
    from mlxbun.cache.mixed import KVPlan
    from mlxbun.speculative.drafters import LayerSkipDrafter, NGramDrafter
    from mlxbun.speculative.engine import speculative_generate

    ours, _, _, tok, _ = sides
    options = {"plan": dict(kv_config=KVPlan.from_args(bits=4, group_size=32, layers=[1], num_layers=3)),
               **SETTINGS}[name]
    plain = list(stream_generate(ours, tok, PROMPT, max_tokens=N, **options))
    for make in (NGramDrafter, lambda: LayerSkipDrafter(4)):
        for k in (1, 3):
            spec = list(speculative_generate(ours, tok, PROMPT, drafter=make(), num_draft=k, max_tokens=N, **options))
            assert [r.token for r in spec] == [r.token for r in plain], (name, k)
            assert max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain)) < 1e-4
