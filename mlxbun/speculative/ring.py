"""Multi-token verification over a ring buffer that keeps attention-sink tokens.

A `RotatingKVCache(max_size, keep>0)` (what `max_kv_size` gives full-attention layers) decodes
one token with the first `keep` tokens plus the last `max_size - keep` tokens in view. Fed
several tokens at once, it keeps the whole recent context but its mask (mlx-lm's) is a plain
sliding window of `max_size` that drops the sink tokens, so verifying k+1 tokens in one call
would attend differently from decoding them one by one. `sink_exact(caches)` wraps such caches
for the verify call in a view whose multi-token mask is what one-token decoding sees: the sinks
plus a window of `max_size - keep`. Everything else (update_and_fetch, offset, the spec-round
contract) goes to the cache itself. Caches without sinks (sliding-window layers, keep=0) already
agree and are passed through.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx

from mlxbun.cache.kv import RotatingKVCache

__all__ = ["SinkWindowView", "sink_exact"]


class SinkWindowView:
    """A RotatingKVCache with keep > 0 whose multi-token mask keeps the sinks in view."""

    def __init__(self, cache: RotatingKVCache):
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)

    def update_and_fetch(self, keys, values):
        return self._cache.update_and_fetch(keys, values)

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        c = self._cache
        if N == 1 or (window_size is not None and window_size != c.max_size):
            return c.make_mask(N, window_size=window_size, return_array=return_array)
        # the buffer update_and_fetch will return: the old context (sinks + the last
        # max_size - 1 - keep tokens once full) in temporal order, then the N new tokens
        length = min(c.offset, c.max_size - 1) + N
        q = mx.arange(length - N, length)[:, None]
        j = mx.arange(length)[None]
        return (j <= q) & ((j > q - (c.max_size - c.keep)) | (j < c.keep))


def sink_exact(caches: Sequence[Any]) -> list:
    """The cache list with every sink-keeping ring wrapped in a `SinkWindowView`."""
    return [SinkWindowView(c) if isinstance(c, RotatingKVCache) and c.keep > 0 else c for c in caches]
