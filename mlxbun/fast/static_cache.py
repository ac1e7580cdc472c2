"""Fixed-shape caches for the compiled decode step: buffers that never grow, positions as arrays.

`mx.compile` traces Python once, so nothing a compiled step does may live in Python ints. Each
class here stands in for an exact cache during the step, built from arrays the step takes as
inputs, and hands its arrays back as outputs:

- `StaticKVCache` (for KVCache): a buffer of `capacity` positions; new keys/values go in with
  `mx.slice_update` at the offset, attention runs over the whole buffer under a mask hiding the
  unwritten tail.
- `StaticRotatingKVCache` (for a sliding-window RotatingKVCache with keep=0): a ring of `window`
  slots, the token at position p in slot p % window; before the ring fills, the unwritten slots
  are masked.
- `static_arrays_cache` (for ArraysCache: conv / SSM states): the same class over the step's
  arrays; recurrent states have fixed shapes already.

A masked sum over a whole buffer is not the sum over the filled part that the exact caches do,
so results are close to, not equal to, the exact path's: the fast path measures them.
`adapter_for(cache)` picks the class and converts back and forth (`CompileGap` when none fits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlxbun.attention import fused_sdpa
from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache, RotatingKVCache

__all__ = ["CacheAdapter", "CompileGap", "StaticKVCache", "StaticRotatingKVCache", "adapter_for"]


class CompileGap(Exception):
    """The compiled step does not apply to this model or cache (the reason is the message)."""


def _padded(a: mx.array, size: int) -> mx.array:
    b, h, n, d = a.shape
    return mx.concatenate([a, mx.zeros((b, h, size - n, d), a.dtype)], axis=2) if size > n else a


class _StaticBuffers:
    """Key and value buffers of a fixed length (axis 2), the write position as a 0-d array."""

    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def _write(self, keys: mx.array, values: mx.array, at: mx.array):
        self.keys = mx.slice_update(self.keys, keys, at.reshape(1), axes=(2,))
        self.values = mx.slice_update(self.values, values, at.reshape(1), axes=(2,))
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        return fused_sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


class StaticKVCache(_StaticBuffers):
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self._write(keys, values, self.offset)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window mask over a full-attention static cache")
        queries = self.offset + mx.arange(N, dtype=mx.int32)[:, None]
        return mx.arange(self.length, dtype=mx.int32)[None] <= queries


class StaticRotatingKVCache(_StaticBuffers):
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] != 1:
            raise ValueError("the static ring takes one token per step")
        return self._write(keys, values, self.offset % self.length)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if N != 1 or window_size not in (None, self.length):
            raise ValueError(f"a {N}-token step or a window {window_size} unlike the ring's {self.length}")
        return (mx.arange(self.length, dtype=mx.int32) <= self.offset)[None]


def static_arrays_cache(arrays) -> ArraysCache:
    cache = ArraysCache(len(arrays))
    cache.cache = list(arrays)
    return cache


@dataclass(frozen=True)
class CacheAdapter:
    """How one exact cache becomes static arrays and back. `kind`: "kv", "ring" or "arrays"."""

    kind: str
    n_arrays: int

    def build(self, arrays, position):
        if self.kind == "kv":
            return StaticKVCache(arrays[0], arrays[1], position)
        if self.kind == "ring":
            return StaticRotatingKVCache(arrays[0], arrays[1], position)
        return static_arrays_cache(arrays)

    def outputs(self, static) -> list:
        return [static.keys, static.values] if self.kind in ("kv", "ring") else list(static.cache)

    def write_back(self, cache, arrays, offset: int, n_new: int) -> None:
        if self.kind == "kv":
            cache.state = (arrays[0][..., :offset, :], arrays[1][..., :offset, :], offset)
        elif self.kind == "ring":
            window = arrays[0].shape[2]
            idx = offset if offset < window else offset % window
            cache.state = (arrays[0], arrays[1], offset, 0, window, idx)
        else:
            cache.cache = list(arrays)
            cache._seen += n_new


def adapter_for(cache: Any, capacity: int) -> tuple[CacheAdapter, list]:
    """(the adapter, the static input arrays) for an exact cache that holds a prefix."""
    kind = type(cache)
    if kind is KVCache:
        if cache.keys is None:
            raise CompileGap("an empty KVCache (nothing prefilled)")
        keys, values = cache.keys_and_values()
        if cache.offset > capacity:
            raise CompileGap(f"capacity {capacity} is below the {cache.offset} tokens a cache holds")
        return CacheAdapter("kv", 2), [_padded(keys, capacity), _padded(values, capacity)]
    if kind is RotatingKVCache:
        if cache.keys is None or cache.keep:
            raise CompileGap("a RotatingKVCache that is empty or keeps sink tokens")
        window, n = cache.max_size, cache.offset
        ordered = [cache._temporal_order(a) for a in (cache.keys, cache.values)]
        if n <= window:
            arrays = [_padded(a[..., :n, :], window) for a in ordered]
        else:  # the last `window` tokens, the one at position p in slot p % window
            arrays = [mx.roll(a[..., -window:, :], n % window, axis=2) for a in ordered]
        return CacheAdapter("ring", 2), arrays
    if kind is ArraysCache:
        if cache.empty() or any(a is None for a in cache.cache):
            raise CompileGap("an ArraysCache with an unset state")
        if cache.lengths is not None or cache.left_padding is not None:
            raise CompileGap("an ArraysCache with batch padding")
        return CacheAdapter("arrays", len(cache.cache)), list(cache.cache)
    raise CompileGap(f"caches of kind {kind.__name__} (the compiled step holds KVCache, RotatingKVCache "
                     "and ArraysCache layers)")
