"""gemma4_text's KV sharing under every cache mlxbun offers (the approach of test_moe_kv_sharing.py).

In mlx-lm 0.32.2 the last num_kv_shared_layers layers have no k / v projections: each takes the
keys, values and rope offset that its type's last projecting layer computed in the same forward
(after that layer's cache update), and make_cache gives caches to the projecting layers only. So
every cache kind must give what mlx-lm's own gemma4_text module gives on the same caches: plain,
rotating (max_kv_size), uniform quantized KV (from the start and mid-decode), TurboQuant, a
per-layer plan, a prompt cache saved and loaded, and speculative rounds that trim / roll back.
Each run is compared, every step's log-probabilities bit for bit, with mlx-lm's module run by
mlxbun's generate on mlxbun's caches, and with mlx-lm's own stream_generate where it runs.

Quantized KV: mlx-lm's shared layers call the fused kernel with cache=None on the producer's
packed (data, scales, biases) groups and fail; mlxbun's attend through the producer's quantized
attention. The oracle there is mlx-lm's module with that one call routed to mlx-lm's own
`quantized_scaled_dot_product_attention` at the run's bits and group (`_shared_quantized`).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import mlx.core as mx
import pytest

from mlxbun.generate import stream_generate
from mlxbun.generation_caches import make_generation_cache
from mlxbun.locate import locate
from mlxbun.names import parse_model
from tests.kv_sharing import PROMPT, N, changed, oracle_stream, same_stream

_S, _F = "sliding_attention", "full_attention"


def _sides(path: Path):
    """(mlxbun's graph, mlx-lm's module for mlxbun's generate, mlx-lm's model for its own generate,
    tokenizer, mlx-lm's tokenizer wrapper)."""
    import mlx_lm

    import mlxbun
    from mlxbun.tokenizer import load_tokenizer

    ours = mlxbun.open_model(path)
    module = mlx_lm.load(str(path))[0]
    oracle, otok = mlx_lm.load(str(path))
    return ours, module, oracle, load_tokenizer(path), otok


@pytest.fixture(scope="module")
def wide(zoo_root):
    """The zoo's gemma4_text (s s f | s s f, the last three KV-shared) with head_dim 32 (global 64),
    so a KV group of 32 divides every layer's head dim."""
    sides = _sides(locate(parse_model("zoo:gemma4_text,head_dim=32"), zoo_root=zoo_root))
    assert sides[0].args.fields["head_dim"] == 32 and sides[0].cache_layers == [0, 1, 2]
    return sides


@pytest.fixture(scope="module")
def all_full(tmp_path_factory):
    """gemma4_text with full layers only (uniform quantized KV refuses sliding layers, as in
    mlx-lm): 4 layers, the last two KV-shared (both read layer 1), head_dim 32, the zoo's
    per-layer inputs, k = v and double-wide MLP; built like the zoo's (mlx-lm's module, perturbed)."""
    from mlx_lm.utils import save_config

    from mlxbun.zoo import tiny_config, weights
    from mlxbun.zoo.tokenizer import write_tokenizer_files

    cfg = {**tiny_config("gemma4_text"), "num_hidden_layers": 4, "layer_types": [_F] * 4, "head_dim": 32,
           "global_head_dim": 32, "num_kv_shared_layers": 2}
    cfg.pop("per_layer_config")
    out = tmp_path_factory.mktemp("g4") / "gemma4_full"
    out.mkdir()
    weights.save_weights(weights.build_model(cfg, 0), out)
    save_config(cfg, out / "config.json")
    write_tokenizer_files(out)
    sides = _sides(out)
    assert [s.previous_kv for s in sides[0]._specs] == [0, 1, 1, 1]
    return sides


@contextlib.contextmanager
def _shared_quantized(group_size: int, bits: int):
    """mlx-lm's gemma4_text with its shared layers' cache-less attention over packed keys routed
    to mlx-lm's quantized SDPA (at the run's group and bits); every other call unchanged."""
    from mlx_lm.models import base, gemma4_text

    original = gemma4_text.scaled_dot_product_attention

    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        if cache is None and not isinstance(keys, mx.array):
            return base.quantized_scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask,
                                                               group_size=group_size, bits=bits)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    gemma4_text.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        gemma4_text.scaled_dot_product_attention = original


