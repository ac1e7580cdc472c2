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

`QuantizedKVCache.from_buffers` is mlx-lm's `KVCache.to_quantized` conversion;
the rules for which caches convert are in `mlxbun.cache.convert`.

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

from mlxbun.attention import (
    backend_has_quantized_attention,
    cached_causal_mask,
    chunked_quantized_sdpa,
    dequantized_sdpa,
    quantized_scaled_dot_product_attention,
)
from mlxbun.cache.spec_round import TrimSpecRound
from mlxbun.errors import ConfigError, UnsupportedModelError

__all__ = [
    "CUDA_ATTENTION_CHUNK",
    "KV_QUANT_BITS",
    "KV_QUANT_GROUP_SIZES",
    "KVQuantError",
    "QuantizedKVCache",
    "check_kv_quant",
]

# What mlx's affine quantize/quantized_matmul do (mlx also takes bits=1; the
# KV path has no use for it and mlx-lm never offers it).
KV_QUANT_BITS = (2, 3, 4, 5, 6, 8)
KV_QUANT_GROUP_SIZES = (32, 64, 128)

# Keys per chunk for the CUDA path's dequantize-then-attend. Measured on the H200
# (benchmarks/kv-memory.md, 28 layers x 4 KV heads x 128, 16k context): dequantizing the whole
# cache peaks at 0.98-1.02x the fp16 cache's decode peak for q8 (over the bound), chunks of
# 8192 at 0.86x with half the decode speed, 2048 at 0.82x with a sixth. 8192 keeps the bound
# with margin at the least cost; `QuantizedKVCache(attention_chunk=...)` overrides it.
CUDA_ATTENTION_CHUNK = 8192


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


class QuantizedKVCache(TrimSpecRound):
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

    @classmethod
    def from_buffers(cls, keys, values, offset: int, group_size: int = 64,
                     bits: int = 4) -> "QuantizedKVCache":
        """mlx-lm's `KVCache.to_quantized`, op for op: the full-precision buffers (None when
        empty) quantized whole, `offset` kept."""
        quant_cache = cls(group_size=group_size, bits=bits)
        quant_cache.offset = offset
        if keys is not None:
            quant_cache._packed_width(keys.shape[-1])  # clear error for a bad head dim
            quant_cache._packed_width(values.shape[-1])
            quant_cache.keys = mx.quantize(keys, group_size=group_size, bits=bits)
            quant_cache.values = mx.quantize(values, group_size=group_size, bits=bits)
        return quant_cache

    def make_mask(self, *args, **kwargs):
        return cached_causal_mask(*args, offset=self.offset, **kwargs)

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))

    def attention(self, queries, q_keys, q_values, scale, mask, sinks=None):
        """Attention over what `update_and_fetch` returned: mlx-lm's quantized sdpa,
        or the chunked one when `attention_chunk` is set and the keys are longer."""
        if sinks is not None:
            raise UnsupportedModelError(
                "QuantizedKVCache: attention sinks are not supported by quantized attention "
                "(nor in mlx-lm)")
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
