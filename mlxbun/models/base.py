"""Masks and attention dispatch, ported op-for-op from mlx-lm 0.32.2 `models/base.py`.

`scaled_dot_product_attention` picks the quantized path when the cache carries
`bits` (mlx-lm's probe), else `mx.fast.scaled_dot_product_attention`.
`softcapped_attention` is gemma2's hand-written attention (tanh softcap on the
scores), which does not go through sdpa.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_map

__all__ = [
    "create_causal_mask",
    "create_attention_mask",
    "create_ssm_mask",
    "quantized_scaled_dot_product_attention",
    "scaled_dot_product_attention",
    "softcapped_attention",
]


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: Optional[int] = None,
    right_padding: Optional[mx.array] = None,
    left_padding: Optional[mx.array] = None,
):
    rinds = mx.arange(offset + N)
    linds = mx.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if right_padding is not None:
        mask = mask & (rinds < mx.expand_dims((offset + N) - right_padding, (1, 2, 3)))
    if left_padding is not None:
        mask = mask & (mx.expand_dims(left_padding, (1, 2, 3)) <= rinds)
    return mask


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


def quantized_scaled_dot_product_attention(
    queries: mx.array,
    q_keys: tuple[mx.array, mx.array, mx.array],
    q_values: tuple[mx.array, mx.array, mx.array],
    scale: float,
    mask: Optional[mx.array],
    group_size: int = 64,
    bits: int = 8,
) -> mx.array:
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    n_repeats = n_q_heads // n_kv_heads

    queries *= scale

    if n_repeats > 1:
        queries = mx.reshape(queries, (B, n_kv_heads, n_repeats, L, D))
        q_keys = tree_map(lambda x: mx.expand_dims(x, axis=-3), q_keys)
        q_values = tree_map(lambda x: mx.expand_dims(x, axis=-3), q_values)

    scores = mx.quantized_matmul(
        queries, *q_keys, transpose=True, group_size=group_size, bits=bits
    )
    if mask is not None:
        if isinstance(mask, str):
            qL, kL = scores.shape[-2:]
            q_indices = mx.arange(kL - qL, kL)
            k_indices = mx.arange(kL)
            mask = q_indices[:, None] >= k_indices[None]
        if n_repeats > 1 and mask.ndim > 3:
            mask = mx.expand_dims(mask, -3)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores += mask
    scores = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(
        scores, *q_values, transpose=False, group_size=group_size, bits=bits
    )

    if n_repeats > 1:
        out = mx.reshape(out, (B, n_q_heads, L, D))

    return out


def scaled_dot_product_attention(
    queries,
    keys,
    values,
    cache,
    scale: float,
    mask: Optional[mx.array],
    sinks: Optional[mx.array] = None,
) -> mx.array:
    if hasattr(cache, "decode_attention") and hasattr(cache, "serves"):
        # TurboQuantKVCache: decode attends in the rotated space straight from the packed
        # codes; anything it cannot serve falls back to plain SDPA on the dequantized K/V.
        from mlxbun.cache.turboquant import turboquant_sdpa

        return turboquant_sdpa(queries, keys, values, cache, scale, mask, sinks,
                               fallback=_standard_sdpa)
    return _standard_sdpa(queries, keys, values, cache, scale, mask, sinks)


def _standard_sdpa(queries, keys, values, cache, scale, mask, sinks=None) -> mx.array:
    if hasattr(cache, "bits"):
        if sinks is not None:
            raise ValueError("Quantized SDPA does not support attention sinks.")
        if hasattr(cache, "attention"):
            # mlxbun's QuantizedKVCache: mlx-lm's exact op sequence by default, or the
            # memory-bounded chunked path when the cache was made with attention_chunk.
            return cache.attention(queries, keys, values, scale=scale, mask=mask)
        return quantized_scaled_dot_product_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            group_size=cache.group_size,
            bits=cache.bits,
        )
    else:
        return mx.fast.scaled_dot_product_attention(
            queries,
            keys,
            values,
            scale=scale,
            mask=mask,
            sinks=sinks,
        )


def softcapped_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    softcap: float,
    mask: Optional[mx.array],
) -> mx.array:
    """gemma2's attention: (q*scale) @ k^T, tanh softcap, mask, precise softmax, @ v.

    Takes roped queries [B, Hq, L, D] and the cache's keys/values [B, Hkv, S, D];
    returns [B, Hq, L, D] (the caller transposes/reshapes). `mask` must be None
    or an array (gemma2 asks for `return_array=True`).
    """
    B, n_heads, L, head_dim = queries.shape
    n_kv_heads = keys.shape[1]
    repeats = n_heads // n_kv_heads

    queries = queries * scale

    if repeats > 1:
        queries = queries.reshape(B, n_kv_heads, repeats, L, head_dim)
        keys = mx.expand_dims(keys, 2)
        values = mx.expand_dims(values, 2)

    scores = queries @ keys.swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap)
    scores *= softcap

    if mask is not None:
        if mask.dtype == mx.bool_:
            scores = mx.where(
                mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype)
            )
        else:
            scores = scores + mask
    scores = mx.softmax(scores, precise=True, axis=-1)
    output = scores @ values
    if repeats > 1:
        output = output.reshape(B, n_heads, L, head_dim)
    return output
