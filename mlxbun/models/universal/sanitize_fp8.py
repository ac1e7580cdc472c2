"""The fp8 checkpoint rules of the sanitize step, op for op as the mlx-lm files: minimax's per-block
dequantization (`fp8_block_dequant`) and mistral4's, which broadcasts a per-tensor / per-expert
scale and drops the static activation scales (`fp8_dequant_broadcast`)."""

from __future__ import annotations

import mlx.core as mx

from mlxbun.errors import LoadError
from mlxbun.models.universal.weight_meta import Meta

__all__ = ["fp8_block_dequant", "fp8_dequant_broadcast"]

_FP8_BLOCK = 128


def fp8_block_dequant(weight, scale_inv):
    """minimax.sanitize's dequant, op for op: fp8 bytes -> bfloat16, times the per-block scale."""
    if isinstance(weight, Meta):
        return Meta(weight.shape, mx.bfloat16)
    dtype = mx.bfloat16
    weight = mx.from_fp8(weight, dtype=mx.bfloat16)
    bs = _FP8_BLOCK
    m, n = weight.shape
    pad_bottom = (-m) % bs
    pad_side = (-n) % bs
    weight = mx.pad(weight, ((0, pad_bottom), (0, pad_side)))
    weight = weight.reshape(((m + pad_bottom) // bs, bs, (n + pad_side) // bs, bs))
    weight = (weight * scale_inv[:, None, :, None]).reshape(m + pad_bottom, n + pad_side)
    return weight[:m, :n].astype(dtype)


def _broadcasts(scale_shape, weight_shape) -> bool:
    if len(scale_shape) > len(weight_shape):
        return False
    pad = (1,) * (len(weight_shape) - len(scale_shape)) + tuple(scale_shape)
    return all(s in (1, w) for s, w in zip(pad, weight_shape))


def _dequant_broadcast(weight, scale_inv):
    """mistral4.sanitize's dequant: a scale that broadcasts multiplies, else the 128x128 blocks."""
    if _broadcasts(scale_inv.shape, weight.shape):
        if isinstance(weight, Meta):
            return Meta(weight.shape, mx.bfloat16)
        dtype = mx.bfloat16
        return (mx.from_fp8(weight, dtype=dtype) * scale_inv).astype(dtype)
    return fp8_block_dequant(weight, scale_inv)


def fp8_dequant_broadcast(w: dict) -> tuple[dict, dict[str, str]]:
    """mistral4.sanitize's fp8 loop: activation scales dropped, each X_scale_inv folded into X."""
    out, dropped = {}, {}
    for k, v in w.items():
        if k.endswith("activation_scale"):
            dropped[k] = "fp8 static activation scale (no consumer)"
            continue
        if k.endswith("_scale_inv"):
            wk = k.replace("_scale_inv", "")
            if wk not in w:
                raise LoadError(f"tensor {k!r} has no matching {wk!r} to dequantize")
            out[wk] = _dequant_broadcast(w[wk], v)
            dropped[k] = f"folded into {wk} (fp8 dequantization)"
        elif k not in out:
            out[k] = v
    return out, dropped
