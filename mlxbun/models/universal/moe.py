"""The universal graph's mixture-of-experts block: router, fused experts, shared expert.

Each branch is a transcription of the mlx-lm 0.32.2 MoE block of the arch that takes
it (the same ops in the same order: the top-k op whose index order fixes the order the
expert outputs are summed in, precise or plain softmax, float32 casts, the compiled
grouped selection), under that file's attribute names, so parameter paths and
safetensors keys are mlx-lm's. The row's `MoEKnobs` choose the branches
(`RouterKind`, `TopKSelect`, `GateKind`, `Combine`, `SharedKind`, ...); `MoESpec`
(`moe_args.py`) holds the numbers.

The router is one module, and taps see routing there: `Router.__call__` returns a
`Routing` (chosen experts [.., k], their weights [.., k], the gate logits [.., E]);
`models/taps.py` records the first (the experts) like any module output and the whole
tuple in `Taps.tuples`. Where mlx-lm's router is a module of its own (deepseek's
MoEGate, granitemoe's router) the Router sits at its path and holds its parameters;
where mlx-lm routes inline after a Linear `gate` (mixtral, qwen*_moe, olmoe), the
Linear stays at its path and the Router is a parameter-free child that mlx-lm's tree
does not have (`Router.observer`: the parity localizer does not ask the oracle for it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models.switch_layers import ClampedSwiGLU, SwitchGLU
from mlxbun.models.universal.kinds import (
    CORRECTED_ROUTERS,
    BiasAt,
    Combine,
    GateKind,
    GroupGuard,
    RouterKind,
    SharedKind,
    TopKSelect,
    exhaustive,
)
from mlxbun.models.universal.mlp import MLP
from mlxbun.models.universal.moe_args import MoESpec
from mlxbun.models.universal.resolve import UniversalArgs
from mlxbun.models.universal.schema import ArchDescriptor, MoEKnobs

__all__ = ["MoEBlock", "Router", "Routing"]


class Routing(NamedTuple):
    experts: mx.array  # [.., k] uint32: the chosen experts, in the order their outputs are summed
    weights: mx.array  # [.., k]: what each chosen expert's output is multiplied by
    logits: mx.array  # [.., E]: the gate's raw logits (what the router kind scores)


# ----------------------------------------------------------------- top-k and routing kinds

_SELECT: Mapping[TopKSelect, Callable[[mx.array, int], mx.array]] = exhaustive(TopKSelect, {
    TopKSelect.NEG_FIRST: lambda s, k: mx.argpartition(-s, kth=k - 1, axis=-1)[..., :k],
    TopKSelect.LAST: lambda s, k: mx.argpartition(s, kth=-k, axis=-1)[..., -k:],
})


def _softmax_topk(r: "Router", logits, bias):  # qwen3_moe, qwen2_moe, olmoe, deepseek
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.stop_gradient(_SELECT[r.select](gates, r.top_k))
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if r.norm_topk:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def _topk_softmax(r: "Router", logits, bias):  # mixtral
    inds = mx.stop_gradient(_SELECT[r.select](logits, r.top_k))
    scores = mx.take_along_axis(logits, inds, axis=-1)
    return inds, mx.softmax(scores, axis=-1, precise=True)


def _topk_softmax_f32(r: "Router", logits, bias):  # granitemoe
    inds = mx.stop_gradient(_SELECT[r.select](logits, r.top_k))
    top = mx.take_along_axis(logits, inds, axis=-1)
    return inds, mx.softmax(top.astype(mx.float32), axis=-1)


@mx.compile
def _group_select_n_group(gates, e_score_correction_bias, top_k, n_group, topk_group,
                          routed_scaling_factor, norm_topk_prob):
    # glm4_moe.group_expert_select, op for op (compiled there too)
    scores = mx.sigmoid(gates.astype(mx.float32))
    orig_scores = scores
    scores = scores + e_score_correction_bias
    if n_group > 1:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        k = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        scores = mx.put_along_axis(scores, mx.stop_gradient(group_idx), mx.array(0.0), axis=-2)
        scores = mx.flatten(scores, -2, -1)
    k = top_k
    inds = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    inds = mx.stop_gradient(inds)
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    if top_k > 1 and norm_topk_prob:
        denominator = scores.sum(axis=-1, keepdims=True)
        scores = scores / denominator
    scores = scores * routed_scaling_factor
    return inds, scores


@mx.compile
def _group_select_k_nonzero(gates, e_score_correction_bias, top_k, n_group, topk_group,
                            routed_scaling_factor, norm_topk_prob):
    # dots1.group_expert_select, op for op (compiled there too)
    scores = mx.sigmoid(gates.astype(mx.float32))
    orig_scores = scores
    scores = scores + e_score_correction_bias
    k = n_group - topk_group
    if k != 0:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        group_idx = mx.stop_gradient(group_idx)
        scores = mx.put_along_axis(scores, group_idx, mx.array(0.0), axis=-2)
        scores = mx.flatten(scores, -2, -1)
    k = top_k
    inds = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
    inds = mx.stop_gradient(inds)
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    if top_k > 1 and norm_topk_prob:
        denominator = scores.sum(axis=-1, keepdims=True)
        scores = scores / denominator
    scores = scores * routed_scaling_factor
    return inds, scores


_GROUP_SELECT = exhaustive(GroupGuard, {GroupGuard.N_GROUP_GT_1: _group_select_n_group,
                                        GroupGuard.K_NONZERO: _group_select_k_nonzero})


def _noaux_tc(r: "Router", logits, bias):  # glm4_moe, dots1 (deepseek-v3 style)
    p = r.params
    return _GROUP_SELECT[r.group_guard](logits, bias, r.top_k, p["n_group"], p["topk_group"],
                                        p["scaling"], r.norm_topk)


@mx.compile
def _moe_gate_select(gates, router_bias, top_k, routed_scaling_factor, norm_topk_prob):
    # step3p5.moe_gate_select, op for op (compiled there too)
    scores = mx.sigmoid(gates.astype(mx.float32))
    corrected_scores = scores + router_bias
    topk_indices = mx.argpartition(-corrected_scores, kth=top_k - 1, axis=-1)[..., :top_k]
    topk_indices = mx.stop_gradient(topk_indices)
    topk_weights = mx.take_along_axis(scores, topk_indices, axis=-1)
    if norm_topk_prob:
        topk_weights = topk_weights / (mx.sum(topk_weights, axis=-1, keepdims=True) + 1e-20)
    return topk_indices, topk_weights * routed_scaling_factor


def _sigmoid_eps(r: "Router", logits, bias):  # step3p5
    return _moe_gate_select(logits, bias, r.top_k, r.params["scaling"], r.norm_topk)


def _sigmoid_biased(r: "Router", logits, bias):  # Klear (the cast to x's dtype: Router.__call__)
    routing_weights = mx.sigmoid(logits.astype(mx.float32))
    biased_weights = routing_weights + bias.reshape((1, 1, -1))
    k = r.top_k
    inds = mx.argpartition(-biased_weights, kth=k - 1, axis=-1)[..., :k]
    inds = mx.stop_gradient(inds)
    scores = mx.take_along_axis(routing_weights, inds, axis=-1)
    if r.norm_topk:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    return inds, scores


def _scored_grouped(r: "Router", logits, bias):  # afmoe.AfmoeMoE, op for op (not compiled)
    p = r.params
    if p["score_func"] == "sigmoid":
        scores = mx.sigmoid(logits.astype(mx.float32))
    else:
        scores = mx.softmax(logits.astype(mx.float32), axis=-1)
    selection_scores = scores + bias
    n_group, topk_group = p["n_group"], p["topk_group"]
    if n_group > 1:
        selection_scores = mx.unflatten(selection_scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(selection_scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        k = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        selection_scores = mx.put_along_axis(
            selection_scores, mx.stop_gradient(group_idx), mx.array(0.0), axis=-2)
        selection_scores = mx.flatten(selection_scores, -2, -1)
    k = r.top_k
    inds = mx.argpartition(-selection_scores, kth=k - 1, axis=-1)[..., :k]
    inds = mx.stop_gradient(inds)
    selected_scores = mx.take_along_axis(scores, inds, axis=-1)
    if r.norm_topk and r.top_k > 1:
        denominator = selected_scores.sum(axis=-1, keepdims=True)
        selected_scores = selected_scores / denominator
    return inds, selected_scores * p["scaling"]


# (router, gate logits, correction bias or None) -> (experts, weights). A new kind: its enum
# member (kinds.RouterKind), the numbers it reads (kinds.ROUTER_PARAMS, then `r.params[name]`
# here), its function here, its lines in explain_moe.py.
_ROUTE = exhaustive(RouterKind, {
    RouterKind.SOFTMAX_TOPK: _softmax_topk,
    RouterKind.TOPK_SOFTMAX: _topk_softmax,
    RouterKind.TOPK_SOFTMAX_F32: _topk_softmax_f32,
    RouterKind.NOAUX_TC: _noaux_tc,
    RouterKind.SIGMOID_EPS: _sigmoid_eps,
    RouterKind.SIGMOID_BIASED: _sigmoid_biased,
    RouterKind.SCORED_GROUPED: _scored_grouped,
})
# the router kinds whose weights are cast to the block input's dtype (Klear: scores.astype(x.dtype))
_WEIGHTS_IN_INPUT_DTYPE = (RouterKind.SIGMOID_BIASED,)

_COMBINE = exhaustive(Combine, {
    Combine.SUM: lambda y, s: (y * s[..., None]).sum(axis=-2),
    Combine.SUM_CAST: lambda y, s: (y * s[..., None]).sum(axis=-2).astype(y.dtype),
    Combine.F32_SUM_CAST: lambda y, s: (y * s[..., None].astype(mx.float32)).sum(axis=-2).astype(y.dtype),
})


# ----------------------------------------------------------------- modules


class Router(nn.Module):
    """Gate logits -> `Routing`. Holds the gate's parameters unless the gate is a sibling
    Linear (GateKind.LINEAR), whose logits the block passes in."""

    def __init__(self, m: MoEKnobs, spec: MoESpec, hidden: int):
        super().__init__()
        r, n = m.router, m.names
        self.kind, self.select, self.gate_kind, self.group_guard = r.kind, r.select, r.gate, r.group_guard
        self.top_k, self.norm_topk = spec.top_k, spec.norm_topk
        self.n_experts = spec.experts
        object.__setattr__(self, "params", spec.params)  # numbers, outside the module tree
        self._inner, self._bias = n.gate_inner, n.correction_bias
        if r.gate is GateKind.WEIGHT:
            self.weight = mx.zeros((spec.experts, hidden))
        elif r.gate is GateKind.NESTED:
            setattr(self, n.gate_inner, nn.Linear(hidden, spec.experts, bias=spec.gate_bias))
        # the correction bias on this module, or (BiasAt.BLOCK) passed in by the block
        self._own_bias = r.kind in CORRECTED_ROUTERS and r.bias_at is BiasAt.ROUTER
        if self._own_bias:
            setattr(self, n.correction_bias, mx.zeros((spec.experts,)))

    @property
    def observer(self) -> bool:
        """True when mlx-lm's tree has no module here (the gate is a sibling Linear)."""
        return self.gate_kind is GateKind.LINEAR

    def __call__(self, x: mx.array, logits: Optional[mx.array] = None,
                 bias: Optional[mx.array] = None) -> Routing:
        if self.gate_kind is GateKind.WEIGHT:
            logits = x @ self["weight"].T
        elif self.gate_kind is GateKind.NESTED:
            logits = self[self._inner](x)
        if self._own_bias:
            bias = self[self._bias]
        inds, weights = _ROUTE[self.kind](self, logits, bias)
        if self.kind in _WEIGHTS_IN_INPUT_DTYPE:
            weights = weights.astype(x.dtype)
        return Routing(inds, weights, logits)


