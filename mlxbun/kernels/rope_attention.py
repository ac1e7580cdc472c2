"""The launcher of ROPE_ATTENTION (`rope_attention_source`): from QKV_PROJ's sums, a layer's q / k
norm, RoPE, K/V append (in place), decode attention and the merge of its splits in one launch, where
the fused decode otherwise makes three (ROPE_KV, the attention's partial and combine).

The merge needs a counter per KV head that is zero before each launch (the last block of a head
sets it back): `Counters` holds one for an executor, a buffer made once, written only by this
kernel (through a const_cast, as the K/V buffer), so between launches it always reads zero.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.kernels.common import Gap, float_bits
from mlxbun.kernels.fused_decode_source import HELPERS
from mlxbun.kernels.rope_attention_source import ROPE_ATTENTION
from mlxbun.kernels import sdpa_decode
from mlxbun.kernels.sdpa_decode import SHARED_LIMIT, decode_split, partial_template, shared_bytes
from mlxbun.kernels.sdpa_decode_source import HEADER as ATTENTION_HEADER

__all__ = ["HEADER", "MAX_KV_HEADS", "Counters", "rope_attention", "rope_attention_gap", "rope_attention_signature",
           "rope_attention_template"]

HEADER = ATTENTION_HEADER + HELPERS
MAX_KV_HEADS = 256  # the counter's slots


class Counters:
    """The merge counters of one executor: MAX_KV_HEADS int32 zeros on the device."""

    def __init__(self):
        self.array = mx.array(np.zeros(MAX_KV_HEADS, np.int32))
        mx.eval(self.array)


def _extra_floats(attn) -> int:
    """Shared floats the prologue adds to the partial block's: the rotated queries, the heads before
    RoPE (queries and the key) and their norms."""
    G = attn.hq // attn.hkv
    return (2 * G + 1) * attn.head_dim + G + 1


def _split(attn) -> tuple[int, int]:
    G = attn.hq // attn.hkv
    return decode_split(attn.capacity, attn.hkv, G, attn.head_dim, book_floats=_extra_floats(attn))


def rope_attention_gap(attn, max_splits: Optional[int] = None) -> Optional[Gap]:
    """Why the one-launch path does not fit this layer (the caller has checked the attention's and
    ROPE_KV's own gaps): its shared memory, its counter, or more than `max_splits` splits of the
    buffer (where the last block's merge of many splits costs more than the launches it saves)."""
    if attn.hkv > MAX_KV_HEADS:
        return Gap(f"{attn.hkv} KV heads (the merge counter has {MAX_KV_HEADS} slots)")
    G = attn.hq // attn.hkv
    chunk, splits = _split(attn)
    if max_splits is not None and splits > max_splits:
        return Gap(f"{splits} splits of {chunk} positions over a {attn.capacity}-position buffer (the one "
                   f"launch merges up to {max_splits})")
    need = shared_bytes(chunk, G, attn.head_dim, book_floats=_extra_floats(attn))
    if need > SHARED_LIMIT:
        return Gap(f"{G} query heads of dim {attn.head_dim} need {need} bytes of shared memory "
                   f"(limit {SHARED_LIMIT})")
    return None


def rope_attention_signature(dtype) -> tuple[list, list]:
    """((name, dtype) inputs, (name, dtype) outputs) of the kernel."""
    return ([("sums", mx.float32), ("bias_q", dtype), ("bias_k", dtype), ("bias_v", dtype), ("q_norm", dtype),
             ("k_norm", dtype), ("inv_freq", mx.float32), ("pos", mx.int32), ("kv", dtype), ("counter", mx.int32)],
            [("out", dtype), ("next_pos", mx.int32), ("o_part", mx.float32), ("ml", mx.float32)])


def rope_attention_template(attn, dtype, chunk: Optional[int] = None) -> list:
    """The partial body's constants (16-bit K/V) and ROPE_KV's (`chunk`: the split's, default `_split`'s)."""
    chunk = chunk or _split(attn)[0]
    return [*partial_template(dtype, attn.head_dim, attn.hq // attn.hkv, attn.hkv, attn.hq, attn.capacity, chunk,
                              attn.scale),
            ("QK_NORM", attn.q_norm is not None), ("QK_EPS_BITS", float_bits(attn.qk_eps)),
            ("BIAS", attn.bias is not None), ("ROPE_TRAD", attn.traditional),
            ("ROPE_SCALE_BITS", float_bits(attn.rope_scale))]


_kernels: dict = {}


def rope_attention(sums: mx.array, attn, dtype, counters: Counters) -> tuple[mx.array, mx.array]:
    """(attention output [HQ * D] in `dtype`, next_pos [1]) for the layer `attn` (its `buffer` and
    `pos` set: `FusedAttention.at`), the new K/V rows written into `attn.buffer` in place."""
    if dtype not in _kernels:
        inputs, outputs = rope_attention_signature(dtype)
        _kernels[dtype] = mx.fast.cuda_kernel(
            name="mlxbun_rope_attention", input_names=[n for n, _ in inputs], output_names=[n for n, _ in outputs],
            source=ROPE_ATTENTION, header=HEADER, ensure_row_contiguous=True)
    a = attn
    chunk, splits = _split(a)
    x = a.buffer  # a dtype operand the kernel never reads where its knob is off
    bias = a.bias or (x, x, x)
    qn, kn = (a.q_norm, a.k_norm) if a.q_norm is not None else (x, x)
    out, next_pos, _, _ = _kernels[dtype](
        inputs=[sums, *bias, qn, kn, a.inv_freq, a.pos, a.buffer, counters.array],
        template=rope_attention_template(a, dtype, chunk), grid=(splits * 32 * sdpa_decode.NWARPS, a.hkv, 1),
        threadgroup=(32 * sdpa_decode.NWARPS, 1, 1),
        output_shapes=[(a.hq * a.head_dim,), (1,), (a.hq * splits * a.head_dim,), (a.hq * splits * 2,)],
        output_dtypes=[dtype, mx.int32, mx.float32, mx.float32])
    return out, next_pos
