"""hunyuan's cross-layer KV sharing (CLA) under every cache the universal graph offers.

In mlx-lm 0.32.2 a sharing layer (i % cla_share_factor != 0) has no k_proj / v_proj: it takes
the last projecting layer's k_proj(x), v_proj(x) of the tokens being run, ropes and normalizes
them with its own modules and fills its OWN cache (hunyuan defines no make_cache: one KVCache per
layer). So the sharing happens before any cache, and every cache kind must give exactly what
mlx-lm's own hunyuan module gives with the same cache: plain, rotating (max_kv_size), quantized
(uniform kv_bits, from the start and mid-decode), TurboQuant, a mixed per-layer plan naming only
sharing layers, and a prompt cache saved and loaded. Each run is compared, every step's
log-probabilities bit for bit, with mlx-lm's module run by mlxbun's generate on mlxbun's caches
(the same cache code, mlx-lm's CLA), and where mlx-lm has the cache kind itself, with mlx-lm's
own stream_generate too. Speculative decoding (n-gram and layer-skip drafters, whose cut can fall
inside a sharing group) equals plain greedy.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.generate import stream_generate
from mlxbun.generation_caches import make_generation_cache
from tests.checkpoint_edits import rewrite_checkpoint
from tests.kv_sharing import PROMPT, N, changed, oracle_stream, same_stream


@pytest.fixture(scope="module")
def wide_hunyuan(zoo, tmp_path_factory) -> Path:
    """The zoo's hunyuan (CLA, share factor 2) with 2 heads of 32 (quantized KV needs a group of
    32 dividing head_dim; mlx-lm's hunyuan has no head_dim key): the same tensors, the q/k norm
    weights widened."""
    widened = lambda tensors: {k: mx.concatenate([v, v])  # noqa: E731
                               if k.endswith(("query_layernorm.weight", "key_layernorm.weight")) else v
                               for k, v in tensors.items()}
    return rewrite_checkpoint(zoo("hunyuan"), tmp_path_factory.mktemp("kv") / "hunyuan_wide", widened,
                              {"num_attention_heads": 2, "num_key_value_heads": 1})


@pytest.fixture(scope="module")
def sides(wide_hunyuan):
    """(mlxbun's graph, mlx-lm's module, mlx-lm's model for its own generate, tokenizer, mlx-lm's
    tokenizer wrapper)."""
    import mlx_lm

    import mlxbun
    from mlxbun.tokenizer import load_tokenizer

    ours = mlxbun.open_model(wide_hunyuan)
    module = mlx_lm.load(str(wide_hunyuan))[0]
    oracle, otok = mlx_lm.load(str(wide_hunyuan))
    assert ours.model_type == "hunyuan" and [s.kv_proj for s in ours.args.layers] == [True, False] * 2
    assert ours.args.head_dim == 32
    return ours, module, oracle, load_tokenizer(wide_hunyuan), otok


SETTINGS = {
    "plain": dict(),
    "rotating": dict(max_kv_size=16),
    "q4": dict(kv_bits=4, kv_group_size=32),
    "q8_mid_decode": dict(kv_bits=8, kv_group_size=32, quantized_kv_start=24),
    "turboquant": dict(kv_bits=3.5, kv_scheme="turboquant"),
}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_every_kv_setting_keeps_mlx_lms_sharing(sides, name):
    ours, module, oracle, tok, otok = sides
    options = SETTINGS[name]
    got = list(stream_generate(ours, tok, PROMPT, max_tokens=N, **options))
    want = list(stream_generate(module, tok, PROMPT, max_tokens=N, **options))
    same_stream(got, want)
    if name != "turboquant":  # mlx-lm's own generate and caches
        same_stream(got, oracle_stream(oracle, otok, **options))
    plain = list(stream_generate(ours, tok, PROMPT, max_tokens=N))
    if name not in ("plain", "rotating"):  # the cache did change the numbers (it ran)
        assert changed(got, plain)


def test_a_mixed_plan_on_sharing_layers_only(sides):
    """A per-layer plan quantizing layers 1 and 3 (the sharing ones) and keeping their projecting
    layers plain: each layer's cache is its own, so the plan applies layer by layer."""
    from mlxbun.cache.mixed import KVPlan
    from mlxbun.cache.quantized import QuantizedKVCache

    ours, module, _, tok, _ = sides
    plan = KVPlan.from_args(bits=4, group_size=32, layers=[1, 3], num_layers=4)
    cache = make_generation_cache(ours, kv_config=plan)
    got = list(stream_generate(ours, tok, PROMPT, max_tokens=N, prompt_cache=cache, kv_config=plan))
    assert [type(c) for c in cache] == [KVCache, QuantizedKVCache] * 2
    want = list(stream_generate(module, tok, PROMPT, max_tokens=N, kv_config=plan))
    same_stream(got, want)


