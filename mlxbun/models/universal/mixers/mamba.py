"""The Mamba (v1) mixer of mlx-lm 0.32.2 (`mamba.MambaBlock`; falcon_mamba runs the same file),
op for op: in_proj splits into x and z; a causal depthwise conv1d over x (its last kernel - 1
inputs are cache slot 0) and SiLU; per token, the selective scan (`ssm_step`: x_proj to delta,
B, C (falcon_mamba: each rms-normed without weight), softplus(dt_proj(delta)), the state update
and readout plus D * x; the state is cache slot 1); out_proj(swiglu(z, y)).

mlx-lm's mixer reads no mask (batch padding is not handled there either) and never calls the
cache's `advance`; this one does, after the state is written, so the speculative round counts the
tokens it added (bookkeeping only: the values are mlx-lm's).

Tensor parallel (`shard`; mlx-lm's file has none): each rank keeps a slice of the I channels:
in_proj's x and z rows, the conv's channels, dt_proj's rows and bias, A_log's and D's rows;
x_proj reads the rank's channels and its partial products are summed across the ranks
(sharded-to-all), so every rank scans delta / B / C of the whole width; out_proj sums the ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models.layers import swiglu
from mlxbun.models.sharding import (
    ALL_TO_SHARDED,
    SHARDED_TO_ALL,
    ShardingError,
    shard_depthwise_conv,
    shard_linear,
)

__all__ = ["MambaKnobs", "MambaMixer"]


@dataclass(frozen=True)
class MambaKnobs:
    """The ModelArgs fields the mixer reads."""

    intermediate: str = "intermediate_size"
    state: str = "state_size"
    conv_kernel: str = "conv_kernel"
    time_step_rank: str = "time_step_rank"
    bias: str = "use_bias"  # bool: in_proj's and out_proj's bias
    conv_bias: str = "use_conv_bias"  # bool: conv1d's bias
    bcdt_rms: str = "use_bcdt_rms"  # bool: delta, B and C rms-normed (falcon_mamba)
    rms_eps: str = "mixer_rms_eps"

    def field_refs(self) -> Iterator[tuple[str, str]]:
        for f in dataclasses.fields(self):
            yield f"hybrid.knobs.{f.name}", getattr(self, f.name)


class MambaMixer(nn.Module):
    cache_slots = 2

    def __init__(self, a: Any, knobs: MambaKnobs, index: int):
        super().__init__()
        f = a.fields
        self.hidden_size = a.hidden
        self.ssm_state_size = N = f[knobs.state]
        self.conv_kernel_size = K = f[knobs.conv_kernel]
        self.intermediate_size = I = f[knobs.intermediate]
        self.time_step_rank = R = int(f[knobs.time_step_rank])
        self.use_bcdt_rms = bool(f[knobs.bcdt_rms])
        self.eps = f[knobs.rms_eps]
        bias = bool(f[knobs.bias])
        self.in_proj = nn.Linear(a.hidden, I * 2, bias=bias)
        self.conv1d = nn.Conv1d(in_channels=I, out_channels=I, kernel_size=K, groups=I,
                                bias=bool(f[knobs.conv_bias]), padding=0)
        self.x_proj = nn.Linear(I, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, I, bias=True)
        A = mx.repeat(mx.arange(1.0, N + 1.0).reshape([1, N]), repeats=I, axis=0)
        self.A_log = mx.log(A)
        self.D = mx.ones([I])
        self.out_proj = nn.Linear(I, a.hidden, bias=bias)

    def shard(self, group, where: str) -> None:
        """Split the I channels across `group` (every split checked before anything changes)."""
        n = group.size()
        if self.intermediate_size % n:
            raise ShardingError(f"{where}: {self.intermediate_size} channels do not split across {n} ranks")
        layers = {"in_proj": shard_linear(self.in_proj, ALL_TO_SHARDED, group, where=f"{where}.in_proj",
                                          segments=2),
                  "x_proj": shard_linear(self.x_proj, SHARDED_TO_ALL, group, where=f"{where}.x_proj"),
                  "dt_proj": shard_linear(self.dt_proj, ALL_TO_SHARDED, group, where=f"{where}.dt_proj"),
                  "out_proj": shard_linear(self.out_proj, SHARDED_TO_ALL, group, where=f"{where}.out_proj")}
        shard_depthwise_conv(self.conv1d, group, where=f"{where}.conv1d")
        for name, module in layers.items():
            setattr(self, name, module)
        per, r = self.intermediate_size // n, group.rank()
        self.A_log, self.D = self.A_log[r * per:(r + 1) * per], self.D[r * per:(r + 1) * per]
        self.intermediate_size = per

    def ssm_step(self, x, A, state=None):
        D = self.D
        deltaBC = self.x_proj(x)
        delta, B, C = mx.split(deltaBC, [self.time_step_rank, self.time_step_rank + self.ssm_state_size],
                               axis=-1)
        if self.use_bcdt_rms:
            delta = mx.fast.rms_norm(delta, weight=None, eps=self.eps)
            B = mx.fast.rms_norm(B, weight=None, eps=self.eps)
            C = mx.fast.rms_norm(C, weight=None, eps=self.eps)
        delta = nn.softplus(self.dt_proj(delta))
        new_state = mx.expand_dims(delta * x, -1) * mx.expand_dims(B, 1)
        if state is not None:
            new_state += state * mx.exp(mx.expand_dims(delta, -1) * A)
        y = (new_state @ mx.expand_dims(C, -1)).squeeze(2)
        y = y + D * x
        return y, new_state

    def _process_sequence(self, x, conv_cache, state_cache):
        xz = self.in_proj(x)
        x, z = xz.split(indices_or_sections=2, axis=-1)
        K = self.conv_kernel_size
        if conv_cache is not None:
            x_full = mx.concatenate([conv_cache, x], axis=1)
        else:
            x_full = mx.pad(x, [(0, 0), (K - 1, 0), (0, 0)])
        conv_out = self.conv1d(x_full)
        new_conv_cache = x_full[:, -(K - 1):, :]
        x = nn.silu(conv_out)
        A = -mx.exp(self.A_log)
        current_state = state_cache
        y = []
        for t in range(x.shape[1]):
            y_t, current_state = self.ssm_step(x[:, t], A, current_state)
            y.append(y_t)
        y = mx.stack(y, axis=1)
        z = self.out_proj(swiglu(z, y))
        return z, (new_conv_cache, current_state)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Any = None) -> mx.array:
        conv_cache, state_cache = (None, None) if cache is None else (cache[0], cache[1])
        output, (new_conv_cache, new_state) = self._process_sequence(x, conv_cache, state_cache)
        if cache is not None:
            cache[0] = new_conv_cache
            cache[1] = new_state
            cache.advance(x.shape[1])
        return output
