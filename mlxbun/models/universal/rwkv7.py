"""The forward of rwkv7 (mlx-lm 0.32.2 `rwkv7.py`), a `UniversalDense` subclass with its own module tree
(`loader._GRAPHS`), op for op as mlx-lm's CPU path: per layer a time mixing (token shift, six
addcmul lerps, r / k / v projections, LoRA gates for decay / in-context rate / value residual /
output gate, the WKV-7 state update token by token (`_wkv7_step_ops`, compiled), a per-head
LayerNorm, the bonus term) and a channel mixing (token shift, relu^2 MLP), each behind a LayerNorm
(layer 0 also a pre-norm); v_first (layer 0's values) threads through the layers. Each layer's
ArraysCache(3) holds the time mixing's shifted token and WKV state and the channel mixing's shifted
token.

Only the layer takes its cache as `cache` (the mixings take it as `state`), so a speculative rollback
replays whole layers (`speculative/replay.py` replays the innermost module taking the cache); the
layer calls the ArraysCache's `advance` (mlx-lm's does not; bookkeeping only). Tensor parallel: not
split (mlx-lm's file has no shard(); the LoRA and per-head mixes have no split here): refused by name."""

from __future__ import annotations

from functools import partial
from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.arrays import ArraysCache
from mlxbun.errors import MlxbunError
from mlxbun.models.sharding import ShardingError
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["RWKV7_TYPES", "Rwkv7Dense"]

RWKV7_TYPES = ("rwkv7",)  # the rows whose forward this module is (loader._GRAPHS)


@partial(mx.compile, shapeless=True)
def addcmul(x, y, z):
    return x + y * z


@partial(mx.compile, shapeless=True)
def l2_norm(x):
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-7)


@mx.compile
def _wkv7_step_ops(r, w, k, v, a, b, state):
    sab = (state @ a[..., None]) @ b[..., None, :]
    state = state * w[:, :, None, :] + v[..., None] @ k[..., None, :] + sab
    y = state @ r[..., None]
    return y, state


class LayerNormPerHead(nn.Module):
    def __init__(self, head_dim, num_heads, eps):
        super().__init__()
        self.weight = mx.zeros((num_heads, head_dim))
        self.bias = mx.zeros((num_heads, head_dim))
        self.eps = eps

    def __call__(self, x):
        return self.weight * mx.fast.layer_norm(x, None, None, self.eps) + self.bias


class LoRA(nn.Module):
    _ACTS = {None: nn.Identity, "sigmoid": nn.Sigmoid, "tanh": nn.Tanh, "relu": nn.ReLU}

    def __init__(self, input_dim: int, output_dim: int, low_rank_dim: int, bias: bool = True,
                 activation: Optional[str] = "tanh"):
        super().__init__()
        self.activation = self._ACTS[activation]()  # (also in the list, as mlx-lm's)
        self.lora = [nn.Linear(input_dim, low_rank_dim, bias=False), self.activation,
                     nn.Linear(low_rank_dim, output_dim, bias=bias)]

    def __call__(self, x) -> mx.array:
        return self.lora[2](self.lora[1](self.lora[0](x)))


class TokenShift(nn.Module):
    def __call__(self, x, state):
        B, L, D = x.shape
        if state is None:
            state = mx.zeros((B, 1, D), x.dtype)
        return state if L == 1 else mx.concatenate([state, x[:, :-1, :]], axis=1)


class Rwkv7ChannelMixing(nn.Module):
    def __init__(self, f: Mapping):
        super().__init__()
        self.key = nn.Linear(f["hidden_size"], f["intermediate_size"], bias=False)
        self.value = nn.Linear(f["intermediate_size"], f["hidden_size"], bias=False)
        self.x_k = mx.zeros((f["hidden_size"]))
        self.token_shift = TokenShift()

    def __call__(self, x, state) -> mx.array:
        x_prev = self.token_shift(x, state[2] if state is not None else None)
        xx = addcmul(x, x_prev - x, self.x_k)
        if state is not None:
            state[2] = x[:, -1:, :]
        return self.value(nn.relu2(self.key(xx)))


