"""The bench's view of the fast path: mlxbun's engine on it, and its drift as table fields."""

from __future__ import annotations

import statistics
import time
from typing import Sequence

import mlx.core as mx

from mlxbun.bench.engines import Engine
from mlxbun.fast import FAST_FIDELITY, FastPath, enable_fast
from mlxbun.fast.decoders import fast_decoder
from mlxbun.fast.fidelity import decode_fidelity, fast_decode_step
from mlxbun.fast.fused_decoder import FusedDecoder
from mlxbun.fast.kernel_count import step_kernels

__all__ = ["fast_engine", "fast_fidelity", "step_profile"]


def fast_engine(engine: Engine) -> tuple[FastPath, Engine]:
    """mlxbun's engine on its fast path: kernels on in every forward, the compiled decode step."""
    fast = enable_fast(engine.module)
    model = engine.module

    def forward(ids, cache):
        with fast.on():
            return model(ids, cache)

    return fast, Engine(engine.name, model, forward, engine.make_cache,
                        decode_step=lambda cache, room: fast_decode_step(fast, cache, room))


def step_profile(fast: FastPath, context: Sequence[int], steps: int = 8) -> dict:
    """The decode step a fast run takes after `context`: which one (fused / compiled / eager), its
    kernels counted from its graph, and per step the host's time (graph build + MLX's encode, until
    `mx.async_eval` returns) against the time until the logits are ready (median microseconds)."""
    model = fast.model
    cache = model.make_cache()
    with fast.on():
        model(mx.array([list(context)], dtype=mx.int32), cache=cache)
    mx.eval([c.state for c in cache])
    decoder = fast_decoder(fast, cache, steps + 2)
    if decoder is None:
        return {"decoder": "eager"}
    ids = mx.array([[int(context[-1])]], dtype=mx.int32)
    counted = step_kernels(*decoder.pending(ids))
    mx.eval(decoder(ids))
    host, total = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        with fast.on():
            logits = decoder(ids)
        mx.async_eval(logits)
        t1 = time.perf_counter()
        mx.eval(logits)
        t2 = time.perf_counter()
        host.append(t1 - t0)
        total.append(t2 - t0)
    decoder.write_back()
    host_us, total_us = statistics.median(host) * 1e6, statistics.median(total) * 1e6
    return {"decoder": "fused" if isinstance(decoder, FusedDecoder) else "compiled",
            "kernels_per_step": counted.total, "layers": len(cache), "host_us": host_us,
            "gpu_after_host_us": max(0.0, total_us - host_us), "step_us": total_us}


def fast_fidelity(fast: FastPath, context: Sequence[int], tokens: Sequence[int]) -> dict:
    """The fields a fast bench result carries: its label, what it ran, its drift vs the exact path,
    and its decode step's kernels and host / GPU time (`step_profile`)."""
    stats = decode_fidelity(fast, context, tokens)
    return {"fidelity": FAST_FIDELITY, "path": fast.describe(), "notes": list(fast.notes),
            "positions": stats.count, "kld_mean": stats.kld_mean, "kld_max": stats.kld_max,
            "top1_agreement": stats.same_top_p, "max_abs_diff": stats.max_abs_diff,
            "step": step_profile(fast, context)}
