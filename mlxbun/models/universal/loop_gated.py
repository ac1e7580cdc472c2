"""The forward of iquestloopcoder (mlx-lm 0.32.2 `iquestloopcoder.py`), a `UniversalDense` subclass
(`loader._GRAPHS`): the layer stack runs twice with the same weights. The first loop is llama's,
each layer's keys / values kept; in the second, each layer's queries attend both to the first
loop's keys / values (globally, the full mask) and to its own over a sliding window
(loop_window_size, a RotatingKVCache of that size), the two outputs mixed per head by a sigmoid
gate computed from the queries (`model.gate_projections[i]`: weight [H, hd], bias [H]).

The row's descriptor builds the module tree (llama's names) and drives the loader, sanitize,
audit and coverage; this module adds the gate projections, the cache list (a KVCache per layer,
then a RotatingKVCache per layer: `cache_layers` names both halves' layers) and the two loops,
op for op as mlx-lm's IQuestLoopCoderModel. The tensor-parallel split is mlx-lm's Model.shard:
the attention and MLP as every llama row's, each gate projection's heads sliced per rank."""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError, UnsupportedModelError
from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["LOOP_GATED_TYPES", "LoopGateProjection", "LoopGatedDense"]

LOOP_GATED_TYPES = ("iquestloopcoder",)  # the rows whose forward this module is (loader._GRAPHS)


@partial(mx.compile, shapeless=True)
def _compute_gate(query: mx.array, weight: mx.array, bias: mx.array) -> mx.array:
    gate_logits = query @ weight[:, None, :].swapaxes(-1, -2)
    gate_logits = gate_logits + bias[..., None, None]
    return mx.sigmoid(gate_logits)


@partial(mx.compile, shapeless=True)
def _mix_attention(gate: mx.array, attn_global: mx.array, attn_local: mx.array) -> mx.array:
    return gate * attn_global + (1 - gate) * attn_local


class LoopGateProjection(nn.Module):
    """mlx-lm's LoopGateProjection: sigmoid(q . weight[h] + bias[h]) per head."""

    def __init__(self, num_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.weight = mx.zeros((num_heads, head_dim))
        self.bias = mx.zeros((num_heads,))

    def shard(self, group, where: str) -> None:
        """Keep this rank's heads (mlx-lm's Model.shard slices weight and bias)."""
        n, r = group.size(), group.rank()
        per = self.num_heads // n
        self.weight, self.bias = self.weight[r * per:(r + 1) * per, :], self.bias[r * per:(r + 1) * per]
        self.num_heads = per

    def __call__(self, query: mx.array) -> mx.array:
        return _compute_gate(query, self.weight, self.bias)


def _qkv(attn, x: mx.array, offset) -> tuple[mx.array, mx.array, mx.array]:
    """mlx-lm's Attention.get_qkv over the universal attention's children."""
    B, L, _ = x.shape
    H, KV = attn._h, attn._kv
    queries = attn.q_proj(x).reshape(B, L, H, -1).transpose(0, 2, 1, 3)
    keys = attn.k_proj(x).reshape(B, L, KV, -1).transpose(0, 2, 1, 3)
    values = attn.v_proj(x).reshape(B, L, KV, -1).transpose(0, 2, 1, 3)
    return attn.rope(queries, offset=offset), attn.rope(keys, offset=offset), values


class LoopGatedDense(UniversalDense):
    """`UniversalDense` whose stack runs a plain loop, then a gated global / windowed loop."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        super().__init__(args, descriptor, config, raw_config)
        self.backbone.gate_projections = [LoopGateProjection(args.n_heads, args.head_dim)
                                          for _ in range(args.n_layers)]
        self._window = args.fields["loop_window_size"]
        self._block_type = type(self.layers[0])  # (a block swapped out of it is being skipped)

    @property
    def cache_layers(self) -> list[int]:
        """The first loop's caches, then the second's: layer i twice."""
        n = len(self.args.layers)
        return list(range(n)) * 2

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: a KVCache per layer, then a RotatingKVCache(loop_window_size) per layer
        (mlxbun: `max_kv_size` bounds the first loop's too)."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        n = len(self.args.layers)
        first = [RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache() for _ in range(n)]
        return first + [RotatingKVCache(max_size=self._window) for _ in range(n)]

    def shard(self, group) -> None:
        """mlx-lm's Model.shard: every layer's attention and MLP, then each gate projection's heads."""
        if group.size() > 1:
            heads = self.backbone.gate_projections[0].num_heads
            if heads % group.size():
                raise MlxbunError(f"{self.model_type}: {heads} gate heads do not split across {group.size()} ranks")
        super().shard(group)
        if group.size() > 1:
            for i, gate in enumerate(self.backbone.gate_projections):
                gate.shard(group, where=f"model.gate_projections.{i}")

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        root = self.backbone
        layers, gates = root.layers, root.gate_projections
        if any(type(layer) is not self._block_type for layer in layers):
            raise UnsupportedModelError(f"{self.model_type}: the loops run each block's modules, not the "
                                        "block itself, so a block cannot be skipped (layer-skip drafting)")
        B, L = ids.shape[:2]
        h = root.embed_tokens(ids)
        if cache is None:
            cache = [None] * (2 * len(layers))
        mask = create_attention_mask(h, cache[0])
        window_mask = create_attention_mask(h, cache[len(layers)], window_size=self._window)
        loop1_kv = []
        for layer, c in zip(layers, cache):
            attn = layer.self_attn
            offset = c.offset if c is not None else 0
            q1, k1, v1 = _qkv(attn, layer.input_layernorm(h), offset)
            if c is not None:
                k1, v1 = c.update_and_fetch(k1, v1)
            loop1_kv.append((k1, v1))
            out = scaled_dot_product_attention(q1, k1, v1, cache=c, scale=attn._scale, mask=mask)
            h = h + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        for layer, gate_proj, c, (k1, v1) in zip(layers, gates, cache[len(layers):], loop1_kv):
            attn = layer.self_attn
            offset = c.offset if c is not None else 0
            q2, k2, v2 = _qkv(attn, layer.input_layernorm(h), offset)
            gate = gate_proj(q2)
            attn_global = scaled_dot_product_attention(q2, k1, v1, cache=c, scale=attn._scale, mask=mask)
            if c is not None:
                k2, v2 = c.update_and_fetch(k2, v2)
            attn_local = scaled_dot_product_attention(q2, k2, v2, cache=c, scale=attn._scale, mask=window_mask)
            mixed = _mix_attention(gate, attn_global, attn_local)
            h = h + attn.o_proj(mixed.transpose(0, 2, 1, 3).reshape(B, L, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return root.norm(h)
