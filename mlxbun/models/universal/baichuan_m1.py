"""The forward of baichuan_m1 (mlx-lm 0.32.2 `baichuan_m1.py`), a `UniversalDense` subclass with its
own module tree (`loader._GRAPHS`), op for op as mlx-lm's: a fused W_pack projection; keys and
values each pass a two-tap causal convolution over positions per KV head (`conv_k` / `conv_v`,
[1, 1, KV, 1, 2]: previous * w0 + current * w1, the previous token's raw key / value kept in the
layer's ArraysCache) before the rope and the KV cache; layers listed in sliding_window_layers
attend over a window (their own head counts when num_swa_* are set) with a RotatingKVCache; each
layer's cache is CacheList(ArraysCache(2), KVCache | RotatingKVCache), as mlx-lm's make_cache.

It calls the ArraysCache's `advance` after writing it (mlx-lm's does not; bookkeeping only, so
speculative rounds count the tokens). Tensor parallel (mlx-lm's file has no shard()): the
attention by heads (W_pack's q / k / v segments, whole KV groups; conv taps sliced per KV head),
the MLP by hidden units."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.cache_list import CacheList
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL, ShardingError, check_heads, shard_linear
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.mlp import MLP
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["BAICHUAN_M1_TYPES", "BaichuanM1Dense"]

BAICHUAN_M1_TYPES = ("baichuan_m1",)  # the rows whose forward this module is (loader._GRAPHS)


class BaichuanAttention(nn.Module):
    def __init__(self, f: Mapping, layer_idx: int):
        super().__init__()
        self.is_swa = layer_idx in f["sliding_window_layers"]
        self.num_heads = (f["num_swa_attention_heads"] if self.is_swa and f["num_swa_attention_heads"]
                          else f["num_attention_heads"])
        self.num_kv_heads = (f["num_swa_key_value_heads"] if self.is_swa and f["num_swa_key_value_heads"]
                             else f["num_key_value_heads"])
        self.hidden_size = f["hidden_size"]
        self.head_dim = self.hidden_size // self.num_heads
        self.scale = self.head_dim**-0.5
        self.W_pack = nn.Linear(self.hidden_size, self.hidden_size + 2 * self.num_kv_heads * self.head_dim,
                                bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rope = nn.RoPE(self.head_dim, traditional=False, base=f["rope_theta"])
        self.conv_window = f["conv_window"]
        self.conv_k = mx.zeros((1, 1, self.num_kv_heads, 1, self.conv_window))
        self.conv_v = mx.zeros((1, 1, self.num_kv_heads, 1, self.conv_window))

    def shard(self, group, where: str) -> None:
        n, r = group.size(), group.rank()
        check_heads(where, self.num_heads, n)
        if self.num_kv_heads % n:
            raise ShardingError(f"{where}: {self.num_kv_heads} KV heads do not split across {n} ranks")
        q = self.hidden_size
        layers = {"W_pack": shard_linear(self.W_pack, ALL_TO_SHARDED, group, where=f"{where}.W_pack",
                                         segments=[q, q + self.num_kv_heads * self.head_dim]),
                  "o_proj": shard_linear(self.o_proj, SHARDED_TO_ALL, group, where=f"{where}.o_proj")}
        for name, module in layers.items():
            setattr(self, name, module)
        per = self.num_kv_heads // n
        self.conv_k = self.conv_k[:, :, r * per:(r + 1) * per]
        self.conv_v = self.conv_v[:, :, r * per:(r + 1) * per]
        self.num_heads //= n
        self.num_kv_heads = per
        self.hidden_size //= n  # (the q segment's width: mlx-lm splits at D)

    def _custom_convolution(self, u, weights, state=None):
        B, H, L, D = u.shape
        weights = weights.reshape((1, H, self.conv_window, 1, 1))
        w0 = weights[:, :, 0]
        w1 = weights[:, :, 1]
        if state is None:
            state = mx.zeros((B, H, 1, D), u.dtype)
        if L > 1:
            u_prev = mx.concatenate([state, u[:, :, :-1]], axis=2)
        else:
            u_prev = state
        return u_prev * w0 + u * w1

    def __call__(self, x: mx.array, mask=None, cache: Any = None) -> mx.array:
        B, L, D = x.shape
        proj = self.W_pack(x)
        q, k, v = mx.split(proj, (self.hidden_size, self.hidden_size + self.num_kv_heads * self.head_dim), axis=-1)
        q = q.reshape(B, L, self.num_heads, self.head_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        v = v.reshape(B, L, self.num_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        if cache is None:
            cache = (None, None)
        if cache[0] is not None:
            offset = cache[1].offset
            last_k, last_v = cache[0][0], cache[0][1]
        else:
            offset = 0
            last_k, last_v = None, None
        k_init, v_init = k, v
        k = self._custom_convolution(k, self.conv_k, state=last_k)
        v = self._custom_convolution(v, self.conv_v, state=last_v)
        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset)
        if cache[0] is not None:
            k, v = cache[1].update_and_fetch(k, v)
            if L > 0:
                cache[0][0] = k_init[:, :, -1:, :]
                cache[0][1] = v_init[:, :, -1:, :]
                cache[0].advance(L)
        out = scaled_dot_product_attention(q, k, v, cache=cache[1], scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, a: UniversalArgs, d: ArchDescriptor, layer_idx: int):
        super().__init__()
        f = a.fields
        self.self_attn = BaichuanAttention(f, layer_idx)
        self.mlp = MLP(a, d)
        self.input_layernorm = nn.RMSNorm(a.hidden, eps=f["rms_norm_eps"])
        self.post_attention_layernorm = nn.RMSNorm(a.hidden, eps=f["rms_norm_eps"])

    def __call__(self, x: mx.array, mask=None, cache: Any = None) -> mx.array:
        x = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class BaichuanM1Dense(UniversalDense):
    """baichuan_m1: parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        self._own_tree(args, descriptor, config, raw_config, tied=False)
        d, n, f = descriptor, descriptor.names, args.fields
        self._swa = set(f["sliding_window_layers"])
        layers = range(args.n_layers)
        self._full_idx = next((i for i in layers if i not in self._swa), None)
        self._swa_idx = f["sliding_window_layers"][0] if f["sliding_window_layers"] else None
        root = nn.Module()
        setattr(root, n.embed, nn.Embedding(args.vocab, args.hidden))
        setattr(root, n.layers, [DecoderLayer(args, d, i) for i in layers])
        setattr(root, n.final_norm, nn.RMSNorm(args.hidden, eps=f["rms_norm_eps"]))
        self[n.root] = root
        self[n.head] = nn.Linear(args.hidden, args.vocab, bias=False)

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: CacheList(ArraysCache(2), RotatingKVCache(sliding_window) on the
        sliding layers, else KVCache) per layer (mlxbun: `max_kv_size` bounds the global ones)."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        w = self.args.fields["sliding_window"]

        def kv(i):
            if i in self._swa:
                return RotatingKVCache(max_size=w)
            return RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache()
        return [CacheList(ArraysCache(size=2), kv(i)) for i in range(self.args.n_layers)]

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        root, n = self.backbone, self.descriptor.names
        x = root[n.embed](ids)
        blocks = root[n.layers]
        if cache is None:
            cache = [(None, None)] * len(blocks)
        c_global = None if self._full_idx is None else cache[self._full_idx][1]
        c_swa = None if self._swa_idx is None else cache[self._swa_idx][1]
        global_mask = create_attention_mask(x, c_global)
        swa_mask = create_attention_mask(x, c_swa, window_size=self.args.fields["sliding_window"])
        for i, (layer, c) in enumerate(zip(blocks, cache)):
            x = layer(x, swa_mask if i in self._swa else global_mask, c)
        return root[n.final_norm](x)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self[self.descriptor.names.head](h)
