"""The MoE knobs of a row applied to one config: which layers route, and every MoE number.

`resolve_moe(d, a)` reads the emulated `ModelArgs` (`a`, after `__post_init__`)
the way the mlx-lm file's MoE block and decoder layer read them; `moe_layers`
is the file's per-layer test, one branch per `MoeLayers` kind.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mlxbun.models.universal.fields import fail, get, int_field
from mlxbun.models.universal.kinds import ROUTER_PARAM_KINDS, MlpSize, MoeLayers, SharedSize, SharedWhen, exhaustive
from mlxbun.models.universal.schema import (
    ArchDescriptor,
)
from mlxbun.models.universal.schema_moe import (
    MoEKnobs,
)

__all__ = ["MoESpec", "moe_layers", "resolve_moe"]


@dataclass(frozen=True)
class MoESpec:
    """Every number of the MoE block (the same on each MoE layer)."""

    experts: int
    top_k: int
    size: int  # one expert's intermediate width
    gate_bias: bool
    expert_bias: bool
    norm_topk: bool
    params: Mapping[str, Any]  # the router kind's numbers (kinds.ROUTER_PARAMS), as the config holds them
    shared_size: int | None = None  # None: no shared expert
    shared_bias: bool = False
    corrected: bool = True  # the router kind's correction bias exists (kinds that have one)
    per_layer: tuple["MoESpec | None", ...] = ()  # MoEKnobs.per_layer: each layer's own numbers

    def at(self, layer: int) -> "MoESpec":
        """The numbers of one MoE layer (the same for every layer unless the row is per_layer)."""
        return self.per_layer[layer] if self.per_layer else self


def _sparse_step(a: Mapping, i: int, m: MoEKnobs) -> bool:  # qwen3_moe's decoder layer
    return (i not in a["mlp_only_layers"]) and (
        a[m.experts] > 0 and (i + 1) % a["decoder_sparse_step"] == 0)


def _first_k_dense(a: Mapping, i: int, m: MoEKnobs) -> bool:  # glm4_moe, dots1
    return a[m.experts] is not None and i >= a["first_k_dense_replace"]


def _first_k_dense_freq(a: Mapping, i: int, m: MoEKnobs) -> bool:  # deepseek
    return (a[m.experts] is not None and i >= a["first_k_dense_replace"]
            and i % a["moe_layer_freq"] == 0)


def _is_moe_layer(a: Mapping, i: int, m: MoEKnobs) -> bool:  # exaone_moe
    return a["is_moe_layer"][i]


def _not_single_expert(a: Mapping, i: int, m: MoEKnobs) -> bool:  # hunyuan
    return a[m.experts] != 1


def _start_end_interval(a: Mapping, i: int, m: MoEKnobs) -> bool:  # ernie4_5_moe's decoder layer
    start = a["moe_layer_start_index"]
    start = min(start) if isinstance(start, (tuple, list)) else start
    end = a["moe_layer_end_index"]
    if end is None:
        end = a["num_hidden_layers"] - 1
    else:
        end = max(end) if isinstance(end, (tuple, list)) else end
    return ((i + 1) % a["moe_layer_interval"] == 0) and i >= start and i <= end


def _num_dense(a: Mapping, i: int, m: MoEKnobs) -> bool:  # afmoe
    return i >= a["num_dense_layers"]


def _enum_string(a: Mapping, i: int, m: MoEKnobs) -> bool:  # step3p5
    if a["moe_layers_enum"]:
        return i in {int(j) for j in a["moe_layers_enum"].strip().split(",")}
    return i in set(range(1, a["num_hidden_layers"]))


def _freq_list(a: Mapping, i: int, m: MoEKnobs) -> bool:  # mimo_v2_flash
    return a["moe_layer_freq"][i] == 1


def _mlp_layer_types(a: Mapping, i: int, m: MoEKnobs) -> bool:  # laguna
    return a["mlp_layer_types"][i] == "sparse"


_LAYER_RULES: Mapping[MoeLayers, Callable[[Mapping, int, MoEKnobs], bool]] = exhaustive(MoeLayers, {
    MoeLayers.ALL: lambda a, i, m: True,
    MoeLayers.SPARSE_STEP: _sparse_step,
    MoeLayers.FIRST_K_DENSE: _first_k_dense,
    MoeLayers.FIRST_K_DENSE_FREQ: _first_k_dense_freq,
    MoeLayers.IS_MOE_LAYER: _is_moe_layer,
    MoeLayers.NOT_SINGLE_EXPERT: _not_single_expert,
    MoeLayers.START_END_INTERVAL: _start_end_interval,
    MoeLayers.NUM_DENSE: _num_dense,
    MoeLayers.ENUM_STRING: _enum_string,
    MoeLayers.FREQ_LIST: _freq_list,
    MoeLayers.MLP_LAYER_TYPES: _mlp_layer_types,
    MoeLayers.PATTERN_E: lambda a, i, m: a["hybrid_override_pattern"][i] == "E",  # nemotron_h
    MoeLayers.OFFSET_PERIOD: lambda a, i, m: (a[m.experts] > 1  # jamba
                                              and (i + a["expert_layer_offset"]) % a["expert_layer_period"] == 0),
})


# SharedKnobs.when_rule: is the shared expert built, given the `when` field's value
_SHARED_WHEN: Mapping[SharedWhen, Callable[[Any], bool]] = exhaustive(SharedWhen, {
    SharedWhen.NOT_NONE: lambda v: v is not None,
    SharedWhen.POSITIVE: lambda v: v is not None and v > 0,
    SharedWhen.POSITIVE_INT: lambda v: v > 0,
})


def moe_layers(d: ArchDescriptor, a: Mapping, n_layers: int) -> list[bool]:
    """Per layer: the MoE block (True) or the row's dense MLP (False)."""
    if d.moe is None:
        return [False] * n_layers
    rule = _LAYER_RULES[d.moe.layers]
    if d.moe.layers is MoeLayers.IS_MOE_LAYER:
        flags = a["is_moe_layer"]
        if not isinstance(flags, list) or len(flags) < n_layers:
            raise fail(d.model_type, f"'is_moe_layer' must be a list of {n_layers} bools (one per "
                                     f"layer), got {flags!r}")
    if d.moe.layers is MoeLayers.FREQ_LIST:
        freq = a["moe_layer_freq"]
        if not isinstance(freq, list) or len(freq) < n_layers:
            raise fail(d.model_type, f"'moe_layer_freq' must be a list of {n_layers} ints (one per "
                                     f"layer), got {freq!r}")
    if d.moe.layers is MoeLayers.START_END_INTERVAL:  # mlx-lm would divide by it
        int_field(a, "moe_layer_interval", d.model_type)
    if d.moe.layers is MoeLayers.ENUM_STRING:
        _check_enum_string(a, d.model_type)
    return [bool(rule(a, i, d.moe)) for i in range(n_layers)]


