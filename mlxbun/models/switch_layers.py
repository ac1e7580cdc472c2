"""Mixture-of-experts building blocks as mlx-lm / mlx-vlm's `switch_layers` compute them.

`SwitchLinear` applies a per-expert linear ([experts, out, in]) with `gather_mm`; above a
token-count threshold the callers sort tokens by expert first (`gather_sort`) so each expert's
rows are contiguous, and restore the order afterwards (`scatter_unsort`).
`SwitchLinear.to_quantized` gives a `QuantizedSwitchLinear` (`gather_qmm`), so `nn.quantize`
(and the loader, which quantizes the modules whose `.scales` a checkpoint holds) packs experts
exactly as mlx-lm does. `SwitchGLU` is mlx-lm's expert MLP, op for op (sorted-indices path
included); `split_pieces` says how a tensor-parallel split cuts it (in place: the MoE block
all-sums).
"""

import math
from functools import lru_cache, partial

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models.layers import swiglu
from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL


@lru_cache(maxsize=None)
def gather_mm_supported(dtype: str) -> bool:
    """Whether this mlx build / default device runs `gather_mm` (unquantized experts) in
    `dtype` ("float32", "float16", "bfloat16"): probed once. mlx 0.32's CPU backend takes
    float32 only; `gather_qmm` (quantized experts) takes all three."""
    dt = getattr(mx, dtype)
    try:
        x, w = mx.ones((1, 1, 1, 8), dtype=dt), mx.ones((2, 8, 8), dtype=dt)
        mx.eval(mx.gather_mm(x, w, rhs_indices=mx.array([[1]], dtype=mx.uint32)))
        return True
    except (RuntimeError, ValueError):
        return False


class QuantizedSwitchLinear(nn.Module):
    """mlx-lm's QuantizedSwitchLinear (affine and the fp modes; no nvfp4 global scale)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = True,
                 group_size: int = 64, bits: int = 4, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        scale = math.sqrt(1 / input_dims)
        weight = mx.random.uniform(low=-scale, high=scale, shape=(num_experts, output_dims, input_dims))
        self._quantize(weight)
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))
        self.freeze()

    def _quantize(self, weight):
        self.weight, self.scales, *biases = mx.quantize(weight, self.group_size, self.bits, mode=self.mode)
        self.biases = biases[0] if biases else None

    def __call__(self, x, indices, sorted_indices=False):
        x = mx.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_indices,
        )
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x


class SwitchLinear(nn.Module):
    """Per-expert linear [experts, out, in] applied with gather_mm (bias off unless asked)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(low=-scale, high=scale,
                                        shape=(num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x, indices, sorted_indices=False):
        x = mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)
        if "bias" in self:
            x = x + mx.expand_dims(self["bias"][indices], -2)
        return x

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine",
                     global_scale: bool = False):
        if global_scale:
            raise ValueError("nvfp4 global scales on expert weights are not supported")
        num_experts, output_dims, input_dims = self.weight.shape
        ql = QuantizedSwitchLinear(input_dims, output_dims, num_experts, False, group_size, bits,
                                   mode=mode)
        ql._quantize(self.weight)
        if "bias" in self:
            ql.bias = self.bias
        return ql


