"""The forward of plamo2 (mlx-lm 0.32.2 `plamo2.py`), a `UniversalDense` subclass with its own module
tree (`loader._GRAPHS`), op for op as mlx-lm's: layers under model.layers.layers, each a mixer
between sandwich norms scaling by (weight + offset) (1 before, 1/5 after the mixer; 1 before,
1/5**1.5 after the MLP): PLaMo 2's Mamba (in_proj laid out per head [z | x], a causal depthwise
conv1d + SiLU whose state is ArraysCache slot 0, bcdt_proj to B / C / dt each rms-normed with its
own weight, dt_proj to the heads, the SSD scan `mixers.ssm.ssm_update` with one B / C group, its
state slot 1; swiglu(z, y); out_proj) on the layers `is_mamba` picks, else attention (fused
qkv_proj, weightless per-head RMSNorm times q_weight / k_weight, nn.RoPE, plain sdpa); a fused
SwiGLU MLP. Caches: ArraysCache(2) per Mamba layer, KVCache per attention layer.

Tensor parallel (mlx-lm's file has no shard()): a Mamba layer by heads (in_proj's per-head rows,
the conv's channels, dt_proj's rows, A_log / D / dt_bias), bcdt_proj's partial products summed
across the ranks so B / C / dt see every channel; attention by heads (qkv segments, whole KV groups,
q_weight / k_weight sliced); the MLP by hidden units."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models.base import create_attention_mask, create_ssm_mask
from mlxbun.models.layers import OffsetRMSNorm, swiglu
from mlxbun.models.sharding import (
    ALL_TO_SHARDED,
    SHARDED_TO_ALL,
    ShardingError,
    check_heads,
    shard_depthwise_conv,
    shard_linear,
)
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.mixers.ssm import padded_conv_input, ssm_update
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["PLAMO2_TYPES", "Plamo2Dense", "plamo2_is_mamba"]

PLAMO2_TYPES = ("plamo2",)  # the rows whose forward this module is (loader._GRAPHS)


def plamo2_is_mamba(f: Mapping, i: int) -> bool:
    """mlx-lm's is_mamba (mamba_step > 1 and i < num_hidden_layers are checked by the post-init)."""
    if not f["mamba_enabled"]:
        return False
    if f["num_hidden_layers"] <= (f["mamba_step"] // 2):
        return i != f["num_hidden_layers"] - 1  # attention in the last layer
    return (i % f["mamba_step"]) != (f["mamba_step"] // 2)


class Plamo2Mamba(nn.Module):
    cache_slots = 2

    def __init__(self, f: Mapping):
        super().__init__()
        self.eps = f["rms_norm_eps"]
        self.hidden_size, self.d_state = f["hidden_size"], f["mamba_d_state"]
        self.conv_kernel_size = f["mamba_d_conv"]
        self.num_heads, self.hidden_size_per_head = f["mamba_num_heads"], f["hidden_size_per_head"]
        self.intermediate_size = self.num_heads * self.hidden_size_per_head
        self.in_proj = nn.Linear(self.hidden_size, 2 * self.intermediate_size, bias=False)
        self.conv1d = nn.Conv1d(in_channels=self.intermediate_size, out_channels=self.intermediate_size, bias=False,
                                kernel_size=self.conv_kernel_size, groups=self.intermediate_size, padding=0)
        self.dt_dim = max(64, self.hidden_size // 16)
        self.bcdt_proj = nn.Linear(self.intermediate_size, self.dt_dim + 2 * self.d_state, bias=False)
        self.dt_proj = nn.Linear(self.dt_dim, self.num_heads, bias=False)
        self.dt_bias = mx.zeros(shape=(self.num_heads,))
        self.A_log = mx.log(mx.arange(1, self.num_heads + 1, dtype=mx.float32))
        self.D = mx.ones(self.num_heads)
        self.dt_norm_weight = mx.ones(self.dt_dim)
        self.B_norm_weight = mx.ones(self.d_state)
        self.C_norm_weight = mx.ones(self.d_state)
        self.out_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def shard(self, group, where: str) -> None:
        n, r = group.size(), group.rank()
        check_heads(where, self.num_heads, n)
        layers = {"in_proj": shard_linear(self.in_proj, ALL_TO_SHARDED, group, where=f"{where}.in_proj"),
                  "bcdt_proj": shard_linear(self.bcdt_proj, SHARDED_TO_ALL, group, where=f"{where}.bcdt_proj"),
                  "dt_proj": shard_linear(self.dt_proj, ALL_TO_SHARDED, group, where=f"{where}.dt_proj"),
                  "out_proj": shard_linear(self.out_proj, SHARDED_TO_ALL, group, where=f"{where}.out_proj")}
        shard_depthwise_conv(self.conv1d, group, where=f"{where}.conv1d")
        for name, module in layers.items():
            setattr(self, name, module)
        per = self.num_heads // n
        self.dt_bias, self.A_log, self.D = (t[r * per:(r + 1) * per] for t in (self.dt_bias, self.A_log, self.D))
        self.num_heads = per
        self.intermediate_size = per * self.hidden_size_per_head

    def _conv(self, conv_input, cache, mask):
        padded_input = padded_conv_input(conv_input, cache, mask, self.conv_kernel_size, self.intermediate_size)
        return nn.silu(self.conv1d(padded_input))

    def _ssm(self, x, B, C, dt, cache, mask):
        batch_size, seq_len, _ = x.shape
        x = x.reshape(batch_size, seq_len, self.num_heads, self.hidden_size_per_head)
        B = B.reshape(batch_size, seq_len, 1, self.d_state)
        C = C.reshape(batch_size, seq_len, 1, self.d_state)
        state, lengths = (cache[1], cache.lengths) if cache else (None, None)
        y, state = ssm_update(x, self.A_log, B, C, self.D, dt, self.dt_bias, state, mask=mask, lengths=lengths)
        if cache:
            cache[1] = state
        return y.reshape(batch_size, seq_len, self.intermediate_size)

    def __call__(self, hidden_states: mx.array, mask: Optional[mx.array] = None, cache=None):
        bsize, length, _ = hidden_states.shape
        zx = self.in_proj(hidden_states).reshape(bsize, length, self.num_heads, -1)
        z, x = mx.split(zx, [self.hidden_size_per_head], axis=-1)
        x = x.reshape(bsize, -1, self.num_heads * self.hidden_size_per_head)
        x = self._conv(x, cache, mask)
        BCdt = self.bcdt_proj(x)
        B, C, dt = mx.split(BCdt, [self.d_state, self.d_state * 2], axis=-1)
        dt = mx.fast.rms_norm(dt, self.dt_norm_weight, self.eps)
        B = mx.fast.rms_norm(B, self.B_norm_weight, self.eps)
        C = mx.fast.rms_norm(C, self.C_norm_weight, self.eps)
        dt = self.dt_proj(dt)
        out = self._ssm(x, B, C, dt, cache, mask)
        if cache:
            cache.advance(out.shape[1])
        return self.out_proj(swiglu(z.flatten(-2), out))


class Plamo2Attention(nn.Module):
    def __init__(self, f: Mapping):
        super().__init__()
        head_dim = f["hidden_size_per_head"]
        self.scale = head_dim**-0.5
        self.q_num_heads, self.k_num_heads = f["num_attention_heads"], f["num_key_value_heads"]
        self.qk_dim = self.v_dim = head_dim
        self.qkv_proj = nn.Linear(f["hidden_size"], (self.q_num_heads + 2 * self.k_num_heads) * head_dim, bias=False)
        self.o_proj = nn.Linear(self.q_num_heads * self.v_dim, f["hidden_size"], bias=False)
        self.q_weight = mx.ones((self.q_num_heads, self.qk_dim))
        self.k_weight = mx.ones((self.k_num_heads, self.qk_dim))
        self.rope = nn.RoPE(self.qk_dim)

    def shard(self, group, where: str) -> None:
        n, r = group.size(), group.rank()
        check_heads(where, self.q_num_heads, n)
        if self.k_num_heads % n:
            raise ShardingError(f"{where}: {self.k_num_heads} KV heads do not split across {n} ranks")
        q = self.q_num_heads * self.qk_dim
        layers = {"qkv_proj": shard_linear(self.qkv_proj, ALL_TO_SHARDED, group, where=f"{where}.qkv_proj",
                                           segments=[q, q + self.k_num_heads * self.qk_dim]),
                  "o_proj": shard_linear(self.o_proj, SHARDED_TO_ALL, group, where=f"{where}.o_proj")}
        for name, module in layers.items():
            setattr(self, name, module)
        hq, hk = self.q_num_heads // n, self.k_num_heads // n
        self.q_weight, self.k_weight = self.q_weight[r * hq:(r + 1) * hq], self.k_weight[r * hk:(r + 1) * hk]
        self.q_num_heads, self.k_num_heads = hq, hk

    def __call__(self, hidden_states: mx.array, mask: Optional[mx.array] = None, cache=None):
        B, T, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        q_dim, k_dim = self.q_num_heads * self.qk_dim, self.k_num_heads * self.qk_dim
        q, k, v = mx.split(qkv, [q_dim, q_dim + k_dim], axis=-1)
        q = q.reshape(B, T, self.q_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
        k = k.reshape(B, T, self.k_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
        v = v.reshape(B, T, self.k_num_heads, self.v_dim).transpose(0, 2, 1, 3)
        q = mx.fast.rms_norm(q, weight=None, eps=1e-6) * self.q_weight[:, None]
        k = mx.fast.rms_norm(k, weight=None, eps=1e-6) * self.k_weight[:, None]
        if cache is not None:
            q = self.rope(q, offset=cache.offset)
            k = self.rope(k, offset=cache.offset)
            k, v = cache.update_and_fetch(k, v)
        else:
            q = self.rope(q)
            k = self.rope(k)
        output = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, T, self.q_num_heads * self.v_dim))


class Plamo2MLP(nn.Module):
    def __init__(self, f: Mapping):
        super().__init__()
        self.gate_up_proj = nn.Linear(f["hidden_size"], f["intermediate_size"] * 2, bias=False)
        self.down_proj = nn.Linear(f["intermediate_size"], f["hidden_size"], bias=False)

    def shard(self, group, where: str) -> None:
        layers = {"gate_up_proj": shard_linear(self.gate_up_proj, ALL_TO_SHARDED, group,
                                               where=f"{where}.gate_up_proj", segments=2),
                  "down_proj": shard_linear(self.down_proj, SHARDED_TO_ALL, group, where=f"{where}.down_proj")}
        for name, module in layers.items():
            setattr(self, name, module)

    def __call__(self, x: mx.array) -> mx.array:
        hs = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(swiglu(hs[0], hs[1]))


class Plamo2Layer(nn.Module):
    def __init__(self, f: Mapping, is_mamba: bool):
        super().__init__()
        self.is_mamba = is_mamba
        self.mixer = Plamo2Mamba(f) if is_mamba else Plamo2Attention(f)
        self.mlp = Plamo2MLP(f)
        eps = f["rms_norm_eps"]
        self.pre_mixer_norm = OffsetRMSNorm(f["hidden_size"], eps, 1.0)
        self.post_mixer_norm = OffsetRMSNorm(f["hidden_size"], eps, 1.0 / 5)
        self.pre_mlp_norm = OffsetRMSNorm(f["hidden_size"], eps, 1.0)
        self.post_mlp_norm = OffsetRMSNorm(f["hidden_size"], eps, 1.0 / (5**1.5))

    def __call__(self, hidden_states: mx.array, mask=None, cache=None):
        residual = hidden_states
        h = self.mixer(hidden_states=self.pre_mixer_norm(hidden_states), mask=mask, cache=cache)
        hidden_states = residual + self.post_mixer_norm(h)
        residual = hidden_states
        h = self.mlp(self.pre_mlp_norm(hidden_states))
        return residual + self.post_mlp_norm(h)


class Plamo2Dense(UniversalDense):
    """plamo2: parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        self._own_tree(args, descriptor, config, raw_config, tied=bool(args.fields["tie_word_embeddings"]))
        d, f = descriptor, args.fields
        self._mamba = [plamo2_is_mamba(f, i) for i in range(args.n_layers)]
        self._ssm_idx = 0 if f["mamba_enabled"] else None
        self._full_idx = f["mamba_step"] // 2  # mlx-lm's fa_idx
        root = nn.Module()
        root.embed_tokens = nn.Embedding(args.vocab, args.hidden)
        root.layers = nn.Module()
        root.layers.layers = [Plamo2Layer(f, m) for m in self._mamba]
        root.norm = OffsetRMSNorm(args.hidden, f["rms_norm_eps"], 1.0)
        self.model = root
        if not self._tied:
            self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)

    @property
    def layers(self) -> list:
        return self.model.layers.layers

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: ArraysCache(2) per Mamba layer, KVCache per attention layer (mlxbun:
        `max_kv_size` bounds the attention's)."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        return [ArraysCache(size=2) if m else (RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size
                                              else KVCache()) for m in self._mamba]

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        x = self.model.embed_tokens(ids)
        layers = self.layers
        if cache is None:
            cache = [None] * len(layers)
        attn_mask = create_attention_mask(x, cache[self._full_idx])
        mamba_mask = create_ssm_mask(x, cache[self._ssm_idx]) if self._ssm_idx is not None else None
        for layer, c in zip(layers, cache):
            x = layer(x, mask=mamba_mask if layer.is_mamba else attn_mask, cache=c)
        return self.model.norm(x)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self.model.embed_tokens.as_linear(h) if self._tied else self.lm_head(h)
