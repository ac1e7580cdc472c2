"""The gated DeltaNet mixer of qwen3_next, qwen3_5 and qwen3_5_moe, op for op as mlx-lm 0.32.2.

One module for mlx-lm's `Qwen3NextGatedDeltaNet` (qwen3_next.py) and `GatedDeltaNet`
(qwen3_5.py, also qwen3_5_moe's): they differ only in the input projections, a typed knob
(`GdnProjections`). The rest is shared and runs in mlx-lm's order: the projected q | k | v
zeroed where the ssm mask is False, prepended with the conv state (cache slot 0: the last
K - 1 inputs, or, with `cache.lengths`, each row's last K - 1 before its length), the depthwise
causal conv1d + silu, the q / k l2-norm (`normalize_qk`, readout scale folded into q), the
gated delta rule (`gated_delta_rule.gated_delta_update`, state in cache slot 1, float32),
then the gated RMSNorm (`rms_norm(y) * silu(z)` in float32) and `out_proj`.
Attribute names are mlx-lm's, so parameter paths are its safetensors keys.

Tensor parallel (`shard`, mlx-lm qwen3_5's Model.shard): each rank keeps whole key heads and the
value heads that read them (the projections all-to-sharded, qwen3_5's fused q | k | v and the
conv's channels by their three parts, qwen3_next's per-key-head groups as they lie), dt_bias and
A_log sliced, a conv and delta state of its own heads; out_proj sums the ranks (sharded-to-all).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import MlxbunError
from mlxbun.models import layers as L
from mlxbun.models.sharding import (
    ALL_TO_SHARDED,
    SHARDED_TO_ALL,
    check_heads,
    shard_depthwise_conv,
    shard_linear,
    slice_heads,
)
from mlxbun.models.universal.fields import fail, int_field
from mlxbun.models.universal.kinds import StrEnum
from mlxbun.models.universal.mixers.gated_delta_rule import gated_delta_update, normalize_qk

__all__ = ["GatedDeltaKnobs", "GatedDeltaNet", "GatedRMSNorm", "GdnProjections", "split_delta_heads"]


class GdnProjections(StrEnum):
    """How the mixer projects its input (the only difference between the two mlx-lm modules)."""

    # qwen3_next: in_proj_qkvz Linear(D, 2 Kd + 2 Vd) and in_proj_ba Linear(D, 2 Hv), both
    # grouped per key head ([q | k | v | z] and [b | a] per head, mlx-lm's
    # fix_query_key_value_ordering splits them)
    QKVZ_BA = "qkvz_ba"
    # qwen3_5: in_proj_qkv Linear(D, 2 Kd + Vd) laid out [q | k | v], in_proj_z Linear(D, Vd),
    # in_proj_b and in_proj_a Linear(D, Hv)
    QKV_Z_B_A = "qkv_z_b_a"


@dataclass(frozen=True)
class GatedDeltaKnobs:
    """The mixer's knobs: its projection layout and the ModelArgs fields it reads."""

    projections: GdnProjections
    num_v_heads: str = "linear_num_value_heads"
    num_k_heads: str = "linear_num_key_heads"
    head_k_dim: str = "linear_key_head_dim"
    head_v_dim: str = "linear_value_head_dim"
    conv_kernel: str = "linear_conv_kernel_dim"

    def __post_init__(self):
        try:
            object.__setattr__(self, "projections", GdnProjections(self.projections))
        except ValueError:
            accepted = ", ".join(repr(p.value) for p in GdnProjections)
            raise MlxbunError(f"GatedDeltaKnobs.projections: {self.projections!r} is not one of "
                              f"{accepted}") from None
        for f in fields(self)[1:]:
            name = getattr(self, f.name)
            if not isinstance(name, str) or not name:
                raise MlxbunError(f"GatedDeltaKnobs.{f.name}: expected a ModelArgs field name, "
                                  f"got {name!r}")

    def field_refs(self) -> Iterator[tuple[str, str]]:
        for f in fields(self)[1:]:
            yield f"hybrid.knobs.{f.name}", getattr(self, f.name)


