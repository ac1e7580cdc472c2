"""Comparing two tensors the way the parity tools do: bit-equality that never calls a NaN
equal, float32 max |a - b|, which side holds a non-finite value."""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["bit_equal", "dtype_name", "max_abs_diff", "nonfinite_sides"]


def dtype_name(a: mx.array) -> str:
    return str(a.dtype).removeprefix("mlx.core.")


def _finite(a: mx.array) -> bool:
    return bool(mx.all(mx.isfinite(a)).item())


def nonfinite_sides(a: mx.array, b: mx.array) -> str | None:
    """Which side holds a NaN or inf: "candidate" (a), "oracle" (b), "candidate and oracle", or
    None when both are finite."""
    sides = [name for name, x in (("candidate", a), ("oracle", b)) if not _finite(x)]
    return " and ".join(sides) or None


def bit_equal(a: mx.array, b: mx.array) -> bool:
    """Same dtype, same shape, same values, and finite: a NaN or inf is never equal, not even
    to the same NaN or inf on the other side (a model that emits them has failed)."""
    return (a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b))
            and _finite(a))


def max_abs_diff(a: mx.array, b: mx.array) -> float | None:
    """max |a - b| computed in float32 (0.0 where bit-equal); None when the shapes differ, NaN
    when either side holds a NaN or inf."""
    if a.shape != b.shape:
        return None
    if not (_finite(a) and _finite(b)):
        return math.nan
    a32, b32 = a.astype(mx.float32), b.astype(mx.float32)
    return float(mx.max(mx.abs(a32 - b32)).item()) if a.size else 0.0
