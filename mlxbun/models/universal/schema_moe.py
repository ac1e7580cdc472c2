"""The MoE part of a descriptor row: the knob dataclasses (`MoEKnobs` and its parts, which
`schema.py` re-exports), the ModelArgs fields they read, and the knob combinations the MoE block
has no branch for (`schema.py` calls the checks when a row is built). It imports the kinds only."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxbun.models.universal.kinds import (
    CORRECTED_ROUTERS,
    ROUTER_PARAMS,
    BiasAt,
    Combine,
    ExpertKind,
    GateKind,
    GroupGuard,
    MlpSize,
    MoeLayers,
    RouterKind,
    SharedKind,
    SharedSize,
    SharedWhen,
    TopKRenorm,
    TopKSelect,
)
from mlxbun.models.universal.kinds import kind_field as _kind
from mlxbun.models.universal.kinds_sanitize import SanitizeOp

__all__ = ["MoEKnobs", "MoENames", "RouterKnobs", "SharedKnobs", "StackExperts", "check_moe", "moe_refs"]


@dataclass(frozen=True)
class MoENames:
    """mlx-lm attribute names inside the MoE block (parameter paths and safetensors keys)."""

    block: str | None = None  # the MoE block in the decoder layer; None: names.mlp
    gate: str = "gate"  # the router's projection (LINEAR) or the router module (WEIGHT, NESTED)
    gate_inner: str = "layer"  # NESTED: the Linear inside the router module
    router: str = "router"  # LINEAR: the parameter-free routing module (not in mlx-lm's tree)
    switch: str = "switch_mlp"  # the fused experts (SwitchGLU)
    gate_proj: str = "gate_proj"
    up_proj: str = "up_proj"
    down_proj: str = "down_proj"
    shared: str = "shared_experts"
    shared_gate: str = "shared_expert_gate"  # SIGMOID_GATED: Linear(D, 1)
    correction_bias: str = "e_score_correction_bias"  # corrected routers: on the module bias_at says
    gate_act: str = "gate_act"  # f32_act_topk: the activation module (nn.Softmax / nn.Sigmoid)
    coefficient: str = "coefficient"  # SharedKind.COEFFICIENT: Linear(D, 2) mixing routed / shared


@dataclass(frozen=True)
class RouterKnobs:
    kind: RouterKind = _kind(RouterKind)
    select: TopKSelect = _kind(TopKSelect, TopKSelect.NEG_FIRST)
    gate: GateKind = _kind(GateKind, GateKind.LINEAR)
    gate_bias: bool | str = False
    norm_topk: bool | str = False  # renormalize the k weights: literal, or the field (norm_topk_prob)
    # the kind's numbers (kinds.ROUTER_PARAMS names them): a ModelArgs field, or a non-str literal;
    # noaux_tc: {"scaling": "routed_scaling_factor", "n_group": "n_group", "topk_group": "topk_group"}
    params: Mapping[str, Any] = field(default_factory=dict)
    group_guard: GroupGuard = _kind(GroupGuard, GroupGuard.N_GROUP_GT_1)  # noaux_tc
    renorm: TopKRenorm = _kind(TopKRenorm, TopKRenorm.SUM)  # noaux_tc: the renormalizing division
    corrected: bool | str = True  # corrected kinds (kinds.CORRECTED_ROUTERS): the per-expert
    # correction bias exists (literal, or the field that switches it: bailing_moe's
    # moe_router_enable_expert_bias)
    bias_at: BiasAt = _kind(BiasAt, BiasAt.ROUTER)  # corrected kinds: the module holding the bias
    gate_f32: bool = False  # gate LINEAR: the gate reads x.astype(float32) (minimax)


@dataclass(frozen=True)
class SharedKnobs:
    kind: SharedKind = _kind(SharedKind, SharedKind.PLAIN)
    size: SharedSize | str = _kind(SharedSize, SharedSize.MOE_TIMES_N, or_field=True)
    count: str | None = None  # MOE_TIMES_N: the shared-expert count field (n_shared_experts)
    when: str | None = None  # built only when this field is not None (deepseek n_shared_experts)
    when_rule: SharedWhen = _kind(SharedWhen, SharedWhen.NOT_NONE)  # what `when` must hold
    enabled: bool | str = True  # and this (literal, or a bool field: moe_router_enable_shared_expert)
    bias: bool | str = False  # the shared MLP's biases (dots1: mlp_bias)
    scale: str | None = None  # ROUTED_SCALED: the field the routed sum is multiplied by (laguna)


@dataclass(frozen=True)
class MoEKnobs:
    """The MoE block of the layers `layers` selects; the other layers keep the row's MLP."""

    experts: str = "num_experts"  # field: routed experts
    top_k: str = "num_experts_per_tok"  # field
    size: str = "moe_intermediate_size"  # field: one expert's intermediate width (or MlpSize
    # FOUR_X_HIDDEN: 4 * hidden, phixtral's)
    size_fallback: str | None = None  # field read when `size`'s is 0 or None (hunyuan, ernie4_5_moe:
    # intermediate_size)
    per_layer: bool = False  # top_k, size and the shared count may each be an int or a list
    # indexed by layer (hunyuan's _int_or_list)
    router: RouterKnobs = RouterKnobs(RouterKind.SOFTMAX_TOPK)
    layers: MoeLayers = _kind(MoeLayers, MoeLayers.ALL)
    expert: ExpertKind = _kind(ExpertKind, ExpertKind.GLU)
    expert_bias: bool | str = False
    combine: Combine = _kind(Combine, Combine.SUM)
    shared: SharedKnobs | None = None
    flat_tokens: bool = False  # olmoe: route x.reshape(-1, D), reshape the sum back to [B, L, D]
    names: MoENames = MoENames()


