"""TurboQuant's key/value split through generation (lab/tq_bits graduated into the KV grammar):
`--kv turboquant:3.5,keys=4` / `kv_key_bits=4` builds caches of those widths, and the stream is bit
for bit the one whose caches were converted by hand with `TurboQuantKVCache(key_bits=4,
value_bits=3)`; mlx-vlm's split stays the default. The grammar's parse / print / errors are in
tests/test_names.py."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxbun.cache.turboquant import TurboQuantKVCache
from mlxbun.errors import GenerationError
from mlxbun.generate import stream_generate
from mlxbun.generation_caches import make_generation_cache, turboquant_layers
from mlxbun.names import parse_kv
from mlxbun.parity.forced import teacher_forced
from tests import test_generate, test_generate_cli, test_speculative

# fixtures of those files, by name: zoo models loaded once (`loaded`), the CLI in-process (`run`) and
# zoo:qwen3 (`qwen3`), speculative targets and draft models (`models`)
loaded, models = test_generate.loaded, test_speculative.models
run, qwen3 = test_generate_cli.run, test_generate_cli.qwen3

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
N = 8

# (name, TurboQuantKVCache's arguments by hand, the (key, value) widths generation must build)
CASES = [
    ("turboquant:3.5", dict(bits=3.5), (3, 4)),  # mlx-vlm's split: the default, unchanged
    ("turboquant:3.5,keys=4", dict(bits=3.5, key_bits=4, value_bits=3), (4, 3)),
    ("turboquant:keys=5,values=2", dict(bits=3.5, key_bits=5, value_bits=2), (5, 2)),
]


def _same(a, b) -> bool:
    return ([r.token for r in a] == [r.token for r in b]
            and all(mx.array_equal(x.logprobs, y.logprobs).item() for x, y in zip(a, b)))


def _named(model, tok, ids, name):
    """(responses, caches) of stream_generate under the KV setting `name`."""
    options = parse_kv(name).as_options()
    cache = make_generation_cache(model, **options)
    return list(stream_generate(model, tok, ids, max_tokens=N, prompt_cache=cache, **options)), cache


def _by_hand(model, tok, ids, **widths):
    """The same run with the conversion done by hand: the prompt but its last token prefilled into
    plain caches (generation's prefill), the layers generation converts (`turboquant_layers`) made
    `TurboQuantKVCache.from_cache(c, **widths)`, then the last token and the decode with no KV option."""
    cache = make_generation_cache(model)
    model(mx.array([ids[:-1]]), cache=cache)
    for i in turboquant_layers(cache):
        cache[i] = TurboQuantKVCache.from_cache(cache[i], **widths)
    return list(stream_generate(model, tok, ids[-1:], max_tokens=N, prompt_cache=cache))


@pytest.mark.parametrize("name, widths, kv", CASES, ids=[c[0] for c in CASES])
def test_generation_runs_the_named_split_bit_for_bit(loaded, name, widths, kv):
    model, tok = loaded("qwen3", "mlxbun")
    ids = tok.encode_prompt(PROMPT)
    named, cache = _named(model, tok, ids, name)
    assert [(type(c), c.key_bits, c.value_bits) for c in cache] == [(TurboQuantKVCache, *kv)] * len(cache)
    assert _same(named, _by_hand(model, tok, ids, **widths))


@pytest.mark.parametrize("side", ["mlxbun", "module"])
def test_the_split_changes_the_stream_and_is_not_mlx_vlms(loaded, side):
    """K4/V3 is not K3/V4 (a split dropped on the way would give mlx-vlm's stream), on mlxbun's graph
    and on the bare mlx-lm module with mlxbun's caches; the library's options name the same run."""
    model, tok = loaded("qwen3", side)
    ids = tok.encode_prompt(PROMPT)
    default, _ = _named(model, tok, ids, "turboquant:3.5")
    split, _ = _named(model, tok, ids, "turboquant:3.5,keys=4")
    assert not any(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(default, split))
    assert _same(split, _by_hand(model, tok, ids, bits=3.5, key_bits=4, value_bits=3))
    for options in (dict(kv_bits=3.5, kv_key_bits=4), dict(kv_bits=3.5, kv_value_bits=3),
                    dict(kv_key_bits=4, kv_value_bits=3)):  # both sides: kv_bits is their mean
        assert _same(split, list(stream_generate(model, tok, ids, max_tokens=N, kv_scheme="turboquant", **options)))


@pytest.mark.parametrize("options, match", [
    (dict(kv_bits=4, kv_key_bits=4), "kv_key_bits=4: a key/value split is TurboQuant's"),
    (dict(kv_scheme="turboquant", kv_value_bits=3), "needs kv_bits"),
    (dict(kv_scheme="turboquant", kv_bits=3.5, kv_key_bits=8), "kv_key_bits=8 leaves kv_value_bits"),
    (dict(kv_scheme="turboquant", kv_bits=3.5, kv_key_bits=4, kv_value_bits=4), "average 4 bits, not kv_bits 3.5"),
])
def test_bad_splits_are_refused_before_any_work(loaded, options, match):
    model, tok = loaded("qwen3", "mlxbun")
    with pytest.raises(GenerationError, match=match):
        stream_generate(model, tok, PROMPT, max_tokens=2, **options)  # eagerly, not at the first next()
    with pytest.raises(GenerationError, match=match):
        make_generation_cache(model, **options)


def test_teacher_forcing_and_the_kv_sweep_take_the_split(loaded):
    from mlxbun.experiments import kv_quant

    model, tok = loaded("qwen3", "mlxbun")
    ids = tok.encode_prompt(PROMPT * 2)

    def by_hand(cache):
        for i in turboquant_layers(cache):
            cache[i] = TurboQuantKVCache.from_cache(cache[i], bits=3.5, key_bits=4, value_bits=3)

    split = teacher_forced(model, ids, prefill=12, kv=parse_kv("turboquant:3.5,keys=4"))
    assert mx.array_equal(split.logits, teacher_forced(model, ids, prefill=12, quantize=by_hand).logits).item()
    default = teacher_forced(model, ids, prefill=12, kv=parse_kv("turboquant:3.5"))
    assert not mx.array_equal(split.logits, default.logits).item()
    assert split.kv_bytes == default.kv_bytes  # equal head dims: every split of 7 bits costs the same

    df = kv_quant.kv_sweep("zoo:qwen3", kv_quant.kv_grid([], [], [3.5, [4, 3]]), context_lengths=(12,),
                           n_eval=4, head_dim=None, record=False)
    rows = df.set_index("label").loc[["turboquant 3.5-bit", "turboquant K4/V3"]]
    assert rows[["bits", "key_bits", "value_bits"]].values.tolist() == [[3.5, 3, 4], [3.5, 4, 3]]
    assert (rows.kld_mean > 0).all() and rows.kld_mean.iloc[0] != rows.kld_mean.iloc[1]


def _json(run, *argv):
    code, out, err = run(*argv, "--json")
    assert code == 0, err
    return json.loads(out)


def test_cli_generate_kv_split(run, qwen3):
    _, model, tok = qwen3
    base = ["--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", str(N)]
    named = _json(run, *base, "--kv", "turboquant:3.5,keys=4")["tokens"]
    ref = stream_generate(model, tok, PROMPT, max_tokens=N, kv_bits=3.5, kv_scheme="turboquant", kv_key_bits=4)
    assert named == [r.token for r in ref]
    assert named != _json(run, *base, "--kv", "turboquant:3.5")["tokens"]  # mlx-vlm's K3/V4: another stream
    # the same setting by flags, and by both sides without a mean
    assert named == _json(run, *base, "--kv-scheme", "turboquant", "--kv-bits", "3.5", "--kv-key-bits", "4")["tokens"]
    assert named == _json(run, *base, "--kv-scheme", "turboquant", "--kv-key-bits", "4",
                          "--kv-value-bits", "3")["tokens"]
    code, _, err = run(*base, "--kv", "turboquant:3.5,keys=4")
    assert code == 0 and "KV: quantized on 2 layer(s) 0-1 of 2 (turboquant K4/V3)" in err
    assert _json(run, *base, "--kv", "turboquant:3.5,keys=4")["kv"] == "turboquant:3.5,keys=4,values=3"
    assert _json(run, *base, "--kv-bits", "3.5", "--kv-scheme", "turboquant")["kv"] == "turboquant:3.5"
    for argv, message in (
            (["--kv", "turboquant:3.5,keys=8"], "keys=8 leaves values 2 x 3.5 - 8 = -1 bits"),
            (["--kv", "uniform:4,keys=4"], "'keys=4': a key/value split is TurboQuant's"),
            (["--kv", "turboquant:3.5,keys=4", "--kv-key-bits", "4"], "drop --kv-key-bits"),
            (["--kv-bits", "4", "--kv-key-bits", "4"], "kv_key_bits=4: a key/value split is TurboQuant's"),
            (["--kv-scheme", "turboquant", "--kv-key-bits", "4"], "needs kv_bits")):
        code, _, err = run(*base, *argv)
        assert code == 1 and message in err and err.count("\n") == 1, err


def test_speculative_decoding_runs_the_split(models):
    """Greedy speculative decoding equals plain decoding under the same split (tokens, and log-probs to
    the batched verify's rounding), for a lookup drafter, a self-draft (the target's own caches) and a
    draft model (its own caches, under the target's KV options), and not mlx-vlm's split's stream."""
    from mlxbun.speculative import DraftModelDrafter, LayerSkipDrafter, NGramDrafter, speculative_generate

    target, tok = models("llama")
    kv = parse_kv("turboquant:3.5,keys=4").as_options()
    plain = list(stream_generate(target, tok, PROMPT, max_tokens=N, **kv))
    default = list(stream_generate(target, tok, PROMPT, max_tokens=N, kv_bits=3.5, kv_scheme="turboquant"))
    assert max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(plain, default)) > 1e-2
    for make in (NGramDrafter, lambda: LayerSkipDrafter(1), lambda: DraftModelDrafter(models("llama@seed1")[0])):
        drafter = make()
        spec = list(speculative_generate(target, tok, PROMPT, drafter=drafter, num_draft=3, max_tokens=N, **kv))
        assert [r.token for r in spec] == [r.token for r in plain], type(drafter).__name__
        assert max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain)) < 1e-4
        if isinstance(drafter, DraftModelDrafter):
            assert [(c.key_bits, c.value_bits) for c in drafter._cache] == [(4, 3)] * len(drafter._cache)
