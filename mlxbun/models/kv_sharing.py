"""Cross-layer KV sharing in the same forward: how a layer that holds no cache of its own attends
over keys / values another layer computed (gemma4_text's KV-shared layers).

mlx-lm shares KV across layers three ways, and mlxbun follows each as written: gemma4_text hands
this forward's keys / values from the producing layer to the sharing layers (this module);
gemma3n's shared layers read their owner's cache (`cache.keys_and_values()`, in
models/gemma3n/layers.py), so every cache kind shares by construction; hunyuan's CLA shares the
projections before any cache (models/universal: each layer keeps its own cache).

mlx-lm's sharing layers call `scaled_dot_product_attention(..., cache=None)` on the arrays the
producing layer's `update_and_fetch` returned: the fused kernel, which mlxbun's dispatch
(`models/base.py`) runs the same way. A quantized producer cache returns packed
(data, scales, biases) groups instead, which the fused kernel cannot take (mlx-lm's sharing
layers fail there): the sharing layer then attends through the producer's cache, i.e. its
quantized attention at the producer's bits and group. The sharing layer never writes that cache.
"""

from __future__ import annotations

import mlx.core as mx

__all__ = ["shared_attention_cache"]


def shared_attention_cache(keys, producer_cache):
    """The cache a sharing layer (no cache of its own) passes to the attention dispatch: None
    (mlx-lm's call) over arrays, the producer's cache over its packed quantized groups."""
    return None if isinstance(keys, mx.array) else producer_cache
