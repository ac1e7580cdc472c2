"""Affine-quantized KV cache with mlx-lm 0.32.2's layout, plus KV-quantization helpers.

`QuantizedKVCache` is ported op-for-op from `mlx_lm/models/cache.py`: the same
(packed, scales, biases) triples per K and V, the step-256 growth, the same
slicing, so the arrays it returns (and attention over them) are bit-identical
to mlx-lm's, and it drops into an mlx-lm model (which probes `bits`). Two
deliberate differences, both where mlx-lm fails rather than computes:
  - the packed width is `dim * bits // 32`; mlx-lm's `dim // (32 // bits)` is
    wrong for 3/5/6 bits at some head dims (e.g. 5 or 6 bits at head_dim 128),
    where its slice assignment raises. Where mlx-lm works the two agree.
  - `nbytes` of an empty cache is 0 (mlx-lm raises AttributeError).

`quantize_cache` is mlx-lm's `KVCache.to_quantized` for mlxbun caches, and
`maybe_quantize_kv_cache` is mlx-lm's generate-loop hook (kv_bits /
kv_group_size / quantized_kv_start) with the same conversion rules.

Attention: `QuantizedKVCache.attention` runs mlx-lm's
`quantized_scaled_dot_product_attention` (bit-exact) unless the cache was made
with `attention_chunk=C`, in which case key lengths above C go through
`chunked_quantized_sdpa` (online softmax over key chunks, GQA folded into the
query rows): bounded transient memory, not bit-exact (fp32 accumulation).
Why (mlx-lm #1587): mlx-lm's path materializes the packed K/V once per GQA
repeat (the expand_dims operands of quantized_matmul get broadcast-copied) and
the whole score matrix, so a 4k-context decode step with q8 KV peaked at 2.6x
the fp16 step on the CPU backend; folding alone removes the decode overhead,
chunking bounds the prefill scores.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx.utils import tree_map

from mlxbun.cache.kv import KVCache, RotatingKVCache, _TrimSpecRound, create_attention_mask
from mlxbun.errors import ConfigError, UnsupportedModelError
from mlxbun.models.base import quantized_scaled_dot_product_attention

__all__ = [
    "KV_QUANT_BITS",
    "KV_QUANT_GROUP_SIZES",
    "KVQuantError",
    "QuantizedKVCache",
    "check_kv_quant",
    "chunked_quantized_sdpa",
    "maybe_quantize_kv_cache",
    "quantize_cache",
]

# What mlx's affine quantize/quantized_matmul do (mlx also takes bits=1; the
# KV path has no use for it and mlx-lm never offers it).
KV_QUANT_BITS = (2, 3, 4, 5, 6, 8)
KV_QUANT_GROUP_SIZES = (32, 64, 128)


class KVQuantError(ConfigError):
    """A KV-quantization setting the backend cannot do (bits, group size, head dim)."""


def check_kv_quant(bits, group_size, where: str = "KV quantization",
                   error: type = KVQuantError) -> tuple[int, int]:
    """Validate an affine (bits, group_size) pair; return them as ints (else raise `error`)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or bits != int(bits) \
            or int(bits) not in KV_QUANT_BITS:
        raise error(
            f"{where}: bits={bits!r} is not supported (affine KV quantization takes "
            f"bits in {list(KV_QUANT_BITS)})")
    if isinstance(group_size, bool) or not isinstance(group_size, int) \
            or group_size not in KV_QUANT_GROUP_SIZES:
        raise error(
            f"{where}: group_size={group_size!r} is not supported (affine KV quantization "
            f"takes group_size in {list(KV_QUANT_GROUP_SIZES)})")
    return int(bits), group_size


class QuantizedKVCache(_TrimSpecRound):
    step = 256

    def __init__(self, group_size: int = 64, bits: int = 8, *,
                 attention_chunk: Optional[int] = None):
        self.bits, self.group_size = check_kv_quant(bits, group_size, "QuantizedKVCache")
        self.keys = None
        self.values = None
        self.offset = 0
        self.attention_chunk = _check_chunk(attention_chunk)
        self._spec = None

    def _packed_width(self, dim: int) -> int:
        if dim % self.group_size:
            raise KVQuantError(
                f"QuantizedKVCache(group_size={self.group_size}, bits={self.bits}): head dim "
                f"{dim} is not a multiple of the group size")
        return dim * self.bits // 32

    def update_and_fetch(self, keys, values):
        B, n_kv_heads, num_steps, k_head_dim = keys.shape
        v_head_dim = values.shape[-1]
        prev = self.offset

        if self.keys is None or (prev + num_steps) > self.keys[0].shape[-2]:
            new_steps = (self.step + num_steps - 1) // self.step * self.step
            shape = (B, n_kv_heads, new_steps)

            def init_quant(dim):
                return (
                    mx.zeros((*shape, self._packed_width(dim)), dtype=mx.uint32),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                    mx.zeros((*shape, dim // self.group_size), dtype=keys.dtype),
                )

            def expand_quant(x):
                new_x = mx.zeros((*shape, x.shape[-1]), dtype=x.dtype)
                return mx.concatenate([x, new_x], axis=-2)

            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys, self.values = tree_map(
                        lambda x: x[..., :prev, :], (self.keys, self.values)
                    )

                self.keys, self.values = tree_map(expand_quant, (self.keys, self.values))
            else:
                self.keys, self.values = init_quant(k_head_dim), init_quant(v_head_dim)

        self.offset += num_steps

        keys = mx.quantize(keys, group_size=self.group_size, bits=self.bits)
        values = mx.quantize(values, group_size=self.group_size, bits=self.bits)
        for i in range(len(self.keys)):
            self.keys[i][..., prev : self.offset, :] = keys[i]
            self.values[i][..., prev : self.offset, :] = values[i]

        return self.keys_and_values()

    def keys_and_values(self):
        if self.offset == self.keys[0].shape[2]:
            return self.keys, self.values
        else:
            return tree_map(lambda x: x[..., : self.offset, :], (self.keys, self.values))

    def size(self):
        return self.offset

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.group_size, self.bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.group_size, self.bits = v

    @property
    def meta_state(self):
        return tuple(map(str, (self.offset, self.group_size, self.bits)))

    @meta_state.setter
    def meta_state(self, v):
        self.offset, self.group_size, self.bits = map(int, v)

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        obj._spec = None
        obj.attention_chunk = None
        obj.state = state
        if meta_state is not None:
            obj.meta_state = meta_state
        return obj

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))

    def attention(self, queries, q_keys, q_values, scale, mask):
        """Attention over what `update_and_fetch` returned: mlx-lm's quantized sdpa,
        or the chunked one when `attention_chunk` is set and the keys are longer."""
        if not backend_has_quantized_attention():
            chunk = self.attention_chunk or CUDA_ATTENTION_CHUNK
            if q_keys[0].shape[-2] > chunk:  # bound the dequantized transient to one chunk
                return chunked_quantized_sdpa(queries, q_keys, q_values, scale, mask, self.group_size,
                                              self.bits, chunk, dequantize=True)
            return dequantized_sdpa(queries, q_keys, q_values, scale, mask, self.group_size, self.bits)
        if self.attention_chunk is not None and q_keys[0].shape[-2] > self.attention_chunk:
            return chunked_quantized_sdpa(queries, q_keys, q_values, scale, mask,
                                          self.group_size, self.bits, self.attention_chunk)
        return quantized_scaled_dot_product_attention(
            queries, q_keys, q_values, scale=scale, mask=mask,
            group_size=self.group_size, bits=self.bits)