class MoEBlock(nn.Module):
    """The MoE block of one layer: route, run the k experts (SwitchGLU), combine, add shared.
    `limits`: the layer's clamped-SwiGLU limits (routed, shared); 0 = plain SwiGLU (step3p5)."""

    def __init__(self, a: UniversalArgs, d: ArchDescriptor, limits: tuple[float, float] = (0, 0)):
        super().__init__()
        m, spec = d.moe, a.moe
        n = m.names
        self._m = m
        D = a.hidden
        if m.router.gate is GateKind.LINEAR:
            setattr(self, n.gate, nn.Linear(D, spec.experts, bias=spec.gate_bias))
            setattr(self, n.router, Router(m, spec, D))
            self._router_name = n.router
        else:
            setattr(self, n.gate, Router(m, spec, D))
            self._router_name = n.gate
        setattr(self, n.switch, SwitchGLU(D, spec.size, spec.experts, bias=spec.expert_bias,
                                          names=(n.gate_proj, n.up_proj, n.down_proj),
                                          activation=ClampedSwiGLU(limits[0]) if limits[0] > 0 else None))
        self._shared = m.shared.kind if spec.shared_size is not None else None
        if self._shared is not None:
            setattr(self, n.shared, MLP(a, d, width=spec.shared_size, bias=spec.shared_bias,
                                        limit=limits[1]))
            if self._shared is SharedKind.SIGMOID_GATED:
                setattr(self, n.shared_gate, nn.Linear(D, 1, bias=False))
            elif self._shared is SharedKind.COEFFICIENT:
                setattr(self, n.coefficient, nn.Linear(D, 2))
        # a corrected router's bias held here (Klear, afmoe: float32, never cast by convert)
        self._block_bias = m.router.kind in CORRECTED_ROUTERS and m.router.bias_at is BiasAt.BLOCK
        if self._block_bias:
            setattr(self, n.correction_bias, mx.zeros((spec.experts,), dtype=mx.float32))

    @property
    def router(self) -> Router:
        return self[self._router_name]

    def __call__(self, x: mx.array) -> mx.array:
        m = self._m
        n = m.names
        if m.flat_tokens:  # olmoe routes the flattened tokens
            B, L_, D = x.shape
            x = x.reshape(-1, D)
        logits = self[n.gate](x) if m.router.gate is GateKind.LINEAR else None
        routing = self.router(x, logits, self[n.correction_bias] if self._block_bias else None)
        y = self[n.switch](x, routing.experts)
        y = _COMBINE[m.combine](y, routing.weights)
        if self._shared is SharedKind.PLAIN:
            y = y + self[n.shared](x)
        elif self._shared is SharedKind.SIGMOID_GATED:
            shared = self[n.shared](x)
            shared = mx.sigmoid(self[n.shared_gate](x)) * shared
            y = y + shared
        elif self._shared is SharedKind.COEFFICIENT:  # Klear
            coef = mx.softmax(self[n.coefficient](x), axis=-1, precise=True)
            shared = self[n.shared](x)
            y = y * coef[..., :1] + shared * coef[..., 1:]
        if m.flat_tokens:
            y = y.reshape(B, L_, D)
        return y
