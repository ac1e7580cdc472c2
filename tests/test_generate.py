"""mlxbun.generate / mlxbun.sampling against mlx-lm 0.32.2 (the L1 oracle, live in-process).

Every oracle test runs mlx-lm's own `stream_generate` (its graph and caches) and mlxbun's on
the same zoo checkpoint with the same settings and seed, and asserts the same token stream and
bit-identical per-step log-probabilities, for three model sides: mlxbun's graph
(`open_model`), the mlx-lm model through the adapter, and the bare mlx-lm module (both with
mlxbun's caches).
"""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import GenerationError, MlxbunError
from mlxbun.generate import StopText, generate, stream_generate
from mlxbun.generation_caches import make_generation_cache

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
N = 12  # tokens per run: enough to cross a window / quantization start, cheap on 2 cores

SIDES = ("mlxbun", "adapter", "module")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def loaded(zoo):
    """`loaded(arch, side)` -> (model, mlxbun tokenizer); `loaded(arch, "oracle")` -> mlx-lm's
    (model, TokenizerWrapper). Each is loaded once per session."""
    import mlx_lm

    import mlxbun
    from mlxbun.models.mlxlm import MlxLmRuntimeModel
    from mlxbun.tokenizer import load_tokenizer

    memo: dict = {}

    def get(arch_or_path, side):
        key = (str(arch_or_path), side)
        if key not in memo:
            path = zoo(arch_or_path) if isinstance(arch_or_path, str) else arch_or_path
            if side == "oracle":
                memo[key] = mlx_lm.load(str(path))
            else:
                oracle_model, _ = get(arch_or_path, "oracle")
                model = {
                    "mlxbun": lambda: mlxbun.open_model(path),
                    # a separate load: the oracle module must never see an mlxbun cache
                    "adapter": lambda: MlxLmRuntimeModel(mlx_lm.load(str(path))[0]),
                    "module": lambda: mlx_lm.load(str(path))[0],
                }[side]()
                memo[key] = (model, load_tokenizer(path))
        return memo[key]

    return get


def _oracle(model, tokenizer, prompt, *, seed=None, temperature=0.0, top_p=1.0, top_k=0, min_p=0.0,
            min_tokens_to_keep=1, repetition_penalty=None, **kwargs):
    from mlx_lm import stream_generate as mlx_stream
    from mlx_lm.sample_utils import make_logits_processors, make_sampler

    sampler = make_sampler(temperature, top_p, min_p, min_tokens_to_keep, top_k=top_k)
    processors = make_logits_processors(None, repetition_penalty, 20)
    kwargs.setdefault("quantized_kv_start", 0)  # mlxbun's default (mlx-lm's is 5000)
    if seed is not None:
        mx.random.seed(seed)
    return list(mlx_stream(model, tokenizer, prompt, sampler=sampler, logits_processors=processors, **kwargs))


def _assert_same_stream(ours, theirs, *, logprobs=True):
    assert [r.token for r in ours] == [r.token for r in theirs]
    assert [r.finish_reason for r in ours] == [r.finish_reason for r in theirs]
    assert [r.generation_tokens for r in ours] == [r.generation_tokens for r in theirs]
    assert ours[-1].prompt_tokens == theirs[-1].prompt_tokens
    if logprobs:
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert a.logprobs.shape == b.logprobs.shape, i
            assert mx.array_equal(a.logprobs, b.logprobs).item(), f"step {i}: logprobs differ"


def _run_both(loaded, arch, side, prompt=PROMPT, max_tokens=N, **options):
    model, tok = loaded(arch, side)
    omodel, otok = loaded(arch, "oracle")
    ours = list(stream_generate(model, tok, prompt, max_tokens=max_tokens, **options))
    theirs = _oracle(omodel, otok, prompt, max_tokens=max_tokens, **options)
    return ours, theirs


# ----------------------------------------------------------------------------- oracle: plain KV


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("arch", ["qwen3", "llama", "gemma3_text", "gemma3n", "gemma4_text"])
def test_greedy_matches_mlx_lm(loaded, arch, side):
    # gemma3_text: sliding layers (window 16) under a prompt + generation that crosses it;
    # gemma3n: the same, and its KV-shared layers read their owners' caches
    ours, theirs = _run_both(loaded, arch, side)
    _assert_same_stream(ours, theirs)
    assert ours[-1].finish_reason == "length" and len(ours) == N
    _, tok = loaded(arch, side)
    text = "".join(r.text for r in ours)
    assert text == tok.decode([r.token for r in ours])  # mlxbun's text = the tokens' text


