"""Resampling a tower's learned position table to an image's patch grid, as mlx-vlm does it
off Metal (interpolate.resize_bilinear_nhwc through kernels._separable_interpolate_mlx): ATen's
bilinear taps, with antialias its triangle filter for downscales, applied one axis at a time in
the order mlx-vlm's cost model picks. (On Metal mlx-vlm runs its own kernel instead; mlxbun
reproduces the MLX path, which is what CPU and CUDA run.)"""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["resize_bilinear_nhwc"]


def _bilinear_taps(in_size: int, out_size: int, antialias: bool) -> tuple[mx.array, mx.array]:
    """(indices, weights) [out, taps] of ATen's upsample_bilinear2d (align_corners False) and,
    for antialiased downscales, _upsample_bilinear2d_aa."""
    scale = in_size / out_size
    src = (mx.arange(out_size, dtype=mx.float32) + 0.5) * scale - 0.5
    if antialias and scale > 1.0:
        lo = mx.maximum(mx.floor(src - scale + 1), 0)
        hi = mx.minimum(mx.floor(src + scale), in_size - 1)
        pos = lo[:, None] + mx.arange(math.ceil(2 * scale), dtype=mx.float32)[None, :]
        w = mx.maximum(0.0, 1.0 - mx.abs(pos - src[:, None]) / scale)
        w = mx.where(pos <= hi[:, None], w, 0.0)
        w = w / w.sum(axis=1, keepdims=True)
        return mx.minimum(pos, in_size - 1).astype(mx.int32), w
    src = mx.maximum(src, 0.0)
    base = mx.floor(src)
    frac = src - base
    pos = base[:, None] + mx.arange(2, dtype=mx.float32)[None, :]
    return mx.clip(pos.astype(mx.int32), 0, in_size - 1), mx.stack([1.0 - frac, frac], axis=1)


def _axis(x: mx.array, idx: mx.array, w: mx.array) -> mx.array:
    n, _, m = x.shape
    out, taps = idx.shape
    g = mx.take(x, idx.reshape(-1), axis=1).reshape(n, out, taps, m)
    return mx.sum(g * w[None, :, :, None], axis=2)


def resize_bilinear_nhwc(x: mx.array, size: tuple[int, int], antialias: bool = False) -> mx.array:
    """[N, H, W, C] -> [N, h, w, C] (float32 from float32 input); the input itself when the size
    is unchanged."""
    n, H, W, C = x.shape
    out_h, out_w = size
    if (H, W) == (out_h, out_w):
        return x
    iy, wy = _bilinear_taps(H, out_h, antialias)
    ix, wx = _bilinear_taps(W, out_w, antialias)
    taps_y, taps_x = iy.shape[1], ix.shape[1]
    h_first = out_h * W * (taps_y + 1) + out_h * out_w * (taps_x + 1)
    w_first = H * W + H * out_w * (taps_x + 1) + out_h * out_w * taps_y
    if h_first <= w_first:
        y = _axis(x.reshape(n, H, W * C), iy, wy)
        y = y.reshape(n, out_h, W, C).transpose(0, 2, 1, 3).reshape(n, W, out_h * C)
        return _axis(y, ix, wx).reshape(n, out_w, out_h, C).transpose(0, 2, 1, 3)
    y = x.transpose(0, 2, 1, 3).reshape(n, W, H * C)
    y = _axis(y, ix, wx)
    y = y.reshape(n, out_w, H, C).transpose(0, 2, 1, 3).reshape(n, H, out_w * C)
    return _axis(y, iy, wy).reshape(n, out_h, out_w, C)
