"""Resampling a tower's learned position table to an image's patch grid, as mlx-vlm does it
off Metal (interpolate.resize_bilinear_nhwc through kernels._separable_interpolate_mlx): ATen's
bilinear taps, with antialias its triangle filter for downscales, applied one axis at a time in
the order mlx-vlm's cost model picks. (On Metal mlx-vlm runs its own kernel instead; mlxbun
reproduces the MLX path, which is what CPU and CUDA run.) Kimi-VL's table is resized bicubically
(kernels._bicubic_interpolate_mlx: PyTorch's a = -0.75 taps, height then width)."""

from __future__ import annotations

import math

import mlx.core as mx

__all__ = ["resize_bicubic_nchw", "resize_bilinear_nhwc"]


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


def _cubic_weight(t: mx.array, a: float = -0.75) -> mx.array:
    at = mx.abs(t)
    at2 = at * at
    at3 = at2 * at
    w1 = (a + 2.0) * at3 - (a + 3.0) * at2 + 1.0
    w2 = a * at3 - 5.0 * a * at2 + 8.0 * a * at - 4.0 * a
    return mx.where(at <= 1.0, w1, mx.where(at < 2.0, w2, mx.zeros_like(t)))


def _cubic_taps(out_size: int, in_size: int) -> tuple[mx.array, mx.array]:
    """(indices, weights) [out, 5]: the taps around each output's source coordinate, those
    outside the input zeroed, the rest normalized (plus 1e-8)."""
    coords = (mx.arange(out_size, dtype=mx.float32) + 0.5) / out_size * in_size - 0.5
    pix = (mx.floor(coords - 2.0).astype(mx.int32) + 1)[:, None] + mx.arange(5, dtype=mx.int32)[None, :]
    w = _cubic_weight((coords[:, None] - pix.astype(mx.float32)) / 1.0)
    w = w * ((pix >= 0) & (pix < in_size))
    return mx.clip(pix, 0, in_size - 1), w / (mx.sum(w, axis=-1, keepdims=True) + 1e-8)


def resize_bicubic_nchw(x: mx.array, size: tuple[int, int]) -> mx.array:
    """[B, C, H, W] -> [B, C, h, w] bicubically (align_corners False, no antialias), in float32,
    cast back to the input's dtype."""
    B, C, in_h, in_w = x.shape
    out_h, out_w = size
    dtype = x.dtype
    x = x.astype(mx.float32)
    pix_y, wy = _cubic_taps(out_h, in_h)
    pix_x, wx = _cubic_taps(out_w, in_w)
    g = x[:, :, pix_y.reshape(-1), :].reshape(B, C, out_h, pix_y.shape[1], in_w)
    tmp = mx.sum(g * wy[None, None, :, :, None], axis=3)
    g = tmp[:, :, :, pix_x.reshape(-1)].reshape(B, C, out_h, out_w, pix_x.shape[1])
    out = mx.sum(g * wx[None, None, None, :, :], axis=4)
    return out if dtype == mx.float32 else out.astype(dtype)
