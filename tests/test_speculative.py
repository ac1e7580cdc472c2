"""Speculative decoding (mlxbun.speculative): greedy output equals plain greedy output token for token,
for every drafter, k = 1..6, on plain, rotating and quantized KV caches, on zoo checkpoints of
several archs; plus the drafters, statistics, adaptive length and option checks.

Quantized KV: mx.quantize takes group sizes 32, 64 and 128 only (mlxbun.cache.quantized
KV_QUANT_GROUP_SIZES) and the zoo's head_dim is 16, so those cases run on the zoo llama recipe
widened to head_dim 32 (`zoo:llama,head_dim=32`) with group size 32.
"""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxbun.cache.kv import RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.generate import stream_generate
from mlxbun.sampling import GenerationError
from mlxbun.speculative import (
    AdaptiveDraftLength,
    Draft,
    DraftModelDrafter,
    DraftSession,
    LayerSkipDrafter,
    NGramDrafter,
    SpecStats,
    VocabularyMismatchError,
    speculative_generate,
    speculative_text,
)
from mlxbun.speculative.drafters import model_blocks, skipping

# repeated spans, so the n-gram drafter finds matches; 79 tokens: crosses the zoo's 16-token
# sliding window and a 24-token max_kv_size ring
PROMPT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy cat. "
          "Once upon a time the quick brown")
SHORT = "Once upon a time"
N = 16
KS = range(1, 7)


@pytest.fixture(scope="session")
def models(zoo, zoo_root):
    """`models(name)` -> (RuntimeModel, tokenizer), loaded once. Names: an arch ("llama"),
    "arch@q8" / "arch@seed1" (draft variants), "wide" / "wide@seed1" (llama with head_dim 32),
    "arch!mlx-lm" (the mlx-lm model through the adapter)."""
    from mlxbun.factory import open_model
    from mlxbun.locate import locate
    from mlxbun.models.mlxlm import load_mlxlm
    from mlxbun.tokenizer import load_tokenizer

    memo = {}

    def get(name):
        if name not in memo:
            base, _, engine = name.partition("!")
            arch, _, var = base.partition("@")
            opts = {"q8": dict(quant=8), "seed1": dict(seed=1), "": {}}[var]
            if arch == "wide":
                path = locate(f"zoo:llama,head_dim=32,seed={opts.get('seed', 0)}", zoo_root=zoo_root)
            else:
                path = zoo(arch, **opts)
            model = load_mlxlm(path) if engine == "mlx-lm" else open_model(path)
            memo[name] = (model, load_tokenizer(path))
        return memo[name]

    return get


def _plain(model, tok, prompt, **kw):
    return [r.token for r in stream_generate(model, tok, prompt, max_tokens=N, **kw)]


def _drafters(models, arch, target):
    """Every drafter kind for this target (fresh instances per run)."""
    blocks = len(model_blocks(target))
    out = {
        "ngram": lambda: NGramDrafter(),
        "self:1": lambda: LayerSkipDrafter(1),
        f"self:{blocks}": lambda: LayerSkipDrafter(blocks),
    }
    if arch is not None:
        out["model@seed1"] = lambda: DraftModelDrafter(models(f"{arch}@seed1")[0])
        if not arch.startswith("wide"):
            out["model@q8"] = lambda: DraftModelDrafter(models(f"{arch}@q8")[0])
    return out


LOGPROB_TOL = 1e-4  # a batched verify forward rounds differently (~2e-6 here); a KV mix-up is ~1e-1


def _mismatches(models, target_name, arch, prompts=(PROMPT,), **kw):
    """Run every drafter x k against plain greedy; return the failures as readable strings.
    Besides the tokens, each token's log-probabilities must agree with plain decoding's to
    LOGPROB_TOL (catches a cache computed differently that happens not to flip an argmax)."""
    target, tok = models(target_name)
    blocks = len(model_blocks(target))
    bad = []
    for prompt in prompts:
        plain = list(stream_generate(target, tok, prompt, max_tokens=N, **kw))
        plain_ids = [r.token for r in plain]
        for name, make in _drafters(models, arch, target).items():
            for k in KS:
                spec = list(speculative_generate(target, tok, prompt, drafter=make(), num_draft=k, max_tokens=N, **kw))
                ids, stats = [r.token for r in spec], spec[-1].stats
                where = f"{name} k={k} prompt={prompt[:12]!r}"
                if ids != plain_ids:
                    first = next(i for i, (a, b) in enumerate(zip(ids + [None] * N, plain_ids)) if a != b)
                    bad.append(f"{where}: first difference at token {first}")
                else:
                    diff = max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain))
                    if diff > LOGPROB_TOL:
                        bad.append(f"{where}: same tokens, logprobs differ by {diff:.3g}")
                if name == f"self:{blocks}" and stats.draft_acceptance_rate != 1.0:
                    bad.append(f"{where}: the full-depth self-draft is the target, yet acceptance "
                               f"{stats.draft_acceptance_rate}")
                assert stats.generated_tokens == N and stats.rounds > 0
    return bad


