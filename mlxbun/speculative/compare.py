"""Plain decoding on the same prompt and options: the baseline speculative decoding is measured
against (tokens/s) and, for greedy decoding, held to (the same tokens)."""

from __future__ import annotations

import time
from dataclasses import dataclass

__all__ = ["PlainRun", "plain_run"]


@dataclass
class PlainRun:
    tokens: list
    text: str
    wall_s: float  # from the call to the last token, prefill included (as SpecStats.wall_s)
    first_token_s: float = float("nan")  # from the call to the first token (the prefill and one step)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after it: plain decoding's per-step rate."""
        t = self.wall_s - self.first_token_s
        return (len(self.tokens) - 1) / t if len(self.tokens) > 1 and t > 0 else float("nan")


def plain_run(model, tokenizer, prompt, **options) -> PlainRun:
    """`mlxbun.generate.stream_generate` with `options`, timed end to end."""
    from mlxbun.generate import stream_generate

    tokens, text = [], ""
    first = float("nan")
    start = time.perf_counter()
    for r in stream_generate(model, tokenizer, prompt, **options):
        if not tokens:
            first = time.perf_counter() - start
        tokens.append(r.token)
        text += r.text
    return PlainRun(tokens, text, time.perf_counter() - start, first)
