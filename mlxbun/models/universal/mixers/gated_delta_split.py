"""olmo_hybrid's gated DeltaNet (mlx-lm 0.32.2 `olmo_hybrid.GatedDeltaNet`), op for op.

How it differs from qwen3_next's / qwen3_5's (mixers/gated_delta.py): six separate projections
(q_proj, k_proj, v_proj, a_proj, b_proj, g_proj; o_proj out), each of q, k, v through its own
causal depthwise conv1d + silu (q_conv1d, k_conv1d, v_conv1d) with its own conv window (cache
slots 0, 1, 2), the projected inputs NOT zeroed where the ssm mask is False (only the delta rule
takes the mask), beta doubled when the row's field allows negative eigenvalues, the delta state in
slot 3, and the gated RMSNorm (`o_norm`, eps from its own field) run on [B * S * Hv, Dv] rows with
g_proj's gate. The q / k l2-norm and the delta rule are gated_delta_rule's (mlx-lm's
`normalize_qk`, `gated_delta_update`, with its Metal-kernel-or-ops dispatch).
Attribute names are mlx-lm's, so parameter paths are its safetensors keys.

Tensor parallel (`shard`; mlx-lm's olmo_hybrid has none): gated_delta.py's split, each rank
holding whole key heads and their value heads: the six projections all-to-sharded, each conv's
channels split (three conv windows of its own width), dt_bias / A_log sliced, o_proj
sharded-to-all.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import MlxbunError
from mlxbun.models.universal.fields import fail, int_field
from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL, check_heads, shard_linear
from mlxbun.models.universal.mixers.gated_delta import GatedRMSNorm, split_delta_heads
from mlxbun.models.universal.mixers.gated_delta_rule import gated_delta_update, normalize_qk

__all__ = ["GatedDeltaSplitConv", "GatedDeltaSplitKnobs"]


@dataclass(frozen=True)
class GatedDeltaSplitKnobs:
    """The ModelArgs fields the mixer reads."""

    num_v_heads: str = "linear_num_value_heads"
    num_k_heads: str = "linear_num_key_heads"
    head_k_dim: str = "linear_key_head_dim"
    head_v_dim: str = "linear_value_head_dim"
    conv_kernel: str = "linear_conv_kernel_dim"
    allow_neg_eigval: str = "linear_allow_neg_eigval"  # a bool: beta in [0, 2] instead of [0, 1]
    norm_eps: str = "layer_norm_epsilon"  # the gated RMSNorm's eps

    def __post_init__(self):
        for f in fields(self):
            name = getattr(self, f.name)
            if not isinstance(name, str) or not name:
                raise MlxbunError(f"GatedDeltaSplitKnobs.{f.name}: expected a ModelArgs field "
                                  f"name, got {name!r}")

    def field_refs(self) -> Iterator[tuple[str, str]]:
        for f in fields(self):
            yield f"hybrid.knobs.{f.name}", getattr(self, f.name)


def _depthwise(channels: int, kernel: int) -> nn.Conv1d:
    return nn.Conv1d(in_channels=channels, out_channels=channels, kernel_size=kernel, bias=False,
                     groups=channels, padding=0)


class GatedDeltaSplitConv(nn.Module):
    """The gated DeltaNet layer of olmo_hybrid (cache: an ArraysCache of 4 slots)."""

    cache_slots = 4  # [q, k, v conv windows [B, K - 1, C], delta state [B, Hv, Dv, Dk] float32]

    def __init__(self, a: Any, knobs: GatedDeltaSplitKnobs, index: int):
        super().__init__()
        f, mt = a.fields, a.model_type
        self.num_v_heads = int_field(f, knobs.num_v_heads, mt)
        self.num_k_heads = int_field(f, knobs.num_k_heads, mt)
        self.head_k_dim = int_field(f, knobs.head_k_dim, mt)
        self.head_v_dim = int_field(f, knobs.head_v_dim, mt)
        if self.num_v_heads % self.num_k_heads != 0:
            raise fail(mt, f"'{knobs.num_v_heads}' ({self.num_v_heads}) must be divisible by "
                           f"'{knobs.num_k_heads}' ({self.num_k_heads}) (layer {index})")
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = int_field(f, knobs.conv_kernel, mt)
        neg = f[knobs.allow_neg_eigval]
        if not isinstance(neg, bool):
            raise fail(mt, f"'{knobs.allow_neg_eigval}' must be true or false, got {neg!r}")
        self.allow_neg_eigval = neg
        eps = f[knobs.norm_eps]
        if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps <= 0:
            raise fail(mt, f"'{knobs.norm_eps}' must be a positive number, got {eps!r}")

        D = a.hidden
        self.q_proj = nn.Linear(D, self.key_dim, bias=False)
        self.k_proj = nn.Linear(D, self.key_dim, bias=False)
        self.v_proj = nn.Linear(D, self.value_dim, bias=False)
        self.a_proj = nn.Linear(D, self.num_v_heads, bias=False)
        self.b_proj = nn.Linear(D, self.num_v_heads, bias=False)
        self.g_proj = nn.Linear(D, self.value_dim, bias=False)
        self.o_proj = nn.Linear(self.value_dim, D, bias=False)

        self.q_conv1d = _depthwise(self.key_dim, self.conv_kernel_size)
        self.k_conv1d = _depthwise(self.key_dim, self.conv_kernel_size)
        self.v_conv1d = _depthwise(self.value_dim, self.conv_kernel_size)

        self.A_log = mx.zeros(self.num_v_heads)
        self.dt_bias = mx.zeros(self.num_v_heads)

        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=eps)

    def shard(self, group, where: str) -> None:
        """Split the heads across `group` (checked first)."""
        check_heads(where, self.num_k_heads, group.size(), "key heads")
        layers = {name: shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
                  for name in ("q_proj", "k_proj", "v_proj", "a_proj", "b_proj", "g_proj")}
        layers["o_proj"] = shard_linear(self.o_proj, SHARDED_TO_ALL, group, where=f"{where}.o_proj")
        split_delta_heads(self, group, where, layers, dict.fromkeys(("q_conv1d", "k_conv1d", "v_conv1d"), 1))

    def _apply_conv1d(self, x: mx.array, conv: nn.Conv1d, conv_state: Optional[mx.array],
                      cache_slot: Optional[Any], slot_idx: int) -> mx.array:
        B, S, D = x.shape
        n_keep = self.conv_kernel_size - 1

        if conv_state is not None:
            padded = mx.concatenate([conv_state, x], axis=1)
        else:
            padded = mx.concatenate([mx.zeros((B, n_keep, D), dtype=x.dtype), x], axis=1)

        if cache_slot is not None:
            cache_slot[slot_idx] = mx.contiguous(padded[:, -n_keep:, :])

        return nn.silu(conv(padded))

    def __call__(self, x: mx.array, mask: Optional[mx.array] = None,
                 cache: Optional[Any] = None) -> mx.array:
        B, S, _ = x.shape

        q = self.q_proj(x)
        k = self.k_proj(x)
        v = self.v_proj(x)

        conv_q_state = cache[0] if cache is not None else None
        conv_k_state = cache[1] if cache is not None else None
        conv_v_state = cache[2] if cache is not None else None

        q = self._apply_conv1d(q, self.q_conv1d, conv_q_state, cache, 0)
        k = self._apply_conv1d(k, self.k_conv1d, conv_k_state, cache, 1)
        v = self._apply_conv1d(v, self.v_conv1d, conv_v_state, cache, 2)

        q = q.reshape(B, S, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, S, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, S, self.num_v_heads, self.head_v_dim)

        q, k = normalize_qk(q, k, inv_scale=self.head_k_dim**-0.5, eps=1e-6)

        state = cache[3] if (cache is not None and cache[3] is not None) else None
        out, state = gated_delta_update(
            q,
            k,
            v,
            self.a_proj(x),
            self.b_proj(x),
            self.A_log,
            self.dt_bias,
            state,
            mask,
            use_kernel=not self.training,
            allow_neg_eigval=self.allow_neg_eigval,
        )

        if cache is not None:
            cache[3] = state
            cache.advance(S)

        gate = self.g_proj(x)
        out = out.reshape(-1, self.head_v_dim)
        gate = gate.reshape(-1, self.head_v_dim)
        out = self.o_norm(out, gate)
        out = out.reshape(B, S, -1)

        return self.o_proj(out)
