"""What a fast run costs in fidelity: its logits against the exact path's on the same tokens.

`decode_fidelity` prefills `context` and then feeds `tokens` one at a time through both paths of
one model (exact: kernels off, eager, KVCache; fast: kernels on, the compiled step where it
applies) and compares every decode step's logits (`mlxbun.parity.metrics.compare_logits`): mean
/ max KLD, top-1 agreement, max |diff|. Teacher-forced, so a single early disagreement does not
turn the rest of the comparison into two different texts.

`verify_fidelity` localizes where a fast speculative run's tokens part from the fast plain
decode's: the same tokens fed through the one-token compiled step, through the T-token verify
step (blocks of T, a round's shape) and eagerly on the exact path; at every position where the
two fast steps' greedy tokens differ, the exact path's margin between the two tokens says
whether that was a near-tie the kernels' rounding decided (numerics) or a real disagreement (a
wrong position or state: a bug).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import mlx.core as mx

from mlxbun.fast.decode import CompiledDecoder
from mlxbun.fast.decoders import fast_decoder
from mlxbun.fast.path import FastPath
from mlxbun.parity.metrics import KLDStats, compare_logits

__all__ = ["VerifyFidelity", "decode_fidelity", "fast_decode_step", "verify_fidelity"]


def fast_decode_step(fast: FastPath, cache: list, room: int) -> Callable[[mx.array], mx.array]:
    """ids [B, 1] -> logits [B, V] on the fast path over `cache` (already holding a prefix):
    the fused step, else the compiled step where it applies (else eager, the reason noted), kernels on. The compiled
    step holds the tokens while it decodes: `step.write_back()` hands them back to `cache`."""
    model = fast.model
    decoder = fast_decoder(fast, cache, room) if fast.compile_decode else None

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


@dataclass
class VerifyFidelity:
    """`verify_fidelity`'s answer: each fast step against the exact path and against each other
    (logits of the same teacher-forced tokens), and `flips`, one row per position where the
    one-token step's and the verify step's greedy tokens differ (see `verify_fidelity`)."""

    block: int
    step_vs_exact: KLDStats
    verify_vs_exact: KLDStats
    verify_vs_step: KLDStats
    flips: list[dict] = field(default_factory=list)


def _margin(logits: mx.array, a: int, b: int) -> float:
    return (logits[a] - logits[b]).item()


def verify_fidelity(fast: FastPath, context: Sequence[int], tokens: Sequence[int], block: int = 3) -> VerifyFidelity:
    """Teacher-forced over `tokens` after `context`: logits of each token through the fast path's
    one-token compiled step, through its verify step in blocks of `block` tokens (a speculative
    round of block - 1 drafts, on a rewindable decoder; the last block may be shorter) and eagerly
    on the exact path. A flip row: `index` (of the token fed), `in_block` (its place in the block),
    the step's and the verify's greedy tokens, the exact path's, `exact_margin` (exact logit of the
    step's token minus the verify's: near 0 means a near-tie), `step_margin` / `verify_margin` (each
    fast step's margin for its own token), `max_abs_diff` (step vs verify logits there)."""
    if not len(context) or not len(tokens):
        raise ValueError("verify_fidelity needs a non-empty context and tokens")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"verify_fidelity: block must be a positive int, got {block!r}")
    model = fast.model
    ctx = mx.array(list(context), dtype=mx.int32)[None]
    exact_cache, step_cache, verify_cache = model.make_cache(), model.make_cache(), model.make_cache()
    model(ctx, cache=exact_cache)
    with fast.on():
        model(ctx, cache=step_cache)
        model(ctx, cache=verify_cache)
    step = fast_decode_step(fast, step_cache, len(tokens) + 1)
    verifier = CompiledDecoder(model, verify_cache, len(tokens) + block, kernels=fast.switch, rewindable=True)
    ids = [int(t) for t in tokens]
    exact, one, many = [], [], []
    for t in ids:
        x = mx.array([[t]], dtype=mx.int32)
        exact.append(model(x, cache=exact_cache)[:, -1, :].astype(mx.float32))
        one.append(step(x).astype(mx.float32))
        mx.eval(exact[-1], one[-1])
    for j in range(0, len(ids), block):
        with fast.on():
            many.append(verifier.verify(mx.array([ids[j:j + block]], dtype=mx.int32)).astype(mx.float32))
        mx.eval(many[-1])
    fast.collect_kernel_gaps()
    exact, one, many = mx.concatenate(exact), mx.concatenate(one), mx.concatenate(many)
    flips = []
    same = (mx.argmax(one, -1) == mx.argmax(many, -1)).tolist()
    for i in (k for k, agree in enumerate(same) if not agree):
        a, b = int(mx.argmax(one[i]).item()), int(mx.argmax(many[i]).item())
        flips.append({"index": i, "in_block": i % block, "step_token": a, "verify_token": b,
                      "exact_token": int(mx.argmax(exact[i]).item()), "exact_margin": _margin(exact[i], a, b),
                      "step_margin": _margin(one[i], a, b), "verify_margin": _margin(many[i], b, a),
                      "max_abs_diff": mx.abs(one[i] - many[i]).max().item()})
    return VerifyFidelity(block, compare_logits(exact, one), compare_logits(exact, many), compare_logits(one, many),
                          flips)
