"""The row's dense MLP (gated, gated-fused or plain), op for op as the mlx-lm files write it.

Used by `dense.py`'s blocks and, at another width, as the shared expert of `moe.py`'s block.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models import layers as L
from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL, shard_linear
from mlxbun.models.switch_layers import clamped_swiglu
from mlxbun.models.universal.kinds import FUSED_ACTS, GATED_ACTS, PLAIN_ACTS, Act, MlpKind, exhaustive
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["MLP"]


def _silu_eager(gate, x):
    """olmo_hybrid's MLP: `nn.silu(gate) * x`, the product outside the compiled silu."""
    return nn.silu(gate) * x


_GATED = exhaustive(GATED_ACTS, {Act.SILU: L.swiglu, Act.GELU: L.gelu_mul,
                                 Act.GELU_APPROX: L.gelu_approx_mul, Act.SILU_EAGER: _silu_eager})
_FUSED = exhaustive(FUSED_ACTS, {Act.SILU: L.swiglu})
_PLAIN = exhaustive(PLAIN_ACTS, {Act.GELU: nn.gelu, Act.GELU_APPROX: nn.gelu_approx,
                                 Act.RELU_SQUARED: L.relu_squared, Act.RELU2: nn.relu2,
                                 Act.XIELU: None})  # None: the XieLU child module


class MLP(nn.Module):
    """The row's dense MLP; `width` / `bias` override its size and biases (MoE shared experts);
    `limit` > 0 clamps its SwiGLU (step3p5's Step3p5MLP)."""

    def __init__(self, a: UniversalArgs, d: ArchDescriptor, width: int | None = None,
                 bias: bool | None = None, limit: float = 0):
        super().__init__()
        self._limit = limit if limit and limit > 0 else None
        self._d, self._n = d, d.names
        D, n = a.hidden, d.names
        I = a.intermediate if width is None else width
        bias = a.mlp_bias if bias is None else bias
        kind, act = d.mlp.kind, d.mlp.act
        if kind is MlpKind.GATED:
            setattr(self, n.gate, nn.Linear(D, I, bias=bias))
            setattr(self, n.up, nn.Linear(D, I, bias=bias))
            act_fn = _GATED[act]
        elif kind is MlpKind.GATED_FUSED:
            setattr(self, n.gate_up, nn.Linear(D, 2 * I, bias=bias))
            act_fn = _FUSED[act]
        else:  # MlpKind.PLAIN
            setattr(self, n.up, nn.Linear(D, I, bias=bias))
            if act is Act.XIELU:
                setattr(self, n.act, L.XieLU())
            act_fn = _PLAIN[act] or self[n.act]
        setattr(self, n.down, nn.Linear(I, D, bias=bias))
        if d.block.inner_norms:
            setattr(self, n.inner_norm, nn.RMSNorm(D, eps=a.eps))
        # outside the module tree (a module here would be listed twice)
        object.__setattr__(self, "_act_fn", act_fn)

    def split_pieces(self) -> list[tuple[str, str, int]]:
        """(child, sharding, segments) of the split over the hidden units, as mlx-lm's Model.shard
        does: the input projections all-to-sharded (a fused gate_up by its two halves), down
        sharded-to-all. `shard` makes it with MLX's sharded layers; an MoE block's shared expert
        makes it in place (the block all-sums once)."""
        n, kind = self._n, self._d.mlp.kind
        ins = [n.gate, n.up] if kind is MlpKind.GATED else [n.gate_up] if kind is MlpKind.GATED_FUSED else [n.up]
        return [(name, ALL_TO_SHARDED, 2 if name == n.gate_up else 1) for name in ins] + [(n.down, SHARDED_TO_ALL, 1)]

    def shard(self, group, where: str = "mlp") -> None:
        """Split the hidden units across `group` (`split_pieces`), down all-summing."""
        layers = {name: shard_linear(self[name], sharding, group, where=f"{where}.{name}", segments=segments)
                  for name, sharding, segments in self.split_pieces()}
        for name, module in layers.items():
            setattr(self, name, module)

    def __call__(self, x):
        d, n = self._d, self._n
        kind = d.mlp.kind
        if d.block.inner_norms:
            x = self[n.inner_norm](x)
        if kind is MlpKind.GATED and self._limit is not None:
            h = clamped_swiglu(self[n.up](x), self[n.gate](x), self._limit)
        elif kind is MlpKind.GATED:
            h = self._act_fn(self[n.gate](x), self[n.up](x))
        elif kind is MlpKind.GATED_FUSED:
            x = self[n.gate_up](x)
            gate, x = mx.split(x, 2, axis=-1)
            h = self._act_fn(gate, x)
        else:  # MlpKind.PLAIN
            h = self._act_fn(self[n.up](x))
        return self[n.down](h)
