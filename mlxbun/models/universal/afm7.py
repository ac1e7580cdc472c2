"""The forward of afm7 (mlx-lm 0.32.2 `afm7.py`), a `UniversalDense` subclass with its own module tree
(`loader._GRAPHS`), op for op as mlx-lm's: num_layers - num_kv_reuse_layers regular layers (a fused
qkv_proj split by its accumulated widths, traditional rope, then q / k RMSNorm, the keys and values
through a compiled fake 8-bit quantization by the learned quant_key_scale / quant_value_scale, sdpa)
and then the KV-reuse layers, which project only queries (rope at offset S - L, q RMSNorm) and attend
to the last regular layer's cached keys / values (without a cache, a concatenating one made for the
forward, as mlx-lm's ConcatenateKVCache); SwiGLU MLPs of int(hidden_dim * hidden_dim_scale_factor);
RMSNorms; the tied head embedding.as_linear. Its cache: a KVCache per regular layer (make_cache).

The row's descriptor drives the loader, audit and coverage. No quantized variant: mlx-lm's
FusedLinear.to_quantized takes no mode argument, which mlx's nn.quantize passes, so no oracle
quantizes afm7 (mlxbun refuses its fused projection the same way). No tensor-parallel split."""

from __future__ import annotations

from functools import partial
from itertools import accumulate
from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache import KVCache
from mlxbun.errors import MlxbunError
from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.layers import swiglu
from mlxbun.models.sharding import ShardingError
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["AFM7_TYPES", "Afm7Dense"]

AFM7_TYPES = ("afm7",)  # the rows whose forward this module is (loader._GRAPHS)


class FusedLinear(nn.Linear):
    """One bias-free projection whose output is split at the accumulated widths."""

    def __init__(self, input_dims: int, output_dims: list[int]):
        *indices, total = accumulate(output_dims)
        self.indices = indices
        super().__init__(input_dims, total, bias=False)

    def __call__(self, x):
        return super().__call__(x).split(self.indices, axis=-1)

    def to_quantized(self, *args, **kwargs):
        raise MlxbunError("afm7: mlx-lm cannot quantize its fused qkv_proj (FusedLinear.to_quantized takes no "
                          "mode argument, which nn.quantize passes), so a quantized afm7 has no oracle")


@partial(mx.compile, shapeless=True)
def _fake_8bit_quant(x, scale):
    dt = x.dtype
    x = x.astype(mx.float32)
    x = (x / scale).round()
    x = mx.clip(x, -128, 127)
    return (x * scale).astype(dt)


class _Concatenate:
    """mlx-lm's ConcatenateKVCache, as far as a cache-less forward uses it."""

    def __init__(self):
        self.keys = self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.keys is not None:
            keys, values = mx.concatenate([self.keys, keys], axis=-2), mx.concatenate([self.values, values], axis=-2)
        self.keys, self.values, self.offset = keys, values, keys.shape[-2]
        return keys, values

    def keys_and_values(self):
        return self.keys, self.values


class Afm7Attention(nn.Module):
    def __init__(self, a: UniversalArgs):
        super().__init__()
        dim, self.n_heads, self.n_kv_heads = a.hidden, a.n_heads, a.n_kv_heads
        self.head_dim = head_dim = dim // self.n_heads
        self.scale = head_dim**-0.5
        self.qkv_proj = FusedLinear(dim, [self.n_heads * head_dim] + 2 * [self.n_kv_heads * head_dim])
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.rope = nn.RoPE(head_dim, traditional=True, base=a.fields["rope_theta"])  # initialize_rope, unscaled
        self.q_norm = nn.RMSNorm(head_dim)
        self.k_norm = nn.RMSNorm(head_dim)
        self.quant_key_scale = mx.array(1.0)
        self.quant_value_scale = mx.array(1.0)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        queries, keys, values = self.qkv_proj(x)
        queries = queries.reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        queries = self.q_norm(self.rope(queries, offset=offset))
        keys = self.k_norm(self.rope(keys, offset=offset))
        keys = _fake_8bit_quant(keys, self.quant_key_scale)
        values = _fake_8bit_quant(values, self.quant_value_scale)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.out_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Afm7ReuseAttention(nn.Module):
    def __init__(self, a: UniversalArgs):
        super().__init__()
        dim, self.n_heads = a.hidden, a.n_heads
        self.head_dim = head_dim = dim // self.n_heads
        self.scale = head_dim**-0.5
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.out_proj = nn.Linear(dim, dim, bias=False)
        self.rope = nn.RoPE(head_dim, traditional=True, base=a.fields["rope_theta"])
        self.q_norm = nn.RMSNorm(head_dim)

    def __call__(self, x: mx.array, keys: mx.array, values: mx.array, mask=None, offset=0) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, -1).transpose(0, 2, 1, 3)
        queries = self.q_norm(self.rope(queries, offset=offset))
        output = scaled_dot_product_attention(queries, keys, values, cache=None, scale=self.scale, mask=mask)
        return self.out_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class Afm7MLP(nn.Module):
    def __init__(self, a: UniversalArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden, a.intermediate, bias=False)
        self.down_proj = nn.Linear(a.intermediate, a.hidden, bias=False)
        self.up_proj = nn.Linear(a.hidden, a.intermediate, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Afm7Block(nn.Module):
    def __init__(self, a: UniversalArgs, reuse: bool):
        super().__init__()
        self.self_attn = Afm7ReuseAttention(a) if reuse else Afm7Attention(a)
        self.mlp = Afm7MLP(a)
        self.input_layernorm = nn.RMSNorm(a.hidden, eps=a.eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden, eps=a.eps)

    def __call__(self, x: mx.array, *attn_args) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return h + self.mlp(self.post_attention_layernorm(h))


class Afm7Dense(UniversalDense):
    """afm7: parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        self._own_tree(args, descriptor, config, raw_config, tied=True)
        reuse = args.fields["num_kv_reuse_layers"]
        root = nn.Module()
        root.embedding = nn.Embedding(args.vocab, args.hidden)
        root.layers = [Afm7Block(args, False) for _ in range(args.n_layers - reuse)]
        root.kv_reuse_layers = [Afm7Block(args, True) for _ in range(reuse)]
        root.output_norm = nn.RMSNorm(args.hidden, eps=args.eps)
        self["model"] = root

    @property
    def layers(self) -> list:  # mlx-lm's: the regular layers, then the KV-reuse ones
        return self.model.layers + self.model.kv_reuse_layers

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: a KVCache per regular layer (it ignores max_kv_size)."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported: {', '.join(sorted(kv_options))}")
        return [KVCache() for _ in self.model.layers]

    def shard(self, group) -> None:
        if group.size() > 1:
            raise ShardingError(f"{self.model_type}: afm7's KV-reuse layers have no tensor-parallel split in "
                                "mlxbun; run it in one process (--tp 1)")

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        h = self.model.embedding(ids)
        if cache is None:
            cache = [None] * len(self.model.layers)
            cache[-1] = _Concatenate()
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.model.layers, cache):
            h = layer(h, mask, c)
        keys, values = cache[-1].keys_and_values()
        # mlx-lm's rope offset S - L, S = keys.shape[2]: the cache's offset (a static cache's buffer is longer)
        offset = cache[-1].offset - ids.shape[1]
        for layer in self.model.kv_reuse_layers:
            h = layer(h, keys, values, mask, offset)
        return self.model.output_norm(h)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self.model.embedding.as_linear(h)
