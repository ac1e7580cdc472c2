"""The forward of gear (mlx-lm 0.32.2 `gear.py`), a `UniversalDense` subclass with its own module tree
(`loader._GRAPHS`), op for op as mlx-lm's: sandwich-normed layers (GearRMSNorm: x * (1 + w) in x's
dtype) of three kinds by layer_types: full attention (rope_theta, rope_scaling) and sliding attention
(rope_local_base_freq, a RotatingKVCache of sliding_window), both with per-head (1 + w) q / k norms,
scale query_pre_attn_scalar ** -0.5 and an optional logit softcap (then a float32-precise softmax
over repeated KV heads); and the conv mixer (`local_mixer`: q / k / v projections, q / k normed,
keys and values through causal depthwise convolutions (key_conv / value_conv, their states in an
ArraysCache), sigmoid(q * k) * v); a gated MLP (hidden_activation); embeddings times sqrt(D);
optional final logit softcap.

The conv mixer takes its ArraysCache as `cache` and calls `advance` (as mlx-lm's), so speculative
rollback replays it like the other mixers. Tensor parallel: not split (mlx-lm's file has no shard());
refused by name."""

from __future__ import annotations

import math
from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models import rope as R
from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.sharding import ShardingError
from mlxbun.models.universal.attention import rope_and_cache
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["GEAR_TYPES", "GearDense"]

GEAR_TYPES = ("gear",)  # the rows whose forward this module is (loader._GRAPHS)

_ACTS = {"gelu_pytorch_tanh": nn.gelu_approx, "gelu_new": nn.gelu_approx, "gelu_fast": nn.gelu_approx,
         "gelu": nn.gelu, "silu": nn.silu, "swish": nn.silu}


class GearRMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float = 1e-6):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, (1.0 + self.weight).astype(x.dtype), self.eps)


def _repeat_kv(x: mx.array, repeats: int) -> mx.array:
    if repeats == 1:
        return x
    B, n_kv_heads, L, D = x.shape
    x = mx.broadcast_to(mx.expand_dims(x, axis=2), (B, n_kv_heads, repeats, L, D))
    return x.reshape(B, n_kv_heads * repeats, L, D)


def _softcap_attention(queries, keys, values, scale: float, softcap: float, mask):
    repeats = queries.shape[1] // keys.shape[1]
    keys, values = _repeat_kv(keys, repeats), _repeat_kv(values, repeats)
    scores = (queries * scale) @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            mask = mx.arange(kL - qL, kL)[:, None] >= mx.arange(kL)[None]
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    return mx.softmax(scores, axis=-1, precise=True) @ values