def _check_enum_string(a: Mapping, mt: str) -> None:
    s = a["moe_layers_enum"]
    if s and (not isinstance(s, str) or not all(j.strip().lstrip("-").isdigit() for j in s.strip().split(","))):
        raise fail(mt, f"'moe_layers_enum' must be a comma-separated list of layer indices, got {s!r}")


def resolve_moe(d: ArchDescriptor, a: Mapping, layers: list[bool]) -> MoESpec | None:
    """The MoE numbers (None for a row without MoE, or a config whose layers are all dense)."""
    m, mt = d.moe, d.model_type
    if m is None or not any(layers):
        return None
    if not m.per_layer:
        return _spec(d, a)
    # hunyuan's _int_or_list: a list-valued top_k / size / shared count is read at the layer index
    listed = [f for f in (m.top_k, m.size, m.shared.count if m.shared else None) if f]
    specs = tuple(_spec(d, {**a, **{f: _int_or_list(a, f, i, mt) for f in listed}}) if routed else None
                  for i, routed in enumerate(layers))
    return dataclasses.replace(next(s for s in specs if s is not None), per_layer=specs)


def _int_or_list(a: Mapping, name: str, i: int, mt: str) -> Any:
    value = a[name]
    if isinstance(value, list):
        if i >= len(value):
            raise fail(mt, f"'{name}' lists {len(value)} values; layer {i} has none")
        return value[i]
    return value


def _spec(d: ArchDescriptor, a: Mapping) -> MoESpec:
    m, mt = d.moe, d.model_type
    experts, top_k = int_field(a, m.experts, mt), int_field(a, m.top_k, mt)
    if m.size is MlpSize.FOUR_X_HIDDEN:  # phixtral: SwitchMLP(dims, dims * 4, ...)
        size = 4 * int_field(a, d.hidden, mt)
    else:
        size = int_field(a, m.size_fallback if m.size_fallback and not a[m.size] else m.size, mt)
    if top_k > experts:
        raise fail(mt, f"'{m.top_k}' = {top_k} is larger than '{m.experts}' = {experts}")
    r = m.router
    shared_size = None
    sh = m.shared
    if sh is not None and sh.when_rule is SharedWhen.POSITIVE_INT:  # mlx-lm compares it with 0
        v = a[sh.when]
        if not isinstance(v, int) or isinstance(v, bool):
            raise fail(mt, f"'{sh.when}' must be an integer, got {v!r}")
    if (sh is not None and (sh.when is None or _SHARED_WHEN[sh.when_rule](a[sh.when]))
            and get(a, sh.enabled, mt)):
        if sh.size is SharedSize.MOE_TIMES_N:
            shared_size = size * a[sh.count]
        elif sh.size is SharedSize.SHARED_OR_MOE_TIMES_N:  # bailing_moe
            shared_size = (a["moe_shared_expert_intermediate_size"] or a[m.size]) * a[sh.count]
        elif sh.size is SharedSize.INTERMEDIATE_TIMES_N:  # hunyuan
            shared_size = int(a["intermediate_size"] * a[sh.count])
        else:
            shared_size = a[sh.size]
    return MoESpec(
        experts=experts, top_k=top_k, size=size,
        gate_bias=bool(get(a, r.gate_bias, mt)), expert_bias=bool(get(a, m.expert_bias, mt)),
        norm_topk=bool(get(a, r.norm_topk, mt)),
        params=MappingProxyType({k: _param(k, v, a, mt) for k, v in r.params.items()}),
        shared_size=shared_size,
        shared_bias=bool(get(a, sh.bias, mt)) if sh is not None else False,
        corrected=bool(get(a, r.corrected, mt)),
    )


def _param(name: str, spec: Any, a: Mapping, mt: str) -> Any:
    """A router number as the config holds it; a kind (ROUTER_PARAM_KINDS) as its enum member."""
    value = get(a, spec, mt)
    kind = ROUTER_PARAM_KINDS.get(name)
    if kind is None:
        return value
    if not isinstance(value, str) or value not in kind._value2member_map_:
        raise fail(mt, f"'{spec}' = {value!r} is not supported (mlx-lm's {mt} runs "
                       f"{', '.join(repr(k.value) for k in kind)})")
    return kind(value)
