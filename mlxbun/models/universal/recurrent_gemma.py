"""The forward of recurrent_gemma (mlx-lm 0.32.2 `recurrent_gemma.py`, Griffin), a `UniversalDense`
subclass with its own module tree (`loader._GRAPHS`), op for op as mlx-lm's: residual blocks whose
temporal block is, by block_types[i % len], either recurrent (linear_y -> gelu_approx gate;
linear_x -> a causal depthwise conv (`conv_1d`, state: ArraysCache slot 0) -> the RG-LRU (per-head
block-diagonal sigmoid input / recurrence gates, a = exp(-8 * gate_a * softplus(recurrent_param)),
the normalized input scanned token by token, state: slot 1) -> * y -> linear_out) or local attention
(one KV head, rope over half the head, a RotatingKVCache of attention_window_size); (1 + w)
RMSNorms (the block norms at eps 1e-5); a gelu_approx MLP of intermediate_size // 2; embeddings
times sqrt(D); logits soft-capped.

The recurrent block calls the ArraysCache's `advance` (mlx-lm's does not; bookkeeping for the
speculative rounds). Tensor parallel (mlx-lm's file has no shard()): a recurrent block by its heads
(linear_y / linear_x rows, the conv's channels, the RG-LRU's per-head gates and recurrence, linear_out
summed), the attention by query heads (its one KV head whole on every rank), the MLP by hidden units."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.layers import GemmaRMSNorm
from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL, check_heads, shard_linear
from mlxbun.models.universal.attention import rope_and_cache
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["RECURRENT_GEMMA_TYPES", "RecurrentGemmaDense"]

RECURRENT_GEMMA_TYPES = ("recurrent_gemma",)  # the rows whose forward this module is (loader._GRAPHS)


def _rows(x: mx.array, group, axis: int = 0) -> mx.array:
    """This rank's contiguous slice of `x` along `axis`."""
    n, r = group.size(), group.rank()
    per = x.shape[axis] // n
    return mx.take(x, mx.arange(r * per, (r + 1) * per), axis=axis)


def rnn_scan(x, a, h0):
    if x.shape[1] == 1:
        if h0 is None:
            return x, x[:, 0]
        y = a * h0[:, None] + x
        return y, y[:, -1]
    if h0 is not None:
        h_t = h0
    else:
        B, _, D = x.shape
        h_t = mx.zeros((B, D), dtype=x.dtype)
    y = mx.zeros_like(x)
    for t in range(x.shape[1]):
        h_t = a[:, t] * h_t + x[:, t]
        y[:, t] = h_t
    return y, h_t


class Conv1d(nn.Module):
    def __init__(self, channels: int, kernel_size: int):
        super().__init__()
        self.weight = mx.zeros((channels, kernel_size, 1))
        self.bias = mx.zeros((channels,))

    def __call__(self, x, cache=None):
        groups, K, _ = self.weight.shape
        if cache is not None:
            x = mx.concatenate([cache, x], axis=1)
        else:
            x = mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)])
        y = mx.conv_general(x, self.weight, groups=groups)
        return y + self.bias, x[:, -K + 1:, :]


class RGLRU(nn.Module):
    def __init__(self, width: int, num_heads: int):
        super().__init__()
        self.width, self.num_heads = width, num_heads
        self.head_dim = width // num_heads
        self.recurrent_param = mx.zeros((width,))
        self.input_gate_weight = mx.zeros((num_heads, self.head_dim, self.head_dim))
        self.input_gate_bias = mx.zeros((num_heads, self.head_dim))
        self.recurrent_gate_weight = mx.zeros((num_heads, self.head_dim, self.head_dim))
        self.recurrent_gate_bias = mx.zeros((num_heads, self.head_dim))

    def __call__(self, x: mx.array, cache=None):
        B, L, _ = x.shape

        def apply_block_linear(h, w, b):
            h = h.reshape((B, L, self.num_heads, self.head_dim))
            h = (h.swapaxes(1, 2) @ w).swapaxes(1, 2) + b
            return mx.sigmoid(h.flatten(2, 3))

        gate_x = apply_block_linear(x, self.input_gate_weight, self.input_gate_bias)
        gate_a = apply_block_linear(x, self.recurrent_gate_weight, self.recurrent_gate_bias)
        log_a = -8.0 * gate_a * nn.softplus(self.recurrent_param)
        a = mx.exp(log_a)
        a_square = mx.exp(2 * log_a)
        gated_x = x * gate_x
        multiplier = mx.sqrt(1 - a_square)
        if cache is None:
            multiplier[:, 0, :] = 1.0
        normalized_x = gated_x * multiplier.astype(x.dtype)
        return rnn_scan(x=normalized_x, a=a, h0=cache)


