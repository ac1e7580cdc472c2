"""lfm2's short convolution (mlx-lm 0.32.2 `lfm2.ShortConv`), op for op: in_proj splits into
B, C, x; B * x runs through a causal depthwise conv1d whose state is the last kernel - 1
inputs (one ArraysCache slot); C gates the conv's output; out_proj.

Tensor parallel (`shard`): every op but out_proj is per channel, so each rank keeps its slice of
the channels (in_proj's B, C and x parts alike, the conv's, a conv state of its own width) and
out_proj sums the slices (sharded-to-all)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL, shard_depthwise_conv, shard_linear

__all__ = ["ShortConv", "ShortConvKnobs"]


@dataclass(frozen=True)
class ShortConvKnobs:
    """The ModelArgs fields the mixer reads."""

    kernel: str = "conv_L_cache"  # the conv's kernel size (its state keeps kernel - 1 inputs)
    bias: str = "conv_bias"  # bias on in_proj, the conv and out_proj

    def field_refs(self) -> Iterator[tuple[str, str]]:
        yield "hybrid.knobs.kernel", self.kernel
        yield "hybrid.knobs.bias", self.bias


class ShortConv(nn.Module):
    cache_slots = 1

    def __init__(self, a: Any, knobs: ShortConvKnobs, index: int):
        super().__init__()
        self.hidden = hidden = a.hidden
        self.L_cache = a.fields[knobs.kernel]
        bias = bool(a.fields[knobs.bias])
        self.conv = nn.Conv1d(in_channels=hidden, out_channels=hidden, kernel_size=self.L_cache,
                              groups=hidden, bias=bias)
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=bias)

    def shard(self, group, where: str) -> None:
        """Split the channels across `group` (checked before anything changes)."""
        layers = {"in_proj": shard_linear(self.in_proj, ALL_TO_SHARDED, group, where=f"{where}.in_proj",
                                          segments=3),
                  "out_proj": shard_linear(self.out_proj, SHARDED_TO_ALL, group, where=f"{where}.out_proj")}
        shard_depthwise_conv(self.conv, group, where=f"{where}.conv")
        for name, module in layers.items():
            setattr(self, name, module)
        self.hidden //= group.size()

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Any = None) -> mx.array:
        BCx = self.in_proj(x)
        B, C, x = mx.split(BCx, 3, axis=-1)
        Bx = B * x
        if mask is not None:
            Bx = mx.where(mask[..., None], Bx, 0)
        if cache is not None:
            if cache[0] is None:
                state = mx.zeros((Bx.shape[0], self.L_cache - 1, self.hidden), dtype=Bx.dtype)
            else:
                state = cache[0]
            Bx = mx.concatenate([state, Bx], axis=1)
            n_keep = self.L_cache - 1
            t = x.shape[1]
            if cache.lengths is not None:  # a batch whose rows end at different positions
                ends = mx.clip(cache.lengths, 0, t)
                positions = (ends[:, None] + mx.arange(n_keep))[..., None]
                cache[0] = mx.take_along_axis(Bx, positions, axis=1)
            else:
                cache[0] = Bx[:, -n_keep:, :]
            cache.advance(t)
        else:
            Bx = mx.pad(Bx, [(0, 0), (self.L_cache - 1, 0), (0, 0)])
        conv_out = self.conv(Bx)
        y = C * conv_out
        return self.out_proj(y)