# 79 tokens: the prefill routes 158 picks (mlx-lm's sorted-indices expert path), decode 2
LONG_PROMPT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy cat. "
               "Once upon a time the quick brown")


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "gpt_oss", "gemma4"])  # gemma4: the MoE block
# beside the MLP, behind the VLM wrapper
def test_moe_greedy_sampled_and_chunked_match_mlx_lm(loaded, arch, side):
    for options in (dict(), dict(temperature=0.8, top_p=0.9, seed=21), dict(prefill_step_size=7)):
        ours, theirs = _run_both(loaded, arch, side, prompt=LONG_PROMPT, **options)
        _assert_same_stream(ours, theirs)
    assert len({r.token for r in ours}) > 1


SAMPLED = {
    "top_p": dict(temperature=0.8, top_p=0.9, seed=11),
    "top_k": dict(temperature=0.8, top_k=20, seed=12),
    "min_p": dict(temperature=0.8, min_p=0.1, min_tokens_to_keep=3, seed=13),
    "all": dict(temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, seed=14),
    "high_temp": dict(temperature=1.5, seed=15),
}


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("name", sorted(SAMPLED))
def test_sampled_matches_mlx_lm(loaded, name, side):
    ours, theirs = _run_both(loaded, "qwen3", side, **SAMPLED[name])
    _assert_same_stream(ours, theirs)


def test_seed_makes_sampling_reproducible_and_differs_from_greedy(loaded):
    model, tok = loaded("qwen3", "mlxbun")
    a = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=N, temperature=1.5, seed=3)]
    b = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=N, temperature=1.5, seed=3)]
    c = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=N, temperature=1.5, seed=4)]
    g = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=N)]
    assert a == b
    assert a != c and a != g


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("options", [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7, temperature=0.8, seed=5),
])
def test_repetition_penalty_matches_mlx_lm(loaded, side, options):
    ours, theirs = _run_both(loaded, "qwen3", side, **options)
    _assert_same_stream(ours, theirs)
    plain = list(stream_generate(*loaded("qwen3", side), PROMPT, max_tokens=N,
                                 **{k: v for k, v in options.items() if k != "repetition_penalty"}))
    assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(ours, plain))


@pytest.mark.parametrize("side", ["mlxbun", "adapter"])
def test_prefill_chunking_matches_mlx_lm(loaded, side):
    ours, theirs = _run_both(loaded, "qwen3", side, prefill_step_size=4, repetition_penalty=1.2)
    _assert_same_stream(ours, theirs)


# ----------------------------------------------------------------------------- oracle: rotating


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("prefill_step_size", [2048, 5])
def test_max_kv_size_matches_mlx_lm_rotating(loaded, side, prefill_step_size):
    # qwen3's model file has no make_cache, so mlx-lm applies max_kv_size itself
    ours, theirs = _run_both(loaded, "qwen3", side, max_kv_size=10, prefill_step_size=prefill_step_size)
    _assert_same_stream(ours, theirs)
    unbounded = list(stream_generate(*loaded("qwen3", side), PROMPT, max_tokens=N))
    assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(ours, unbounded))


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "gpt_oss", "gemma4_text"])  # gpt_oss: attention sinks
def test_max_kv_size_is_honoured_where_mlx_lm_ignores_it(loaded, arch):  # over the ring too
    from mlx_lm.models import cache as mc

    omodel, otok = loaded(arch, "oracle")
    # mlx-lm: the model's own make_cache wins, max_kv_size is silently dropped
    oracle_caches = mc.make_prompt_cache(omodel, max_kv_size=8)
    assert any(type(c) is mc.KVCache for c in oracle_caches)
    ignored = _oracle(omodel, otok, PROMPT, max_tokens=N, max_kv_size=8)
    plain = _oracle(omodel, otok, PROMPT, max_tokens=N)
    _assert_same_stream(ignored, plain)

    # mlxbun: every full-attention layer gets a bounded ring (sliding layers keep their window)
    model, tok = loaded(arch, "mlxbun")
    cache = make_generation_cache(model, max_kv_size=8)
    natural = model.make_cache()
    for c, n in zip(cache, natural):
        assert isinstance(c, RotatingKVCache)
        assert c.max_size == (8 if isinstance(n, KVCache) else n.max_size)
    ours = list(stream_generate(model, tok, PROMPT, max_tokens=N, prompt_cache=cache))
    n_prompt = ours[-1].prompt_tokens
    for c, n in zip(cache, natural):
        assert c.offset == n_prompt + N
        if isinstance(n, KVCache):
            assert c.keys.shape[2] == 8  # bounded, after a prompt longer than 8
    assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(ours, plain))

    # ... and it is exactly mlx-lm's graph over mlx-lm's rotating caches of the same shape
    forced = [mc.RotatingKVCache(max_size=8, keep=4) if type(c) is mc.KVCache
              else mc.RotatingKVCache(max_size=c.max_size, keep=c.keep)
              for c in mc.make_prompt_cache(omodel)]
    theirs = _oracle(omodel, otok, PROMPT, max_tokens=N, prompt_cache=forced)
    _assert_same_stream(ours, theirs)