def _check_chunk(chunk):
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise KVQuantError(f"attention_chunk must be a positive int or None, got {chunk!r}")
    return chunk


# ------------------------------------------------------------------ conversion


def quantize_cache(cache, group_size: int = 64, bits: int = 4) -> QuantizedKVCache:
    """mlx-lm's `KVCache.to_quantized` for an mlxbun `KVCache` (op for op).

    A `QuantizedKVCache` is returned unchanged when its settings match (refused
    when they differ: re-quantizing would compound the error). A
    `RotatingKVCache` is refused, as in mlx-lm (its ring buffer is not in
    temporal order and `offset` is not its length).
    """
    check_kv_quant(bits, group_size, "quantize_cache")
    if isinstance(cache, QuantizedKVCache):
        if (cache.bits, cache.group_size) != (bits, group_size):
            raise KVQuantError(
                f"quantize_cache: cache is already quantized with bits={cache.bits}, "
                f"group_size={cache.group_size}; asked for bits={bits}, group_size={group_size}")
        return cache
    if isinstance(cache, RotatingKVCache):
        raise UnsupportedModelError(
            "quantize_cache: RotatingKVCache (sliding-window) quantization is not supported "
            "(nor in mlx-lm)")
    if not isinstance(cache, KVCache):
        raise UnsupportedModelError(
            f"quantize_cache: cannot quantize a {type(cache).__name__} (only KVCache converts)")
    quant_cache = QuantizedKVCache(group_size=group_size, bits=bits)
    quant_cache.offset = cache.offset
    if cache.keys is not None:
        quant_cache._packed_width(cache.keys.shape[-1])  # clear error for a bad head dim
        quant_cache._packed_width(cache.values.shape[-1])
        quant_cache.keys = mx.quantize(cache.keys, group_size=group_size, bits=bits)
        quant_cache.values = mx.quantize(cache.values, group_size=group_size, bits=bits)
    return quant_cache


def maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
    """mlx-lm's generate-loop hook, in place on the list `prompt_cache`.

    Same rule as mlx-lm: nothing when `kv_bits` is None; else every cache that
    has a `to_quantized` method (in mlx-lm: KVCache, and RotatingKVCache which
    raises) and `offset >= quantized_kv_start` is converted. mlxbun KVCaches
    convert through `quantize_cache`; an mlxbun RotatingKVCache refuses naming
    its index; caches with nothing to quantize (QuantizedKVCache, ArraysCache)
    stay. Foreign (mlx-lm) caches are converted by their own `to_quantized`.
    """
    if kv_bits is None:
        return
    for e, c in enumerate(prompt_cache):
        if isinstance(c, (KVCache, RotatingKVCache)):
            if c.offset >= quantized_kv_start:
                try:
                    prompt_cache[e] = quantize_cache(c, group_size=kv_group_size, bits=kv_bits)
                except (UnsupportedModelError, KVQuantError) as err:
                    raise type(err)(f"cache {e}: {err}") from None
        elif hasattr(c, "to_quantized") and c.offset >= quantized_kv_start:
            prompt_cache[e] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)


# ------------------------------------------------------------------ CUDA attention


# Keys per chunk for the CUDA path's dequantize-then-attend. Measured on the H200
# (benchmarks/kv-memory.md, 28 layers x 4 KV heads x 128, 16k context): dequantizing the whole
# cache peaks at 0.98-1.02x the fp16 cache's decode peak for q8 (over the bound), chunks of
# 8192 at 0.86x with half the decode speed, 2048 at 0.82x with a sixth. 8192 keeps the bound
# with margin at the least cost; `QuantizedKVCache(attention_chunk=...)` overrides it.
CUDA_ATTENTION_CHUNK = 8192


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


# ------------------------------------------------------------------ chunked attention


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
