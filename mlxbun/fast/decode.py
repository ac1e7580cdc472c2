"""The compiled decode step: one `mx.compile`d call per generated token.

Decode at small batch is bound by launches and host overhead on a GPU (a 1B model's step is
hundreds of tiny kernels). `CompiledDecoder` traces the model's one-token forward once, with
every layer's cache as a `StaticKVCache` whose buffers and offset are the step's inputs and
outputs, and replays the fused graph for every later token. It applies where every cache of
the model is an exact full-attention `KVCache` and the graph traces with an array offset;
anything else is a `CompileGap` naming why, and the caller decodes eagerly.
"""

from __future__ import annotations

import mlx.core as mx

from mlxbun.cache.kv import KVCache
from mlxbun.fast.static_cache import StaticKVCache

__all__ = ["CompileGap", "CompiledDecoder", "capacity_for"]

CAPACITY_STEP = 256


class CompileGap(Exception):
    """The compiled step does not apply to this model or cache (the reason is the message)."""


def capacity_for(tokens: int) -> int:
    """Static buffer positions for `tokens` tokens: rounded up to a multiple of 256, so
    nearby lengths share one compiled graph."""
    return -(-max(tokens, 1) // CAPACITY_STEP) * CAPACITY_STEP


def _check_caches(cache: list) -> None:
    if not cache:
        raise CompileGap("the model keeps no cache")
    kinds = sorted({type(c).__name__ for c in cache if type(c) is not KVCache})
    if kinds:
        raise CompileGap(f"caches of kind {', '.join(kinds)} (the compiled step holds plain KVCache layers)")
    offsets = {c.offset for c in cache}
    if len(offsets) != 1:
        raise CompileGap(f"layers hold different numbers of tokens {sorted(offsets)}")


def _compiled_step(model, n: int):
    """The model's compiled step over `n` static caches, made once per model: `mx.compile`
    keys its traces on the function object, so every decoder of the model shares them."""
    steps = model.__dict__.setdefault("_mlxbun_compiled_steps", {})
    if n not in steps:
        def step(ids, position, *state):
            layers = [StaticKVCache(state[2 * i], state[2 * i + 1], position) for i in range(n)]
            logits = model(ids, cache=layers)[:, -1, :]
            return (logits, position + ids.shape[1], *[a for s in layers for a in (s.keys, s.values)])

        steps[n] = mx.compile(step)
    return steps[n]


class CompiledDecoder:
    """Decode one token at a time through a compiled step over static copies of `cache`.

    `room`: the tokens still to come (the static buffers hold the cache's tokens plus `room`,
    rounded up by `capacity_for`). `decoder(ids [B, 1]) -> logits [B, V]` advances the static
    caches; `write_back()` puts their content back into `cache` (the exact caches the decoder
    started from)."""

    def __init__(self, model, cache: list, room: int):
        _check_caches(cache)
        self.model, self.cache = model, cache
        self.offset = cache[0].offset
        capacity = capacity_for(self.offset + room)
        statics = [StaticKVCache.from_kv_cache(c, capacity) for c in cache]
        self.state = [a for s in statics for a in (s.keys, s.values)]
        self.position = mx.array(self.offset, dtype=mx.int32)
        self.capacity = capacity
        self._step = _compiled_step(model, len(cache))
        self._traced = False

    def __call__(self, ids: mx.array) -> mx.array:
        if self.offset + ids.shape[1] > self.capacity:
            raise CompileGap(f"the static cache is full ({self.capacity} positions)")
        try:
            out = self._step(ids, self.position, *self.state)
        except CompileGap:
            raise
        except (ValueError, TypeError, RuntimeError) as e:
            if self._traced:
                raise
            raise CompileGap(f"the graph does not trace with an array offset ({type(e).__name__}: {e})") from e
        self._traced = True
        logits, self.position, *self.state = out
        self.offset += ids.shape[1]
        return logits

    def write_back(self) -> None:
        for i, c in enumerate(self.cache):
            StaticKVCache(self.state[2 * i], self.state[2 * i + 1], self.position).write_back(c, self.offset)