# ----------------------------------------------------------------------------- oracle: quantized KV


QUANTIZED = [
    dict(kv_bits=4, kv_group_size=32, quantized_kv_start=0),
    dict(kv_bits=8, kv_group_size=32, quantized_kv_start=0),
    dict(kv_bits=4, kv_group_size=32, quantized_kv_start=46),  # quantizes mid-decode
    dict(kv_bits=8, kv_group_size=32, quantized_kv_start=46, temperature=0.8, top_p=0.9, seed=2),
]


@pytest.mark.parametrize("side", SIDES)
@pytest.mark.parametrize("options", QUANTIZED, ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_quantized_kv_matches_mlx_lm(loaded, wide_qwen3, side, options):
    ours, theirs = _run_both(loaded, wide_qwen3, side, **options)
    _assert_same_stream(ours, theirs)
    plain = list(stream_generate(*loaded(wide_qwen3, side), PROMPT, max_tokens=N,
                                 **{k: v for k, v in options.items() if not k.startswith(("kv_", "quant"))}))
    assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(ours, plain))


@pytest.fixture(scope="module")
def wide_qwen3_moe(zoo_root):
    """The zoo's qwen3_moe with head_dim 32 (quantizable KV at group 32)."""
    from mlxbun.zoo import cached_checkpoint

    return cached_checkpoint("qwen3_moe", head_dim=32, root=zoo_root)


@pytest.mark.parametrize("options", QUANTIZED[:3], ids=lambda o: "-".join(f"{k}{v}" for k, v in o.items()))
def test_quantized_kv_matches_mlx_lm_on_moe(loaded, wide_qwen3_moe, options):
    """Routed experts over a quantized KV cache: the same stream as mlx-lm's."""
    ours, theirs = _run_both(loaded, wide_qwen3_moe, "mlxbun", prompt=LONG_PROMPT, **options)
    _assert_same_stream(ours, theirs)


def test_turboquant_and_mixed_kv_run_on_moe(loaded, wide_qwen3_moe):
    """TurboQuant and a per-layer plan convert an MoE model's caches, and change what it computes."""
    from mlxbun.cache.quantized import QuantizedKVCache
    from mlxbun.cache.turboquant import TurboQuantKVCache

    model, tok = loaded(wide_qwen3_moe, "mlxbun")
    plain = list(stream_generate(model, tok, LONG_PROMPT, max_tokens=N))
    for kv, kind in ((dict(kv_bits=3.5, kv_scheme="turboquant"), TurboQuantKVCache),
                     (dict(kv_config=[{"layer_idx": 1, "bits": 4, "group_size": 32}]), QuantizedKVCache)):
        cache = make_generation_cache(model, **kv)
        out = list(stream_generate(model, tok, LONG_PROMPT, max_tokens=N, prompt_cache=cache, **kv))
        assert len(out) == N and isinstance(cache[-1 if kind is QuantizedKVCache else 0], kind), kv
        assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(out, plain)), kv


def test_quantized_kv_converts_caches_at_the_start_offset(loaded, wide_qwen3):
    from mlxbun.cache import quantized
    model, tok = loaded(wide_qwen3, "mlxbun")
    cache = make_generation_cache(model, kv_bits=4, kv_group_size=32)
    seen = []
    for r in stream_generate(model, tok, PROMPT, max_tokens=N, prompt_cache=cache, kv_bits=4,
                             kv_group_size=32, quantized_kv_start=46):
        seen.append(all(isinstance(c, quantized.QuantizedKVCache) for c in cache))
    n_prompt = r.prompt_tokens
    assert n_prompt < 46 < n_prompt + N
    # the cache is one token ahead of the yielded stream (mlx-lm's pipelining)
    assert seen == [n_prompt + i + 1 >= 46 for i in range(N)]
    assert all(c.bits == 4 and c.group_size == 32 for c in cache)


def test_zoo_head_dim_refuses_kv_quantization_clearly(loaded):
    model, tok = loaded("qwen3", "mlxbun")  # head_dim 16: no mx.quantize group divides it
    with pytest.raises(MlxbunError, match="kv_group_size"):
        list(stream_generate(model, tok, PROMPT, max_tokens=2, kv_bits=4, kv_group_size=32))


# ----------------------------------------------------------------------------- TurboQuant


