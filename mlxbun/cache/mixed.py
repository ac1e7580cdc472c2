"""Mixed-precision KV: a per-layer plan of which caches are quantized, and how.

A `KVPlan` maps cache indices to affine (bits, group_size); layers it does not
name, and optiq entries with bits 0, stay full precision. Sources:
  - `KVPlan.from_kv_config(cfg.kv_config, num_layers)`: optiq's kv_config.json
    (as parsed by `mlxbun.config` into `KVLayerSpec`s, or the raw entry dicts);
    indices are cache indices, as in optiq's `install_mixed_kv`.
  - `KVPlan.from_args(bits=..., group_size=..., layers=..., num_layers=...)`.

Use: `plan.make_caches(model.make_cache())` quantizes the named layers from the
start (quantize-on-write); `plan.maybe_quantize(caches, quantized_kv_start)`
converts them once they hold `quantized_kv_start` tokens (optiq's patched
`maybe_quantize_kv_cache`, which skips empty caches).

Sliding-window layers (RotatingKVCache) are refused, naming the layer: mlx-lm
refuses them too, and optiq converts them to its own RotatingQuantizedKVCache,
which mlxbun does not port. A plan entry on a layer without attention KV (an
ArraysCache of a recurrent layer) is refused rather than skipped: an explicit
plan that silently does nothing would misreport what ran.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Optional

from mlxbun.cache.convert import quantize_cache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.quantized import KVQuantError, QuantizedKVCache, check_kv_quant

__all__ = ["KVPlan", "KVPlanError"]


class KVPlanError(KVQuantError):
    """A per-layer KV plan names a layer or a setting that cannot be built."""


def _entry_fields(e: Any, where: str) -> tuple[Any, Any, Any]:
    if isinstance(e, Mapping):
        if "layer_idx" not in e or "bits" not in e:
            raise KVPlanError(f"{where}: needs keys 'layer_idx' and 'bits', got {sorted(e)}")
        return e["layer_idx"], e["bits"], e.get("group_size", 64)
    try:
        return e.layer_idx, e.bits, e.group_size
    except AttributeError:
        raise KVPlanError(f"{where}: expected a KVLayerSpec or a mapping, got {type(e).__name__}") from None


class KVPlan:
    """Per-layer KV precision: `layers[i] = (bits, group_size)` for quantized layers."""

    def __init__(self, layers: Mapping[int, tuple[int, int]], num_layers: int, source: str = "KV plan"):
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise KVPlanError(f"{source}: num_layers must be a positive int, got {num_layers!r}")
        self.num_layers, self.source = num_layers, source
        self.layers: dict[int, tuple[int, int]] = {}
        for i, (bits, group) in sorted(layers.items()):
            self._check_index(i, f"{source}: layer {i!r}")
            self.layers[i] = check_kv_quant(bits, group, f"{source}: layer {i}", KVPlanError)

    def _check_index(self, i, where):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.num_layers:
            raise KVPlanError(
                f"{where}: layer index {i!r} does not exist (the model has {self.num_layers} "
                f"cache layers, 0..{self.num_layers - 1})")

    @classmethod
    def from_kv_config(cls, kv_config: Iterable[Any], num_layers: int, *,
                       source: str = "kv_config") -> "KVPlan":
        """From optiq entries {layer_idx, bits, group_size=64}; bits 0 = full precision."""
        if kv_config is None or isinstance(kv_config, (str, bytes, Mapping)):
            raise KVPlanError(f"{source}: expected a sequence of layer entries, got {type(kv_config).__name__}")
        plan = cls({}, num_layers, source)
        seen = set()
        for n, e in enumerate(kv_config):
            idx, bits, group = _entry_fields(e, f"{source} entry {n}")
            where = f"{source} entry {n} (layer_idx={idx!r}, bits={bits!r}, group_size={group!r})"
            plan._check_index(idx, where)
            if idx in seen:
                raise KVPlanError(f"{where}: layer {idx} appears twice")
            seen.add(idx)
            if isinstance(bits, (int, float)) and not isinstance(bits, bool) and bits == 0:
                continue  # optiq: 0 bits = keep this layer full precision
            plan.layers[idx] = check_kv_quant(bits, group, where, KVPlanError)
        plan.layers = dict(sorted(plan.layers.items()))
        return plan

    @classmethod
    def from_args(cls, bits: int, group_size: int = 64, layers: Optional[Sequence[int]] = None, *,
                  num_layers: int) -> "KVPlan":
        """Quantize `layers` (default: all) at one setting."""
        chosen = range(num_layers) if layers is None else list(layers)
        source = f"KV plan (bits={bits}, group_size={group_size})"
        if len(set(chosen)) != len(chosen):
            raise KVPlanError(f"{source}: layers {list(chosen)} repeat an index")
        return cls({i: (bits, group_size) for i in chosen}, num_layers, source)

    def spec(self, i: int) -> Optional[tuple[int, int]]:
        """(bits, group_size) of cache `i`, None when it stays full precision."""
        return self.layers.get(i)

    def describe(self) -> str:
        q = ", ".join(f"{i}:q{b}/g{g}" for i, (b, g) in self.layers.items()) or "none"
        return f"{self.num_layers} layers, quantized {q}"

    def __repr__(self):
        return f"KVPlan({self.describe()})"

    # -- applying the plan

    def _convert(self, i: int, c: Any):
        bits, group = self.layers[i]
        where = f"{self.source}: layer {i}"
        if isinstance(c, QuantizedKVCache):
            if (c.bits, c.group_size) != (bits, group):
                raise KVPlanError(f"{where}: cache is already quantized with bits={c.bits}, "
                                  f"group_size={c.group_size}; the plan asks bits={bits}, "
                                  f"group_size={group}")
            return c
        if isinstance(c, RotatingKVCache):
            raise KVPlanError(
                f"{where}: is a sliding-window layer (RotatingKVCache, max_size={c.max_size}); "
                "quantizing it is not supported (mlx-lm refuses it; optiq's "
                "RotatingQuantizedKVCache is not ported). Drop the entry or give it bits 0.")
        if not isinstance(c, KVCache):
            raise KVPlanError(f"{where}: holds a {type(c).__name__}, not an attention KV cache; "
                              "there is nothing to quantize. Drop the entry or give it bits 0.")
        try:
            return quantize_cache(c, group_size=group, bits=bits)
        except KVQuantError as e:
            raise KVPlanError(f"{where}: {e}") from None

    def _check_count(self, caches):
        if len(caches) != self.num_layers:
            raise KVPlanError(f"{self.source}: the plan is for {self.num_layers} cache layers, "
                              f"got {len(caches)} caches")

    def make_caches(self, base_caches: Sequence[Any]) -> list:
        """A new list: the plan's layers quantized, every other cache as given."""
        base = list(base_caches)
        self._check_count(base)
        return [self._convert(i, c) if i in self.layers else c for i, c in enumerate(base)]

    def maybe_quantize(self, prompt_cache: list, quantized_kv_start: int = 0) -> None:
        """In place: convert each planned, non-empty layer holding >= start tokens."""
        self._check_count(prompt_cache)
        for i in self.layers:
            c = prompt_cache[i]
            if isinstance(c, KVCache) and (c.keys is None or c.offset < quantized_kv_start):
                continue  # not yet: empty (optiq skips these too) or below the start
            # everything else converts, is checked (already quantized) or is refused
            prompt_cache[i] = self._convert(i, c)
