"""What the graphs call for masks and attention (mlx-lm 0.32.2 `models/base.py` signatures).

`scaled_dot_product_attention(q, k, v, cache, scale, mask, sinks)` asks the cache: an
mlxbun cache attends over what its own `update_and_fetch` returned (`cache.attention`:
the fused kernel for full-precision caches, quantized attention for QuantizedKVCache,
rotated-space decode for TurboQuantKVCache). Without a cache, or with an mlx-lm cache
(which has no `attention`), it does what mlx-lm's does: quantized attention when the
cache carries `bits` (mlx-lm's probe), else the fused kernel. The math itself lives in
`mlxbun.attention`.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlxbun.attention import create_causal_mask, fused_sdpa, quantized_scaled_dot_product_attention

__all__ = [
    "create_attention_mask",
    "create_ssm_mask",
    "scaled_dot_product_attention",
]


def create_attention_mask(
    h, cache=None, window_size: Optional[int] = None, return_array: bool = False
):
    """Mask for hidden states `h` [B, N, ...]: None, "causal" or a bool array."""
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def create_ssm_mask(h, cache=None):
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(h.shape[1])
    return None


def scaled_dot_product_attention(
    queries,
    keys,
    values,
    cache,
    scale: float,
    mask: Optional[mx.array],
    sinks: Optional[mx.array] = None,
) -> mx.array:
    attend = getattr(cache, "attention", None)
    if attend is not None:
        return attend(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if hasattr(cache, "bits"):  # an mlx-lm QuantizedKVCache
        if sinks is not None:
            raise ValueError("Quantized SDPA does not support attention sinks.")
        return quantized_scaled_dot_product_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            group_size=cache.group_size,
            bits=cache.bits,
        )
    return fused_sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
