"""Helpers of the cross-layer KV-sharing tests (hunyuan's CLA: tests/test_moe_kv_sharing.py;
gemma3n's shared layers: tests/test_gemma3n_kv_sharing.py; gemma4_text's:
tests/test_gemma4_kv_sharing.py): compare two generation streams step
by step, and run mlx-lm's own stream_generate on the same prompt and KV options."""

from __future__ import annotations

import mlx.core as mx

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time"
N = 12


def same_stream(a, b) -> None:
    """Equal tokens, and every step's log-probabilities bit for bit."""
    assert [r.token for r in a] == [r.token for r in b]
    for i, (x, y) in enumerate(zip(a, b)):
        assert mx.array_equal(x.logprobs, y.logprobs).item(), f"step {i}: logprobs differ"


def changed(a, b) -> bool:
    """Whether some step's log-probabilities differ (a cache setting did change the numbers)."""
    return not all(mx.array_equal(x.logprobs, y.logprobs).item() for x, y in zip(a, b))


def oracle_stream(oracle, otok, prompt=PROMPT, max_tokens=N, **options) -> list:
    """mlx-lm's own stream_generate (its caches, its KV quantization) with mlxbun's default
    quantized_kv_start (0; mlx-lm's is 5000)."""
    from mlx_lm import stream_generate as mlx_stream

    options.setdefault("quantized_kv_start", 0)
    return list(mlx_stream(oracle, otok, prompt, max_tokens=max_tokens, **options))