# ----------------------------------------------------------------------------- greedy equality


@pytest.mark.parametrize("arch", ["llama", "qwen3", "phi3", "gemma3_text", "qwen3_moe", "mixtral",
                                  "gpt_oss", "gemma3n", "gemma4_text", "gemma4"])
def test_greedy_equals_plain_on_plain_and_sliding_caches(models, arch):
    # gemma3_text: sliding-window layers hold RotatingKVCache(16) and the prompt crosses it;
    # gemma3n: its last two layers read layers 2 and 1's caches (the rollback trims only owners)
    assert _mismatches(models, arch, arch) == []


@pytest.mark.parametrize("arch,prompts", [("llama", (PROMPT, SHORT)), ("gemma3_text", (SHORT,)),
                                          ("gemma3n", (PROMPT,))])  # gemma3n ends SHORT at EOS
def test_greedy_equals_plain_on_rotating_max_kv_size(models, arch, prompts):
    # max_kv_size: every full-attention layer is a RotatingKVCache(24, keep=4) ring (attention
    # sinks); the long prompt starts past it, the short one crosses it while generating
    assert _mismatches(models, arch, arch, prompts=prompts, max_kv_size=24) == []


PLAN = {"layers": [{"layer_idx": 1, "bits": 4, "group_size": 32}]}  # optiq kv_config: layer 1 at 4 bits


@pytest.mark.parametrize("kv", [dict(kv_bits=4), dict(kv_bits=8), dict(kv_bits=4, quantized_kv_start=87),
                                dict(kv_config=PLAN, quantized_kv_start=87)],
                         ids=["4bit", "8bit", "4bit-start87", "plan-start87"])
def test_greedy_equals_plain_on_quantized_kv(models, kv):
    # start 87: the quantize hook converts mid-generation (prompt 79 tokens); rounds stop there
    kv = {"kv_group_size": 32, **kv} if "kv_bits" in kv else kv
    assert _mismatches(models, "wide", "wide", **kv) == []


def test_greedy_equals_plain_under_the_checkpoint_kv_plan(zoo_root, tmp_path):
    """A checkpoint's own kv_config.json applies by default on both sides ("none" on neither)."""
    import json
    import shutil

    from mlxbun.factory import open_model
    from mlxbun.locate import locate
    from mlxbun.tokenizer import load_tokenizer

    ck = tmp_path / "ck"
    shutil.copytree(locate("zoo:llama,head_dim=32", zoo_root=zoo_root), ck)
    (ck / "kv_config.json").write_text(json.dumps(PLAN["layers"]))
    target, tok = open_model(ck), load_tokenizer(ck)
    for kv in ({}, {"kv_config": "none"}):
        plain = list(stream_generate(target, tok, PROMPT, max_tokens=N, **kv))
        for make in (NGramDrafter, lambda: LayerSkipDrafter(1)):
            spec = list(speculative_generate(target, tok, PROMPT, drafter=make(), num_draft=3, max_tokens=N, **kv))
            assert [r.token for r in spec] == [r.token for r in plain]
            assert max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain)) <= LOGPROB_TOL
        if not kv:
            planned = plain
    assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(planned, plain))


def test_greedy_equals_plain_on_turboquant_kv(models):
    assert _mismatches(models, "llama", None, kv_bits=3.5, kv_scheme="turboquant") == []


def test_greedy_equals_plain_with_an_mlx_lm_target_and_draft(models):
    # any RuntimeModel: the mlx-lm graph through the adapter, drafted by an mlx-lm model
    target, tok = models("qwen3!mlx-lm")
    plain = _plain(target, tok, PROMPT)
    for make in (lambda: DraftModelDrafter(models("qwen3@q8")[0]), lambda: LayerSkipDrafter(1),
                 lambda: DraftModelDrafter(models("qwen3@seed1!mlx-lm")[0].module)):
        for k in (1, 4):
            assert speculative_text(target, tok, PROMPT, drafter=make(), num_draft=k, max_tokens=N)[1] == plain


