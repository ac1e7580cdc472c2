"""The Mamba2 mixer of mlx-lm 0.32.2: `Mamba2Block` (mamba2.py), `NemotronHMamba2Mixer`
(nemotron_h.py), `FalconH1Mixer` (falcon_h1.py) and `GraniteMoeHybridMamba2Mixer`
(granitemoehybrid.py) as one module, their differences as knobs.

The four files run the same forward: in_proj split [gate | conv input | dt], a causal
depthwise conv1d over [x | B | C] (its last kernel-1 inputs are cache slot 0) and SiLU, the
SSD scan (`ssm.ssm_update`; its state is cache slot 1), the gated RMSNorm, out_proj. What
differs is which ModelArgs fields hold the sizes and biases (`Mamba2Knobs`' field names),
the gated norm (`GatedNorm`, `norm_when`, `norm_before_gate`), whether D is cast to the
input dtype before the scan (nemotron_h, granitemoehybrid) and whether the scan reads the
cache's `lengths` (all but nemotron_h). Attribute names are mlx-lm's, so parameter paths
are its safetensors keys.

Tensor parallel (`shard`; none of the four mlx-lm files has one): each rank keeps its heads (its
part of in_proj's gate, x and dt rows, of the conv's x channels, of D / dt_bias / A_log) and the
B / C groups they read: its share of the groups where they split across the ranks, else (groups
fewer than the ranks) its heads' one group, repeated so that each rank holds a copy. The gated
norm normalizes whole groups as unsplit: a rank holding whole groups (GROUPED, n_groups a multiple
of the ranks) normalizes them alone, else the squared sums are all-summed over the ranks sharing
a group (WHOLE: all of them). out_proj sums the ranks (sharded-to-all); the conv and SSM states
hold the rank's channels and heads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import MlxbunError
from mlxbun.models.layers import swiglu
from mlxbun.models.sharding import (
    ALL_TO_SHARDED,
    SHARDED_TO_ALL,
    ShardingError,
    check_heads,
    repeat_rows,
    rms_norm_over_ranks,
    shard_depthwise_conv,
    shard_linear,
    slice_heads,
)
from mlxbun.models.universal.fields import fail, int_field
from mlxbun.models.universal.kinds import StrEnum
from mlxbun.models.universal.mixers.ssm import padded_conv_input, ssm_update

__all__ = ["GatedNorm", "GatedRMSNorm", "Mamba2Knobs", "Mamba2KnobsError", "Mamba2Mixer"]


class Mamba2KnobsError(MlxbunError):
    """A `Mamba2Knobs` value the mixer has no branch for."""


class GatedNorm(StrEnum):
    """The gated RMSNorm on the scan output y (gate: in_proj's first slice), module `norm`."""

    WHOLE = "whole"  # rms_norm(y, weight, eps) over the full width; swiglu(gate, .) before it
    # (mamba2's MambaRMSNormGated, falcon_h1's FalconH1RMSNormGated) or after it (norm_before_gate)
    GROUPED = "grouped"  # swiglu(gate, y), rms_norm without weight over groups of width / n_groups,
    # then weight * the flattened groups (nemotron_h's MambaRMSNormGated)


@dataclass(frozen=True)
class Mamba2Knobs:
    """What differs between mlx-lm's Mamba2 mixers. Strings name ModelArgs fields."""

    heads: str = "num_heads"
    head_dim: str = "head_dim"
    state: str = "ssm_state_size"
    groups: str = "n_groups"
    conv_kernel: str = "conv_kernel"
    conv_bias: str = "use_conv_bias"  # bool field: conv1d's bias
    in_bias: str = "use_bias"  # bool field: in_proj's bias
    out_bias: str = "use_bias"  # bool field: out_proj's bias
    eps: str = "layer_norm_epsilon"  # the gated norm's eps
    intermediate: str | None = None  # field: the scan width; None: heads * head_dim
    time_step_limit: str | tuple[float, float] = "time_step_limit"  # field, or the literal
    # (lo, hi) the mixer fixes (falcon_h1: (0.0, inf))
    norm: GatedNorm = GatedNorm.WHOLE
    norm_when: str | None = None  # bool field: False = no norm module, y = swiglu(gate, y)
    # (falcon_h1's mamba_rms_norm); None: the norm is always there
    norm_before_gate: bool | str = False  # literal or bool field: rms_norm first, then swiglu
    # (falcon_h1's mamba_norm_before_gate); GatedNorm.WHOLE only
    d_cast: bool = False  # D.astype(x.dtype) before the scan (nemotron_h, granitemoehybrid)
    scan_lengths: bool = True  # the scan gets cache.lengths (all but nemotron_h)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "norm":
                if not isinstance(v, GatedNorm):
                    if v not in GatedNorm._value2member_map_:
                        accepted = ", ".join(repr(m.value) for m in GatedNorm)
                        raise Mamba2KnobsError(f"Mamba2Knobs.norm = {v!r} is not one of {accepted}")
                    object.__setattr__(self, "norm", GatedNorm(v))
            elif f.name in ("d_cast", "scan_lengths"):
                if not isinstance(v, bool):
                    raise Mamba2KnobsError(f"Mamba2Knobs.{f.name} = {v!r} must be a bool")
            elif f.name == "time_step_limit" and not isinstance(v, str):
                ok = (isinstance(v, tuple) and len(v) == 2
                      and all(isinstance(x, float) for x in v) and v[0] <= v[1])
                if not ok:
                    raise Mamba2KnobsError(f"Mamba2Knobs.time_step_limit = {v!r} must be a field "
                                           "name or a (lo, hi) pair of floats, lo <= hi")
            elif f.name == "norm_before_gate" and isinstance(v, bool):
                continue
            elif not (isinstance(v, str) and v.isidentifier()) and not (
                    v is None and f.name in ("intermediate", "norm_when")):
                raise Mamba2KnobsError(f"Mamba2Knobs.{f.name} = {v!r} must be a ModelArgs field name")
        if self.norm is GatedNorm.GROUPED and self.norm_before_gate is not False:
            raise Mamba2KnobsError("Mamba2Knobs.norm_before_gate takes norm 'whole' (the grouped "
                                   "norm gates first)")

    def field_refs(self) -> Iterator[tuple[str, str]]:
        """(knob, ModelArgs field) for every field the knobs read."""
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, str) and not isinstance(v, GatedNorm):
                yield f"hybrid.knobs.{f.name}", v