class GatedRMSNorm(nn.Module):
    """mlx-lm's `Qwen3NextRMSNormGated` as the mixer calls it (always with its gate)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(hidden_size)

    def __call__(self, hidden_states: mx.array, gate: mx.array) -> mx.array:
        x = mx.fast.rms_norm(hidden_states, self.weight, self.eps)
        return L.precise_swiglu(hidden_states, gate, x)


def split_delta_heads(mixer: nn.Module, group, where: str, layers: dict, convs: dict) -> None:
    """A gated DeltaNet's split, once every piece is computed: the checked linears `layers` set,
    the depthwise `convs` ({name: segments}) split, the per-value-head dt_bias / A_log sliced and
    the head counts divided. Checks the heads first (key heads whole on each rank, so the value
    heads that read them stay with them)."""
    n = group.size()
    check_heads(where, mixer.num_k_heads, n, "key heads")
    check_heads(where, mixer.num_v_heads, n, "value heads")
    for name, segments in convs.items():
        shard_depthwise_conv(mixer[name], group, where=f"{where}.{name}", segments=segments)
    for name, module in layers.items():
        setattr(mixer, name, module)
    mixer.dt_bias = slice_heads(mixer.dt_bias, group)
    mixer.A_log = slice_heads(mixer.A_log, group)
    mixer.num_k_heads //= n
    mixer.num_v_heads //= n
    mixer.key_dim //= n
    mixer.value_dim //= n


class GatedDeltaNet(nn.Module):
    """The gated DeltaNet layer (mlx-lm's attribute names; cache: an ArraysCache of 2 slots)."""

    cache_slots = 2  # [conv state [B, K - 1, conv_dim], delta state [B, Hv, Dv, Dk] float32]

    def __init__(self, a: Any, knobs: GatedDeltaKnobs, index: int):
        super().__init__()
        f, mt = a.fields, a.model_type
        self._projections = knobs.projections
        self.hidden_size = a.hidden
        self.num_v_heads = int_field(f, knobs.num_v_heads, mt)
        self.num_k_heads = int_field(f, knobs.num_k_heads, mt)
        self.head_k_dim = int_field(f, knobs.head_k_dim, mt)
        self.head_v_dim = int_field(f, knobs.head_v_dim, mt)
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        if self.num_v_heads % self.num_k_heads != 0:
            raise fail(mt, f"'{knobs.num_v_heads}' ({self.num_v_heads}) must be divisible by "
                           f"'{knobs.num_k_heads}' ({self.num_k_heads}) (layer {index})")

        self.conv_kernel_size = int_field(f, knobs.conv_kernel, mt)
        self.layer_norm_epsilon = a.eps

        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = nn.Conv1d(
            in_channels=self.conv_dim,
            out_channels=self.conv_dim,
            bias=False,
            kernel_size=self.conv_kernel_size,
            groups=self.conv_dim,
            padding=0,
        )

        D = self.hidden_size
        if self._projections is GdnProjections.QKVZ_BA:
            self.in_proj_qkvz = nn.Linear(D, self.key_dim * 2 + self.value_dim * 2, bias=False)
            self.in_proj_ba = nn.Linear(D, self.num_v_heads * 2, bias=False)
        else:  # GdnProjections.QKV_Z_B_A
            self.in_proj_qkv = nn.Linear(D, self.key_dim * 2 + self.value_dim, bias=False)
            self.in_proj_z = nn.Linear(D, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(D, self.num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(D, self.num_v_heads, bias=False)

        self.dt_bias = mx.ones(self.num_v_heads)
        A = mx.random.uniform(low=0, high=16, shape=(self.num_v_heads,))
        self.A_log = mx.log(A)

        self.norm = GatedRMSNorm(self.head_v_dim, eps=self.layer_norm_epsilon)
        self.out_proj = nn.Linear(self.value_dim, D, bias=False)

    def shard(self, group, where: str) -> None:
        """Split the heads across `group` as mlx-lm qwen3_5's Model.shard (checked first)."""
        def a2s(name, segments=1):
            return shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}", segments=segments)

        check_heads(where, self.num_k_heads, group.size(), "key heads")
        kd = self.key_dim
        if self._projections is GdnProjections.QKVZ_BA:  # [q | k | v | z], [b | a] per key head
            layers = {"in_proj_qkvz": a2s("in_proj_qkvz"), "in_proj_ba": a2s("in_proj_ba")}
        else:  # GdnProjections.QKV_Z_B_A
            layers = {"in_proj_qkv": a2s("in_proj_qkv", [kd, 2 * kd]),
                      **{name: a2s(name) for name in ("in_proj_z", "in_proj_b", "in_proj_a")}}
        layers["out_proj"] = shard_linear(self.out_proj, SHARDED_TO_ALL, group, where=f"{where}.out_proj")
        split_delta_heads(self, group, where, layers, {"conv1d": [kd, 2 * kd]})
        self.conv_dim //= group.size()

    def _project_qkvz_ba(self, inputs: mx.array):
        """qwen3_next: the fused projections and mlx-lm's `fix_query_key_value_ordering`."""
        B, S, _ = inputs.shape
        mixed_qkvz, mixed_ba = self.in_proj_qkvz(inputs), self.in_proj_ba(inputs)
        nk, dn, nv, dv = self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim
        mixed_qkvz = mixed_qkvz.reshape(*mixed_qkvz.shape[:-1], nk, -1)
        mixed_ba = mixed_ba.reshape(*mixed_ba.shape[:-1], nk, -1)
        q, k, v, z = mx.split(mixed_qkvz, [dn, 2 * dn, 2 * dn + nv // nk * dv], axis=-1)
        b, a = mx.split(mixed_ba, [nv // nk], axis=-1)
        v = v.reshape(*v.shape[:2], -1, dv)
        z = z.reshape(*z.shape[:2], -1, dv)
        b = b.reshape(*b.shape[:2], nv)
        a = a.reshape(*a.shape[:2], nv)
        mixed_qkv = mx.concatenate(
            [q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)], axis=-1
        )
        return mixed_qkv, z, b, a

    def _project_qkv_z_b_a(self, inputs: mx.array):
        """qwen3_5: four projections."""
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)
        return qkv, z, b, a

    def __call__(
        self,
        inputs: mx.array,
        mask: Optional[mx.array] = None,
        cache: Optional[Any] = None,
    ) -> mx.array:
        B, S, _ = inputs.shape
        if self._projections is GdnProjections.QKVZ_BA:
            mixed_qkv, z, b, a = self._project_qkvz_ba(inputs)
        else:  # GdnProjections.QKV_Z_B_A
            mixed_qkv, z, b, a = self._project_qkv_z_b_a(inputs)

        if cache is not None and cache[0] is not None:
            conv_state = cache[0]
        else:
            conv_state = mx.zeros(
                (B, self.conv_kernel_size - 1, self.conv_dim),
                dtype=inputs.dtype,
            )

        if mask is not None:
            mixed_qkv = mx.where(mask[..., None], mixed_qkv, 0)
        conv_input = mx.concatenate([conv_state, mixed_qkv], axis=1)

        if cache is not None:
            n_keep = self.conv_kernel_size - 1
            if cache.lengths is not None:
                ends = mx.clip(cache.lengths, 0, S)
                positions = (ends[:, None] + mx.arange(n_keep))[..., None]
                cache[0] = mx.take_along_axis(conv_input, positions, axis=1)
            else:
                cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])

        conv_out = nn.silu(self.conv1d(conv_input))

        q, k, v = [
            t.reshape(B, S, h, d)
            for t, h, d in zip(
                mx.split(conv_out, [self.key_dim, 2 * self.key_dim], -1),
                [self.num_k_heads, self.num_k_heads, self.num_v_heads],
                [self.head_k_dim, self.head_k_dim, self.head_v_dim],
            )
        ]

        state = cache[1] if cache else None
        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)

        out, state = gated_delta_update(
            q,
            k,
            v,
            a,
            b,
            self.A_log,
            self.dt_bias,
            state,
            mask,
            use_kernel=not self.training,
        )

        if cache is not None:
            cache[1] = state
            cache.advance(S)

        out = self.norm(out, z)
        return self.out_proj(out.reshape(B, S, -1))
