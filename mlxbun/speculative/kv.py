"""The KV quantize hook of a speculative run: `stream_generate`'s hook for the same KV options,
shared by the round loop (the target's caches) and the model drafters (their own caches)."""

from __future__ import annotations

from typing import Optional

from mlxbun.cache.mixed import KVPlan
from mlxbun.generation_caches import kv_quantizer, load_kv_plan

__all__ = ["quantize_hook"]


def quantize_hook(kv: dict, n_caches: int, *, first: Optional[int] = None):
    """stream_generate's KV quantize hook for these `make_generation_cache` options over a
    model with `n_caches` caches (None when nothing quantizes). `first`: the hook of a cache
    list holding only the first `first` of them (a self-draft's): a per-layer plan keeps its
    entries on those layers."""
    plan = None if kv.get("kv_config") is None else load_kv_plan(kv["kv_config"], n_caches)
    if plan is not None and first is not None:
        kept = {i: v for i, v in plan.layers.items() if i < first}
        if not kept:
            return None
        plan = KVPlan(kept, first, source=plan.source)
    if plan is None and kv.get("kv_bits") is None:
        return None
    return kv_quantizer(kv.get("kv_scheme", "uniform"), kv.get("kv_bits"), kv.get("kv_group_size", 64),
                        kv.get("quantized_kv_start", 0), plan, key_bits=kv.get("kv_key_bits"),
                        value_bits=kv.get("kv_value_bits"))
