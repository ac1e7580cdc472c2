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

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.wall_s if self.wall_s > 0 else float("nan")


def plain_run(model, tokenizer, prompt, **options) -> PlainRun:
    """`mlxbun.generate.stream_generate` with `options`, timed end to end."""
    from mlxbun.generate import stream_generate

    tokens, text = [], ""
    start = time.perf_counter()
    for r in stream_generate(model, tokenizer, prompt, **options):
        tokens.append(r.token)
        text += r.text
    return PlainRun(tokens, text, time.perf_counter() - start)