def gather_sort(x, indices):
    *_, M = indices.shape
    indices = indices.flatten()
    order = mx.argsort(indices)
    inv_order = mx.argsort(order)
    return x.flatten(0, -3)[order // M], indices[order], inv_order


def scatter_unsort(x, inv_order, shape=None):
    x = x[inv_order]
    if shape is not None:
        x = mx.unflatten(x, 0, shape)
    return x


class SwiGLU(nn.Module):
    """mlx-lm's SwiGLU module (`activation(x_up, x_gate)`): a child of SwitchGLU's tree."""

    def __call__(self, x, gate):
        return swiglu(gate, x)


@partial(mx.compile, shapeless=True)
def clamped_swiglu(x, gate, limit):
    """step3p5.clamped_swiglu (compiled, shapeless): silu(gate) clipped above, x clipped to +-limit."""
    gate = mx.clip(nn.silu(gate), a_min=None, a_max=limit)
    x = mx.clip(x, a_min=-limit, a_max=limit)
    return gate * x


class ClampedSwiGLU(nn.Module):
    """step3p5's ClampedSwiGLU module (`activation(x_up, x_gate)` in SwitchGLU's tree)."""

    def __init__(self, limit: float):
        super().__init__()
        self.limit = limit

    def __call__(self, x, gate):
        return clamped_swiglu(x, gate, self.limit)


@partial(mx.compile, shapeless=True)
def clipped_silu(x, gate):
    """mlx-vlm's kimi_vl clipped_silu (compiled, shapeless): silu(gate) clipped to +-100, times x."""
    return mx.clip(gate * mx.sigmoid(gate), a_min=-100, a_max=100) * x


class ClippedSiLU(nn.Module):
    """mlx-vlm's kimi_vl experts' activation (`activation(x_up, x_gate)` in SwitchGLU's tree)."""

    def __call__(self, x, gate):
        return clipped_silu(x, gate)


# mlx-lm's SwitchGLU default `activation=SwiGLU()` is one instance shared by every SwitchGLU;
# mlxbun shares one too, so taps record its calls under the same paths on both sides.
_SHARED_SWIGLU = SwiGLU()


class SwitchMLP(nn.Module):
    """mlx-lm's SwitchMLP: fc1 / activation / fc2 SwitchLinears (`names`), tokens sorted by expert
    from 64 picks."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int, activation: nn.Module,
                 bias: bool = False, names: tuple[str, str] = ("fc1", "fc2")):
        super().__init__()
        self._names = names
        setattr(self, names[0], SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias))
        setattr(self, names[1], SwitchLinear(hidden_dims, input_dims, num_experts, bias=bias))
        self.activation = activation

    def split_pieces(self) -> list[tuple[str, str, int]]:
        """(child, sharding, segments) of a tensor-parallel split over every expert's hidden
        units, made in place (the MoE block all-sums): fc1 all-to-sharded, fc2 sharded-to-all."""
        fc1, fc2 = self._names
        return [(fc1, ALL_TO_SHARDED, 1), (fc2, SHARDED_TO_ALL, 1)]

    def __call__(self, x, indices) -> mx.array:
        fc1, fc2 = self._names
        x = mx.expand_dims(x, (-2, -3))
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= 64
        idx = indices
        inv_order = None
        if do_sort:
            x, idx, inv_order = gather_sort(x, indices)
        x = self[fc1](x, idx, sorted_indices=do_sort)
        x = self.activation(x)
        x = self[fc2](x, idx, sorted_indices=do_sort)
        if do_sort:
            x = scatter_unsort(x, inv_order, indices.shape)
        return x.squeeze(-2)


class SwitchGLU(nn.Module):
    """mlx-lm's SwitchGLU: gate/up/down SwitchLinears, tokens sorted by expert from 64 picks."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int, bias: bool = False,
                 names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 activation: nn.Module | None = None):
        super().__init__()
        self._names = names
        gate, up, down = names
        setattr(self, gate, SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias))
        setattr(self, up, SwitchLinear(input_dims, hidden_dims, num_experts, bias=bias))
        setattr(self, down, SwitchLinear(hidden_dims, input_dims, num_experts, bias=bias))
        self.activation = activation if activation is not None else _SHARED_SWIGLU

    def split_pieces(self) -> list[tuple[str, str, int]]:
        """(child, sharding, segments) of a tensor-parallel split over every expert's hidden
        units, made in place as mlx-lm's Model.shard does (the MoE block all-sums): gate / up
        all-to-sharded, down sharded-to-all."""
        gate, up, down = self._names
        return [(gate, ALL_TO_SHARDED, 1), (up, ALL_TO_SHARDED, 1), (down, SHARDED_TO_ALL, 1)]

    def __call__(self, x, indices) -> mx.array:
        gate, up, down = self._names
        x = mx.expand_dims(x, (-2, -3))
        # many tokens: sort them so each expert's rows are contiguous
        indices = mx.stop_gradient(indices)
        do_sort = indices.size >= 64
        idx = indices
        inv_order = None
        if do_sort:
            x, idx, inv_order = gather_sort(x, indices)
        x_up = self[up](x, idx, sorted_indices=do_sort)
        x_gate = self[gate](x, idx, sorted_indices=do_sort)
        x = self[down](self.activation(x_up, x_gate), idx, sorted_indices=do_sort)
        if do_sort:
            x = scatter_unsort(x, inv_order, indices.shape)
        return x.squeeze(-2)
