"""What a fast run costs in fidelity: its logits against the exact path's on the same tokens.

`decode_fidelity` prefills `context` and then feeds `tokens` one at a time through both paths of
one model (exact: kernels off, eager, KVCache; fast: kernels on, the compiled step where it
applies) and compares every decode step's logits (`mlxbun.parity.metrics.compare_logits`): mean
/ max KLD, top-1 agreement, max |diff|. Teacher-forced, so a single early disagreement does not
turn the rest of the comparison into two different texts.
"""

from __future__ import annotations

from typing import Callable, Sequence

import mlx.core as mx

from mlxbun.fast.decode import CompiledDecoder, CompileGap
from mlxbun.fast.path import FastPath
from mlxbun.parity.metrics import KLDStats, compare_logits

__all__ = ["decode_fidelity", "fast_decode_step"]


def fast_decode_step(fast: FastPath, cache: list, room: int) -> Callable[[mx.array], mx.array]:
    """ids [B, 1] -> logits [B, V] on the fast path over `cache` (already holding a prefix):
    the compiled step where it applies (else eager, the reason noted), kernels on. The compiled
    step holds the tokens while it decodes: `step.write_back()` hands them back to `cache`."""
    model, decoder = fast.model, None
    if fast.compile_decode:
        try:
            decoder = CompiledDecoder(model, cache, room, kernels=fast.switch)
        except CompileGap as e:
            fast.note(f"compiled decode off: {e}")

    def step(ids: mx.array) -> mx.array:
        with fast.on():
            return model(ids, cache=cache)[:, -1, :] if decoder is None else decoder(ids)

    step.write_back = (lambda: None) if decoder is None else decoder.write_back
    return step


def decode_fidelity(fast: FastPath, context: Sequence[int], tokens: Sequence[int]) -> KLDStats:
    """Fast vs exact logits over `tokens` decoded after `context` (see the module docstring)."""
    if not len(context) or not len(tokens):
        raise ValueError("decode_fidelity needs a non-empty context and tokens")
    model = fast.model
    ctx = mx.array(list(context), dtype=mx.int32)[None]
    exact_cache, fast_cache = model.make_cache(), model.make_cache()
    model(ctx, cache=exact_cache)
    with fast.on():
        model(ctx, cache=fast_cache)
    step = fast_decode_step(fast, fast_cache, len(tokens) + 1)
    exact, quick = [], []
    for t in tokens:
        ids = mx.array([[int(t)]], dtype=mx.int32)
        exact.append(model(ids, cache=exact_cache)[:, -1, :].astype(mx.float32))
        quick.append(step(ids).astype(mx.float32))
        mx.eval(exact[-1], quick[-1])
    fast.collect_kernel_gaps()
    return compare_logits(mx.concatenate(exact), mx.concatenate(quick))