@pytest.mark.parametrize("side", SIDES)
def test_turboquant_converts_full_attention_caches(loaded, monkeypatch, side):
    from mlxbun.cache.turboquant import TurboQuantKVCache
    from mlxbun.models import base

    decode_calls = []
    original = TurboQuantKVCache.decode_attention

    def counting(self, *args, **kwargs):
        decode_calls.append(self.offset)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(TurboQuantKVCache, "decode_attention", counting)
    model, tok = loaded("qwen3", side)
    cache = make_generation_cache(model, kv_bits=3.5, kv_scheme="turboquant")
    out = list(stream_generate(model, tok, PROMPT, max_tokens=N, prompt_cache=cache,
                               kv_bits=3.5, kv_scheme="turboquant"))
    assert len(out) == N
    # single-query attention ran from the packed codes (mlx-vlm's decode path) in both layers at
    # every step: the prompt's last token, then N tokens fed (the last one computed ahead, as in
    # mlx-lm); and the attention routing is undone once the stream ends
    assert len(decode_calls) == 2 * (N + 1)
    assert not hasattr(base.scaled_dot_product_attention, "_turboquant_original")
    assert all(isinstance(c, TurboQuantKVCache) for c in cache)  # 2 layers: mlx-vlm keeps none
    assert all((c.key_bits, c.value_bits) == (3, 4) for c in cache)
    assert all(c.offset == out[-1].prompt_tokens + N for c in cache)
    plain_cache = make_generation_cache(model)
    plain = list(stream_generate(model, tok, PROMPT, max_tokens=N, prompt_cache=plain_cache))
    assert sum(c.nbytes for c in cache) < sum(c.nbytes for c in plain_cache) / 3
    # lossy: the first step already sees a quantized prompt
    assert not mx.array_equal(out[0].logprobs, plain[0].logprobs).item()


def test_turboquant_start_beyond_the_run_is_plain(loaded):
    model, tok = loaded("qwen3", "mlxbun")
    tq = list(stream_generate(model, tok, PROMPT, max_tokens=N, kv_bits=3.5, kv_scheme="turboquant",
                              quantized_kv_start=10_000))
    plain = list(stream_generate(model, tok, PROMPT, max_tokens=N))
    _assert_same_stream(tq, plain)


def test_turboquant_keeps_the_last_layer_full_precision_beyond_two_layers(loaded):
    from mlxbun.cache.turboquant import TurboQuantKVCache

    model, tok = loaded("smollm3", "mlxbun")  # 4 layers
    cache = make_generation_cache(model, kv_bits=4, kv_scheme="turboquant")
    list(stream_generate(model, tok, PROMPT, max_tokens=3, prompt_cache=cache, kv_bits=4,
                         kv_scheme="turboquant"))
    assert [type(c) for c in cache] == [TurboQuantKVCache] * 3 + [KVCache]


# ----------------------------------------------------------------------------- prompts, EOS, stop


@pytest.mark.parametrize("side", ["mlxbun", "module"])
def test_text_and_id_prompts_give_the_same_tokens(loaded, side):
    model, tok = loaded("qwen3", side)
    ids = tok.encode_prompt(PROMPT)
    assert ids[0] == tok.bos_token_id  # the zoo tokenizer adds BOS
    by_text = list(stream_generate(model, tok, PROMPT, max_tokens=N))
    by_list = list(stream_generate(model, tok, ids, max_tokens=N))
    by_array = list(stream_generate(model, tok, mx.array(ids), max_tokens=N))
    by_2d = list(stream_generate(model, tok, mx.array([ids]), max_tokens=N))
    for other in (by_list, by_array, by_2d):
        _assert_same_stream(by_text, other)
    # a prompt that already starts with BOS does not get a second one
    with_bos = list(stream_generate(model, tok, tok.bos_token + PROMPT, max_tokens=N))
    _assert_same_stream(by_text, with_bos)


def test_eos_stops_generation_like_mlx_lm(loaded):
    from mlxbun.tokenizer import load_tokenizer

    model, tok = loaded("qwen3", "mlxbun")
    omodel, otok = loaded("qwen3", "oracle")
    greedy = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=N)]
    k = next(i for i in range(3, N) if greedy[i] not in greedy[:i])  # first occurrence
    eos_tok = load_tokenizer(tok.path)
    eos_tok.eos_token_ids = tuple(eos_tok.eos_token_ids) + (greedy[k],)
    ours = list(stream_generate(model, eos_tok, PROMPT, max_tokens=N))
    saved = otok.eos_token_ids
    otok.eos_token_ids = set(saved) | {greedy[k]}
    try:
        theirs = _oracle(omodel, otok, PROMPT, max_tokens=N)
    finally:
        otok.eos_token_ids = saved
    _assert_same_stream(ours, theirs)
    assert len(ours) == k + 1 and ours[-1].token == greedy[k]
    assert ours[-1].finish_reason == "stop" and ours[-1].generation_tokens == k + 1
    assert "".join(r.text for r in ours) == tok.decode(greedy[:k])  # EOS adds no text


