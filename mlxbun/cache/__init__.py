"""Caches for attention layers: mlx-lm's layouts plus the spec-round contract."""

from mlxbun.cache.kv import KVCache, RotatingKVCache

__all__ = ["KVCache", "RotatingKVCache"]