class GatedRMSNorm(nn.Module):
    """mlx-lm's MambaRMSNormGated (mamba2, nemotron_h), FalconH1RMSNormGated,
    GraniteMoeHybridRMSNormGated, per `GatedNorm`."""

    def __init__(self, width: int, eps: float, kind: GatedNorm, group_size: int,
                 before_gate: bool):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(width)
        self._kind = kind
        self._group_size = group_size
        self._before_gate = before_gate
        self._over_ranks = None  # set by split(): a norm whose groups span several ranks

    @property
    def groups(self) -> int:
        """How many groups it normalizes separately (WHOLE: one)."""
        return self.weight.shape[0] // self._group_size if self._kind is GatedNorm.GROUPED else 1

    def split(self, group, span: int) -> None:
        """Keep this rank's slice of the weight; `span` ranks share each normalized group (1: the
        rank holds whole groups and normalizes them alone)."""
        self.weight = slice_heads(self.weight, group)
        if span > 1:
            object.__setattr__(self, "_over_ranks", rms_norm_over_ranks(group, span))

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        split = self._over_ranks
        if self._kind is GatedNorm.GROUPED:
            x = swiglu(gate, x)
            if split is not None:  # the rank's slice is part of one group
                return split(x, self.weight, self.eps)
            x = mx.unflatten(x, axis=-1, shape=(-1, self._group_size))
            x = mx.fast.rms_norm(x, weight=None, eps=self.eps)
            return self.weight * x.flatten(-2)
        norm = mx.fast.rms_norm if split is None else split
        if self._before_gate:
            return swiglu(gate, norm(x, self.weight, self.eps))
        return norm(swiglu(gate, x), self.weight, self.eps)


def _flag(f: Mapping[str, Any], name: str, mt: str) -> bool:
    v = f[name]
    if not isinstance(v, bool):
        raise fail(mt, f"'{name}' must be true or false, got {v!r}")
    return v


