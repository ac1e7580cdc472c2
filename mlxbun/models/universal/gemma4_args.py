"""gemma4_text's numbers: mlx-lm 0.32.2's `ModelArgs.__post_init__` (the `gemma4_text` post-init
step of the row) and each layer's shape as `gemma4_text.py`'s constructors compute it.

Per layer (`Gemma4Layer`): the layer type (sliding / full), the head dim (`global_head_dim` on
full layers when set), the kv heads (`num_global_key_value_heads` on k = v full layers when set),
whether it projects its own keys / values (`layer < num_hidden_layers - num_kv_shared_layers`)
or reads those of the last earlier projecting layer of its type (`previous_kvs`), the MLP width
(doubled on the KV-shared layers with `use_double_wide_mlp`) and the rope dict of its type.
Data and checks only; `gemma4.py` builds the graph from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxbun.models.universal.fields import fail as _fail

__all__ = ["FULL", "GEMMA4_MODEL_TYPES", "SLIDING", "Gemma4Layer", "gemma4_layers", "gemma4_text_post_init"]

FULL, SLIDING = "full_attention", "sliding_attention"
# the rows whose forward is gemma4.py's (the loader builds it, explain lists it)
GEMMA4_MODEL_TYPES = frozenset({"gemma4_text", "gemma4"})

_DEFAULT_ROPE = {
    FULL: {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0, "rope_type": "proportional"},
    SLIDING: {"partial_rotary_factor": 1.0, "rope_theta": 10000.0, "rope_type": "default"},
}


def _int(a: Mapping, key: str, mt: str, low: int = 1) -> int:
    v = a[key]
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise _fail(mt, f"'{key}' must be an integer >= {low}, got {v!r}")
    return v


def gemma4_text_post_init(a: dict, mt: str) -> None:
    """`ModelArgs.__post_init__`: the default rope_parameters and layer_types (sliding_window_pattern
    - 1 sliding then one full, repeated), then the checks mlx-lm fails on later (a KeyError while
    wiring the KV sharing, a missing per-type rope dict) as named refusals."""
    if a["rope_parameters"] is None:
        a["rope_parameters"] = {k: dict(v) for k, v in _DEFAULT_ROPE.items()}
    n = _int(a, "num_hidden_layers", mt)
    if a["layer_types"] is None:
        p = _int(a, "sliding_window_pattern", mt)
        pattern = [SLIDING] * (p - 1) + [FULL]
        a["layer_types"] = (pattern * (n // len(pattern) + 1))[:n]
    lt = a["layer_types"]
    if not isinstance(lt, list) or len(lt) < n or any(t not in (FULL, SLIDING) for t in lt[:n]):
        raise _fail(mt, f"'layer_types' must list {n} layers of {FULL!r} / {SLIDING!r}, got {lt!r}"[:300])
    rp = a["rope_parameters"]
    for t in set(lt[:n]):
        if not isinstance(rp, Mapping) or not isinstance(rp.get(t, {}), Mapping):
            raise _fail(mt, f"'rope_parameters' must map {t!r} to a rope dict, got {rp!r}"[:300])
    shared = _int(a, "num_kv_shared_layers", mt, low=0)
    first = n - shared
    if shared and first <= 0:
        raise _fail(mt, f"'num_kv_shared_layers' ({shared}) must leave a layer projecting keys / values "
                        f"(num_hidden_layers is {n})")
    missing = sorted(set(lt[first:n]) - set(lt[:first]))
    if missing:
        raise _fail(mt, f"KV-shared layer type(s) {missing} have no earlier layer of their type projecting "
                        f"keys / values (layers 0..{first - 1})")
    if a["hidden_size_per_layer_input"]:
        _int(a, "vocab_size_per_layer_input", mt)
    if a["enable_moe_block"]:
        for key in ("num_experts", "top_k_experts", "moe_intermediate_size"):
            _int(a, key, mt)


@dataclass(frozen=True)
class Gemma4Layer:
    index: int
    layer_type: str
    head_dim: int
    n_kv_heads: int
    has_kv: bool  # projects its own keys / values (else reads layer `previous_kv`'s)
    previous_kv: int  # mlx-lm's previous_kvs[index]: itself, or the layer whose k / v it reads
    k_eq_v: bool  # values are the key projection (attention_k_eq_v on full layers)
    mlp_width: int
    rope: Mapping[str, Any]  # rope_parameters[layer_type] (initialize_rope's scaling_config)

    @property
    def sliding(self) -> bool:
        return self.layer_type == SLIDING


def first_kv_shared(a: Mapping) -> int:
    return a["num_hidden_layers"] - a["num_kv_shared_layers"]


def gemma4_layers(a: Mapping) -> tuple[Gemma4Layer, ...]:
    """Each layer's shape, with the expressions of gemma4_text.py's Attention / MLP constructors."""
    n, first = a["num_hidden_layers"], first_kv_shared(a)
    lt = a["layer_types"]
    kvs_by_type: dict[str, int] = {}
    out = []
    for i in range(n):
        sliding = lt[i] == SLIDING
        full_dim = not sliding and a["global_head_dim"]
        head_dim = a["global_head_dim"] if full_dim else a["head_dim"]
        k_eq_v = bool(a["attention_k_eq_v"]) and not sliding
        kv_heads = (a["num_global_key_value_heads"] if k_eq_v and a["num_global_key_value_heads"] is not None
                    else a["num_key_value_heads"])
        has_kv = i < first
        if has_kv:
            kvs_by_type[lt[i]] = i
        double = bool(a["use_double_wide_mlp"]) and i >= first > 0
        out.append(Gemma4Layer(i, lt[i], head_dim, kv_heads, has_kv,
                               i if has_kv else kvs_by_type[lt[i]],
                               k_eq_v, a["intermediate_size"] * (2 if double else 1),
                               (a["rope_parameters"] or {}).get(lt[i], {})))
    return tuple(out)