@dataclass(frozen=True)
class StackExperts:
    """mlx-lm's sanitize loop stacking per-expert HF tensors into the fused SwitchGLU ones:
    <layer>.<block>.experts.<e>.<src>.<key> for e < experts -> <layer>.<block>.<switch>.<dst>.<key>."""

    names: tuple[tuple[str, str], ...] = (("gate_proj", "gate_proj"), ("up_proj", "up_proj"),
                                          ("down_proj", "down_proj"))
    keys: tuple[str, ...] = ("weight", "scales", "biases")  # qwen3_moe stacks "weight" only
    container: str = "experts"  # the per-expert modules' list (phixtral: mlp)


def moe_refs(m: Any) -> Iterator[tuple[str, str]]:
    """(knob, ModelArgs field) for every field a row's MoEKnobs `m` reads."""
    yield from (("moe.experts", m.experts), ("moe.top_k", m.top_k))
    if not isinstance(m.size, MlpSize):
        yield "moe.size", m.size
    if m.size_fallback:
        yield "moe.size_fallback", m.size_fallback
    r = m.router
    for knob, value in (("moe.router.gate_bias", r.gate_bias), ("moe.router.norm_topk", r.norm_topk),
                        ("moe.router.corrected", r.corrected),
                        ("moe.expert_bias", m.expert_bias),
                        *((f"moe.router.params[{k!r}]", v) for k, v in r.params.items())):
        if isinstance(value, str):
            yield knob, value
    if m.layers is MoeLayers.SPARSE_STEP:
        yield from (("moe.layers", "mlp_only_layers"), ("moe.layers", "decoder_sparse_step"))
    elif m.layers in (MoeLayers.FIRST_K_DENSE, MoeLayers.FIRST_K_DENSE_FREQ):
        yield "moe.layers", "first_k_dense_replace"
        if m.layers is MoeLayers.FIRST_K_DENSE_FREQ:
            yield "moe.layers", "moe_layer_freq"
    elif m.layers is MoeLayers.IS_MOE_LAYER:
        yield "moe.layers", "is_moe_layer"
    elif m.layers is MoeLayers.START_END_INTERVAL:
        yield from (("moe.layers", f) for f in ("moe_layer_start_index", "moe_layer_end_index",
                                                "moe_layer_interval"))
    elif m.layers is MoeLayers.NUM_DENSE:
        yield "moe.layers", "num_dense_layers"
    elif m.layers is MoeLayers.ENUM_STRING:
        yield "moe.layers", "moe_layers_enum"
    elif m.layers is MoeLayers.FREQ_LIST:
        yield "moe.layers", "moe_layer_freq"
    elif m.layers is MoeLayers.MLP_LAYER_TYPES:
        yield "moe.layers", "mlp_layer_types"
    elif m.layers is MoeLayers.PATTERN_E:
        yield "moe.layers", "hybrid_override_pattern"
    elif m.layers is MoeLayers.OFFSET_PERIOD:
        yield from (("moe.layers", "expert_layer_offset"), ("moe.layers", "expert_layer_period"))
    sh = m.shared
    if sh is not None:
        if not isinstance(sh.size, SharedSize):
            yield "moe.shared.size", sh.size
        elif sh.size is SharedSize.SHARED_OR_MOE_TIMES_N:
            yield "moe.shared.size", "moe_shared_expert_intermediate_size"
        elif sh.size is SharedSize.INTERMEDIATE_TIMES_N:
            yield "moe.shared.size", "intermediate_size"
        for knob, value in (("moe.shared.count", sh.count), ("moe.shared.when", sh.when),
                            ("moe.shared.bias", sh.bias), ("moe.shared.enabled", sh.enabled),
                            ("moe.shared.scale", sh.scale)):
            if isinstance(value, str):
                yield knob, value


# router kinds whose renormalization is part of the kind (sparsemixer: none; the others: always)
_FIXED_NORM_ROUTERS = (RouterKind.SPARSEMIXER, RouterKind.F32_ACT_TOPK, RouterKind.SIGMOID_CORRECTED,
                       RouterKind.CAPPED_SCORE)