def test_config_eos_ids_stop_too(loaded, monkeypatch):
    model, tok = loaded("qwen3", "mlxbun")
    greedy = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=N)]
    k = next(i for i in range(2, N) if greedy[i] not in greedy[:i])
    monkeypatch.setattr(model, "config", _Cfg(model.config, greedy[k]))
    out = list(stream_generate(model, tok, PROMPT, max_tokens=N))
    assert len(out) == k + 1 and out[-1].finish_reason == "stop"


class _Cfg:
    """A config whose eos_token_ids adds one id."""

    def __init__(self, config, extra):
        self._config = config
        self.eos_token_ids = tuple(config.eos_token_ids) + (extra,)

    def __getattr__(self, name):
        return getattr(self._config, name)


def _greedy_text(loaded, n=20):
    model, tok = loaded("qwen3", "mlxbun")
    out = list(stream_generate(model, tok, PROMPT, max_tokens=n))
    return model, tok, "".join(r.text for r in out), out


def test_stop_string_ends_text_before_it(loaded):
    model, tok, full, greedy = _greedy_text(loaded)
    stop = full[7:10]
    assert len(stop) == 3 and full.index(stop) == 7
    out = list(stream_generate(model, tok, PROMPT, max_tokens=20, stop=[stop]))
    text = "".join(r.text for r in out)
    assert text == full[:7]
    assert out[-1].finish_reason == "stop"
    assert all(r.finish_reason is None for r in out[:-1])
    # it stopped at the token that completed the stop string, not later
    ids = [r.token for r in greedy]
    done = next(i for i in range(len(ids)) if stop in tok.decode(ids[: i + 1]))
    assert [r.token for r in out] == ids[: done + 1]
    # several stop strings: the earliest in the text wins; one that never appears changes nothing
    out2 = list(stream_generate(model, tok, PROMPT, max_tokens=20, stop=["\x00never", full[12:15], stop]))
    assert "".join(r.text for r in out2) == full[:7]
    out3 = list(stream_generate(model, tok, PROMPT, max_tokens=20, stop="\x00never"))
    assert "".join(r.text for r in out3) == full and out3[-1].finish_reason == "length"


def test_stop_text_never_streams_part_of_a_stop_string():
    cut = StopText(["END!"])
    pieces = ["ab", "cE", "N", "D", "x", "E", "ND", "!zz"]
    out = []
    for p in pieces:
        out.append(cut.add(p))
        if cut.stopped:
            break
    assert "".join(out) == "abcENDx"
    assert out[:4] == ["ab", "c", "", ""]  # "E", "EN", "END" held back while they could start END!
    assert cut.stopped
    # without a match, everything held back comes out at the end
    cut = StopText(["END!"])
    assert cut.add("xEN") == "x"
    assert cut.add("", final=True) == "EN" and not cut.stopped


def test_generate_returns_text_and_verbose_prints_speeds(loaded, capsys):
    model, tok = loaded("qwen3", "mlxbun")
    stream = "".join(r.text for r in stream_generate(model, tok, PROMPT, max_tokens=N))
    assert generate(model, tok, PROMPT, max_tokens=N) == stream
    capsys.readouterr()
    assert generate(model, tok, PROMPT, max_tokens=N, verbose=True) == stream
    out = capsys.readouterr().out
    assert stream in out
    assert "Prompt: " in out and "tokens-per-sec" in out and "Peak memory:" in out


def test_response_fields(loaded):
    model, tok = loaded("qwen3", "mlxbun")
    out = list(stream_generate(model, tok, PROMPT, max_tokens=4))
    n_prompt = len(tok.encode_prompt(PROMPT))
    assert [r.generation_tokens for r in out] == [1, 2, 3, 4]
    for r in out:
        assert r.prompt_tokens == n_prompt
        assert r.prompt_tps > 0 and r.generation_tps > 0 and r.peak_memory > 0
        assert r.logprobs.shape == (model.config.vocab_size,)
        assert abs(mx.logsumexp(r.logprobs).item()) < 1e-4  # normalized
        assert r.token == mx.argmax(r.logprobs).item()  # greedy


def test_user_logits_processors_run(loaded):
    model, tok = loaded("qwen3", "mlxbun")
    banned = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=1)][0]
    calls = []

    def ban(tokens, logits):
        calls.append(len(tokens))
        logits[:, banned] = -float("inf")
        return logits

    out = list(stream_generate(model, tok, PROMPT, max_tokens=4, logits_processors=[ban]))
    assert banned not in [r.token for r in out]
    n_prompt = out[-1].prompt_tokens
    # the processors see the prompt, then one more token per step (mlx-lm's bookkeeping)
    assert calls[:4] == [n_prompt, n_prompt + 1, n_prompt + 2, n_prompt + 3]


