"""The MoE knobs of a row applied to one config: which layers route, and every MoE number.

`resolve_moe(d, a)` reads the emulated `ModelArgs` (`a`, after `__post_init__`)
the way the mlx-lm file's MoE block and decoder layer read them; `moe_layers`
is the file's per-layer test, one branch per `MoeLayers` kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from mlxbun.models.universal.fields import fail, get, int_field
from mlxbun.models.universal.kinds import MoeLayers, SharedSize, SharedWhen, exhaustive
from mlxbun.models.universal.schema import ArchDescriptor, MoEKnobs

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


def _sparse_step(a: Mapping, i: int, m: MoEKnobs) -> bool:  # qwen3_moe's decoder layer
    return (i not in a["mlp_only_layers"]) and (
        a[m.experts] > 0 and (i + 1) % a["decoder_sparse_step"] == 0)


def _first_k_dense(a: Mapping, i: int, m: MoEKnobs) -> bool:  # glm4_moe, dots1
    return a[m.experts] is not None and i >= a["first_k_dense_replace"]


def _first_k_dense_freq(a: Mapping, i: int, m: MoEKnobs) -> bool:  # deepseek
    return (a[m.experts] is not None and i >= a["first_k_dense_replace"]
            and i % a["moe_layer_freq"] == 0)


def _num_dense(a: Mapping, i: int, m: MoEKnobs) -> bool:  # afmoe
    return i >= a["num_dense_layers"]


def _enum_string(a: Mapping, i: int, m: MoEKnobs) -> bool:  # step3p5
    if a["moe_layers_enum"]:
        return i in {int(j) for j in a["moe_layers_enum"].strip().split(",")}
    return i in set(range(1, a["num_hidden_layers"]))


_LAYER_RULES: Mapping[MoeLayers, Callable[[Mapping, int, MoEKnobs], bool]] = exhaustive(MoeLayers, {
    MoeLayers.ALL: lambda a, i, m: True,
    MoeLayers.SPARSE_STEP: _sparse_step,
    MoeLayers.FIRST_K_DENSE: _first_k_dense,
    MoeLayers.FIRST_K_DENSE_FREQ: _first_k_dense_freq,
    MoeLayers.NUM_DENSE: _num_dense,
    MoeLayers.ENUM_STRING: _enum_string,
})

# SharedKnobs.when: is the shared expert built, given the field's value
_SHARED_WHEN: Mapping[SharedWhen, Callable[[Any], bool]] = exhaustive(SharedWhen, {
    SharedWhen.NOT_NONE: lambda v: v is not None,
    SharedWhen.POSITIVE: lambda v: v > 0,
})


def moe_layers(d: ArchDescriptor, a: Mapping, n_layers: int) -> list[bool]:
    """Per layer: the MoE block (True) or the row's dense MLP (False)."""
    if d.moe is None:
        return [False] * n_layers
    rule = _LAYER_RULES[d.moe.layers]
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
    experts, top_k = int_field(a, m.experts, mt), int_field(a, m.top_k, mt)
    if top_k > experts:
        raise fail(mt, f"'{m.top_k}' = {top_k} is larger than '{m.experts}' = {experts}")
    r = m.router
    shared_size = None
    sh = m.shared
    if sh is not None and sh.when_is is SharedWhen.POSITIVE:  # mlx-lm compares it with 0
        v = a[sh.when]
        if not isinstance(v, int) or isinstance(v, bool):
            raise fail(mt, f"'{sh.when}' must be an integer, got {v!r}")
    if sh is not None and (sh.when is None or _SHARED_WHEN[sh.when_is](a[sh.when])):
        if sh.size is SharedSize.MOE_TIMES_N:
            shared_size = a[m.size] * a[sh.count]
        else:
            shared_size = a[sh.size]
    return MoESpec(
        experts=experts, top_k=top_k, size=int_field(a, m.size, mt),
        gate_bias=bool(get(a, r.gate_bias, mt)), expert_bias=bool(get(a, m.expert_bias, mt)),
        norm_topk=bool(get(a, r.norm_topk, mt)),
        params=MappingProxyType({k: get(a, v, mt) for k, v in r.params.items()}),
        shared_size=shared_size,
        shared_bias=bool(get(a, sh.bias, mt)) if sh is not None else False,
    )
