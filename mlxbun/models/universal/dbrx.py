"""The forward of dbrx (mlx-lm 0.32.2 `dbrx.py`), a `UniversalDense` subclass with its own module tree
(`loader._GRAPHS`), op for op as mlx-lm's: a fused Wqkv clipped to +-clip_qkv, rope over the whole
head (attn_config's rope_theta); norm_1 / attention / norm_2 held in `norm_attn_norm` (bias-free
LayerNorms, eps 1e-5); a mixture of per-expert SwiGLU MLPs (`ffn.experts[e]`: w1 gate, v1 up, w2
down) routed by `ffn.router.layer`: softmax over every expert in float32, top-k, the k weights
divided by their L1 norm and cast to x's dtype, then token by token the chosen experts' outputs
stacked on the last axis and summed with those weights (mlx-lm's inference loop).

The row's descriptor drives the loader, sanitize (`dbrx_experts`: the fused per-layer expert
matrices split per expert, w2 transposed), audit and coverage. Tensor parallel (mlx-lm's file has
no shard()): the attention by heads (Wqkv's q / k / v segments, whole KV groups), each expert by
hidden units (w1 / v1 all-to-sharded, w2 sharded-to-all); the router and norms whole."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.layers import swiglu
from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL, ShardingError, check_heads, shard_linear
from mlxbun.models.universal.attention import rope_and_cache
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["DBRX_TYPES", "DbrxDense"]

DBRX_TYPES = ("dbrx",)  # the rows whose forward this module is (loader._GRAPHS)


class DbrxAttention(nn.Module):
    def __init__(self, f: Mapping):
        super().__init__()
        self.num_heads, self.d_model = f["n_heads"], f["d_model"]
        self.head_dim = self.d_model // self.num_heads
        self.num_key_value_heads = f["attn_config"]["kv_n_heads"]
        self.clip_qkv = f["attn_config"]["clip_qkv"]
        self.scale = self.head_dim**-0.5
        self.Wqkv = nn.Linear(self.d_model, (self.num_key_value_heads * 2 + self.num_heads) * self.head_dim,
                              bias=False)
        self.out_proj = nn.Linear(self.d_model, self.d_model, bias=False)
        self.rope = nn.RoPE(self.head_dim, traditional=False, base=f["attn_config"]["rope_theta"])

    def shard(self, group, where: str) -> None:
        n = group.size()
        check_heads(where, self.num_heads, n)
        if self.num_key_value_heads % n:
            raise ShardingError(f"{where}: {self.num_key_value_heads} KV heads do not split across {n} ranks")
        q = self.num_heads * self.head_dim
        layers = {"Wqkv": shard_linear(self.Wqkv, ALL_TO_SHARDED, group, where=f"{where}.Wqkv",
                                       segments=[q, q + self.num_key_value_heads * self.head_dim]),
                  "out_proj": shard_linear(self.out_proj, SHARDED_TO_ALL, group, where=f"{where}.out_proj")}
        for name, module in layers.items():
            setattr(self, name, module)
        self.num_heads //= n
        self.num_key_value_heads //= n
        self.d_model //= n  # (the split of the q segment: mlx-lm's `splits` read d_model)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        qkv = self.Wqkv(x)
        qkv = mx.clip(qkv, a_min=-self.clip_qkv, a_max=self.clip_qkv)
        splits = [self.d_model, self.d_model + self.head_dim * self.num_key_value_heads]
        queries, keys, values = mx.split(qkv, splits, axis=-1)
        B, L, D = x.shape
        queries = queries.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)
        keys = keys.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        values = values.reshape(B, L, self.num_key_value_heads, -1).transpose(0, 2, 1, 3)
        queries, keys, values = rope_and_cache(self.rope, queries, keys, values, cache)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.out_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class NormAttnNorm(nn.Module):
    def __init__(self, f: Mapping):
        super().__init__()
        self.norm_1 = nn.LayerNorm(f["d_model"], bias=False)
        self.norm_2 = nn.LayerNorm(f["d_model"], bias=False)
        self.attn = DbrxAttention(f)

    def shard(self, group, where: str) -> None:
        self.attn.shard(group, where=f"{where}.attn")

    def __call__(self, x, mask=None, cache=None):
        h = self.attn(self.norm_1(x), mask=mask, cache=cache)
        x = h + x
        return x, self.norm_2(x)


class DbrxMLP(nn.Module):
    def __init__(self, d_model: int, ffn_dim: int):
        super().__init__()
        self.v1 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w1 = nn.Linear(d_model, ffn_dim, bias=False)
        self.w2 = nn.Linear(ffn_dim, d_model, bias=False)

    def shard(self, group, where: str) -> None:
        layers = {"v1": shard_linear(self.v1, ALL_TO_SHARDED, group, where=f"{where}.v1"),
                  "w1": shard_linear(self.w1, ALL_TO_SHARDED, group, where=f"{where}.w1"),
                  "w2": shard_linear(self.w2, SHARDED_TO_ALL, group, where=f"{where}.w2")}
        for name, module in layers.items():
            setattr(self, name, module)

    def __call__(self, x: mx.array) -> mx.array:
        return self.w2(swiglu(self.w1(x), self.v1(x)))


class Router(nn.Module):
    def __init__(self, d_model: int, num_experts: int):
        super().__init__()
        self.layer = nn.Linear(d_model, num_experts, bias=False)

    def __call__(self, x: mx.array):
        return self.layer(x)


class SparseMoeBlock(nn.Module):
    def __init__(self, f: Mapping):
        super().__init__()
        ffn = f["ffn_config"]
        self.num_experts, self.num_experts_per_tok = ffn["moe_num_experts"], ffn["moe_top_k"]
        self.router = Router(f["d_model"], self.num_experts)
        self.experts = [DbrxMLP(f["d_model"], ffn["ffn_hidden_size"]) for _ in range(self.num_experts)]

    def shard(self, group, where: str) -> None:
        for e, expert in enumerate(self.experts):
            expert.shard(group, where=f"{where}.experts.{e}")

    def __call__(self, x: mx.array) -> mx.array:
        ne = self.num_experts_per_tok
        orig_shape = x.shape
        x = x.reshape(-1, x.shape[-1])
        gates = self.router(x)
        gates = mx.softmax(gates.astype(mx.float32), axis=-1)
        inds = mx.stop_gradient(mx.argpartition(-gates, kth=ne - 1, axis=-1)[:, :ne])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = scores / mx.linalg.norm(scores, ord=1, axis=-1, keepdims=True)
        scores = scores.astype(x.dtype)
        y = []
        for xt, st, it in zip(x, scores, inds.tolist()):
            yt = mx.stack([self.experts[e](xt) for e in it], axis=-1)
            y.append((yt * st).sum(axis=-1))
        return mx.stack(y, axis=0).reshape(orig_shape)


class DecoderLayer(nn.Module):
    def __init__(self, f: Mapping):
        super().__init__()
        self.ffn = SparseMoeBlock(f)
        self.norm_attn_norm = NormAttnNorm(f)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        r, h = self.norm_attn_norm(x, mask, cache)
        return self.ffn(h) + r


class DbrxDense(UniversalDense):
    """dbrx: parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        self._own_tree(args, descriptor, config, raw_config, tied=False)
        d, n, f = descriptor, descriptor.names, args.fields
        root = nn.Module()
        setattr(root, n.embed, nn.Embedding(args.vocab, args.hidden))
        setattr(root, n.layers, [DecoderLayer(f) for _ in range(args.n_layers)])
        setattr(root, n.final_norm, nn.LayerNorm(args.hidden, bias=False))
        self[n.root] = root
        self[n.head] = nn.Linear(args.hidden, args.vocab, bias=False)

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        root, n = self.backbone, self.descriptor.names
        h = root[n.embed](ids)
        blocks = root[n.layers]
        if cache is None:
            cache = [None] * len(blocks)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(blocks, cache):
            h = layer(h, mask, c)
        return root[n.final_norm](h)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self[self.descriptor.names.head](h)