def test_mlx_lm_shared_layers_fail_on_quantized_kv(all_full):
    """Why the quantized oracle routes one call: mlx-lm alone cannot run it."""
    _, module, _, tok, _ = all_full
    with pytest.raises((TypeError, ValueError)):
        list(stream_generate(module, tok, PROMPT, max_tokens=2, kv_bits=4, kv_group_size=32))


def test_caches_are_mlx_lm_s_projecting_layers_only(wide, all_full):
    from mlx_lm.models.cache import make_prompt_cache

    for ours, module, *_ in (wide, all_full):
        want = [type(c).__name__ for c in make_prompt_cache(module)]
        assert [type(c).__name__ for c in ours.make_cache()] == want
        assert len(want) == len(ours.cache_layers) < len(ours.layers)
    assert [c.max_size for c in wide[0].make_cache()[:2]] == [16, 16]


PLAIN = {"plain": dict(), "chunked": dict(prefill_step_size=5), "rotating": dict(max_kv_size=24),
         "turboquant": dict(kv_bits=3.5, kv_scheme="turboquant")}
# TurboQuant converts full-attention KVCaches except the last cache of more than two: the wide
# model's list is [ring, ring, KVCache], so it runs on the all-full one
_PLAIN_CASES = [(f, n) for n in PLAIN for f in ("wide", "all_full") if not (n == "turboquant" and f == "wide")]


@pytest.mark.parametrize("fixture,name", _PLAIN_CASES, ids=[f"{f}-{n}" for f, n in _PLAIN_CASES])
def test_full_precision_and_turboquant_caches_keep_mlx_lm_s_sharing(request, fixture, name):
    ours, module, oracle, tok, otok = request.getfixturevalue(fixture)
    options = PLAIN[name]
    got = list(stream_generate(ours, tok, PROMPT, max_tokens=N, **options))
    same_stream(got, list(stream_generate(module, tok, PROMPT, max_tokens=N, **options)))
    if name in ("plain", "chunked"):  # mlx-lm's own generate and caches (its make_cache ignores
        same_stream(got, oracle_stream(oracle, otok, **options))  # max_kv_size)
    else:  # the cache changed the numbers (it ran)
        plain = list(stream_generate(ours, tok, PROMPT, max_tokens=N))
        assert changed(got, plain)


QUANTIZED = {"q4": dict(kv_bits=4, kv_group_size=32), "q8_mid_decode": dict(kv_bits=8, kv_group_size=32,
                                                                            quantized_kv_start=24)}


@pytest.mark.parametrize("name", sorted(QUANTIZED))
def test_uniform_quantized_kv_reads_the_producer_s_packed_keys(all_full, name):
    ours, module, _, tok, _ = all_full
    options = QUANTIZED[name]
    got = list(stream_generate(ours, tok, PROMPT, max_tokens=N, **options))
    with _shared_quantized(options["kv_group_size"], options["kv_bits"]):
        same_stream(got, list(stream_generate(module, tok, PROMPT, max_tokens=N, **options)))
    plain = list(stream_generate(ours, tok, PROMPT, max_tokens=N))
    assert changed(got, plain)