def test_greedy_with_a_repetition_penalty_equals_plain(models):
    target, tok = models("llama")
    plain = _plain(target, tok, PROMPT, repetition_penalty=1.3, repetition_context_size=8)
    for make in (NGramDrafter, lambda: DraftModelDrafter(models("llama@q8")[0])):
        for k in (2, 5):
            ids = speculative_text(target, tok, PROMPT, drafter=make(), num_draft=k, max_tokens=N,
                                   repetition_penalty=1.3, repetition_context_size=8)[1]
            assert ids == plain


def test_adaptive_draft_length_keeps_greedy_exact(models):
    target, tok = models("llama")
    plain = _plain(target, tok, PROMPT)
    for make in (NGramDrafter, lambda: DraftModelDrafter(models("llama@seed1")[0])):
        _, ids, stats = speculative_text(target, tok, PROMPT, drafter=make(), num_draft=6, max_tokens=N, adaptive=True)
        assert ids == plain
        assert sum(stats.k_histogram.values()) == stats.rounds


def test_sampling_on_a_zoo_model(models):
    from mlxbun.speculative import Sampling

    target, tok = models("llama")
    opts = dict(temperature=0.8, top_p=0.95, top_k=40, min_p=0.02, max_tokens=N)
    sampling = Sampling(0.8, 0.95, 40, 0.02)
    # the full-depth self-draft proposes from p itself: every draft token is accepted
    _, ids, stats = speculative_text(target, tok, PROMPT, drafter=LayerSkipDrafter(2), num_draft=4, seed=3, **opts)
    assert stats.draft_acceptance_rate > 0.99
    assert speculative_text(target, tok, PROMPT, drafter=LayerSkipDrafter(2), num_draft=4, seed=3, **opts)[1] == ids
    assert speculative_text(target, tok, PROMPT, drafter=LayerSkipDrafter(2), num_draft=4, seed=4, **opts)[1] != ids
    for make in (NGramDrafter, lambda: LayerSkipDrafter(1), lambda: DraftModelDrafter(models("llama@q8")[0])):
        spec = list(speculative_generate(target, tok, PROMPT, drafter=make(), num_draft=3, seed=5, **opts))
        assert len(spec) == N
        for r in spec:  # every token lies in the support of the processed target distribution
            assert sampling.probs(r.logprobs[None])[0, r.token].item() > 0


# ----------------------------------------------------------------------------- responses


def test_responses_match_stream_generate(models):
    target, tok = models("llama")
    plain = list(stream_generate(target, tok, PROMPT, max_tokens=N))
    spec = list(speculative_generate(target, tok, PROMPT, drafter=DraftModelDrafter(models("llama@q8")[0]),
                                     num_draft=3, max_tokens=N))
    assert [r.token for r in spec] == [r.token for r in plain]
    assert "".join(r.text for r in spec) == "".join(r.text for r in plain)
    assert [r.finish_reason for r in spec] == [r.finish_reason for r in plain]
    assert [r.generation_tokens for r in spec] == list(range(1, N + 1))
    for a, b in zip(spec, plain):  # the same distributions, up to the batched forward's rounding
        assert mx.allclose(a.logprobs, b.logprobs, atol=1e-4).item()
    stats = spec[-1].stats
    assert all(r.stats is stats for r in spec)
    flags = [r.from_draft for r in spec]
    assert sum(flags) == stats.accepted_tokens > 0


def test_stop_string_and_eos(models):
    target, tok = models("llama")
    text = "".join(r.text for r in stream_generate(target, tok, PROMPT, max_tokens=N))
    stop = text[3:6]
    want = list(stream_generate(target, tok, PROMPT, max_tokens=N, stop=stop))
    got = list(speculative_generate(target, tok, PROMPT, drafter="ngram", num_draft=4, max_tokens=N, stop=stop))
    assert "".join(r.text for r in got) == "".join(r.text for r in want)
    assert got[-1].finish_reason == "stop" and len(got) == len(want)

    # a forced EOS: the plain stream's 5th token declared end-of-sequence
    plain = _plain(target, tok, PROMPT)

    class Tok:
        def __init__(self, inner, eos):
            self.inner, self.eos_token_ids = inner, {eos}

        def __getattr__(self, name):
            return getattr(self.inner, name)

    eos_tok = Tok(tok, plain[4])
    got = list(speculative_generate(target, eos_tok, PROMPT, drafter=LayerSkipDrafter(2), num_draft=3, max_tokens=N))
    assert [r.token for r in got] == plain[:5] and got[-1].finish_reason == "stop"


