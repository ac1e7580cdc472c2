"""Speculative decoding on the fast path (CPU): the compiled step's multi-token verify and its
rewind, the engine's verify through it, the cases it leaves to the eager verify (and says so),
and `generate --draft ... --fast`."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxbun import cli
from mlxbun.factory import open_model
from mlxbun.fast import CompiledDecoder, CompileGap, enable_fast
from mlxbun.generate import stream_generate
from mlxbun.speculative import NGramDrafter, speculative_text
from mlxbun.speculative.engine import speculative_generate_step
from mlxbun.speculative.verify import Sampling
from mlxbun.tokenizer import load_tokenizer

PROMPT = [1, 5, 9, 5, 9, 5, 9, 3, 5, 9, 5]  # repeats: the n-gram drafter has something to find
TOL = 1e-5  # float32: a masked sum over the static buffer vs the exact cache's sum over its tokens


def _prefilled(model, ids):
    cache = model.make_cache()
    model(mx.array([ids]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def test_verify_then_rewind_attends_only_the_kept_tokens(zoo):
    """Four tokens verified, two rejected: the rows equal the exact forward's, and the next step
    sees the prompt and the two kept tokens only (a rewind that kept the rejected keys would not)."""
    model = open_model(zoo("llama"))
    dec = CompiledDecoder(model, _prefilled(model, PROMPT), room=16, rewindable=True)
    rows = dec.verify(mx.array([[7, 8, 2, 4]]))
    exact = _prefilled(model, PROMPT)
    want = model(mx.array([[7, 8, 2, 4]]), cache=exact)[0]
    assert rows.shape == want.shape and mx.allclose(rows, want, atol=TOL, rtol=0).item()

    dec.rewind(2)
    assert dec.offset == len(PROMPT) + 2
    got = dec(mx.array([[6]]))
    kept = _prefilled(model, PROMPT + [7, 8])
    want = model(mx.array([[6]]), cache=kept)[:, -1, :]
    assert mx.allclose(got, want, atol=TOL, rtol=0).item()
    rejected_seen = model(mx.array([[6]]), cache=_prefilled(model, PROMPT + [7, 8, 2, 4]))[:, -1, :]
    assert mx.abs(got - rejected_seen).max().item() > 100 * TOL  # the check can tell the two apart

    dec.write_back()
    assert dec.cache[0].offset == len(PROMPT) + 3 and dec.cache[0].keys.shape[2] == len(PROMPT) + 3
    with pytest.raises(ValueError, match="rewind 5: the decoder fed 0 tokens"):
        dec.rewind(5)


@pytest.mark.parametrize("arch, kind", [("gemma3_text", "ring"), ("mamba2", "arrays")])
def test_rings_and_recurrent_states_cannot_rewind(zoo, arch, kind):
    model = open_model(zoo(arch))
    cache = _prefilled(model, PROMPT)
    with pytest.raises(CompileGap, match=rf"layers of kind \[.*'{kind}'.*\] cannot go back"):
        CompiledDecoder(model, cache, room=8, rewindable=True)
    dec = CompiledDecoder(model, cache, room=8)  # one token per step still works
    with pytest.raises(CompileGap, match="multi-token step"):
        dec.verify(mx.array([[1, 2]]))


@pytest.mark.parametrize("arch, quant", [("llama", None), ("qwen3", None), ("llama", 4)])
@pytest.mark.parametrize("drafter", ["ngram", "self:1"])
def test_fast_speculative_greedy_equals_plain(zoo, arch, quant, drafter):
    """Greedy, the fast path's speculative tokens equal plain decoding's (fast and exact) on the
    zoo models, with at least one rejection (so rewinds ran) and the verify on the compiled step."""
    path = zoo(arch, quant=quant)
    model, tok = open_model(path), load_tokenizer(path)
    exact = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=20)]
    fast = enable_fast(model)
    plain_fast = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=20, fast=fast)]
    _, ids, stats = speculative_text(model, tok, PROMPT, drafter=drafter, num_draft=3, max_tokens=20, fast=fast)
    assert ids == plain_fast == exact
    assert stats.draft_tokens > stats.accepted_tokens  # some drafts were rejected: the decoder rewound
    assert not any("speculative verify" in n for n in fast.notes), fast.notes
    assert any("draft model's forwards run eagerly" in n for n in fast.notes) == drafter.startswith("self")


def test_fast_speculative_hands_the_cache_back(zoo):
    """The target's exact caches get the tokens back: the same length and keys (within TOL) as
    the eager verify's caches after the same run, also when the budget ends inside a round."""
    path = zoo("llama")
    model = open_model(path)
    runs = {}
    for name, fast in (("exact", None), ("fast", enable_fast(model))):
        cache = model.make_cache()
        gen = speculative_generate_step(mx.array(PROMPT), model, _bound_ngram(model), cache=cache, num_draft=3,
                                        max_tokens=13, sampling=Sampling(), fast=fast)
        runs[name] = ([t for t, _, _ in gen], cache)
    (exact_ids, exact_cache), (fast_ids, fast_cache) = runs["exact"], runs["fast"]
    assert fast_ids == exact_ids and len(fast_ids) == 13
    for e, f in zip(exact_cache, fast_cache):
        assert f.offset == e.offset
        assert mx.allclose(f.keys_and_values()[0], e.keys_and_values()[0], atol=TOL, rtol=0).item()


