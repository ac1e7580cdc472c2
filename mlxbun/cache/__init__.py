"""Caches for attention layers: mlx-lm's layouts plus the spec-round contract."""

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.turboquant import TurboQuantKVCache, patch_mlxlm_attention, turboquant_sdpa

__all__ = ["KVCache", "RotatingKVCache", "TurboQuantKVCache", "patch_mlxlm_attention", "turboquant_sdpa"]
