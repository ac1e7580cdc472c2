"""Draft-model speculative decoding against mlx-lm 0.32.2's `speculative_generate_step` (live,
in-process): the same tokens, the same from_draft flags and bit-identical log-probabilities,
for k = 1..6, target and draft being zoo checkpoints of one arch (a different seed: nearly
nothing accepted; the 8-bit and 4-bit quantizations of the target: most accepted), with the
target as mlxbun's graph and as the mlx-lm model through the adapter."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlxbun.speculative import DraftModelDrafter, speculative_generate

PROMPT = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy cat. "
          "Once upon a time the quick brown")
N = 16


@pytest.fixture(scope="session")
def pair(zoo):
    """`pair(arch, draft_variant)` -> (mlx-lm target, mlx-lm draft, mlxbun target, mlxbun draft,
    mlxbun tokenizer), loaded once."""
    import mlx_lm

    from mlxbun.factory import open_model
    from mlxbun.tokenizer import load_tokenizer

    memo = {}

    def get(arch, variant):
        key = (arch, variant)
        if key not in memo:
            opts = {"seed1": dict(seed=1), "q8": dict(quant=8), "q4": dict(quant=4)}[variant]
            t_path, d_path = zoo(arch), zoo(arch, **opts)
            memo[key] = (mlx_lm.load(str(t_path))[0], mlx_lm.load(str(d_path))[0], open_model(t_path),
                         open_model(d_path), load_tokenizer(t_path))
        return memo[key]

    return get


def _oracle(target, draft, ids, k):
    from mlx_lm.generate import speculative_generate_step

    return list(speculative_generate_step(mx.array(ids), target, draft, num_draft_tokens=k, max_tokens=N))


def _ours(target, draft, tok, ids, k):
    return [(r.token, r.logprobs, r.from_draft)
            for r in speculative_generate(target, tok, ids, drafter=DraftModelDrafter(draft), num_draft=k,
                                          max_tokens=N)]


def _assert_same(ours, ref, where):
    assert [t for t, _, _ in ours] == [int(t) for t, _, _ in ref], where
    assert [f for _, _, f in ours] == [bool(f) for _, _, f in ref], where
    for i, ((_, a, _), (_, b, _)) in enumerate(zip(ours, ref)):
        assert mx.array_equal(a, b).item(), f"{where}: logprobs of token {i}"


@pytest.mark.parametrize("arch,variant", [("llama", "seed1"), ("llama", "q8"), ("qwen3", "q4"), ("phi3", "q4")])
def test_draft_model_matches_mlx_lm_speculative_generate_step(pair, arch, variant):
    lm_target, lm_draft, target, draft, tok = pair(arch, variant)
    ids = tok.encode_prompt(PROMPT)
    accepted = 0
    for k in range(1, 7):
        ref = _oracle(lm_target, lm_draft, ids, k)
        _assert_same(_ours(target, draft, tok, ids, k), ref, f"{arch} draft {variant} k={k}")
        accepted += sum(bool(f) for _, _, f in ref)
    if variant != "seed1":
        assert accepted > 20  # the comparison covered accepted drafts, bonus tokens and rollbacks


def test_mlx_lm_models_through_the_adapter_match_too(pair):
    lm_target, lm_draft, _, _, tok = pair("qwen3", "q4")
    ids = tok.encode_prompt(PROMPT)
    for k in (2, 5):
        ref = _oracle(lm_target, lm_draft, ids, k)
        # the same modules, now run by mlxbun's engine with mlxbun's caches
        _assert_same(_ours(lm_target, lm_draft, tok, ids, k), ref, f"adapter k={k}")
