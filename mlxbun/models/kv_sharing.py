"""Cross-layer KV sharing in the same forward: how a layer that holds no cache of its own attends
over keys / values another layer computed (gemma4_text's KV-shared layers; a piece to unify with
other sharing schemes, e.g. gemma3n's, which reads the designated layer's cache).

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
