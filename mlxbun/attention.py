"""Attention math, independent of caches and model graphs: masks and SDPA variants.

Ported op for op from mlx-lm 0.32.2 (`models/base.py`, `models/cache.py`) where mlx-lm
has them, so attention through these functions is bit-identical to mlx-lm's:
  create_causal_mask         causal (optionally windowed / padded) bool mask
  cached_causal_mask         the mask for N new queries over a cache of `offset` tokens
                             (mlx-lm's `cache.create_attention_mask`)
  fused_sdpa                 `mx.fast.scaled_dot_product_attention` (full precision)
  softcapped_attention       gemma2's hand-written attention (tanh softcap on the scores)
  quantized_scaled_dot_product_attention   mlx-lm's attention over affine-quantized K/V
and mlxbun's own variants for affine-quantized K/V:
  chunked_quantized_sdpa     online softmax over key chunks: bounded transient memory
  dequantized_sdpa           dequantize + the fused kernel: the CUDA path
  backend_has_quantized_attention   whether quantized_matmul runs attention's shapes here

Caches (`mlxbun.cache`) pick among these for their own layout; the graphs reach them
through `mlxbun.models.base.scaled_dot_product_attention`, which asks the cache.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_map

__all__ = [
    "backend_has_quantized_attention",
    "cached_causal_mask",
    "chunked_quantized_sdpa",
    "create_causal_mask",
    "dequantized_sdpa",
    "fused_sdpa",
    "quantized_scaled_dot_product_attention",
    "softcapped_attention",
]


# ------------------------------------------------------------------ masks


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


def cached_causal_mask(N: int, offset: int, return_array: bool, window_size: Optional[int]):
    """What a KV cache holding `offset` tokens gives `make_mask(N, ...)`: None, "causal"
    or a bool array (mlx-lm's `cache.create_attention_mask`)."""
    if window_size is not None:
        return create_causal_mask(N, offset, window_size=window_size)
    elif N == 1:
        return None
    elif return_array:
        return create_causal_mask(N, offset, window_size=window_size)
    else:
        return "causal"


# ------------------------------------------------------------------ full precision


def fused_sdpa(queries, keys, values, scale: float, mask, sinks: Optional[mx.array] = None) -> mx.array:
    """mlx-lm's full-precision attention: the fused kernel, as its sdpa calls it."""
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


# ------------------------------------------------------------------ affine-quantized K/V


def quantized_scaled_dot_product_attention(
    queries: mx.array,
    q_keys: tuple[mx.array, mx.array, mx.array],
    q_values: tuple[mx.array, mx.array, mx.array],
    scale: float,
    mask: Optional[mx.array],
    group_size: int = 64,
    bits: int = 8,
) -> mx.array:
    """mlx-lm's quantized attention, op for op (it scales `queries` in place, as mlx-lm does)."""
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


def backend_has_quantized_attention() -> bool:
    """False on mlx's CUDA backend, whose quantized_matmul has no kernel for attention's
    shapes (e.g. `1x513x128x32, transpose: true` fails at the first decode step, which
    is why mlx-lm's kv_bits does not run there; see shared/gpu/README.md)."""
    return not (mx.default_device() == mx.gpu and mx.cuda.is_available())


def dequantized_sdpa(queries, q_keys, q_values, scale, mask, group_size: int, bits: int) -> mx.array:
    """Attention through dequantize + the fused SDPA kernel: the CUDA path for quantized KV.
    Same math as the quantized-matmul path; rounding differs (it is not the CPU/Metal op
    sequence), so it is only ever used where that sequence cannot run."""
    keys = mx.dequantize(*q_keys, group_size=group_size, bits=bits).astype(queries.dtype)
    values = mx.dequantize(*q_values, group_size=group_size, bits=bits).astype(queries.dtype)
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def chunked_quantized_sdpa(
    queries: mx.array,
    q_keys: tuple[mx.array, mx.array, mx.array],
    q_values: tuple[mx.array, mx.array, mx.array],
    scale: float,
    mask,
    group_size: int = 64,
    bits: int = 8,
    chunk_size: int = 1024,
    dequantize: bool = False,
) -> mx.array:
    """Quantized attention over key chunks with an online-softmax merge.

    `dequantize=True` dequantizes one chunk at a time and uses plain matmuls: the CUDA
    path, where mlx has no quantized_matmul kernel for attention's shapes.

    Same inputs and mask conventions as `quantized_scaled_dot_product_attention`
    (None, "causal", bool or additive array broadcastable to [B, Hq, L, S]).
    Two changes bound the transient memory: the GQA repeat is folded into the
    query rows ([B, Hkv, rep*L, D]) so the packed keys/values are never
    broadcast-copied per query head, and only one [.., rep*L, chunk] score block
    lives at a time. Running max / sum / output accumulate in float32, so the
    result differs from the unchunked path by rounding only.
    """
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = q_keys[0].shape[-3]
    S = q_keys[0].shape[-2]
    rep = n_q_heads // n_kv_heads
    dtype = queries.dtype
    q = (queries * scale).reshape(B, n_kv_heads, rep * L, D)
    if isinstance(mask, mx.array) and mask.ndim > 3:
        mask = mx.expand_dims(mask, -3)  # [B, H|1, L, S] -> [B, H|1, 1, L, S]
    neg = mx.finfo(mx.float32).min  # a row always has an unmasked key somewhere,
    # so chunks that are fully masked are wiped by the max correction later.

    m = l = acc = None
    for start in range(0, S, chunk_size):
        end = min(start + chunk_size, S)
        kc = tuple(x[..., start:end, :] for x in q_keys)
        vc = tuple(x[..., start:end, :] for x in q_values)
        # Order the lazy graph chunk by chunk: without this edge, evaluation may
        # walk the running-max chain first and hold every chunk's scores at once.
        qk = q if m is None else mx.depends(q, [m, l, acc])
        if dequantize:
            kc = mx.dequantize(*kc, group_size=group_size, bits=bits).astype(dtype)
            vc = mx.dequantize(*vc, group_size=group_size, bits=bits).astype(dtype)
            s = qk @ kc.swapaxes(-1, -2)
        else:
            s = mx.quantized_matmul(qk, *kc, transpose=True, group_size=group_size, bits=bits)
        s = s.astype(mx.float32).reshape(B, n_kv_heads, rep, L, end - start)
        if mask is not None:
            if isinstance(mask, str):
                qi = mx.arange(S - L, S)[:, None]
                mc = qi >= mx.arange(start, end)[None]
            else:
                mc = mask[..., start:end]
            if mc.dtype == mx.bool_:
                s = mx.where(mc, s, neg)
            else:
                s = s + mc.astype(mx.float32)
        m_new = s.max(axis=-1, keepdims=True) if m is None else mx.maximum(m, s.max(axis=-1, keepdims=True))
        p = mx.exp(s - m_new)
        p_rows = p.astype(dtype).reshape(B, n_kv_heads, rep * L, end - start)
        if dequantize:
            pv = p_rows @ vc
        else:
            pv = mx.quantized_matmul(p_rows, *vc, transpose=False, group_size=group_size, bits=bits)
        pv = pv.astype(mx.float32).reshape(B, n_kv_heads, rep, L, -1)
        if m is None:
            l, acc = p.sum(axis=-1, keepdims=True), pv
        else:
            corr = mx.exp(m - m_new)
            l = l * corr + p.sum(axis=-1, keepdims=True)
            acc = acc * corr + pv
        m = m_new
    if isinstance(mask, mx.array) and mask.dtype != mx.bool_:
        # as in mlx-lm, an additive mask promotes the scores (and the output)
        dtype = (mx.zeros((), dtype) + mx.zeros((), mask.dtype)).dtype
    out = (acc / l).astype(dtype)
    return out.reshape(B, n_q_heads, L, -1)
