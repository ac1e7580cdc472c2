"""deepseek_v32's DSA indexer (`MlaKind.ABSORBED_INDEXED`), op for op as mlx-lm 0.32.2's `Indexer`:
per token, the index_topk cached positions the attention may see, scored by index_n_heads small
heads over its own cached keys (relu(q k^T) weighted per head, summed over the heads); None while
the cache holds at most index_topk positions."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models import rope as R

__all__ = ["Indexer"]


class Indexer(nn.Module):
    def __init__(self, hidden: int, q_lora_rank: int, heads: int, head_dim: int, topk: int, rope_dim: int,
                 theta, traditional: bool, scaling, max_positions):
        super().__init__()
        self.n_heads, self.head_dim, self.index_topk = heads, head_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.softmax_scale = head_dim**-0.5
        self.rope = R.initialize_rope(rope_dim, theta, traditional, scaling, max_positions)

    def __call__(self, x, qr, mask, cache=None):
        b, s, _ = x.shape
        q = self.wq_b(qr)
        q = q.reshape(b, s, self.n_heads, self.head_dim).swapaxes(1, 2)
        k = self.wk(x)
        k = self.k_norm(k)
        k = mx.reshape(k, (b, 1, s, self.head_dim))
        offset = cache.offset if cache is not None else 0
        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset)
        if cache is not None:
            k, _ = cache.update_and_fetch(k, k)
            cache.values = mx.zeros_like(cache.keys)  # as mlx-lm: keeps the unevaluated graph small
        if k.shape[2] <= self.index_topk:
            return None
        scores = q @ k.swapaxes(-1, -2)
        scores = mx.maximum(scores, 0)
        weights = self.weights_proj(x) * (self.n_heads**-0.5 * self.softmax_scale)
        weights = weights.swapaxes(-1, -2)[..., None]
        scores = scores * weights
        if s > 1:  # mlx-lm's per-head Python sum (its order of additions)
            scores = sum(scores[:, h: h + 1] for h in range(scores.shape[1]))
        else:
            scores = scores.sum(axis=1, keepdims=True)
        if mask is not None:
            scores = mx.where(mask, scores, -float("inf"))
        return mx.argpartition(scores, kth=-self.index_topk, axis=-1)[..., -self.index_topk:]