def test_option_errors(models):
    target, tok = models("llama")
    with pytest.raises(GenerationError, match="num_draft"):
        speculative_generate(target, tok, PROMPT, drafter="ngram", num_draft=0)
    with pytest.raises(GenerationError, match="unknown drafter"):
        speculative_generate(target, tok, PROMPT, drafter="medusa")
    with pytest.raises(GenerationError, match="kv_bits"):
        speculative_generate(target, tok, PROMPT, drafter="ngram", kv_bits=7)
    with pytest.raises(MlxbunError, match="layers=3 but the target has 2 blocks"):
        speculative_generate(target, tok, PROMPT, drafter=LayerSkipDrafter(3))
    with pytest.raises(MlxbunError, match="n-gram draft: min_n=3 is above max_n=2"):
        NGramDrafter(max_n=2, min_n=3)


def test_vocabulary_mismatch_refuses_naming_both_sizes(models):
    target, tok = models("llama")
    draft, _ = models("llama@seed1")

    class Narrow:
        """A draft model whose head scores 500 of the 512 tokens."""

        def make_cache(self):
            return draft.make_cache()

        def __call__(self, ids, cache=None):
            return draft(ids, cache=cache)[..., :500]

    with pytest.raises(VocabularyMismatchError, match="scores 500 tokens but the target scores 512"):
        speculative_generate(target, tok, PROMPT, drafter=DraftModelDrafter(Narrow(), label="narrow"))


def test_a_cache_without_the_spec_contract_refuses(models):
    from mlx_lm.models.cache import KVCache as MlxLmKVCache

    target, tok = models("llama")

    class Foreign:
        """A model whose caches are mlx-lm's, already holding a token (an empty one would be
        swapped for mlxbun's by make_generation_cache)."""

        def make_cache(self):
            caches = [MlxLmKVCache() for _ in target.layers]
            for c in caches:
                c.update_and_fetch(mx.zeros((1, 2, 1, 16)), mx.zeros((1, 2, 1, 16)))
            return caches

        def __call__(self, ids, cache=None):
            return target(ids)

    with pytest.raises(MlxbunError, match=r"cache 0 \(KVCache\) has no spec-round contract"):
        speculative_text(target, tok, PROMPT, drafter=DraftModelDrafter(Foreign()), max_tokens=4)


# ----------------------------------------------------------------------------- drafters


def test_ngram_drafter_longest_match_first_most_recent_occurrence():
    d = NGramDrafter(max_n=3, min_n=1)
    # suffix (1, 2, 3) occurred at 0 (-> 4 5 6) and at 6 (-> 7 8): the most recent wins
    ctx = [1, 2, 3, 4, 5, 6, 1, 2, 3, 7, 8, 9, 1, 2, 3]
    assert d.propose(ctx, 4) == [7, 8, 9, 1]
    assert d.propose(ctx, 1) == [7]
    # only a 1-gram matches: (5, 3) and (3, 5, 3) never occurred before; 3 last did at 14 (-> 5 3)
    assert d.propose(ctx + [5, 3], 2) == [5, 3]
    # no match at all
    assert d.propose([1, 2, 3, 4], 3) == []
    assert d.propose([1, 2, 1], 5) == [2, 1]  # the continuation stops at the end of the text
    assert d.propose([9, 9], 3) == [9]
    d2 = NGramDrafter(max_n=2, min_n=2)
    assert d2.propose([4, 1, 2, 7, 3, 2], 2) == []  # 1-grams are not tried
    assert d2.propose([4, 1, 2, 7, 1, 2], 2) == [7, 1]


