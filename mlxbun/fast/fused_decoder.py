"""The fused decode step: a dense model's one-token forward in five kernel launches per layer (seven
where the attention takes three).

`FusedDecoder` runs a `FusedPlan` (`fast.fused_plan`) over static K/V buffers of its own, one
[2, KV, capacity, D] buffer per layer (keys, then values: the prefix copied in, the exact caches'
arrays let go while it decodes, `write_back` hands the tokens back), through an executor of
`kernels.fused_decode`: `CudaFusedOps` (the kernels) or `ReferenceFusedOps` (the same math as MLX
ops: the CPU tests run the decoder's plumbing with it). The step is `mx.compile`d once per model,
executor and layout, so a token costs the kernels' encode and nothing built in Python.

Per layer: norm + the q/k/v GEMV; q/k norm, RoPE, the new K/V rows written in place and decode
attention (one `rope_attention` launch, or three where its gap says: `ops.qkv_attention`); o_proj +
residual, norm + gate/up + SiLU, down + residual; then the final norm + head. One token at a time,
batch 1, plain KVCaches: anything else is a `FusedGap` and the caller runs the compiled step
(`fast.decode.CompiledDecoder`).
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from mlxbun.cache.kv import KVCache
from mlxbun.fast.decode import capacity_for
from mlxbun.fast.fused_plan import FusedGap, FusedPlan
from mlxbun.fast.static_cache import _padded

__all__ = ["FusedDecoder", "forget_fused_steps", "fused_step"]

_STEPS = "_mlxbun_fused_steps"


def fused_step(plan: FusedPlan, ops, ids: mx.array, position: mx.array, *buffers: mx.array):
    """One token's (logits [1, V], next position [1], the layers' buffers) through `ops`."""
    h = plan.embed(ids).reshape(-1)
    out, next_pos = [], position
    for layer, buffer in zip(plan.layers, buffers):
        attn = layer.attn.at(buffer, position)
        o, buffer, next_pos = ops.qkv_attention(h, layer.attn_norm, (layer.q, layer.k, layer.v), attn)
        h = ops.gemv(o, layer.o, residual=h)
        act = ops.gemv_swiglu(h, layer.mlp_norm, layer.gate, layer.up)
        h = ops.gemv(act, layer.down, residual=h)
        out.append(buffer)
    logits = ops.gemv(h, plan.head, norm=plan.final_norm)
    return (logits.reshape(1, -1), next_pos, *out)


def forget_fused_steps(model) -> None:
    """Drop the model's compiled fused steps, so the next decoder traces again (after a change the
    traces hold: a launch knob of `kernels.fused_decode`; benchmarks compare them in one process)."""
    model.__dict__.pop(_STEPS, None)


def _compiled(model, plan: FusedPlan, ops):
    steps = model.__dict__.setdefault(_STEPS, {})
    key = (ops.name, ops.inplace)
    if key not in steps:
        steps[key] = mx.compile(lambda ids, position, *buffers: fused_step(plan, ops, ids, position, *buffers))
    return steps[key]


class FusedDecoder:
    """Decode one token at a time through `plan` on `ops` over static copies of `cache` (a list of
    KVCaches holding the same prefix, batch 1). `decoder(ids [1, 1]) -> logits [1, V]`."""

    def __init__(self, model, plan: FusedPlan, cache: list, room: int, ops):
        if len(cache) != len(plan.layers) or any(type(c) is not KVCache for c in cache):
            kinds = sorted({type(c).__name__ for c in cache})
            raise FusedGap(f"caches {kinds} (the fused step holds one plain KVCache per layer)")
        if any(c.keys is None for c in cache):
            raise FusedGap("an empty KVCache (nothing prefilled)")
        offsets = {c.offset for c in cache}
        if len(offsets) != 1:
            raise FusedGap(f"layers hold different numbers of tokens {sorted(offsets)}")
        self.offset = self.start = offsets.pop()
        if cache[0].keys.shape[0] != 1:
            raise FusedGap(f"batch {cache[0].keys.shape[0]} (the fused step decodes batch 1)")
        self.model, self.plan, self.cache, self.ops = model, plan, cache, ops
        self.capacity = capacity_for(self.offset + room)
        for layer in plan.layers:
            gap = ops.attention_gap(replace(layer.attn, capacity=self.capacity), plan.dtype)
            if gap is not None:
                raise FusedGap(f"decode attention: {gap.reason}")
        self.buffers = []
        for c in cache:
            keys, values = c.keys_and_values()
            self.buffers.append(mx.concatenate([_padded(keys, self.capacity), _padded(values, self.capacity)]))
        mx.eval(self.buffers)
        for c in cache:
            c.keys = c.values = None  # the buffers hold the tokens now (write_back restores them)
        self.position = mx.array([self.offset], dtype=mx.int32)
        self._step = _compiled(model, plan, ops)

    def __call__(self, ids: mx.array) -> mx.array:
        if ids.shape != (1, 1):
            raise FusedGap(f"the fused step decodes one token of batch 1, got ids {ids.shape}")
        if self.offset + 1 > self.capacity:
            raise FusedGap(f"the static cache is full ({self.capacity} positions)")
        logits, self.position, *self.buffers = self._step(ids, self.position, *self.buffers)
        self.offset += 1
        return logits

    def pending(self, ids: mx.array) -> list:
        """The step's outputs for `ids`, built and not evaluated, the decoder not advanced (to count
        the kernels a step launches: `fast.kernel_count`; never evaluate them: an in-place write would
        land)."""
        return list(self._step(ids, self.position, *self.buffers))

    def write_back(self) -> None:
        n = self.offset
        for c, buffer in zip(self.cache, self.buffers):
            c.state = (buffer[0:1, :, :n, :], buffer[1:2, :, :n, :], n)
        self.start = self.offset
