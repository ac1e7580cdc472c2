"""The bench's view of the fast path: mlxbun's engine on it, and its drift as table fields."""

from __future__ import annotations

from typing import Sequence

from mlxbun.bench.engines import Engine
from mlxbun.fast import FAST_FIDELITY, FastPath, enable_fast
from mlxbun.fast.fidelity import decode_fidelity, fast_decode_step

__all__ = ["fast_engine", "fast_fidelity"]


def fast_engine(engine: Engine) -> tuple[FastPath, Engine]:
    """mlxbun's engine on its fast path: kernels on in every forward, the compiled decode step."""
    fast = enable_fast(engine.module)
    model = engine.module

    def forward(ids, cache):
        with fast.on():
            return model(ids, cache)

    return fast, Engine(engine.name, model, forward, engine.make_cache,
                        decode_step=lambda cache, room: fast_decode_step(fast, cache, room))


def fast_fidelity(fast: FastPath, context: Sequence[int], tokens: Sequence[int]) -> dict:
    """The fields a fast bench result carries: its label, what it ran, its drift vs the exact path."""
    stats = decode_fidelity(fast, context, tokens)
    return {"fidelity": FAST_FIDELITY, "path": fast.describe(), "notes": list(fast.notes),
            "positions": stats.count, "kld_mean": stats.kld_mean, "kld_max": stats.kld_max,
            "top1_agreement": stats.same_top_p, "max_abs_diff": stats.max_abs_diff}
