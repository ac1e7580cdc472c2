"""`StaticKVCache`: a fixed-capacity KV buffer whose write position is an array.

What a compiled decode step needs: `mx.compile` traces Python once, so nothing the step does
may live in Python ints. The buffer never grows (capacity is set when decoding starts), the
offset is a 0-d int32 array, new keys/values go in with `mx.slice_update` at that offset, and
attention runs over the whole buffer under a mask that hides the unwritten tail. The masked
sum over `capacity` keys is not the sum over `offset` keys that `KVCache` does, so results are
close to, not equal to, the exact path's: the fast path measures them (KLD, top-1).
"""

from __future__ import annotations

import mlx.core as mx

from mlxbun.attention import fused_sdpa
from mlxbun.cache.kv import KVCache

__all__ = ["StaticKVCache"]


class StaticKVCache:
    def __init__(self, keys: mx.array, values: mx.array, offset: mx.array):
        self.keys, self.values, self.offset = keys, values, offset

    @classmethod
    def from_kv_cache(cls, cache: KVCache, capacity: int) -> "StaticKVCache":
        """The filled part of an exact KVCache copied into a buffer of `capacity` positions."""
        keys, values = cache.keys_and_values()
        n = cache.offset
        if n > capacity:
            raise ValueError(f"capacity {capacity} is below the {n} tokens the cache holds")

        def padded(a: mx.array) -> mx.array:
            b, h, _, d = a.shape
            return mx.concatenate([a, mx.zeros((b, h, capacity - n, d), a.dtype)], axis=2)

        return cls(padded(keys), padded(values), mx.array(n, dtype=mx.int32))

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        at = self.offset.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
        self.values = mx.slice_update(self.values, values, at, axes=(2,))
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window layer cannot use the static cache")
        queries = self.offset + mx.arange(N, dtype=mx.int32)[:, None]
        return mx.arange(self.capacity, dtype=mx.int32)[None] <= queries

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        return fused_sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks)

    def write_back(self, cache: KVCache, offset: int) -> None:
        """Put the first `offset` positions back into an exact KVCache (prompt-cache saving, a
        later exact step)."""
        cache.state = (self.keys[..., :offset, :], self.values[..., :offset, :], offset)
