"""Speculative decoding on hybrid / recurrent targets and drafts (mlx-lm's own qwen3_next, qwen3_5,
lfm2, nemotron_h, mamba2 and falcon_h1 through the adapter, tests/hybrid_models.py): greedy output equals
plain decoding token for token (log-probabilities to LOGPROB_TOL) for every drafter kind, k = 1..6,
the draft model a hybrid too; KV options work exactly or refuse as plain decoding does; a rejected
round replays exactly the kept tokens, and SpecStats counts them.

Structured around the `model` fixture (a model name -> (target, draft of the same arch)), so
other rows (the universal graph's zoo hybrids) parametrize the same tests.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from mlxbun.cache.arrays import ArraysCache
from mlxbun.errors import GenerationError, MlxbunError, UnsupportedModelError
from mlxbun.generate import stream_generate
from mlxbun.generation_caches import make_generation_cache
from mlxbun.speculative import (
    DraftModelDrafter,
    DraftSession,
    LayerSkipDrafter,
    NGramDrafter,
    SpecStats,
    speculative_generate,
)
from mlxbun.speculative import engine as spec_engine
from mlxbun.speculative.drafters import logits_width, model_blocks
from mlxbun.speculative.engine import speculative_generate_step
from tests.hybrid_models import ATTENTION_HEAD_DIM, MODELS, VOCAB, IdTokenizer, open_hybrid

# repeated spans (the n-gram drafter finds matches) in 24 tokens
PROMPT = [(7 * i * i + 3 * i) % 256 for i in range(12)] * 2
N = 16
KS = range(1, 7)
LOGPROB_TOL = 1e-4  # a batched verify / replay forward rounds differently (~1e-6); a stale state is ~1e-1
TOK = IdTokenizer()


@pytest.fixture(scope="module", params=MODELS)
def model(request):
    """(target, draft): the named model (seed 0) and the same arch with other weights (seed 1)."""
    return open_hybrid(request.param), open_hybrid(request.param, seed=1)


def _drafters(target, draft, *, every=True):
    out = {"ngram": NGramDrafter, "model@seed1": lambda: DraftModelDrafter(draft)}
    if every:
        blocks = len(model_blocks(target))
        out.update({"self:1": lambda: LayerSkipDrafter(1), f"self:{blocks}": lambda: LayerSkipDrafter(blocks)})
    return out


def _mismatches(target, draft, ks=KS, every=True, rollback="mixers", **kw):
    """Every drafter x k against plain greedy: the failures as strings, and the summed stats."""
    plain = list(stream_generate(target, TOK, PROMPT, max_tokens=N, **kw))
    kw["rollback"] = rollback
    plain_ids = [r.token for r in plain]
    bad, total = [], []
    for name, make in _drafters(target, draft, every=every).items():
        for k in ks:
            spec = list(speculative_generate(target, TOK, PROMPT, drafter=make(), num_draft=k, max_tokens=N, **kw))
            ids, stats = [r.token for r in spec], spec[-1].stats
            total.append(stats)
            if ids != plain_ids:
                first = next(i for i, (a, b) in enumerate(zip(ids + [None] * N, plain_ids)) if a != b)
                bad.append(f"{name} k={k}: first difference at token {first}")
                continue
            diff = max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain))
            if diff > LOGPROB_TOL:
                bad.append(f"{name} k={k}: same tokens, logprobs differ by {diff:.3g}")
            if name.startswith("self:") and name != "self:1" and (stats.draft_acceptance_rate != 1.0 or stats.replays):
                bad.append(f"{name} k={k}: the full-depth self-draft is the target, yet acceptance "
                           f"{stats.draft_acceptance_rate} and {stats.replays} replays")
    return bad, SpecStats.aggregate(total)


def test_greedy_equals_plain_for_every_drafter(model):
    bad, stats = _mismatches(*model)  # rollback="mixers", the default
    assert bad == []
    assert stats.replays > 0 and stats.replayed_tokens >= stats.replays  # the rollback path ran


def test_greedy_equals_plain_with_the_whole_model_replay(model):
    bad, stats = _mismatches(*model, every=False, rollback="model")
    assert bad == [] and stats.replays > 0


@pytest.mark.parametrize("rollback", ["mixers", "model"])
def test_sampled_tokens_are_scored_on_the_right_state(model, rollback):
    """Under sampling (temperature 1) no plain stream to compare with, but each emitted token's
    log-probabilities must be the target's after exactly the tokens before it: teacher-force the
    whole emitted sequence in one forward and compare every row, replays and all."""
    target, draft = model
    spec = list(speculative_generate(target, TOK, PROMPT, drafter=DraftModelDrafter(draft), num_draft=3,
                                     max_tokens=N, temperature=1.0, seed=0, rollback=rollback))
    assert spec[-1].stats.replays > 0
    seq = PROMPT + [r.token for r in spec[:-1]]
    logits = target(mx.array([seq]))[0, len(PROMPT) - 1:]
    forced = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    diff = max(mx.abs(r.logprobs - forced[i]).max().item() for i, r in enumerate(spec))
    assert diff < LOGPROB_TOL


def _attention_layers(target) -> list[int]:
    return [i for i, c in enumerate(make_generation_cache(target)) if hasattr(c, "offset")]


@pytest.mark.parametrize("kv", ["kv_bits", "kv_bits_start", "max_kv_size", "kv_config"])
def test_kv_options_work_exactly_or_refuse_as_plain(model, kv):
    target, draft = model
    layers = _attention_layers(target)
    options = {"kv_bits": dict(kv_bits=4, kv_group_size=ATTENTION_HEAD_DIM),
               # quantized from token 30 on: rounds stop short of it until the hook converts (a
               # model without attention layers has nothing to convert, and drafts all along)
               "kv_bits_start": dict(kv_bits=4, kv_group_size=ATTENTION_HEAD_DIM, quantized_kv_start=30),
               "max_kv_size": dict(max_kv_size=8),  # the 24-token prompt crosses the ring
               "kv_config": dict(kv_config=[{"layer_idx": i, "bits": 4, "group_size": ATTENTION_HEAD_DIM}
                                            for i in layers or [0]])}[kv]
    if kv == "kv_config" and not layers:  # a plan on a recurrent layer: both refuse, naming it
        errors = []
        for run in (lambda: stream_generate(target, TOK, PROMPT, max_tokens=2, **options),
                    lambda: speculative_generate(target, TOK, PROMPT, drafter="ngram", max_tokens=2, **options)):
            with pytest.raises(MlxbunError, match=r"layer 0: holds a (ArraysCache|CacheList)") as e:
                list(run())
            errors.append(str(e.value))
        assert errors[0] == errors[1]
        return
    bad, stats = _mismatches(target, draft, ks=(2, 5), every=False, **options)
    assert bad == [] and stats.draft_tokens > 0


def test_a_hybrid_drafts_for_an_attention_target_and_back(model):
    llama = open_hybrid("mlx-lm:llama")
    target, _ = model
    for t, d in ((llama, target), (target, llama)):
        plain = [r.token for r in stream_generate(t, TOK, PROMPT, max_tokens=N)]
        for k in (1, 3, 6):
            got = [r.token for r in speculative_generate(t, TOK, PROMPT, drafter=DraftModelDrafter(d), num_draft=k,
                                                         max_tokens=N)]
            assert got == plain, (type(t.module).__module__, k)


class _Recording(SpecStats):
    def add_round(self, k, n_drafted, n_accepted, draft_s, verify_s):
        self.log = getattr(self, "log", []) + [(n_drafted, n_accepted)]
        super().add_round(k, n_drafted, n_accepted, draft_s, verify_s)


def test_a_rejected_round_replays_its_kept_tokens_and_the_stats_count_them(model):
    target, draft = model
    drafter = DraftModelDrafter(draft)
    drafter.bind(DraftSession(target=target, vocab_size=logits_width(target)))
    stats = _Recording()
    list(speculative_generate_step(mx.array(PROMPT), target, drafter, cache=make_generation_cache(target),
                                   num_draft=4, max_tokens=N, stats=stats))
    # a round that rejected a draft (n < m) replays the pending token + the n accepted drafts
    want = [n + 1 for m, n in stats.log if n < m]
    assert want and (stats.replays, stats.replayed_tokens) == (len(want), sum(want))
    assert stats.replay_s > 0 and 0 < stats.replay_time_fraction < 1
    row = {name: v for name, v, _, _ in stats.as_rows()}
    assert (row["replays"], row["replayed_tokens"], row["replay_s"]) == (stats.replays, sum(want), stats.replay_s)
    assert f"{sum(want)} tokens replayed in {len(want)} rounds" in stats.summary()
    both = SpecStats.aggregate([stats, stats])
    assert (both.replays, both.replayed_tokens, both.replay_s) == (2 * len(want), 2 * sum(want), 2 * stats.replay_s)


def test_without_the_replay_a_hybrid_target_goes_wrong(monkeypatch):
    """The old commit (each cache's spec_commit, the replay count dropped; rollback="model" goes
    through commit_spec_round) on lfm2: the recurrent state falls back to the round's start while
    attention keeps the round: output changes."""
    target, draft = open_hybrid("mlx-lm:lfm2"), open_hybrid("mlx-lm:lfm2", seed=1)
    plain = list(stream_generate(target, TOK, PROMPT, max_tokens=N))

    def dropped(caches, n):
        for c in caches:
            c.spec_commit(n)
        return 0

    monkeypatch.setattr(spec_engine, "commit_spec_round", dropped)
    spec = list(speculative_generate(target, TOK, PROMPT, drafter=DraftModelDrafter(draft), num_draft=3, max_tokens=N,
                                     rollback="model"))
    diff = max(mx.abs(a.logprobs - b.logprobs).max().item() for a, b in zip(spec, plain))
    assert diff > 100 * LOGPROB_TOL


def test_layer_skip_takes_the_caches_its_blocks_use():
    """nemotron_h's blocks M * - M hold caches [M, *, M] (its MLP block none)."""
    target = open_hybrid("mlx-lm:nemotron_h")
    session = DraftSession(target=target, vocab_size=logits_width(target))
    got = []
    for layers in (1, 2, 3, 4):
        d = LayerSkipDrafter(layers)
        d.bind(session)
        got.append([type(c).__name__ for c in d._new_cache()])
    assert got == [["ArraysCache"], ["ArraysCache", "KVCache"], ["ArraysCache", "KVCache"],
                   ["ArraysCache", "KVCache", "ArraysCache"]]


