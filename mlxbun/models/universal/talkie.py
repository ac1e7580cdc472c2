"""The forward of talkie (mlx-lm 0.32.2 `talkie.py`), a `UniversalDense` subclass with its own module
tree (`loader._GRAPHS`), op for op as mlx-lm's: every norm weightless (mx.fast.rms_norm at
rms_norm_eps); the embedding normed, kept as e_x and added back by every block through a learned
scalar gain (`embed_skip`); attention over separate q / k / v projections, rotated with negated
frequencies -(theta ** (2i / hd)), the queries and keys rms-normed after the rope, the queries
scaled per head (`head_gain`); the attention and MLP outputs scaled by scalar gains (`attn_gain`,
`mlp_gain`); the output projection a bare [V, D] parameter (`lm_head`) scaled by `lm_head_gain`.

The row's descriptor drives the loader, sanitize, audit and coverage. Tensor parallel: the
attention by heads (q / k / v all-to-sharded, attn_resid sharded-to-all, head_gain sliced), the
MLP by hidden units; the scalar gains stay whole on every rank."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL, check_heads, shard_linear
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.mlp import MLP
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["TALKIE_TYPES", "TalkieDense"]

TALKIE_TYPES = ("talkie",)  # the rows whose forward this module is (loader._GRAPHS)


def _rms(x: mx.array, eps: float) -> mx.array:  # talkie.rms_norm: all of Talkie's norms are weightless
    return mx.fast.rms_norm(x, None, eps)


class _Gain(nn.Module):
    """A learned scalar (ActGain's a_g, WeightGain's w_g) times x, in x's dtype; whole on every rank."""

    def __init__(self, name: str, init: float = 1.0):
        super().__init__()
        self._name = name
        setattr(self, name, mx.full((1,), init))

    def shard(self, group, where: str) -> None:
        """Replicated: a scalar."""

    def __call__(self, x: mx.array) -> mx.array:
        return x * self[self._name].astype(x.dtype)


class HeadGain(nn.Module):
    def __init__(self, n_head: int):
        super().__init__()
        self.head_g = mx.ones((n_head,))

    def __call__(self, x: mx.array) -> mx.array:  # x: (B, H, L, D)
        return x * self.head_g.astype(x.dtype).reshape(1, -1, 1, 1)


class TalkieAttention(nn.Module):
    def __init__(self, a: UniversalArgs):
        super().__init__()
        dim, self.n_heads, self.head_dim = a.hidden, a.n_heads, a.head_dim
        self.scale = self.head_dim**-0.5
        self.eps = a.fields["rms_norm_eps"]
        proj_dim = self.n_heads * self.head_dim
        self.attn_query = nn.Linear(dim, proj_dim, bias=False)
        self.attn_key = nn.Linear(dim, proj_dim, bias=False)
        self.attn_value = nn.Linear(dim, proj_dim, bias=False)
        self.attn_resid = nn.Linear(proj_dim, dim, bias=False)
        self.head_gain = HeadGain(self.n_heads)
        # (not a parameter: a plain attribute would join the tree)
        object.__setattr__(self, "_rope_freqs", -(a.fields["rope_theta"] ** (
            mx.arange(0, self.head_dim, 2, dtype=mx.float32) / self.head_dim)))

    def shard(self, group, where: str) -> None:
        """Split the heads across `group` (checked first)."""
        n, r = group.size(), group.rank()
        check_heads(where, self.n_heads, n)
        layers = {name: shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
                  for name in ("attn_query", "attn_key", "attn_value")}
        layers["attn_resid"] = shard_linear(self.attn_resid, SHARDED_TO_ALL, group, where=f"{where}.attn_resid")
        for name, module in layers.items():
            setattr(self, name, module)
        per = self.n_heads // n
        self.head_gain.head_g = self.head_gain.head_g[r * per:(r + 1) * per]
        self.n_heads = per

    def _rope(self, x, offset):
        return mx.fast.rope(x, dims=self.head_dim, traditional=False, base=None, scale=1.0, offset=offset,
                            freqs=self._rope_freqs)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Optional[Any] = None) -> mx.array:
        B, L, _ = x.shape
        queries = self.attn_query(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        keys = self.attn_key(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        values = self.attn_value(x).reshape(B, L, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)
        offset = cache.offset if cache is not None else 0
        queries = self._rope(queries, offset)
        keys = self._rope(keys, offset)
        queries = _rms(queries, self.eps)
        keys = _rms(keys, self.eps)
        queries = self.head_gain(queries)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.attn_resid(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


class TalkieBlock(nn.Module):
    def __init__(self, a: UniversalArgs, d: ArchDescriptor):
        super().__init__()
        gain_init = (2 * a.n_layers) ** -0.5
        self.eps = a.fields["rms_norm_eps"]
        self.attn = TalkieAttention(a)
        self.attn_gain = _Gain("a_g", gain_init)
        self.mlp = MLP(a, d)  # mlp_gate / mlp_linear / mlp_resid, silu(gate) * linear (eager)
        self.mlp_gain = _Gain("a_g", gain_init)
        self.embed_skip = _Gain("a_g", 0.0)

    def __call__(self, x: mx.array, mask=None, cache=None, e_x: Optional[mx.array] = None) -> mx.array:
        x = x + self.attn_gain(self.attn(_rms(x, self.eps), mask, cache))
        x = x + self.mlp_gain(self.mlp(_rms(x, self.eps)))
        return x + self.embed_skip(e_x)


class TalkieDense(UniversalDense):
    """talkie: parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        self._own_tree(args, descriptor, config, raw_config, tied=False)
        d, n = descriptor, descriptor.names
        self._eps = args.fields["rms_norm_eps"]
        root = nn.Module()
        setattr(root, n.embed, nn.Embedding(args.vocab, args.hidden))
        setattr(root, n.layers, [TalkieBlock(args, d) for _ in range(args.n_layers)])
        self[n.root] = root
        self.lm_head = mx.zeros((args.vocab, args.hidden))  # a bare parameter, no .weight
        self.lm_head_gain = _Gain("w_g")

    def shard(self, group) -> None:
        if group.size() > 1:
            for i, block in enumerate(self.layers):
                check_heads(f"model.blocks.{i}.attn", block.attn.n_heads, group.size())
        super().shard(group)

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        root, n = self.backbone, self.descriptor.names
        h = _rms(root[n.embed](ids), self._eps)
        e_x = h
        blocks = root[n.layers]
        if cache is None:
            cache = [None] * len(blocks)
        mask = create_attention_mask(h, cache[0])
        for block, c in zip(blocks, cache):
            h = block(h, mask, c, e_x=e_x)  # (x first: a layer-skip draft returns it)
        return _rms(h, self._eps)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self.lm_head_gain(h @ self.lm_head.T)
