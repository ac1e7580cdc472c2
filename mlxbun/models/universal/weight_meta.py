"""`Meta`: a checkpoint tensor known from its header only (shape, dtype), enough for the sanitize
rules, quantization and the weight audit to run without reading the data."""

from __future__ import annotations

from mlxbun.errors import LoadError

__all__ = ["Meta"]


class Meta:
    """A tensor known from its header: enough for sanitize, quantize and the audit."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), dtype

    @property
    def mx_dtype(self):
        return self.dtype

    def squeeze(self):
        return Meta([s for s in self.shape if s != 1], self.dtype)

    def swapaxes(self, a: int, b: int):
        shape = list(self.shape)
        shape[a], shape[b] = shape[b], shape[a]
        return Meta(shape, self.dtype)

    def __add__(self, scalar):  # a norm weight + 1 (qwen3_next, qwen3_5)
        return self

    def __mul__(self, other):
        try:
            import numpy as np

            shape = np.broadcast_shapes(self.shape, tuple(other.shape))
        except ValueError:
            raise LoadError(f"cannot broadcast shapes {self.shape} and {tuple(other.shape)}") from None
        return Meta(shape, other.dtype)