def test_a_plan_quantizing_a_producer_only(wide):
    """A per-layer plan quantizing cache 2 (layer 2, the full layer layer 5 reads): layer 5 attends
    over layer 2's packed keys at the plan's bits; the sliding producers stay plain."""
    from mlxbun.cache.kv import RotatingKVCache
    from mlxbun.cache.mixed import KVPlan
    from mlxbun.cache.quantized import QuantizedKVCache

    ours, module, _, tok, _ = wide
    plan = KVPlan.from_args(bits=4, group_size=32, layers=[2], num_layers=3)
    cache = make_generation_cache(ours, kv_config=plan)
    got = list(stream_generate(ours, tok, PROMPT, max_tokens=N, prompt_cache=cache, kv_config=plan))
    assert [type(c) for c in cache] == [RotatingKVCache, RotatingKVCache, QuantizedKVCache]
    with _shared_quantized(32, 4):
        same_stream(got, list(stream_generate(module, tok, PROMPT, max_tokens=N, kv_config=plan)))
    plain = list(stream_generate(ours, tok, PROMPT, max_tokens=N))
    assert changed(got, plain)


@pytest.mark.parametrize("kv", [dict(), dict(kv_bits=4, kv_group_size=32)], ids=["plain", "q4"])
def test_a_saved_prompt_cache_continues_the_sharing(all_full, tmp_path, kv):
    from mlxbun.cache import prompt_cache as pc
    from mlxbun.generation_caches import model_identity_of

    ours, module, _, tok, _ = all_full
    ids = tok.encode_prompt(PROMPT)
    head, tail = ids[:9], ids[9:]
    file = tmp_path / "gemma4.safetensors"
    live = make_generation_cache(ours, **kv)
    list(stream_generate(ours, tok, head, max_tokens=2, prompt_cache=live, **kv))
    assert len(live) == 2 and all(c.offset == len(head) + 2 for c in live)  # the projecting layers'
    pc.save_prompt_cache(file, live, model_identity=model_identity_of(ours))
    continued = list(stream_generate(ours, tok, tail, max_tokens=N, prompt_cache=live, **kv))
    from_file = list(stream_generate(ours, tok, tail, max_tokens=N, prompt_cache=str(file), **kv))
    same_stream(from_file, continued)
    ref = make_generation_cache(module, **kv)
    with _shared_quantized(32, 4):
        list(stream_generate(module, tok, head, max_tokens=2, prompt_cache=ref, **kv))
        same_stream(continued, list(stream_generate(module, tok, tail, max_tokens=N, prompt_cache=ref, **kv)))


@pytest.mark.parametrize("fixture,kv", [("wide", dict()), ("wide", dict(max_kv_size=24)),
                                        ("all_full", dict(kv_bits=4, kv_group_size=32)),
                                        ("all_full", dict(kv_bits=3.5, kv_scheme="turboquant"))],
                         ids=["plain", "rotating", "q4", "turboquant"])
def test_speculative_drafters_keep_the_sharing(request, fixture, kv):
    """Speculative greedy equals plain greedy with every drafter kind: the layer-skip self-draft
    cuts the stack before, inside and after the shared layers (self:4 keeps shared layer 3, which
    reads layer 1), and the projecting layers' caches trim / roll back per round."""
    from mlxbun.speculative.drafters import DraftModelDrafter, LayerSkipDrafter, NGramDrafter
    from mlxbun.speculative.engine import speculative_generate

    ours, _, _, tok, _ = request.getfixturevalue(fixture)
    plain = list(stream_generate(ours, tok, PROMPT, max_tokens=N, **kv))
    n = len(ours.layers)
    makers = [NGramDrafter, lambda: DraftModelDrafter(ours)] + [lambda i=i: LayerSkipDrafter(i)
                                                                 for i in range(1, n + 1)]
    for make in makers:
        for k in (1, 3):
            drafter = make()
            spec = list(speculative_generate(ours, tok, PROMPT, drafter=drafter, num_draft=k, max_tokens=N,
                                             **kv))
            assert [r.token for r in spec] == [r.token for r in plain], (drafter.name, k)
            # tests/test_speculative.py's LOGPROB_TOL: a batched verify forward rounds differently
            assert max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain)) < 1e-4
