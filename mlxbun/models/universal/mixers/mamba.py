"""The Mamba (v1) mixers of mlx-lm 0.32.2: `mamba.MambaBlock` (falcon_mamba runs the same file) and
jamba's `JambaMambaMixer` (`JambaMambaMixer` below: normed delta / B / C, a vectorized scan). Mamba's,
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

__all__ = ["JambaMambaKnobs", "JambaMambaMixer", "MambaKnobs", "MambaMixer"]


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
        self._build(a.hidden, f[knobs.intermediate], f[knobs.state], f[knobs.conv_kernel],
                    int(f[knobs.time_step_rank]), bool(f[knobs.bias]), bool(f[knobs.conv_bias]))
        self.use_bcdt_rms = bool(f[knobs.bcdt_rms])
        self.eps = f[knobs.rms_eps]

    def _build(self, hidden: int, I: int, N: int, K: int, R: int, bias: bool, conv_bias: bool) -> None:
        """mlx-lm's modules and their sizes (MambaBlock's; JambaMambaMixer's too)."""
        self.hidden_size, self.intermediate_size = hidden, I
        self.ssm_state_size, self.conv_kernel_size, self.time_step_rank = N, K, R
        self.in_proj = nn.Linear(hidden, I * 2, bias=bias)
        self.conv1d = nn.Conv1d(in_channels=I, out_channels=I, kernel_size=K, groups=I, bias=conv_bias,
                                padding=0)
        self.x_proj = nn.Linear(I, R + 2 * N, bias=False)
        self.dt_proj = nn.Linear(R, I, bias=True)
        A = mx.repeat(mx.arange(1.0, N + 1.0).reshape([1, N]), repeats=I, axis=0)
        self.A_log = mx.log(A)
        self.D = mx.ones([I])
        self.out_proj = nn.Linear(I, hidden, bias=bias)

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
        y, current_state = self._scan(x, A, state_cache)
        z = self.out_proj(swiglu(z, y))
        return z, (new_conv_cache, current_state)

    def _scan(self, x, A, state):
        """mamba's: ssm_step token by token, the outputs stacked."""
        y = []
        for t in range(x.shape[1]):
            y_t, state = self.ssm_step(x[:, t], A, state)
            y.append(y_t)
        return mx.stack(y, axis=1), state

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Any = None) -> mx.array:
        conv_cache, state_cache = (None, None) if cache is None else (cache[0], cache[1])
        output, (new_conv_cache, new_state) = self._process_sequence(x, conv_cache, state_cache)
        if cache is not None:
            cache[0] = new_conv_cache
            cache[1] = new_state
            cache.advance(x.shape[1])
        return output


@dataclass(frozen=True)
class JambaMambaKnobs:
    """The ModelArgs fields jamba's mixer reads (the width is expand * hidden)."""

    expand: str = "mamba_expand"
    state: str = "mamba_d_state"
    conv_kernel: str = "mamba_d_conv"
    time_step_rank: str = "mamba_dt_rank"
    bias: str = "mamba_proj_bias"
    conv_bias: str = "mamba_conv_bias"
    eps: str = "rms_norm_eps"  # dt_layernorm / b_layernorm / c_layernorm

    def field_refs(self) -> Iterator[tuple[str, str]]:
        for f in dataclasses.fields(self):
            yield f"hybrid.knobs.{f.name}", getattr(self, f.name)


@mx.compile
def _fma(a, b, c):  # jamba.fma
    return a * b + c


class JambaMambaMixer(MambaMixer):
    """mlx-lm's `JambaMambaMixer`: the Mamba mixer of width mamba_expand * hidden whose delta, B and C
    pass RMSNorm modules (dt_layernorm, b_layernorm, c_layernorm) and whose scan computes every
    token's update at once, then chains the state through a compiled fma per token."""

    def __init__(self, a: Any, knobs: JambaMambaKnobs, index: int):
        nn.Module.__init__(self)
        f = a.fields
        self._build(a.hidden, f[knobs.expand] * a.hidden, f[knobs.state], f[knobs.conv_kernel],
                    f[knobs.time_step_rank], bool(f[knobs.bias]), bool(f[knobs.conv_bias]))
        eps = f[knobs.eps]
        self.dt_layernorm = nn.RMSNorm(self.time_step_rank, eps=eps)
        self.b_layernorm = nn.RMSNorm(self.ssm_state_size, eps=eps)
        self.c_layernorm = nn.RMSNorm(self.ssm_state_size, eps=eps)

    def ssm_step(self, x, A, state=None):
        T = x.shape[1]
        D = self.D
        deltaBC = self.x_proj(x)
        delta, B, C = mx.split(deltaBC, [self.time_step_rank, self.time_step_rank + self.ssm_state_size],
                               axis=-1)
        delta, B, C = self.dt_layernorm(delta), self.b_layernorm(B), self.c_layernorm(C)
        delta = nn.softplus(self.dt_proj(delta))
        new_state = mx.expand_dims(delta * x, -1) * mx.expand_dims(B, -2)
        dtA = mx.exp(mx.expand_dims(delta, -1) * A)
        for t in range(T):
            if state is not None:
                new_state[:, t] = _fma(state, dtA[:, t], new_state[:, t])
            state = new_state[:, t]
        y = (new_state @ mx.expand_dims(C, -1)).squeeze(-1)
        y = y + D * x
        return y, new_state[:, -1]

    def _scan(self, x, A, state):
        """jamba's: every token at once (ssm_step chains the state)."""
        return self.ssm_step(x, A, state)