# corrected router kinds whose correction bias a row may switch off (`RouterKnobs.corrected`);
# the other corrected kinds always add theirs
_SWITCHABLE_BIAS = (RouterKind.NOAUX_TC, RouterKind.GROUPED_SCORE, RouterKind.SIGMOID_SCALED)
# the gate kinds whose logits a sibling module of the router computes
_SIBLING_GATE = (GateKind.LINEAR, GateKind.WRAPPED)


def check_moe(d: Any, m: Any, stack_type: type) -> None:
    """Combinations of a row's MoE knobs the graph has no branch for (`d.error` names them)."""
    r = m.router
    want = ROUTER_PARAMS[r.kind]
    if set(r.params) != set(want):
        raise d.error(f"moe.router.params for kind {r.kind.value!r} must name exactly "
                      f"{', '.join(want) or 'nothing'} (each a ModelArgs field or a literal); got "
                      f"{', '.join(r.params) or 'nothing'}")
    if r.kind in CORRECTED_ROUTERS and r.gate in _SIBLING_GATE and r.bias_at is BiasAt.ROUTER:
        raise d.error(f"moe.router.kind {r.kind.value!r} with bias_at 'router' keeps its correction "
                      "bias on the router module: moe.router.gate must be 'weight' or 'nested' "
                      "(or bias_at 'block')")
    if r.kind not in CORRECTED_ROUTERS and r.bias_at is not BiasAt.ROUTER:
        raise d.error(f"moe.router.bias_at with {r.kind.value!r}: that router kind has no "
                      "correction bias")
    if r.kind not in CORRECTED_ROUTERS and r.corrected is not True:
        raise d.error(f"moe.router.corrected with {r.kind.value!r}: the kind has no correction bias")
    if r.kind not in _SWITCHABLE_BIAS and r.corrected is not True:
        raise d.error(f"moe.router.corrected with {r.kind.value!r}: the kind always adds its "
                      "correction bias")
    if r.renorm is TopKRenorm.SUM_EPS and (r.kind is not RouterKind.NOAUX_TC
                                           or r.group_guard is not GroupGuard.N_GROUP_GT_1):
        raise d.error("moe.router.renorm 'sum_eps' is a branch of kind 'noaux_tc' with group_guard "
                      "'n_group_gt_1' only (exaone_moe)")
    if r.kind in (RouterKind.TOPK_SOFTMAX, RouterKind.TOPK_SOFTMAX_F32) and r.norm_topk is not False:
        raise d.error(f"moe.router.norm_topk with {r.kind.value!r}: the softmax over the k chosen "
                      "experts is already normalized (no such branch)")
    if r.kind in _FIXED_NORM_ROUTERS and r.norm_topk is not False:
        raise d.error(f"moe.router.norm_topk with {r.kind.value!r}: the kind fixes whether its k "
                      "weights are renormalized (no such branch)")
    if r.gate_f32 and r.gate is not GateKind.LINEAR:
        raise d.error("moe.router.gate_f32 casts the input of a Linear gate: moe.router.gate must "
                      "be 'linear'")
    if m.shared is not None and (m.shared.kind is SharedKind.ROUTED_SCALED) != (m.shared.scale is not None):
        raise d.error("moe.shared.kind 'routed_scaled' and moe.shared.scale (the field scaling the "
                      "routed sum) go together")
    if m.shared is not None and m.shared.when_rule is not SharedWhen.NOT_NONE and m.shared.when is None:
        raise d.error(f"moe.shared.when_rule {m.shared.when_rule.value!r} needs moe.shared.when "
                      "(the field it tests)")
    if (m.shared is not None and m.shared.size in (SharedSize.MOE_TIMES_N, SharedSize.SHARED_OR_MOE_TIMES_N,
                                                   SharedSize.INTERMEDIATE_TIMES_N)
            and m.shared.count is None):
        raise d.error(f"moe.shared.size {m.shared.size.value!r} needs moe.shared.count (the "
                      "shared-expert count field, e.g. n_shared_experts)")
    n = m.names
    block = n.block or d.names.mlp
    inside = [n.gate, n.switch] + ([n.router] if r.gate in _SIBLING_GATE else [])
    if r.kind in CORRECTED_ROUTERS and r.bias_at is BiasAt.BLOCK:
        inside.append(n.correction_bias)  # on the block, beside the gate / router
    if r.kind is RouterKind.F32_ACT_TOPK:
        inside.append(n.gate_act)
    if m.shared is not None:
        inside.append(n.shared)
        if m.shared.kind is SharedKind.SIGMOID_GATED:
            inside.append(n.shared_gate)
        elif m.shared.kind is SharedKind.COEFFICIENT:
            inside.append(n.coefficient)
    if len(set(inside)) != len(inside):
        raise d.error(f"moe.names give two children of the MoE block ({block}) one name: {inside}")
    for rule in d.sanitize:
        if rule.op is SanitizeOp.STACK_EXPERTS and not isinstance(rule.arg, stack_type):
            raise d.error("sanitize 'stack_experts' takes a StackExperts arg")