def test_a_saved_prompt_cache_continues_the_sharing(sides, tmp_path):
    from mlxbun.cache import prompt_cache as pc
    from mlxbun.generation_caches import model_identity_of

    ours, module, _, tok, _ = sides
    ids = tok.encode_prompt(PROMPT)
    head, tail = ids[:9], ids[9:]
    file = tmp_path / "hunyuan.safetensors"
    live = make_generation_cache(ours)
    list(stream_generate(ours, tok, head, max_tokens=2, prompt_cache=live))
    assert all(type(c) is KVCache and c.offset == len(head) + 2 for c in live)  # one per layer
    pc.save_prompt_cache(file, live, model_identity=model_identity_of(ours))
    continued = list(stream_generate(ours, tok, tail, max_tokens=N, prompt_cache=live))
    from_file = list(stream_generate(ours, tok, tail, max_tokens=N, prompt_cache=str(file)))
    same_stream(from_file, continued)
    ref = make_generation_cache(module)
    list(stream_generate(module, tok, head, max_tokens=2, prompt_cache=ref))
    same_stream(continued, list(stream_generate(module, tok, tail, max_tokens=N, prompt_cache=ref)))


def test_hunyuan_caches_are_one_plain_cache_per_layer_as_mlx_lm(sides):
    """mlx-lm's hunyuan has no make_cache: make_prompt_cache gives each layer a KVCache (sharing
    layers included), and max_kv_size a RotatingKVCache each; mlxbun builds the same."""
    from mlx_lm.models.cache import make_prompt_cache

    ours, module, _, _, _ = sides
    assert [type(c).__name__ for c in make_prompt_cache(module)] == ["KVCache"] * 4
    assert [type(c) for c in ours.make_cache()] == [KVCache] * 4
    assert [type(c) for c in make_generation_cache(ours, max_kv_size=16)] == [RotatingKVCache] * 4


def test_speculative_drafters_keep_the_sharing(sides):
    """Speculative greedy equals plain greedy on a CLA model with every drafter kind: the
    layer-skip self-draft cuts the stack inside a sharing group (self:1 keeps layer 0, which
    projects; self:3 keeps layer 2's group half) and the target's own caches roll back per layer."""
    from mlxbun.speculative.drafters import LayerSkipDrafter, NGramDrafter
    from mlxbun.speculative.engine import speculative_generate

    ours, _, _, tok, _ = sides
    plain = list(stream_generate(ours, tok, PROMPT, max_tokens=N))
    makers = [NGramDrafter] + [lambda n=n: LayerSkipDrafter(n) for n in (1, 2, 3, 4)]
    for make in makers:
        for k in (1, 3):
            drafter = make()
            spec = list(speculative_generate(ours, tok, PROMPT, drafter=drafter, num_draft=k, max_tokens=N))
            assert [r.token for r in spec] == [r.token for r in plain], (drafter.name, k)
            # tests/test_speculative.py's LOGPROB_TOL: a batched verify forward rounds differently
            assert max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain)) < 1e-4
