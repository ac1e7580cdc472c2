"""Mixture-of-experts building blocks as mlx-lm / mlx-vlm's `switch_layers` compute them.

`SwitchLinear` applies a per-expert linear ([experts, out, in]) with `gather_mm`; above a
token-count threshold the callers sort tokens by expert first (`gather_sort`) so each expert's
rows are contiguous, and restore the order afterwards (`scatter_unsort`).
"""

import math

import mlx.core as mx
import mlx.nn as nn


class SwitchLinear(nn.Module):
    """Per-expert linear [experts, out, in] applied with gather_mm (no bias)."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(low=-scale, high=scale,
                                        shape=(num_experts, output_dims, input_dims))

    def __call__(self, x, indices, sorted_indices=False):
        return mx.gather_mm(x, self["weight"].swapaxes(-1, -2), rhs_indices=indices,
                            sorted_indices=sorted_indices)


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