class Rwkv7TimeMixing(nn.Module):
    def __init__(self, f: Mapping, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        D = self.hidden_size = f["hidden_size"]
        self.head_dim = f["head_dim"]
        self.num_heads = D // self.head_dim
        self.token_shift = TokenShift()
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            setattr(self, name, mx.zeros((1, 1, D)))
        for name in ("k_k", "k_a", "r_k"):
            setattr(self, name, mx.zeros((self.num_heads, self.head_dim)))
        self.r_proj = nn.Linear(D, D, bias=False)
        self.k_proj = nn.Linear(D, D, bias=False)
        self.v_proj = nn.Linear(D, D, bias=False)
        self.o_proj = nn.Linear(D, D, bias=False)
        self.g_norm = LayerNormPerHead(self.head_dim, self.num_heads, eps=64e-5)
        self.w_lora = LoRA(D, D, low_rank_dim=f["decay_low_rank_dim"], activation="tanh")
        if layer_idx > 0:
            self.v_lora = LoRA(D, D, low_rank_dim=f["v_low_rank_dim"], activation=None)
        self.a_lora = LoRA(D, D, low_rank_dim=f["a_low_rank_dim"], activation=None)
        self.g_lora = LoRA(D, D, low_rank_dim=f["gate_low_rank_dim"], activation="sigmoid", bias=False)

    def _wkv7(self, r, w, k, v, a, b, state):
        B, L, _, _ = r.shape
        if state is None:
            state = mx.zeros((B, self.num_heads, self.head_dim, self.head_dim), dtype=r.dtype)
        ys = []
        for t in range(L):
            y, state = _wkv7_step_ops(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state)
            ys.append(y)
        return mx.stack(ys, axis=1).astype(r.dtype), state

    def __call__(self, x, v_first, state):
        shift, wkv = (None, None) if state is None else (state[0], state[1])
        B, L, D = x.shape
        xx = self.token_shift(x, shift) - x
        xr, xw, xk, xv, xa, xg = (addcmul(x, xx, self[n]) for n in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"))
        key = self.k_proj(xk).reshape(B, L, self.num_heads, self.head_dim)
        value = self.v_proj(xv).reshape(B, L, self.num_heads, self.head_dim)
        receptance = self.r_proj(xr).reshape(B, L, self.num_heads, self.head_dim)
        iclr = mx.sigmoid(self.a_lora(xa)).reshape(B, L, self.num_heads, self.head_dim)
        gate = self.g_lora(xg)
        if self.layer_idx == 0:
            v_first = value
        else:
            vv = mx.sigmoid(self.v_lora(xv)).reshape(B, L, self.num_heads, self.head_dim)
            value = addcmul(value, v_first - value, vv)
        decay = mx.sigmoid(self.w_lora(xw).reshape(B, L, self.num_heads, self.head_dim)).astype(mx.float32)
        decay = mx.exp(-0.606531 * decay).astype(receptance.dtype)
        kk = l2_norm((key * self.k_k))
        key = key * (1 + (iclr - 1) * self.k_a)
        out, new_wkv = self._wkv7(receptance, decay, key, value, -kk, kk * iclr, wkv)
        out = self.g_norm(out.reshape(B, L, self.num_heads, self.head_dim))
        out = (out + (receptance * key * self.r_k).sum(axis=-1, keepdims=True) * value).reshape([B, L, D])
        if state is not None:
            state[0] = x[:, -1:, :]
            state[1] = new_wkv
        return self.o_proj(out * gate), v_first


class Rwkv7Layer(nn.Module):
    cache_slots = 3

    def __init__(self, f: Mapping, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        if layer_idx == 0:
            self.pre_norm = nn.LayerNorm(f["hidden_size"], eps=f["norm_eps"])
        self.attn = Rwkv7TimeMixing(f, layer_idx)
        self.ffn = Rwkv7ChannelMixing(f)
        self.attn_norm = nn.LayerNorm(f["hidden_size"], eps=f["norm_eps"])
        self.ffn_norm = nn.LayerNorm(f["hidden_size"], eps=f["norm_eps"])

    def __call__(self, x, v_first=None, cache=None):
        if self.layer_idx == 0:
            x = self.pre_norm(x)
        h, v_first = self.attn(self.attn_norm(x), v_first, cache)
        h = x + h
        out = h + self.ffn(self.ffn_norm(h), cache)
        if isinstance(cache, ArraysCache):
            cache.advance(x.shape[1])
        return out, v_first


class Rwkv7Dense(UniversalDense):
    """rwkv7: parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        self._own_tree(args, descriptor, config, raw_config, tied=bool(args.fields["tie_word_embeddings"]), ssm_idx=0)
        d, f = descriptor, args.fields
        root = nn.Module()
        root.embeddings = nn.Embedding(args.vocab, args.hidden)
        root.layers = [Rwkv7Layer(f, i) for i in range(args.n_layers)]
        root.norm = nn.LayerNorm(args.hidden, eps=f["norm_eps"])
        self.model = root
        if not self._tied:
            self.lm_head = nn.Linear(args.hidden, args.vocab, bias=False)

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: an ArraysCache(3) per layer (no KV cache to bound)."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        return [ArraysCache(size=3) for _ in range(self.args.n_layers)]

    def shard(self, group) -> None:
        if group.size() > 1:
            raise ShardingError(f"{self.model_type}: rwkv7's time mixing (LoRA gates, per-head mixes) has no "
                                "tensor-parallel split in mlxbun; run it in one process (--tp 1)")

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        x = self.model.embeddings(ids)
        if cache is None:
            cache = [None] * len(self.model.layers)
        v_first = None
        for layer, c in zip(self.model.layers, cache):
            out = layer(x, v_first, c)
            if not isinstance(out, tuple):  # a layer the layer-skip drafter skips: x alone
                x = out
                continue
            x, v_first = out
        return self.model.norm(x)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self.model.embeddings.as_linear(h) if self._tied else self.lm_head(h)
