"""Opt-in, beyond mlx-lm: uniform (affine) quantization of a cache whose attention reads it as
arrays, such as deepseek_v3's absorbed MLA cache (the normed KV latent as keys, the shared rope
key as values: `(q_pe * scale) @ k_pe^T` and the latent's expansion through embed_q /
unembed_out need float arrays, so mlx-lm's QuantizedKVCache, which hands back packed tuples,
cannot serve it: mlx-lm fails there and mlxbun's generation refuses it).

`DequantizingKVCache` stores exactly what mlx-lm's QuantizedKVCache stores (the same
`mx.quantize` of the same buffers: same bytes, same codes) and hands back their
`mx.dequantize`d image in the cache's dtype; attention over it is the plain fused kernel. The
numbers are what uniform KV quantization of the latent costs in quality (the stored values are
rounded as mlx-lm rounds K/V); the memory is the packed bytes, plus a transient float image
per attention call. Nothing builds it by default: `quantize_latent_caches` converts a model's
filled full-precision caches when a caller asks (the bench `mlxbun.bench.mla_kv`, or
`teacher_forced(..., quantize=...)`). Saving it as a prompt cache is refused (not a known class).
"""

from __future__ import annotations

import mlx.core as mx

from mlxbun.attention import fused_sdpa
from mlxbun.cache.kv import KVCache
from mlxbun.cache.quantized import QuantizedKVCache, check_kv_quant

__all__ = ["DequantizingKVCache", "quantize_latent_caches"]


class DequantizingKVCache(QuantizedKVCache):
    """A QuantizedKVCache whose fetch is the dequantized float image of its packed K/V."""

    def update_and_fetch(self, keys, values):
        dtype = keys.dtype
        q_keys, q_values = super().update_and_fetch(keys, values)
        return self._dequantize(q_keys, dtype), self._dequantize(q_values, dtype)

    def _dequantize(self, q, dtype):
        return mx.dequantize(*q, group_size=self.group_size, bits=self.bits).astype(dtype)

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        """Attention over the fetched (float) arrays: the fused kernel."""
        return fused_sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


def quantize_latent_caches(caches: list, bits: int, group_size: int = 64) -> None:
    """Convert (in place) every filled full-precision KVCache of `caches` into a
    `DequantizingKVCache` (mlx-lm's `to_quantized` conversion of its buffers); converted ones
    stay. A head dim the group size does not divide raises `KVQuantError` naming it."""
    bits, group_size = check_kv_quant(bits, group_size, "latent KV quantization")
    for i, c in enumerate(caches):
        if type(c) is KVCache and c.offset > 0:
            caches[i] = DequantizingKVCache.from_buffers(c.keys, c.values, c.offset, group_size, bits)