def _bound_ngram(model):
    from mlxbun.speculative.drafters import DraftSession, logits_width

    drafter = NGramDrafter()
    drafter.bind(DraftSession(target=model, vocab_size=logits_width(model), sampling=Sampling()))
    return drafter


@pytest.mark.parametrize("arch, head_dim, options, reason", [
    ("gemma3_text", None, {}, "cannot go back after a rejection"),
    ("qwen3_next", None, {}, "recurrent layers roll back by replay"),
    # the start lies past the prompt: the hook converts the caches mid-decode (quantized from token 0,
    # they are already converted when decoding starts: see the test below)
    ("llama", 64, {"kv_bits": 8, "quantized_kv_start": 14}, "KV quantization converts the caches"),
])
def test_where_the_compiled_verify_does_not_apply_it_verifies_eagerly_and_says_why(zoo, arch, head_dim, options,
                                                                                    reason):
    path = zoo(arch, head_dim=head_dim)
    model, tok = open_model(path), load_tokenizer(path)
    fast = enable_fast(model)
    plain = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=12, fast=fast, **options)]
    _, ids, _ = speculative_text(model, tok, PROMPT, drafter="ngram", num_draft=2, max_tokens=12, fast=fast,
                                 **options)
    assert ids == plain
    assert any(n.startswith("speculative verify eager") and reason in n for n in fast.notes), fast.notes


@pytest.mark.parametrize("options", [{"kv_bits": 8}, {"kv_bits": 3.5, "kv_scheme": "turboquant"}],
                         ids=["uniform-q8", "turboquant-3.5"])
def test_quantized_kv_converted_before_decoding_verifies_on_the_compiled_step(zoo, options):
    """KV quantized from token 0: the hook converted every layer during the prefill, so the compiled
    verify holds the quantized (affine or TurboQuant) caches; greedy equals plain decoding, fast and
    exact, with rejections (rewinds over packed buffers)."""
    path = zoo("llama", head_dim=64)
    model, tok = open_model(path), load_tokenizer(path)
    exact = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=16, **options)]
    fast = enable_fast(model)
    plain_fast = [r.token for r in stream_generate(model, tok, PROMPT, max_tokens=16, fast=fast, **options)]
    _, ids, stats = speculative_text(model, tok, PROMPT, drafter="ngram", num_draft=3, max_tokens=16, fast=fast,
                                     **options)
    assert ids == plain_fast == exact
    assert stats.draft_tokens > stats.accepted_tokens
    assert not any("eager" in n or "compiled decode off" in n for n in fast.notes), fast.notes


