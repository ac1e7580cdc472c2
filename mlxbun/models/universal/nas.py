"""The forward of nemotron-nas (mlx-lm 0.32.2 `nemotron-nas.py`), a `UniversalDense` subclass
(`loader._GRAPHS`): every layer's shape comes from its block_configs entry. Its attention is the
universal one with H // n_heads_in_group KV heads, a `LinearSubblockReplacement` (one
Linear(D, D) named `linear`) or nothing (no-op: no input_layernorm either); its MLP is the
universal one at int(2 * ffn_mult * D / 3) rounded up to a multiple of 256, a replacement, or
nothing (no post_attention_layernorm either). mlx-lm's cache list holds a KVCache for every layer
whose attention is not a no-op (a replacement's is never written), the mask taken from the first.

The normalized block_configs are the post-init's (`post_init._nemotron_nas_blocks`). Tensor
parallel: the attentions and MLPs split as every row's; a replacement Linear stays whole on every
rank (each computes it, no collective)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models.base import create_attention_mask
from mlxbun.models.universal.attention import Attention
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.mlp import MLP
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["NAS_TYPES", "NasDense", "nas_shape", "nas_width"]

NAS_TYPES = ("nemotron-nas",)  # the rows whose forward this module is (loader._GRAPHS)


def nas_width(ffn_mult: float, hidden: int) -> int:
    """mlx-lm's _ffn_mult_to_intermediate_size: int(2 * ffn_mult * D / 3), up to a multiple of 256."""
    n = int(2 * ffn_mult * hidden / 3)
    return n if n % 256 == 0 else n + 256 - (n % 256)


def nas_shape(conf: Mapping, heads: int, hidden: int) -> str:
    """One layer's shape for `mlxbun explain`: attention KV heads / linear / none, MLP width / linear / none."""
    attn, ffn = conf["attention"], conf["ffn"]
    a = "none" if attn["no_op"] else "linear" if attn["replace_with_linear"] else f"KV {heads // attn['n_heads_in_group']}"
    m = "none" if ffn["no_op"] else "linear" if ffn["replace_with_linear"] else f"I {nas_width(ffn['ffn_mult'], hidden)}"
    return f"{a} / {m}"


class LinearSubblockReplacement(nn.Module):
    """mlx-lm's: one Linear(D, D) in place of an attention or an MLP (mask and cache ignored)."""

    def __init__(self, hidden: int, bias: bool):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden, bias=bias)

    def shard(self, group, where: str) -> None:
        """Kept whole on every rank (each computes it; no collective needed)."""

    def __call__(self, x: mx.array, *args, **kwargs) -> mx.array:
        return self.linear(x)


class NasBlock(nn.Module):
    def __init__(self, a: UniversalArgs, d: ArchDescriptor, spec, conf: Mapping):
        super().__init__()
        attn, ffn = conf["attention"], conf["ffn"]
        self.use_sliding = False
        if not attn["no_op"]:
            self.input_layernorm = nn.RMSNorm(a.hidden, eps=a.eps)
            if attn["replace_with_linear"]:
                self.self_attn = LinearSubblockReplacement(a.hidden, a.attn_bias)
            else:
                heads = (a.n_heads, a.n_heads // attn["n_heads_in_group"])
                self.self_attn = Attention(a, d, dataclasses.replace(spec, heads=heads))
        if not ffn["no_op"]:
            self.post_attention_layernorm = nn.RMSNorm(a.hidden, eps=a.eps)
            if ffn["replace_with_linear"]:
                self.mlp = LinearSubblockReplacement(a.hidden, a.mlp_bias)
            else:
                self.mlp = MLP(a, d, width=nas_width(ffn["ffn_mult"], a.hidden))

    @property
    def has_attention(self) -> bool:
        return "self_attn" in self

    def __call__(self, x: mx.array, mask=None, cache=None, *args) -> mx.array:
        if "self_attn" in self:
            x = x + self.self_attn(self.input_layernorm(x), mask, cache)
        if "mlp" in self:
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


class NasDense(UniversalDense):
    """`UniversalDense` whose layers take their shapes from block_configs."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        super().__init__(args, descriptor, config, raw_config)
        confs = args.fields["block_configs"]
        self.backbone[descriptor.names.layers] = [NasBlock(args, descriptor, spec, conf)
                                                  for spec, conf in zip(args.layers, confs)]
        self._attending = [i for i, layer in enumerate(self.layers) if layer.has_attention]

    @property
    def cache_layers(self) -> list[int]:
        """The layers whose attention is not a no-op (a replacement's cache is never written)."""
        return list(self._attending)

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: a KVCache per layer whose attention is not a no-op (mlxbun:
        `max_kv_size` bounds them)."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        return [RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache()
                for _ in self._attending]

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        root, n = self.backbone, self.descriptor.names
        h = root[n.embed](ids)
        if cache is None:
            cache = [None] * len(self._attending)
        mask = create_attention_mask(h, cache[0] if cache else None)
        slots = iter(cache)
        for layer in root[n.layers]:
            h = layer(h, mask, next(slots) if layer.has_attention else None)
        return root[n.final_norm](h)
