"""The forward of a row with `loops` knobs (nanbeige): mlx-lm runs the whole layer stack several
times with the same weights, each pass with its own KV caches and (unless skip_loop_final_norm)
ending with the final norm. A UniversalDense subclass (`loader._GRAPHS`): the module tree, sanitize,
audit and split are the row's; only the cache list and the forward differ."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models.base import create_attention_mask
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.fields import get

__all__ = ["LoopedDense", "loop_count"]


def loop_count(fields, knobs, mt: str) -> int:
    """mlx-lm's effective_num_loops: one per loop_loss_weights entry plus one, else num_loops."""
    weights = get(fields, knobs.loss_weights, mt)
    return len(weights) + 1 if weights else get(fields, knobs.loops, mt)


class LoopedDense(UniversalDense):
    """`UniversalDense` whose layer stack runs `loop_count` times (nanbeige's NanbeigeModel)."""

    @property
    def loops(self) -> int:
        return loop_count(self.args.fields, self.descriptor.loops, self.model_type)

    @property
    def cache_layers(self) -> list[int]:
        """Entry j of the cache list is layer j % N (one entry per layer per loop)."""
        n = len(self.args.layers)
        return [j % n for j in range(self.loops * n)]

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: a KVCache per layer per loop (max_kv_size, which mlx-lm's ignores,
        bounds each as the universal graph does)."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        n = self.loops * len(self.args.layers)
        if max_kv_size is not None:
            return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(n)]
        return [KVCache() for _ in range(n)]

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        d, n, root = self.descriptor, self.descriptor.names, self.backbone
        skip = get(self.args.fields, d.loops.skip_final_norm, self.model_type)
        blocks, norm = root[n.layers], root[n.final_norm]
        h = root[n.embed](ids)
        if cache is None:
            cache = [None] * (self.loops * len(blocks))
        mask = create_attention_mask(h, cache[0])
        for i in range(self.loops):
            for layer, c in zip(blocks, cache[i * len(blocks):(i + 1) * len(blocks)]):
                h = layer(h, mask, c)
            if not skip:
                h = norm(h)
        return norm(h) if skip else h