# ----------------------------------------------------------------------------- option errors


@pytest.mark.parametrize("options, match", [
    (dict(max_tokens=-1), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(temperature=-0.1), "temperature"),
    (dict(top_k=-1), "top_k"),
    (dict(min_p=2.0), "min_p"),
    (dict(kv_bits=7), "kv_bits"),
    (dict(kv_bits=3.5), "turboquant"),
    (dict(kv_bits=4, kv_group_size=16), "kv_group_size"),
    (dict(kv_bits=11, kv_scheme="turboquant"), "TurboQuant"),
    (dict(kv_scheme="nf4"), "kv_scheme"),
    (dict(kv_scheme="turboquant"), "needs kv_bits"),
    (dict(kv_bits=4, max_kv_size=16), "max_kv_size"),
    (dict(max_kv_size=0), "max_kv_size"),
    (dict(quantized_kv_start=-1), "quantized_kv_start"),
    (dict(stop=[""]), "stop"),
    (dict(seed=-3), "seed"),
    (dict(temperature=0.5, temp=0.7), "temp"),
    (dict(prompt_cache="/nonexistent/cache.safetensors"), "prompt cache"),
    (dict(prefill_step_size=0), "prefill_step_size"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
])
def test_bad_options_raise_mlxbun_errors_before_any_work(loaded, options, match):
    model, tok = loaded("qwen3", "mlxbun")
    with pytest.raises(MlxbunError, match=match):
        stream_generate(model, tok, PROMPT, **options)  # raised eagerly, not at first next()


@pytest.mark.parametrize("prompt", [[], mx.array([], dtype=mx.int32), [[1, 2], [3, 4]], [1.5, 2.0],
                                    mx.array([1.0, 2.0])])
def test_bad_prompts(loaded, prompt):
    model, tok = loaded("qwen3", "mlxbun")
    with pytest.raises(GenerationError):
        stream_generate(model, tok, prompt)


def test_vocab_size_of_reads_every_config_form_and_falls_back_to_the_logits():
    from types import SimpleNamespace

    from mlxbun.generate import check_token_ids, vocab_size_of

    class Logits:  # no config: the width of its logits for one token
        config = None

        def __call__(self, ids):
            return mx.zeros((1, ids.shape[1], 40))

    assert vocab_size_of(SimpleNamespace(config=SimpleNamespace(vocab_size=7))) == 7  # TextConfig
    assert vocab_size_of(SimpleNamespace(config={"vocab_size": 9})) == 9  # a raw config.json dict
    assert vocab_size_of(SimpleNamespace(config={"text_config": {"vocab_size": 11}})) == 11  # a VLM wrapper's
    assert vocab_size_of(SimpleNamespace(config=SimpleNamespace(text_config=SimpleNamespace(vocab_size=13)))) == 13
    assert vocab_size_of(Logits()) == 40
    check_token_ids([0, 39], 40)
    check_token_ids(mx.array([[0, 39]]), 40)
    with pytest.raises(GenerationError, match=r"ids: token 40 at position 1 is outside the model's vocabulary "
                                              r"\(valid ids: 0\.\.39\)"):
        check_token_ids(mx.array([[0, 40]]), 40, "ids")
    with pytest.raises(GenerationError, match=r"prompt: token -1 at position 0 is not a token id"):
        check_token_ids([-1], None)


def test_top_k_not_below_vocab_is_an_mlxbun_error(loaded):
    model, tok = loaded("qwen3", "mlxbun")
    with pytest.raises(MlxbunError, match="vocabulary size 512"):
        list(stream_generate(model, tok, PROMPT, max_tokens=2, temperature=0.5, top_k=512))


def test_temp_alias(loaded):
    model, tok = loaded("qwen3", "mlxbun")
    a = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=6, temp=0.9, seed=1)]
    b = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=6, temperature=0.9, seed=1)]
    assert a == b


# ----------------------------------------------------------------------------- samplers