def test_mixer_rollback_refuses_a_model_whose_recurrent_cache_reaches_no_mixer():
    """rollback="mixers" finds the module each ArraysCache is handed to (a `cache` parameter);
    a model that updates its state some other way is refused before any work, naming the cache."""

    class Block(nn.Module):
        def __call__(self, x, state):
            total = x.sum(axis=1, keepdims=True)
            state[0] = total if state[0] is None else state[0] + total
            state.advance(x.shape[1])
            return x + state[0]

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, 8)
            self.layers = [Block()]

        def __call__(self, ids, cache):
            return self.layers[0](self.embed(ids), cache[0] if cache else ArraysCache(1))

    class Toy(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()

        def __call__(self, ids, cache=None):
            return self.model.embed.as_linear(self.model(ids, cache))

        def make_cache(self):
            return [ArraysCache(1)]

    toy = Toy()
    with pytest.raises(UnsupportedModelError, match=r"no module of .* takes recurrent cache\(s\) \[0\]"):
        list(speculative_generate(toy, TOK, PROMPT, drafter="ngram", max_tokens=4))
    assert len(list(speculative_generate(toy, TOK, PROMPT, drafter="ngram", max_tokens=4, rollback="model"))) == 4
    with pytest.raises(GenerationError, match=r"rollback must be one of \['model', 'mixers'\], got 'both'"):
        speculative_generate(toy, TOK, PROMPT, drafter="ngram", rollback="both")