def test_ngram_index_matches_a_brute_force_search():
    import random

    rng = random.Random(0)
    d = NGramDrafter(max_n=4)
    ctx = []
    for _ in range(300):
        ctx += [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
        got = d.propose(ctx, 3)
        want = []
        for n in range(4, 0, -1):
            starts = [s for s in range(len(ctx) - n) if ctx[s:s + n] == ctx[-n:]]
            if len(ctx) > n and starts:
                s = starts[-1]
                want = ctx[s + n:s + n + 3]
                break
        assert got == want, ctx


def test_layer_skip_shares_weights_and_restores_the_blocks(models):
    target, tok = models("llama")
    blocks = model_blocks(target)
    classes = [type(b) for b in blocks]
    params = {k: id(v) for k, v in tree_flatten(target.parameters())}
    d = LayerSkipDrafter(1)
    d.bind(DraftSession(target=target, vocab_size=512))
    draft = d.propose(tok.encode_prompt(PROMPT), 3)
    assert len(draft) == 3 and draft.q is None
    assert len(d._cache) == 1  # a cache for the first layer only
    assert [type(b) for b in blocks] == classes
    assert {k: id(v) for k, v in tree_flatten(target.parameters())} == params
    # the full depth is the target itself, bit for bit; one layer is not
    ids = mx.array([tok.encode_prompt(PROMPT)])
    full = LayerSkipDrafter(2)
    full.bind(DraftSession(target=target, vocab_size=512))
    full._cache = full._new_cache()
    assert mx.array_equal(full._logits(ids), target(ids)).item()
    d._cache = d._new_cache()
    assert not mx.allclose(d._logits(ids), target(ids)).item()
    # an exception inside the skip still restores the classes
    with pytest.raises(ZeroDivisionError):
        with skipping(blocks[1:]):
            assert type(blocks[1]) is not classes[1]
            1 / 0
    assert [type(b) for b in blocks] == classes


def test_draft_model_cache_rolls_back_through_the_contract(models):
    target, tok = models("gemma3_text")
    draft, _ = models("gemma3_text@q8")
    d = DraftModelDrafter(draft)
    d.bind(DraftSession(target=target, vocab_size=512))
    ctx = tok.encode_prompt(PROMPT)
    first = d.propose(ctx, 4)
    assert any(isinstance(c, RotatingKVCache) for c in d._cache)
    d.observe(first[:1], 1)
    assert all(c.offset == len(ctx) + 1 for c in d._cache)  # context + the accepted draft token
    # the next round sees the accepted token and the target's correction
    nxt = d.propose(ctx + [first[0], 7], 2)
    d.observe([], 0)
    assert len(nxt) == 2 and all(c.offset == len(ctx) + 2 for c in d._cache)
    with pytest.raises(MlxbunError, match="did not grow"):
        d.propose(ctx + [first[0], 7], 2)


def test_drafter_prefill_then_propose_equals_propose_alone(models):
    """The engine runs a model drafter's prompt pass inside its prefill (so it counts as prompt
    processing, as mlx-lm counts its draft model's): the draft it then proposes is the draft a
    drafter that did that pass inside its first `propose` proposes, token for token."""
    target, tok = models("llama")
    ctx = tok.encode_prompt(PROMPT)
    alone, split = LayerSkipDrafter(1), LayerSkipDrafter(1)
    for d in (alone, split):
        d.bind(DraftSession(target=target, vocab_size=512))
    split.prefill(ctx)
    assert split._cache[0].offset == len(ctx) - 1  # all but the last prompt token
    split.prefill(ctx)  # once only
    assert split._cache[0].offset == len(ctx) - 1
    assert list(split.propose(ctx, 3)) == list(alone.propose(ctx, 3))
    with pytest.raises(MlxbunError, match="bind"):
        LayerSkipDrafter(1).prefill(ctx)


def test_drafter_protocol_misuse():
    d = DraftModelDrafter(lambda ids, cache=None: mx.zeros((1, 1, 4)))
    with pytest.raises(MlxbunError, match="bind"):
        d.propose([1, 2], 2)
    assert Draft([1, 2], None) == [1, 2] and Draft().q is None


# ----------------------------------------------------------------------------- statistics


def test_stats_formulas_aggregation_and_rows(tmp_path):
    s = SpecStats()
    s.add_round(4, 4, 4, 0.01, 0.02)  # all accepted
    s.add_round(4, 4, 1, 0.01, 0.02)
    s.add_round(4, 0, 0, 0.0, 0.01)  # nothing drafted (n-gram miss): not a draft
    s.add_round(2, 2, 0, 0.01, 0.02)
    s.generated_tokens, s.wall_s, s.plain_tokens_per_s = 12, 0.5, 20.0
    assert (s.rounds, s.drafts, s.draft_tokens, s.accepted_tokens) == (4, 3, 10, 5)
    assert s.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert s.draft_acceptance_rate == pytest.approx(0.5)
    assert s.acceptance_per_position == pytest.approx([2 / 3, 1 / 3, 1 / 3, 1 / 3])
    assert s.conditional_acceptance_per_position == pytest.approx([2 / 3, 1 / 3, 1 / 2, 1 / 2])
    assert dict(s.acceptance_length_histogram) == {5: 1, 2: 1, 1: 1}
    assert s.tokens_per_s == pytest.approx(24.0) and s.speedup == pytest.approx(1.2)
    d = s.as_dict()
    assert d["drafts"] == 3 and d["acceptance_length_histogram"] == {1: 1, 2: 1, 5: 1}

    agg = SpecStats.aggregate([s, s])
    assert (agg.requests, agg.drafts, agg.accepted_tokens) == (2, 6, 10)
    assert agg.acceptance_per_position == s.acceptance_per_position
    assert agg.plain_tokens_per_s == pytest.approx(20.0)
    assert math.isnan(SpecStats().mean_acceptance_length)

    from mlxbun.results import open_results

    with open_results(tmp_path / "r.sqlite") as store:
        run = store.new_run("spec_test", params={"drafter": "ngram"})
        s.record(run, k=4)
        df = store.load(experiment="spec_test", expand_params=True)
    metrics = set(df.metric)
    assert {"drafts", "draft_tokens", "accepted_tokens", "mean_acceptance_length", "draft_acceptance_rate",
            "acceptance_per_position", "acceptance_length_count", "draft_s", "verify_s", "tokens_per_s",
            "speedup"} <= metrics
    pos = df[df.metric == "acceptance_per_position"].sort_values("params.position")
    assert list(pos.value) == pytest.approx(s.acceptance_per_position)
    assert set(df["params.k"]) == {4} and set(df["params.drafter"]) == {"ngram"}
    assert "Mean acceptance length: 2.67" in s.summary()


def test_adaptive_controller_follows_acceptance_and_costs():
    good = AdaptiveDraftLength(6)
    assert good.choose() == 6
    for _ in range(20):
        good.update(6, 6, 6, draft_s=0.001, verify_s=0.01)
    assert good.choose() == 6  # everything accepted, cheap drafts: draft the maximum

    bad = AdaptiveDraftLength(6)
    for k in (6, 3, 1) * 10:
        bad.update(k, k, 0, draft_s=0.01 * k, verify_s=0.01 + 0.001 * k)
    assert bad.choose() == 0  # nothing accepted, costly drafts: plain decoding wins
    picks = [bad.choose() for _ in range(16)]
    assert picks.count(1) == 2 and set(picks) == {0, 1}  # probing every 8th round

    mid = AdaptiveDraftLength(8, k_min=1)
    for k in (8, 4, 2) * 10:
        n = min(k, 2)
        mid.update(k, k, n, draft_s=0.004 * k, verify_s=0.01 + 0.002 * (k + 1))
    assert 1 <= mid.choose() <= 4  # acceptance about 2 tokens: a short draft
    with pytest.raises(MlxbunError, match="k_max"):
        AdaptiveDraftLength(0)


# ----------------------------------------------------------------------------- CLI


def test_generate_flags_drive_the_engine(models, zoo, zoo_root, tmp_path, monkeypatch, capsys):
    import argparse

    from mlxbun.commands import generate as gen
    from mlxbun.commands.speculative_flags import finish_spec_from_args, run_spec_from_args, spec_requested
    from mlxbun.results import open_results

    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    gen.register(sub)  # the generate command adds the speculative flags itself
    target, tok = models("llama")
    prompt = tok.encode_prompt(PROMPT)
    plain = _plain(target, tok, prompt)
    db = tmp_path / "r.sqlite"
    for flags in (["--draft", "ngram:2"], ["--draft", "zoo:llama"], ["--draft", "self:1", "--adaptive"]):
        args = parser.parse_args(["generate", "--model", "zoo:llama", "--prompt", PROMPT, "--max-tokens", str(N),
                                  "--num-draft", "4", "--spec-compare-plain", "--spec-results", str(db),
                                  *flags])
        assert spec_requested(args)
        last, ids = None, []
        for last in run_spec_from_args(args, target, tok, prompt):
            ids.append(last.token)
        assert ids == plain
        d = finish_spec_from_args(args, last, target, tok, prompt, model_path=zoo("llama"))
        assert d["plain_tokens_per_s"] > 0 and d["generated_tokens"] == N
    assert capsys.readouterr().err.count("Speculative: Mean acceptance length") == 3
    with open_results(db, create=False) as store:
        rows = store.load(experiment="spec", expand_params=True)
    assert set(rows["params.drafter"]) == {"ngram:2", "model:zoo:llama", "self:1"}
    assert not spec_requested(parser.parse_args(["generate", "--model", "zoo:llama", "--prompt", "x"]))
    for draft, message in (("ngram:x", "whole number"), ("self:0", "positive whole number"),
                           ("nosuchdir", "unknown drafter 'nosuchdir'")):
        bad = parser.parse_args(["generate", "--model", "zoo:llama", "--prompt", "x", "--draft", draft])
        with pytest.raises(MlxbunError, match=message):
            run_spec_from_args(bad, target, tok, prompt)
    bad = parser.parse_args(["generate", "--model", "zoo:llama", "--prompt", "x", "--draft", "ngram",
                             "--prompt-cache", "f.safetensors"])
    with pytest.raises(MlxbunError, match="--prompt-cache does not combine"):
        run_spec_from_args(bad, target, tok, prompt)


def test_workbench_sweep_records_rows(tmp_path, zoo_root, monkeypatch):
    from mlxbun.experiments.spec_acceptance import benchmark_markdown, spec_sweep
    from mlxbun.results import open_results
    from mlxbun.speculative import make_drafter

    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    prompts = {"rep": "a b c a b c a b", "plain": "Once upon a time"}
    sweep = spec_sweep("zoo:llama", ["ngram", "model:zoo:llama@q8"], ks=(1, 3), prompts=prompts, max_tokens=8,
                       results_path=tmp_path / "r.sqlite")
    summary = sweep.summary()
    assert list(summary.drafter) == ["ngram", "ngram", "model:zoo:llama@q8", "model:zoo:llama@q8"]
    assert summary.same_as_plain.all() and (summary.plain_tokens_per_s > 0).all()
    sweep.require_same_as_plain()  # every greedy run matched: no error
    sweep.same[("ngram", 3, "plain")] = False
    with pytest.raises(MlxbunError, match=r"differs from plain decoding \(1 of 8 runs\): ngram k=3 prompt 'plain'"):
        sweep.require_same_as_plain()
    assert summary.draft_acceptance_rate.iloc[2] > 0.5  # the target's 8-bit copy agrees with it
    assert set(sweep.histogram().acceptance_length) <= {1, 2, 3, 4}
    assert len(sweep.table()) == 8
    with open_results(tmp_path / "r.sqlite", create=False) as store:
        rows = store.load(experiment="spec_acceptance", expand_params=True)
    assert set(rows["params.prompt_set"]) == {"custom"}
    assert (rows[rows.metric == "same_as_plain"].value == 1.0).all()
    assert len(rows[(rows.metric == "plain_tokens_per_s") & rows["params.drafter"].isna()]) == 2
    md = benchmark_markdown(sweep, "python -m mlxbun.experiments.spec_acceptance")
    assert "| ngram | 1 |" in md and "Reading it honestly" in md
    with pytest.raises(MlxbunError, match="unknown zoo variant 'q3'.*accepted forms"):
        make_drafter("model:zoo:llama@q3")
    with pytest.raises(MlxbunError, match="unknown drafter 'medusa': not ngram"):
        make_drafter("medusa")
    with pytest.raises(MlxbunError, match="unknown zoo variant"):
        spec_sweep("zoo:llama", ["ngram", "model:zoo:llama@q3"], ks=(1,), prompts=prompts, max_tokens=8,
                   record=False)


def test_generate_cli_json_has_the_spec_object(zoo_root, monkeypatch, capsys):
    import json

    from mlxbun.cli import main

    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    base = ["generate", "--model", "zoo:llama", "--prompt", PROMPT, "--max-tokens", str(N), "--json"]
    assert main(base) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main(base + ["--draft", "ngram:3", "--num-draft", "4"]) == 0
    text = capsys.readouterr().out
    assert "NaN" not in text  # strict JSON
    out = json.loads(text)
    assert out["tokens"] == plain["tokens"]
    spec = out["spec"]
    assert {"drafts", "draft_tokens", "accepted_tokens", "mean_acceptance_length", "acceptance_per_position"} <= set(spec)
    assert spec["mean_acceptance_length"] == 1 + spec["accepted_tokens"] / spec["drafts"]