def _log_softmax(x):
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("options", [
    dict(temp=0.0),
    dict(temp=0.7),
    dict(temp=0.7, top_p=0.5),
    dict(temp=0.7, min_p=0.2),
    dict(temp=0.7, min_p=0.2, min_tokens_to_keep=5),
    dict(temp=0.7, top_k=7),
    dict(temp=1.3, top_p=0.8, min_p=0.05, top_k=40),
    dict(temp=0.9, xtc_probability=0.5, xtc_threshold=0.05, xtc_special_tokens=[0, 1]),
], ids=str)
def test_sampler_draws_mlx_lm_tokens(options):
    from mlx_lm.sample_utils import make_sampler as mlx_make_sampler

    from mlxbun.sampling import make_sampler

    mx.random.seed(0)
    logprobs = _log_softmax(3 * mx.random.normal((1, 300)))
    ours_s, theirs_s = make_sampler(**options), mlx_make_sampler(**{"top_p": 0.0, **options})
    mx.random.seed(42)
    ours = [ours_s(logprobs).item() for _ in range(40)]
    mx.random.seed(42)
    theirs = [theirs_s(logprobs).item() for _ in range(40)]
    assert ours == theirs
    if options["temp"] > 0:
        assert len(set(ours)) > 1


def test_filters_are_bit_exact():
    from mlx_lm import sample_utils as su

    from mlxbun import sampling

    mx.random.seed(1)
    logprobs = _log_softmax(2 * mx.random.normal((1, 257)))
    pairs = [
        (sampling.apply_top_p(logprobs, 0.7), su.apply_top_p(logprobs, 0.7)),
        (sampling.apply_min_p(logprobs, 0.1, 4), su.apply_min_p(logprobs, 0.1, 4)),
        (sampling.apply_top_k(logprobs, 9), su.apply_top_k(logprobs, 9)),
    ]
    for ours, theirs in pairs:
        assert mx.array_equal(ours, theirs).item()
        assert 0 < mx.isfinite(ours).sum().item() < 257


def test_logits_processors_match_mlx_lm():
    from mlx_lm.sample_utils import make_logits_processors as mlx_make

    from mlxbun.sampling import make_logits_processors

    opts = dict(logit_bias={3: 2.0, 9: -1.5}, repetition_penalty=1.4, repetition_context_size=5,
                presence_penalty=0.3, frequency_penalty=0.2)
    ours, theirs = make_logits_processors(**opts), mlx_make(**opts)
    assert len(ours) == len(theirs) == 4
    tokens = mx.array([3, 5, 5, 7, 9, 11, 5])
    mx.random.seed(2)
    logits = mx.random.normal((1, 32))
    a, b = logits, logits
    for p, q in zip(ours, theirs):
        a, b = p(tokens, mx.array(a)), q(tokens, mx.array(b))
        assert mx.array_equal(a, b).item()
    assert not mx.array_equal(a, logits).item()
    assert make_logits_processors() == [] and make_logits_processors(repetition_penalty=0) == []


@pytest.mark.parametrize("options", [dict(top_p=0), dict(top_p=1.01), dict(temp=float("nan")),
                                     dict(min_tokens_to_keep=0), dict(top_k=2.5),
                                     dict(xtc_threshold=0.9)])
def test_sampler_option_errors(options):
    from mlxbun.sampling import make_sampler

    with pytest.raises(GenerationError):
        make_sampler(**{"temp": 0.5, **options})


# ----------------------------------------------------------------------------- caches in, caches out


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss", "qwen3_moe", "gemma4_text"])  # gpt_oss: sliding rings and full
# caches; gemma4_text: a cache list without its KV-shared layers
def test_prompt_cache_list_continues_like_mlx_lm(loaded, arch):
    """A prefix in a cache list, then the rest as the prompt: mlx-lm's multi-turn use."""
    from mlx_lm.models import cache as mc

    model, tok = loaded(arch, "mlxbun")
    omodel, otok = loaded(arch, "oracle")
    ids = tok.encode_prompt(PROMPT)
    head, tail = ids[:9], ids[9:]

    cache = make_generation_cache(model)
    first = list(stream_generate(model, tok, head, max_tokens=3, prompt_cache=cache))
    ocache = mc.make_prompt_cache(omodel)
    ofirst = _oracle(omodel, otok, head, max_tokens=3, prompt_cache=ocache)
    _assert_same_stream(first, ofirst)
    assert cache[0].offset == ocache[0].offset == len(head) + 3

    ours = list(stream_generate(model, tok, tail, max_tokens=N, prompt_cache=cache))
    theirs = _oracle(omodel, otok, tail, max_tokens=N, prompt_cache=ocache)
    _assert_same_stream(ours, theirs)