class Mamba2Mixer(nn.Module):
    """One Mamba2 layer's mixer: __call__(x, mask, cache) with cache an ArraysCache(size=2)."""

    cache_slots = 2  # [conv state, SSM state], mlx-lm's ArraysCache(size=2)

    def __init__(self, a, knobs: Mamba2Knobs, index: int):
        super().__init__()
        f, mt = a.fields, a.model_type
        self.num_heads = int_field(f, knobs.heads, mt)
        self.head_dim = int_field(f, knobs.head_dim, mt)
        self.ssm_state_size = int_field(f, knobs.state, mt)
        self.n_groups = int_field(f, knobs.groups, mt)
        self.conv_kernel_size = int_field(f, knobs.conv_kernel, mt)
        if self.num_heads % self.n_groups:
            raise fail(mt, f"'{knobs.heads}' ({self.num_heads}) is not a multiple of "
                           f"'{knobs.groups}' ({self.n_groups})")
        self.intermediate_size = (int_field(f, knobs.intermediate, mt) if knobs.intermediate
                                  else self.num_heads * self.head_dim)
        if self.intermediate_size != self.num_heads * self.head_dim:
            raise fail(mt, f"'{knobs.intermediate}' ({self.intermediate_size}) is not "
                           f"'{knobs.heads}' * '{knobs.head_dim}' ({self.num_heads * self.head_dim})")
        tsl = knobs.time_step_limit
        self._time_step_limit = f[tsl] if isinstance(tsl, str) else tsl
        self._d_cast = knobs.d_cast
        self._scan_lengths = knobs.scan_lengths
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * self.ssm_state_size

        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            kernel_size=self.conv_kernel_size,
            padding=0,
            groups=self.conv_dim,
            bias=_flag(f, knobs.conv_bias, mt),
        )
        projection_size = self.intermediate_size + self.conv_dim + self.num_heads
        self.in_proj = nn.Linear(a.hidden, projection_size, bias=_flag(f, knobs.in_bias, mt))
        self.dt_bias = mx.ones(self.num_heads)
        self.A_log = mx.log(mx.arange(1, self.num_heads + 1, dtype=mx.float32))
        self.D = mx.ones(self.num_heads)
        if knobs.norm_when is None or _flag(f, knobs.norm_when, mt):
            before = knobs.norm_before_gate
            if self.intermediate_size % self.n_groups:
                raise fail(mt, f"the scan width ({self.intermediate_size}) is not a multiple of "
                               f"'{knobs.groups}' ({self.n_groups})")
            self.norm = GatedRMSNorm(
                self.intermediate_size, f[knobs.eps], knobs.norm,
                self.intermediate_size // self.n_groups,
                _flag(f, before, mt) if isinstance(before, str) else before)
        self.out_proj = nn.Linear(self.intermediate_size, a.hidden,
                                  bias=_flag(f, knobs.out_bias, mt))

    def shard(self, group, where: str) -> None:
        """Split the heads across `group` (checked before anything changes)."""
        n = group.size()
        H, G, S, I = self.num_heads, self.n_groups, self.ssm_state_size, self.intermediate_size
        check_heads(where, H, n, "heads")
        if G % n and n % G:
            raise ShardingError(f"{where}: {G} B / C groups neither split across {n} ranks nor repeat "
                                f"to one per rank ({H} heads)")
        norm = self["norm"] if "norm" in self else None
        if norm is not None and norm.groups % n and n % norm.groups:
            raise ShardingError(f"{where}.norm: {norm.groups} normalized groups neither split across "
                                f"{n} ranks nor span whole ranks")
        out_proj = shard_linear(self.out_proj, SHARDED_TO_ALL, group, where=f"{where}.out_proj")
        if G < n:  # each rank's heads read one group: repeat each group's B and C rows n // G times
            for lo in (I, I + n * S):  # B then C in the conv channels [x | B | C]
                repeat_rows(self.in_proj, G, n, (I + lo, I + lo + G * S))
                repeat_rows(self.conv1d, G, n, (lo, lo + G * S))
            self.conv1d.groups = self.conv1d.weight.shape[0]  # still depthwise, over more channels
        groups = max(G, n)
        bc = groups * S
        self.in_proj = shard_linear(self.in_proj, ALL_TO_SHARDED, group, where=f"{where}.in_proj",
                                    segments=[I, 2 * I, 2 * I + bc, 2 * I + 2 * bc])
        shard_depthwise_conv(self.conv1d, group, where=f"{where}.conv1d", segments=[I, I + bc])
        self.out_proj = out_proj
        if norm is not None:
            norm.split(group, max(n // norm.groups, 1))
        for name in ("dt_bias", "A_log", "D"):
            setattr(self, name, slice_heads(self[name], group))
        self.num_heads, self.n_groups, self.intermediate_size = H // n, groups // n, I // n
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * S

    def _conv(self, conv_input: mx.array, cache, mask: Optional[mx.array]) -> mx.array:
        padded_input = padded_conv_input(conv_input, cache, mask, self.conv_kernel_size, self.conv_dim)
        return nn.silu(self.conv1d(padded_input))

    def _ssm(self, hidden_states: mx.array, B: mx.array, C: mx.array, dt: mx.array, cache,
             mask: Optional[mx.array]) -> mx.array:
        batch_size, seq_len, _ = hidden_states.shape
        hidden_states = hidden_states.reshape(
            batch_size, seq_len, self.num_heads, self.head_dim
        )
        B = B.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
        C = C.reshape(batch_size, seq_len, self.n_groups, self.ssm_state_size)
        state = lengths = None
        if cache is not None:
            state = cache[1]
            if self._scan_lengths:
                lengths = cache.lengths
        D = self.D.astype(hidden_states.dtype) if self._d_cast else self.D
        y, state = ssm_update(
            hidden_states,
            self.A_log,
            B,
            C,
            D,
            dt,
            self.dt_bias,
            state,
            self._time_step_limit,
            mask,
            lengths,
        )
        if cache is not None:
            cache[1] = state
        return y.reshape(batch_size, seq_len, self.intermediate_size)

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache=None) -> mx.array:
        projected = self.in_proj(x)
        gate, conv_input, dt = mx.split(
            projected,
            [self.intermediate_size, self.intermediate_size + self.conv_dim],
            axis=-1,
        )
        conv_output = self._conv(conv_input, cache, mask)
        hidden_states, B, C = mx.split(
            conv_output,
            [
                self.intermediate_size,
                self.intermediate_size + self.n_groups * self.ssm_state_size,
            ],
            axis=-1,
        )
        y = self._ssm(hidden_states, B, C, dt, cache, mask)
        if cache is not None:
            cache.advance(y.shape[1])
        y = self.norm(y, gate) if "norm" in self else swiglu(gate, y)
        return self.out_proj(y)