class RecurrentBlock(nn.Module):
    cache_slots = 2

    def __init__(self, width: int, num_heads: int, conv1d_temporal_width: int = 4):
        super().__init__()
        self.linear_y = nn.Linear(width, width)
        self.linear_x = nn.Linear(width, width)
        self.linear_out = nn.Linear(width, width)
        self.conv_1d = Conv1d(channels=width, kernel_size=conv1d_temporal_width)
        self.rg_lru = RGLRU(width=width, num_heads=num_heads)

    def shard(self, group, where: str) -> None:
        check_heads(where, self.rg_lru.num_heads, group.size())
        layers = {"linear_y": shard_linear(self.linear_y, ALL_TO_SHARDED, group, where=f"{where}.linear_y"),
                  "linear_x": shard_linear(self.linear_x, ALL_TO_SHARDED, group, where=f"{where}.linear_x"),
                  "linear_out": shard_linear(self.linear_out, SHARDED_TO_ALL, group, where=f"{where}.linear_out")}
        for name, module in layers.items():
            setattr(self, name, module)
        self.conv_1d.weight, self.conv_1d.bias = _rows(self.conv_1d.weight, group), _rows(self.conv_1d.bias, group)
        lru = self.rg_lru
        for name in ("recurrent_param", "input_gate_weight", "input_gate_bias", "recurrent_gate_weight",
                     "recurrent_gate_bias"):
            setattr(lru, name, _rows(lru[name], group))
        lru.num_heads //= group.size()
        lru.width //= group.size()

    def __call__(self, x: mx.array, cache=None, mask=None):
        y = nn.gelu_approx(self.linear_y(x))
        x = self.linear_x(x)
        slots = [None, None] if cache is None else cache
        x, slots[0] = self.conv_1d(x=x, cache=slots[0])
        x, slots[1] = self.rg_lru(x=x, cache=slots[1])
        if isinstance(cache, ArraysCache):
            cache.advance(x.shape[1])
        return self.linear_out(x * y)


class LocalAttentionBlock(nn.Module):
    def __init__(self, width: int, num_heads: int, window_size: int):
        super().__init__()
        self.width, self.num_heads, self.window_size = width, num_heads, window_size
        self.scale = (width // num_heads) ** (-0.5)
        self.head_dim = width // num_heads
        self.q_proj = nn.Linear(width, width, bias=False)
        self.k_proj = nn.Linear(width, self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.head_dim, bias=False)
        self.o_proj = nn.Linear(width, width, bias=True)
        self.rope = nn.RoPE(self.head_dim // 2, traditional=False)

    def shard(self, group, where: str) -> None:
        """Query heads split; the one KV head computed whole on every rank."""
        n = group.size()
        check_heads(where, self.num_heads, n)
        layers = {"q_proj": shard_linear(self.q_proj, ALL_TO_SHARDED, group, where=f"{where}.q_proj"),
                  "o_proj": shard_linear(self.o_proj, SHARDED_TO_ALL, group, where=f"{where}.o_proj")}
        for name, module in layers.items():
            setattr(self, name, module)
        self.num_heads //= n

    def __call__(self, x: mx.array, cache=None, mask=None):
        B, L, D = x.shape
        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        queries = queries.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, 1, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, 1, -1).transpose(0, 2, 1, 3)
        queries, keys, values = rope_and_cache(self.rope, queries, keys, values, cache)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class MLPBlock(nn.Module):
    def __init__(self, width: int, expanded_width: int):
        super().__init__()
        self.up_proj = nn.Linear(width, expanded_width // 2)
        self.gate_proj = nn.Linear(width, expanded_width // 2)
        self.down_proj = nn.Linear(expanded_width // 2, width)

    def shard(self, group, where: str) -> None:
        layers = {name: shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
                  for name in ("up_proj", "gate_proj")}
        layers["down_proj"] = shard_linear(self.down_proj, SHARDED_TO_ALL, group, where=f"{where}.down_proj")
        for name, module in layers.items():
            setattr(self, name, module)

    def __call__(self, x: mx.array):
        gate = self.gate_proj(x)
        return self.down_proj(nn.gelu_approx(gate) * self.up_proj(x))


class ResidualBlock(nn.Module):
    def __init__(self, f: Mapping, kind: str):
        super().__init__()
        width = f["hidden_size"]
        self.temporal_block_type = kind
        self.temporal_pre_norm = GemmaRMSNorm(width)
        if kind == "recurrent":
            self.temporal_block = RecurrentBlock(width, f["num_attention_heads"], f["conv1d_width"])
        else:
            self.temporal_block = LocalAttentionBlock(width, f["num_attention_heads"], f["attention_window_size"])
        self.channel_pre_norm = GemmaRMSNorm(width)
        self.mlp_block = MLPBlock(width, f["intermediate_size"])

    def __call__(self, x: mx.array, cache=None, mask=None):
        residual = self.temporal_block(self.temporal_pre_norm(x), cache=cache, mask=mask) + x
        return self.mlp_block(self.channel_pre_norm(residual)) + residual


class RecurrentGemmaDense(UniversalDense):
    """recurrent_gemma: parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        self._own_tree(args, descriptor, config, raw_config, tied=False)
        d, f = descriptor, args.fields
        kinds = f["block_types"]
        self._kinds = [kinds[i % len(kinds)] for i in range(args.n_layers)]
        self._swa_idx, self._full_idx = kinds.index("attention"), None
        root = nn.Module()
        root.embed_tokens = nn.Embedding(args.vocab, args.hidden)
        root.layers = [ResidualBlock(f, k) for k in self._kinds]
        root.final_norm = GemmaRMSNorm(args.hidden, eps=f["rms_norm_eps"])
        self.model = root
        self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: ArraysCache(2) per recurrent block, RotatingKVCache(window) per
        attention block."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        w = self.args.fields["attention_window_size"]
        return [ArraysCache(size=2) if k == "recurrent" else RotatingKVCache(max_size=w) for k in self._kinds]

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        f, root = self.args.fields, self.model
        x = root.embed_tokens(ids)
        if f["embeddings_scale_by_sqrt_dim"]:
            x = x * math.sqrt(x.shape[-1])
        if cache is None:
            cache = [None] * len(root.layers)
        mask = create_attention_mask(x, cache[self._swa_idx], window_size=f["attention_window_size"])
        for i, block in enumerate(root.layers):
            x = block(x, mask=mask, cache=cache[i])
        return root.final_norm(x)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        logits = self.lm_head(h) if "lm_head" in self else self.model.embed_tokens.as_linear(h)
        c = self.args.fields["logits_soft_cap"]
        return mx.tanh(logits / c) * c if c else logits