@pytest.mark.parametrize("arch", ["qwen3", "gpt_oss", "qwen3_moe", "gemma4_text"])
def test_saved_prompt_cache_round_trip(loaded, tmp_path, arch):
    from mlxbun.cache import prompt_cache as pc
    from mlxbun.generation_caches import model_identity_of

    model, tok = loaded(arch, "mlxbun")
    ids = tok.encode_prompt(PROMPT)
    head, tail = ids[:9], ids[9:]
    file = tmp_path / "c.safetensors"

    live = make_generation_cache(model)
    list(stream_generate(model, tok, head, max_tokens=2, prompt_cache=live))
    pc.save_prompt_cache(file, live, model_identity=model_identity_of(model))
    continued_live = list(stream_generate(model, tok, tail, max_tokens=N, prompt_cache=live))
    from_file = list(stream_generate(model, tok, tail, max_tokens=N, prompt_cache=str(file)))
    _assert_same_stream(from_file, continued_live)

    other, _ = loaded("llama", "mlxbun")  # a cache made by another model is refused
    with pytest.raises(MlxbunError, match="another model"):
        stream_generate(other, tok, tail, prompt_cache=file)


class _NotQuantizable:
    """Mixin for an mlx-lm cache that mlx-lm's `maybe_quantize_kv_cache` must skip."""

    @property
    def to_quantized(self):
        raise AttributeError("to_quantized")


@pytest.mark.parametrize("start", [0, 46])
def test_kv_plan_matches_mlx_lm_per_layer(loaded, wide_qwen3, tmp_path, start):
    """A per-layer plan quantizes exactly the layers it names, at mlx-lm's points: the oracle is
    mlx-lm with the other layers' caches made unquantizable."""
    from mlx_lm.models import cache as mc

    from mlxbun.cache.mixed import KVPlan
    from mlxbun.cache.quantized import QuantizedKVCache

    class FixedKVCache(_NotQuantizable, mc.KVCache):
        pass

    model, tok = loaded(wide_qwen3, "mlxbun")
    omodel, otok = loaded(wide_qwen3, "oracle")
    plan = KVPlan.from_args(bits=4, group_size=32, layers=[1], num_layers=2)
    cache = make_generation_cache(model, kv_config=plan)
    ours = list(stream_generate(model, tok, PROMPT, max_tokens=N, prompt_cache=cache, kv_config=plan,
                                quantized_kv_start=start))
    assert [type(c) for c in cache] == [KVCache, QuantizedKVCache]
    theirs = _oracle(omodel, otok, PROMPT, max_tokens=N, prompt_cache=[FixedKVCache(), mc.KVCache()],
                     kv_bits=4, kv_group_size=32, quantized_kv_start=start)
    _assert_same_stream(ours, theirs)

    # every layer at one setting is kv_bits itself; the file form (optiq's) is the same plan
    everything = list(stream_generate(model, tok, PROMPT, max_tokens=N, quantized_kv_start=start,
                                      kv_config=KVPlan.from_args(bits=4, group_size=32, num_layers=2)))
    uniform = list(stream_generate(model, tok, PROMPT, max_tokens=N, kv_bits=4, kv_group_size=32,
                                   quantized_kv_start=start))
    _assert_same_stream(everything, uniform)
    assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(ours, uniform))
    file = tmp_path / "kv_config.json"
    file.write_text(json.dumps([{"layer_idx": 0, "bits": 0}, {"layer_idx": 1, "bits": 4, "group_size": 32}]))
    from_file = list(stream_generate(model, tok, PROMPT, max_tokens=N, kv_config=str(file),
                                     quantized_kv_start=start))
    _assert_same_stream(from_file, ours)


def test_kv_plan_errors_are_eager(loaded, tmp_path):
    from mlxbun.cache.mixed import KVPlan

    model, tok = loaded("gemma3_text", "mlxbun")
    sliding = KVPlan.from_args(bits=4, group_size=32, layers=[0], num_layers=4)
    with pytest.raises(MlxbunError, match="sliding-window"):
        stream_generate(model, tok, PROMPT, kv_config=sliding)
    with pytest.raises(MlxbunError, match="does not exist"):
        stream_generate(model, tok, PROMPT, kv_config=[{"layer_idx": 9, "bits": 4}])
    with pytest.raises(MlxbunError, match="no such file"):
        stream_generate(model, tok, PROMPT, kv_config=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{nope")
    with pytest.raises(MlxbunError, match="JSON"):
        stream_generate(model, tok, PROMPT, kv_config=tmp_path / "bad.json")
    with pytest.raises(MlxbunError, match="kv_config"):
        stream_generate(model, tok, PROMPT, kv_config=[{"layer_idx": 2, "bits": 4}], kv_bits=4)


def test_mlx_lm_caches_are_replaced_by_mlxbun_caches(loaded):
    model, _ = loaded("gemma3_text", "adapter")
    caches = make_generation_cache(model)
    assert [type(c) for c in caches] == [RotatingKVCache, RotatingKVCache, KVCache, RotatingKVCache]
    assert [getattr(c, "max_size", None) for c in caches] == [16, 16, None, 16]
    assert all(type(c).__module__ == "mlxbun.cache.kv" for c in caches)