def test_cli_draft_with_fast(zoo, capsys):
    path = str(zoo("llama", quant=4))
    assert cli.main(["generate", "--model", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "12",
                     "--draft", "ngram", "--num-draft-tokens", "3", "--fast", "--spec-compare-plain", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["fast"]["fidelity"] == "L2-fast" and "compiled decode step" in out["fast"]["path"]
    assert out["spec"]["draft_tokens"] > 0 and out["spec"]["plain_tokens_per_s"] > 0
    assert not any("speculative verify" in n for n in out["fast"]["notes"])
    plain = cli.main(["generate", "--model", path, "--prompt-ids", ",".join(map(str, PROMPT)), "--max-tokens", "12",
                      "--fast", "--json"])
    assert plain == 0 and json.loads(capsys.readouterr().out)["tokens"] == out["tokens"]


def test_spec_sweep_on_the_fast_path(zoo_root):
    from mlxbun.experiments.spec_acceptance import spec_sweep

    sweep = spec_sweep("zoo:llama", ["ngram"], [2], max_tokens=8, record=False, fast=True,
                       prompts={"list": "apples, pears, plums, apples, pears, plums, apples,"})
    assert all(sweep.same.values()) and len(sweep.runs) == 1


# ------------------------------------------------------------------ localizing a split: verify_fidelity


def test_verify_fidelity_finds_no_flip_where_the_two_fast_steps_agree(zoo):
    from mlxbun.fast.fidelity import verify_fidelity

    model = open_model(zoo("llama", head_dim=32))
    tokens = [(i * 11) % 60 + 1 for i in range(10)]
    got = verify_fidelity(enable_fast(model), [3, 1, 4, 1, 5], tokens, block=4)  # blocks 4, 4, 2
    assert got.flips == [] and got.block == 4
    for stats in (got.step_vs_exact, got.verify_vs_exact, got.verify_vs_step):
        assert stats.count == len(tokens) and stats.max_abs_diff < 1e-4 and stats.same_top_p == 1.0


def test_verify_fidelity_reports_where_the_verify_step_parts_and_the_exact_margin_there(zoo, monkeypatch):
    """A verify step that favours one token at the second place of every block: each flip is
    found at its index, with the exact path's margin for the step's token (positive: the exact
    path agrees with the one-token step) and the planted gap in max_abs_diff."""
    import mlxbun.fast.fidelity as fidelity_mod
    from mlxbun.fast.fidelity import verify_fidelity

    planted = 17

    class Skewed(CompiledDecoder):
        def verify(self, ids):
            logits = super().verify(ids)
            if logits.shape[0] < 2:
                return logits
            bump = mx.zeros(logits.shape).at[1, planted].add(50.0)
            return logits + bump

    monkeypatch.setattr(fidelity_mod, "CompiledDecoder", Skewed)
    model = open_model(zoo("llama", head_dim=32))
    tokens = [(i * 11) % 60 + 1 for i in range(9)]
    got = verify_fidelity(enable_fast(model), [3, 1, 4, 1, 5], tokens, block=3)
    assert [f["index"] for f in got.flips] == [1, 4, 7]
    for f in got.flips:
        assert f["in_block"] == 1 and f["verify_token"] == planted and f["step_token"] == f["exact_token"]
        assert f["exact_margin"] > 0 and f["step_margin"] > 0 and f["verify_margin"] > 0
        assert 49.0 < f["max_abs_diff"] < 51.0
    assert got.verify_vs_step.same_top_p == pytest.approx(6 / 9)


@pytest.mark.parametrize("context, tokens, block, match", [
    ([], [1], 2, "non-empty"), ([1], [], 2, "non-empty"), ([1], [2], 0, "block must be a positive int"),
    ([1], [2], True, "block must be a positive int")])
def test_verify_fidelity_refuses_bad_arguments(zoo, context, tokens, block, match):
    from mlxbun.fast.fidelity import verify_fidelity

    with pytest.raises(ValueError, match=match):
        verify_fidelity(enable_fast(open_model(zoo("llama", head_dim=32))), context, tokens, block)