class MLP(nn.Module):
    def __init__(self, f: Mapping):
        super().__init__()
        self.gate_proj = nn.Linear(f["hidden_size"], f["intermediate_size"], bias=False)
        self.up_proj = nn.Linear(f["hidden_size"], f["intermediate_size"], bias=False)
        self.down_proj = nn.Linear(f["intermediate_size"], f["hidden_size"], bias=False)
        self._act = _ACTS[f["hidden_activation"]]

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(self._act(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    def __init__(self, f: Mapping, layer_idx: int):
        super().__init__()
        dim, bias = f["hidden_size"], f["attention_bias"]
        self.n_heads, self.n_kv_heads, self.head_dim = f["num_attention_heads"], f["num_key_value_heads"], f["head_dim"]
        self.scale = f["query_pre_attn_scalar"] ** -0.5
        self.attn_logit_softcapping = f["attn_logit_softcapping"]
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = GearRMSNorm(self.head_dim, eps=f["rms_norm_eps"])
        self.k_norm = GearRMSNorm(self.head_dim, eps=f["rms_norm_eps"])
        sliding = f["layer_types"][layer_idx] == "sliding_attention"
        self.rope = R.initialize_rope(self.head_dim, f["rope_local_base_freq"] if sliding else f["rope_theta"],
                                      False, None if sliding else f["rope_scaling"], f["max_position_embeddings"])

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        keys = self.k_norm(keys).transpose(0, 2, 1, 3)
        values = values.transpose(0, 2, 1, 3)
        queries, keys, values = rope_and_cache(self.rope, queries, keys, values, cache)
        if self.attn_logit_softcapping:
            output = _softcap_attention(queries, keys, values, self.scale, self.attn_logit_softcapping, mask)
        else:
            output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class ConvKVGatedMixer(nn.Module):
    cache_slots = 2

    def __init__(self, f: Mapping):
        super().__init__()
        bias = f["attention_bias"]
        self.head_dim, self.n_heads, self.n_kv_heads = f["head_dim"], f["num_attention_heads"], f["num_key_value_heads"]
        self.num_key_value_groups = self.n_heads // self.n_kv_heads
        self.kv_dim = self.n_kv_heads * self.head_dim
        self.L_cache = f["conv_L_cache"]
        self.key_conv = nn.Conv1d(self.kv_dim, self.kv_dim, self.L_cache, groups=self.kv_dim, bias=bias, padding=0)
        self.value_conv = nn.Conv1d(self.kv_dim, self.kv_dim, self.L_cache, groups=self.kv_dim, bias=bias, padding=0)
        self.q_proj = nn.Linear(f["hidden_size"], self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(f["hidden_size"], self.kv_dim, bias=bias)
        self.v_proj = nn.Linear(f["hidden_size"], self.kv_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, f["hidden_size"], bias=bias)
        self.q_norm = GearRMSNorm(self.head_dim, eps=f["rms_norm_eps"])
        self.k_norm = GearRMSNorm(self.head_dim, eps=f["rms_norm_eps"])

    def _conv(self, x, conv, cache, cache_idx: int):
        n_keep = self.L_cache - 1
        if cache is not None:
            state = cache[cache_idx]
            if state is None:
                state = mx.zeros((x.shape[0], n_keep, x.shape[-1]), dtype=x.dtype)
            conv_input = mx.concatenate([state, x], axis=1)
            if n_keep > 0:
                if cache.lengths is not None:
                    ends = mx.clip(cache.lengths, 0, x.shape[1])
                    positions = (ends[:, None] + mx.arange(n_keep))[..., None]
                    cache[cache_idx] = mx.take_along_axis(conv_input, positions, axis=1)
                else:
                    cache[cache_idx] = mx.contiguous(conv_input[:, -n_keep:, :])
            else:
                cache[cache_idx] = mx.zeros((x.shape[0], 0, x.shape[-1]), dtype=x.dtype)
        else:
            conv_input = mx.pad(x, [(0, 0), (n_keep, 0), (0, 0)])
        return conv(conv_input)

    def _expand_kv(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        x = mx.expand_dims(x.reshape(B, L, self.n_kv_heads, self.head_dim), axis=3)
        x = mx.broadcast_to(x, (B, L, self.n_kv_heads, self.num_key_value_groups, self.head_dim))
        return x.reshape(B, L, self.n_heads * self.head_dim)

    def __call__(self, x: mx.array, mask=None, cache: Optional[ArraysCache] = None) -> mx.array:
        B, L, _ = x.shape
        if mask is not None:
            x = mx.where(mask[..., None], x, 0)
        query = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        key = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        value = self.v_proj(x)
        query = self.q_norm(query).reshape(B, L, -1)
        key = self.k_norm(key).reshape(B, L, -1)
        key = self._conv(key, self.key_conv, cache, cache_idx=0)
        value = self._conv(value, self.value_conv, cache, cache_idx=1)
        if cache is not None:
            cache.advance(L)
        return self.o_proj(mx.sigmoid(query * self._expand_kv(key)) * self._expand_kv(value))


class DecoderLayer(nn.Module):
    def __init__(self, f: Mapping, layer_idx: int):
        super().__init__()
        D, eps = f["hidden_size"], f["rms_norm_eps"]
        self.attention_type = f["layer_types"][layer_idx]
        if self.attention_type != "conv_mixer":
            self.self_attn = Attention(f, layer_idx)
        else:
            self.local_mixer = ConvKVGatedMixer(f)
        self.mlp = MLP(f)
        self.input_layernorm = GearRMSNorm(D, eps=eps)
        self.post_attention_layernorm = GearRMSNorm(D, eps=eps)
        self.pre_feedforward_layernorm = GearRMSNorm(D, eps=eps)
        self.post_feedforward_layernorm = GearRMSNorm(D, eps=eps)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        h = self.input_layernorm(x)
        h = (self.local_mixer if "local_mixer" in self else self.self_attn)(h, mask=mask, cache=cache)
        h = x + self.post_attention_layernorm(h)
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GearDense(UniversalDense):
    """gear: parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        self._own_tree(args, descriptor, config, raw_config, tied=bool(args.fields["tie_word_embeddings"]))
        d, f = descriptor, args.fields
        types = list(f["layer_types"])
        self._first = {t: (types.index(t) if t in types else None)
                       for t in ("full_attention", "sliding_attention", "conv_mixer")}
        self._full_idx = self._first["full_attention"]
        self._swa_idx, self._ssm_idx = self._first["sliding_attention"], self._first["conv_mixer"]
        root = nn.Module()
        root.embed_tokens = nn.Embedding(args.vocab, args.hidden)
        root.layers = [DecoderLayer(f, i) for i in range(args.n_layers)]
        root.norm = GearRMSNorm(args.hidden, eps=f["rms_norm_eps"])
        self.model = root
        if not self._tied:
            self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: KVCache (full), RotatingKVCache(sliding_window) (sliding), ArraysCache(2)
        (conv mixer); mlxbun: `max_kv_size` bounds the full layers."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        w = self.args.fields["sliding_window"]

        def one(t):
            if t == "full_attention":
                return RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache()
            return RotatingKVCache(max_size=w) if t == "sliding_attention" else ArraysCache(size=2)
        return [one(layer.attention_type) for layer in self.model.layers]

    def shard(self, group) -> None:
        if group.size() > 1:
            raise ShardingError(f"{self.model_type}: gear's layers have no tensor-parallel split in mlxbun; "
                                "run it in one process (--tp 1)")

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        f, root = self.args.fields, self.model
        h = root.embed_tokens(ids) * math.sqrt(self.args.hidden)
        if cache is None:
            cache = [None] * len(root.layers)
        fa, swa, conv = self._first["full_attention"], self._first["sliding_attention"], self._first["conv_mixer"]
        masks = {"full_attention": create_attention_mask(h, cache[fa]) if fa is not None else None,
                 "sliding_attention": (create_attention_mask(h, cache[swa], window_size=f["sliding_window"])
                                       if swa is not None else None),
                 "conv_mixer": (cache[conv].make_mask(h.shape[1])
                                if conv is not None and cache[conv] is not None else None)}
        for layer, c in zip(root.layers, cache):
            h = layer(h, mask=masks[layer.attention_type], cache=c)
        return root.norm(h)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        out = self.model.embed_tokens.as_linear(h) if self._tied else self.lm_head(h)
        cap = self.args.fields["final_logit_softcapping"]
        return mx.tanh(out / cap) * cap if cap else out
