"""Caches for attention (and recurrent) layers: mlx-lm's layouts plus the spec-round
contract `spec_begin() / spec_commit(n_accepted) / spec_rollback()`. Each KV cache
attends over what it fetched: `cache.attention(queries, keys, values, scale, mask, sinks)`."""

from mlxbun.cache.arrays import ArraysCache, begin_spec_round, commit_spec_round, rollback_spec_round
from mlxbun.cache.cache_list import CacheList
from mlxbun.cache.convert import maybe_quantize_kv_cache, quantize_cache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.mixed import KVPlan, KVPlanError
from mlxbun.cache.prompt_cache import (
    PromptCacheError,
    cache_layout,
    cached_tokens,
    common_prefix_length,
    load_prompt_cache,
    model_identity,
    register_cache_class,
    reuse_prefix,
    save_prompt_cache,
)
from mlxbun.cache.quantized import KVQuantError, QuantizedKVCache, check_kv_quant
from mlxbun.cache.turboquant import TurboQuantKVCache, patch_mlxlm_attention, turboquant_sdpa

__all__ = [
    "ArraysCache", "CacheList", "KVCache", "RotatingKVCache", "QuantizedKVCache", "TurboQuantKVCache",
    "KVPlan", "KVPlanError", "KVQuantError", "PromptCacheError",
    "begin_spec_round", "commit_spec_round", "rollback_spec_round",
    "check_kv_quant", "maybe_quantize_kv_cache", "quantize_cache",
    "save_prompt_cache", "load_prompt_cache", "model_identity", "cache_layout", "cached_tokens",
    "common_prefix_length", "reuse_prefix", "register_cache_class",
    "patch_mlxlm_attention", "turboquant_sdpa",
]
