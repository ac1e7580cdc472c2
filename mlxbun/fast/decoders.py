"""Which decode step a fast run takes: the fused kernels, else the compiled step, else eager.

`fast_decoder(fast, cache, room)` tries the fused step (`fast.fused_decoder`: five launches per
layer, dense rows, plain KVCaches, CUDA) and, where it does not apply, the compiled step
(`fast.decode.CompiledDecoder`); each reason it passes over is said once in the FastPath's notes.
"""

from __future__ import annotations

from typing import Optional, Union

from mlxbun.fast.decode import CompiledDecoder, CompileGap
from mlxbun.fast.fused_decoder import FusedDecoder
from mlxbun.fast.fused_plan import FusedGap, FusedPlan, fused_plan
from mlxbun.fast.path import FastPath
from mlxbun.kernels.fused_decode import CudaFusedOps, backend_gap

__all__ = ["fast_decoder", "fused_plan_of"]


def fused_plan_of(fast: FastPath) -> FusedPlan:
    """The model's FusedPlan, made once (FusedGap, remembered too, where it has none)."""
    cached = fast.__dict__.get("_fused_plan")
    if cached is None:
        try:
            cached = fused_plan(fast.model)
        except FusedGap as e:
            cached = e
        fast.__dict__["_fused_plan"] = cached
    if isinstance(cached, FusedGap):
        raise cached
    return cached


def _fused(fast: FastPath, cache: list, room: int) -> FusedDecoder:
    ops = fast.fused_ops
    if ops is None:
        gap = backend_gap()
        if gap is not None:
            raise FusedGap(gap.reason)
        ops = CudaFusedOps()
    return FusedDecoder(fast.model, fused_plan_of(fast), cache, room, ops)


def fast_decoder(fast: FastPath, cache: list, room: int) -> Optional[Union[FusedDecoder, CompiledDecoder]]:
    """The decoder a fast run uses over `cache` for `room` more tokens, or None (decode eagerly)."""
    if fast.fused:
        try:
            return _fused(fast, cache, room)
        except FusedGap as e:
            fast.note(f"fused decode off: {e}; the compiled step runs")
    try:
        return CompiledDecoder(fast.model, cache, room, kernels=fast.switch)
    except CompileGap as e:
        fast.note(f"compiled decode off: {e}")
        return None
