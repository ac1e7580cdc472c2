"""The compiled decode step: one `mx.compile`d call per generated token.

Decode at small batch is bound by launches and host overhead (a small model's step is hundreds
of tiny ops, each built in Python). `CompiledDecoder` traces the model's one-token forward once,
with every layer's cache replaced by its fixed-shape stand-in (`fast.static_cache`: plain,
quantized and TurboQuant KV, sliding-window ring, recurrent states, CacheLists of them) whose
arrays and position are the step's inputs and outputs, and replays the traced graph for every later token. Anything it cannot hold (another
cache kind, a graph that needs the position as a Python int) is a `CompileGap` naming why, and
the caller decodes eagerly.

Speculative decoding's verify forward runs through the same step (`verify`: T tokens in, T rows
of logits out; `mx.compile` traces once per T), and a rejection goes back by moving the position
(`rewind`): the rejected positions stay in the buffers, past the filled length, where attention
never reads them. Only full-attention buffers can go back that way (a ring overwrites the slot
it writes, a recurrent state holds every token it saw), so `rewindable=True` refuses the others.
"""

from __future__ import annotations

import mlx.core as mx

from mlxbun.cache.cache_list import CacheList
from mlxbun.fast.static_cache import CacheAdapter, CompileGap, adapter_for

__all__ = ["CompileGap", "CompiledDecoder", "capacity_for", "forget_compiled_steps"]

CAPACITY_STEP = 256
_STEPS = "_mlxbun_compiled_steps"  # where a model keeps its compiled steps (`_compiled_step`)


def capacity_for(tokens: int) -> int:
    """Static buffer positions for `tokens` tokens: rounded up to a multiple of 256, so
    nearby lengths share one compiled graph."""
    return -(-max(tokens, 1) // CAPACITY_STEP) * CAPACITY_STEP


def _layers(cache: list):
    """Every cache of the list, a CacheList's children in its place."""
    for c in cache:
        yield from _layers(c.caches) if isinstance(c, CacheList) else (c,)


def _offset(cache: list) -> int:
    offsets = {c.offset for c in _layers(cache) if hasattr(c, "offset")}
    if len(offsets) > 1:
        raise CompileGap(f"layers hold different numbers of tokens {sorted(offsets)}")
    return offsets.pop() if offsets else 0  # recurrent layers only: the position is never read


def forget_compiled_steps(model) -> None:
    """Drop the model's compiled steps, so the next decoder traces again (after a change the traces
    hold: which kernel or write op the static caches choose; benchmarks compare them in one process)."""
    model.__dict__.pop(_STEPS, None)


def _compiled_step(model, layout: tuple[CacheAdapter, ...], kernels):
    """The model's compiled step for one cache layout (and kernel switch), made once per model and
    layout: `mx.compile` keys its traces on the function object, so every decoder shares them."""
    steps = model.__dict__.setdefault(_STEPS, {})
    key = (layout, None if kernels is None else id(kernels))
    if key not in steps:
        def step(ids, position, *flat):
            layers, at = [], 0
            for a in layout:
                layers.append(a.build(flat[at:at + a.n_arrays], position, kernels))
                at += a.n_arrays
            logits = model(ids, cache=layers)  # every row: a verify step reads all T
            return (logits, position + ids.shape[1], *[x for a, s in zip(layout, layers) for x in a.outputs(s)])

        steps[key] = mx.compile(step)
    return steps[key]


class CompiledDecoder:
    """Decode one token at a time through a compiled step over static copies of `cache`.

    `room`: the tokens still to come (full-attention buffers hold the cache's tokens plus `room`,
    rounded up by `capacity_for`; sliding-window rings hold their window). `decoder(ids [B, 1])
    -> logits [B, V]` advances the static state; `write_back()` puts it back into `cache` (the
    exact caches the decoder started from; their full-attention buffers are let go while the
    decoder holds the tokens, so the KV cache is not held twice). `kernels`: the fast path's switch (`FastSwitch`): with
    it, attention in the static caches runs mlxbun's decode kernel where it applies. `rewindable`:
    the decoder must take multi-token `verify` steps and `rewind` (full-attention layers only)."""

    def __init__(self, model, cache: list, room: int, kernels=None, *, rewindable: bool = False):
        if not cache:
            raise CompileGap("the model keeps no cache")
        self.model, self.cache = model, cache
        self.offset = self.start = _offset(cache)
        self.capacity = capacity_for(self.offset + room)
        pairs = [adapter_for(c, self.capacity) for c in cache]
        self.layout = tuple(a for a, _ in pairs)
        others = sorted({a.kind for a in self.layout if not a.rewindable})
        if rewindable and others:
            raise CompileGap(f"layers of kind {others} cannot go back after a rejection by moving the position "
                             "(a ring overwrites its slots, a recurrent state holds every token)")
        self.state = [x for _, arrays in pairs for x in arrays]
        mx.eval(self.state)
        for adapter, c in zip(self.layout, cache):
            adapter.release(c)  # the static copies hold the tokens now: no second copy while decoding
        self.position = mx.array(self.offset, dtype=mx.int32)
        self._step = _compiled_step(model, self.layout, kernels)
        self._traced: set[int] = set()  # the step lengths traced so far

    def __call__(self, ids: mx.array) -> mx.array:
        """Logits [B, V] of one token `ids` [B, 1]."""
        if ids.shape[1] != 1:
            raise CompileGap(f"the compiled step decodes one token per call, got {ids.shape[1]}")
        return self._run(ids)[:, -1, :]

    def verify(self, ids: mx.array) -> mx.array:
        """Logits [T, V] of the T tokens `ids` [1, T] (a speculative round's pending token and
        drafts); one compiled trace per T. Full-attention layers only (`rewindable`)."""
        if ids.shape[1] > 1 and not all(a.rewindable for a in self.layout):
            raise CompileGap("a multi-token step over a ring or a recurrent state")
        return self._run(ids)[0]

    def pending(self, ids: mx.array) -> list:
        """The step's outputs for `ids`, built and not evaluated, the decoder not advanced (to count
        the kernels a step launches: `fast.kernel_count`)."""
        return list(self._step(ids, self.position, *self.state))

    def rewind(self, n: int) -> None:
        """Drop the last `n` tokens fed (a speculative round's rejected drafts)."""
        if n < 0 or n > self.offset - self.start:
            raise ValueError(f"rewind {n}: the decoder fed {self.offset - self.start} tokens")
        if n:
            if not all(a.rewindable for a in self.layout):
                raise CompileGap("a ring or a recurrent state cannot rewind")
            self.offset -= n
            self.position = mx.array(self.offset, dtype=mx.int32)

    def _run(self, ids: mx.array) -> mx.array:
        if self.offset + ids.shape[1] > self.capacity and any(a.bounded for a in self.layout):
            raise CompileGap(f"the static cache is full ({self.capacity} positions)")
        try:
            out = self._step(ids, self.position, *self.state)
        except (ValueError, TypeError, RuntimeError, AttributeError, IndexError) as e:
            if ids.shape[1] in self._traced:
                raise
            raise CompileGap(f"the graph does not trace with static caches ({type(e).__name__}: {e})") from e
        self._traced.add(ids.shape[1])
        logits, self.position, *self.state = out
        self.offset += ids.shape[1]
        return logits

    def write_back(self) -> None:
        at = 0
        for adapter, c in zip(self.layout, self.cache):
            adapter.write_back(c, self.state[at:at + adapter.n_arrays], self.offset, self.offset - self.start)
            at += adapter.n_arrays
        self.start = self.offset
