"""Which caches convert to QuantizedKVCache, and when: mlx-lm 0.32.2's kv_bits rules.

`quantize_cache` is mlx-lm's `KVCache.to_quantized` for mlxbun caches, with clear refusals
for what does not convert; `maybe_quantize_kv_cache` is mlx-lm's generate-loop hook
(kv_bits / kv_group_size / quantized_kv_start) with the same conversion rules.
"""

from __future__ import annotations

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.quantized import KVQuantError, QuantizedKVCache, check_kv_quant
from mlxbun.errors import UnsupportedModelError

__all__ = ["maybe_quantize_kv_cache", "quantize_cache"]


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
    return cache.to_quantized(group_size=group_size, bits=bits)


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
