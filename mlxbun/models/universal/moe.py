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

Tensor parallelism (`MoEBlock.shard`, as mlx-lm's MoE blocks with a `sharding_group`): every
expert's hidden units split in place across the ranks, the router replicated, one all-sum of the
block's output after the routed and shared experts are combined.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models.layers import SwigluOAI
from mlxbun.models.sharding import shard_inplace_all
from mlxbun.models.switch_layers import ClampedSwiGLU, ClippedSiLU, SwitchGLU, SwitchMLP
from mlxbun.models.universal.kinds import (
    CORRECTED_ROUTERS,
    BiasAt,
    Combine,
    ExpertKind,
    GateAct,
    GateKind,
    GroupGuard,
    RouterKind,
    ScoreFunc,
    SharedKind,
    TopkMethod,
    TopKRenorm,
    TopKSelect,
    exhaustive,
)
from mlxbun.models.universal.mlp import MLP
from mlxbun.models.universal.moe_args import MoESpec
from mlxbun.models.universal.schema import (
    ArchDescriptor,
)
from mlxbun.models.universal.schema_moe import (
    MoEKnobs,
)
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["Gate", "MoEBlock", "Router", "Routing"]


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


def _softmax_group_greedy(r: "Router", logits, bias):  # deepseek_v2's MoEGate, op for op
    p = r.params
    scores = mx.softmax(logits, axis=-1, precise=True)
    if p["method"] is TopkMethod.GROUP_LIMITED_GREEDY:
        bsz, seq_len = logits.shape[:2]
        scores = scores.reshape(bsz, seq_len, p["n_group"], -1)
        group_scores = scores.max(axis=-1, keepdims=True)
        k = p["n_group"] - p["topk_group"]
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        group_idx = mx.stop_gradient(group_idx)
        scores = mx.put_along_axis(scores, group_idx, mx.array(0.0, scores.dtype), axis=-2)
        scores = scores.reshape(bsz, seq_len, -1)
    k = r.top_k
    inds = mx.stop_gradient(mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k])
    scores = mx.take_along_axis(scores, inds, axis=-1)
    return inds, scores * p["scaling"]


def _topk_softmax(r: "Router", logits, bias):  # mixtral
    inds = mx.stop_gradient(_SELECT[r.select](logits, r.top_k))
    scores = mx.take_along_axis(logits, inds, axis=-1)
    return inds, mx.softmax(scores, axis=-1, precise=True)


def _topk_softmax_f32(r: "Router", logits, bias):  # granitemoe
    inds = mx.stop_gradient(_SELECT[r.select](logits, r.top_k))
    top = mx.take_along_axis(logits, inds, axis=-1)
    return inds, mx.softmax(top.astype(mx.float32), axis=-1)


@mx.compile
def _group_select(gates, e_score_correction_bias, top_k, n_group, topk_group, routed_scaling_factor,
                  norm_topk_prob, k_nonzero_guard, eps_renorm, argsort_ungrouped=False):
    # mlx-lm's group_expert_select, op for op (compiled there too), in its three spellings: glm4_moe
    # groups when n_group > 1, dots1 when n_group - topk_group != 0 (`k_nonzero_guard`), exaone_moe
    # and mimo_v2_flash are glm4_moe's with 1e-20 added to the renormalizing sum (`eps_renorm`);
    # mlx-vlm's kimi_vl copy takes an ungrouped top k by argsort (`argsort_ungrouped`)
    scores = mx.sigmoid(gates.astype(mx.float32))
    orig_scores = scores
    scores = scores + e_score_correction_bias
    k = n_group - topk_group
    grouped = (k != 0) if k_nonzero_guard else (n_group > 1)
    if grouped:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        scores = mx.put_along_axis(scores, mx.stop_gradient(group_idx), mx.array(0.0), axis=-2)
        scores = mx.flatten(scores, -2, -1)
    if argsort_ungrouped and not grouped:
        inds = mx.argsort(scores, axis=-1)[..., -top_k:]
    else:
        inds = mx.argpartition(-scores, kth=top_k - 1, axis=-1)[..., :top_k]
    inds = mx.stop_gradient(inds)
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    if top_k > 1 and norm_topk_prob:
        denominator = scores.sum(axis=-1, keepdims=True)
        scores = scores / (denominator + 1e-20) if eps_renorm else scores / denominator
    scores = scores * routed_scaling_factor
    return inds, scores


@mx.compile
def _mistral4_select(gates, top_k, n_group, topk_group, routed_scaling_factor, norm_topk_prob):
    # mlx-lm's mistral4_expert_select, op for op (compiled there too)
    scores = mx.softmax(gates.astype(mx.float32), axis=-1)
    if n_group > 1:
        scores_grouped = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(scores_grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
        k = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        scores_grouped = mx.put_along_axis(scores_grouped, mx.stop_gradient(group_idx), mx.array(0.0), axis=-2)
        scores_for_choice = mx.flatten(scores_grouped, -2, -1)
    else:
        scores_for_choice = scores
    inds = mx.argpartition(-scores_for_choice, kth=top_k - 1, axis=-1)[..., :top_k]
    inds = mx.stop_gradient(inds)
    selected_scores = mx.take_along_axis(scores, inds, axis=-1)
    if norm_topk_prob:
        denominator = selected_scores.sum(axis=-1, keepdims=True) + 1e-20
        selected_scores = selected_scores / denominator
    selected_scores = selected_scores * routed_scaling_factor
    return inds, selected_scores


def _softmax_grouped(r: "Router", logits, bias):  # mistral4
    p = r.params
    return _mistral4_select(logits, r.top_k, p["n_group"], p["topk_group"], p["scaling"], r.norm_topk)


# the guard as _group_select's k_nonzero_guard flag
_K_NONZERO_GUARD = exhaustive(GroupGuard, {GroupGuard.N_GROUP_GT_1: False, GroupGuard.K_NONZERO: True,
                                           GroupGuard.N_GROUP_GT_1_ARGSORT: False})


def _noaux_tc(r: "Router", logits, bias):  # glm4_moe, dots1, exaone_moe, mimo_v2_flash (deepseek-v3 style)
    p = r.params
    return _group_select(logits, bias, r.top_k, p["n_group"], p["topk_group"], p["scaling"], r.norm_topk,
                         _K_NONZERO_GUARD[r.group_guard], r.renorm is TopKRenorm.SUM_EPS,
                         r.group_guard is GroupGuard.N_GROUP_GT_1_ARGSORT)


@mx.compile
def _grouped_score_select(gates, e_score_correction_bias, top_k, n_group, topk_group,
                          routed_scaling_factor, norm_topk_prob, score_function):
    # bailing_moe.group_expert_select, op for op (compiled there too)
    in_type = gates.dtype
    if score_function == "sigmoid":
        scores = mx.sigmoid(gates.astype(mx.float32))
    else:
        scores = mx.softmax(gates.astype(mx.float32), axis=-1)
    orig_scores = scores
    if e_score_correction_bias is not None:
        scores = scores + e_score_correction_bias
    if n_group > 1:
        scores = mx.unflatten(scores, axis=-1, shape=(n_group, -1))
        group_scores = mx.topk(scores, 2, axis=-1).sum(axis=-1, keepdims=True)
        k = n_group - topk_group
        group_idx = mx.argpartition(group_scores, kth=k - 1, axis=-2)[..., :k, :]
        scores = mx.put_along_axis(scores, mx.stop_gradient(group_idx), mx.array(0.0, scores.dtype),
                                   axis=-2)
        scores = mx.flatten(scores, -2, -1)
    k = top_k
    inds = mx.argpartition(scores, kth=-k, axis=-1)[..., -k:]
    inds = mx.stop_gradient(inds)
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    if top_k > 1 and norm_topk_prob:
        denominator = scores.sum(axis=-1, keepdims=True) + 1e-20
        scores = scores / denominator
    scores = scores * routed_scaling_factor
    return inds, scores.astype(in_type)


def _grouped_score(r: "Router", logits, bias):  # bailing_moe
    p = r.params
    return _grouped_score_select(logits, bias, r.top_k, p["n_group"], p["topk_group"], p["scaling"],
                                 r.norm_topk, p["score"])


@partial(mx.compile, shapeless=True)
def _aggregate_expert_outputs(expert_outputs, scores):  # bailing_moe's, op for op
    return (expert_outputs * scores[..., None]).sum(axis=-2).astype(expert_outputs.dtype)


def _sparsemixer(r: "Router", logits, bias):  # phimoe.sparsemixer, op for op
    gates, jitter_eps = logits, r.params["jitter_eps"]
    masked = gates
    inds, scores = [], []
    for _ in range(r.top_k):
        top = masked.max(axis=-1, keepdims=True)
        ind = mx.stop_gradient(mx.argmax(masked, axis=-1, keepdims=True))
        factor = mx.maximum(mx.abs(gates), top)
        band = mx.where((top - gates) / factor > 2 * jitter_eps, -mx.inf, masked)
        band = mx.softmax(band, axis=-1, precise=True)
        scores.append(mx.take_along_axis(band, ind, axis=-1))
        inds.append(ind)
        masked = mx.put_along_axis(masked, ind, mx.array(-mx.inf, masked.dtype), axis=-1)
    return mx.concatenate(inds, axis=-1), mx.concatenate(scores, axis=-1)


# f32_act_topk's activation: a module of the MoE block, as in mlx-lm's tree (nn's compiled
# softmax / sigmoid); the Router calls the same instance, so taps see it at the block's path
_GATE_ACT = exhaustive(GateAct, {GateAct.SOFTMAX: nn.Softmax, GateAct.SIGMOID: nn.Sigmoid})
_ACT_ROUTERS = (RouterKind.F32_ACT_TOPK,)


def _f32_act_topk(r: "Router", logits, bias):  # ernie4_5_moe
    gates = r.gate_act(logits.astype(mx.float32))
    inds = mx.stop_gradient(_SELECT[r.select](gates, r.top_k))
    scores = mx.take_along_axis(gates, inds, axis=-1)
    return inds, scores / mx.maximum(scores.sum(axis=-1, keepdims=True), 1e-12)


def _sigmoid_corrected(r: "Router", logits, bias):  # minimax (the cast to x's dtype: Router)
    scores = mx.sigmoid(logits)
    orig_scores = scores
    scores = scores + bias
    inds = mx.stop_gradient(_SELECT[r.select](scores, r.top_k))
    scores = mx.take_along_axis(orig_scores, inds, axis=-1)
    return inds, scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-20)


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


def _sigmoid_scaled(r: "Router", logits, bias):  # lfm2_moe (the cast to x's dtype: Router)
    routing_weights = mx.sigmoid(logits)
    k = r.top_k
    chosen_by = routing_weights if bias is None else routing_weights.astype(mx.float32) + bias
    inds = mx.stop_gradient(_SELECT[r.select](chosen_by, k))
    scores = mx.take_along_axis(routing_weights, inds, axis=-1)
    if r.norm_topk:
        scores = scores / (mx.sum(scores, axis=-1, keepdims=True) + 1e-6)
    return inds, scores * r.params["scaling"]


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


_SCORE = exhaustive(ScoreFunc, {ScoreFunc.SIGMOID: mx.sigmoid,
                                ScoreFunc.SQRTSOFTPLUS: lambda logits: mx.sqrt(nn.softplus(logits))})


def _capped_score(r: "Router", logits, bias):  # laguna.MoEGate, op for op
    logits = logits.astype(mx.float32)
    softcap = r.params["softcap"]
    if softcap > 0.0:
        logits = mx.tanh(logits / softcap) * softcap
    scores = _SCORE[r.params["score_fn"]](logits)
    scores_for_selection = scores + bias
    inds = mx.argpartition(-scores_for_selection, kth=r.top_k - 1, axis=-1)[..., :r.top_k]
    inds = mx.stop_gradient(inds)
    weights = mx.take_along_axis(scores, inds, axis=-1)
    return inds, weights / weights.sum(axis=-1, keepdims=True)


# (router, gate logits, correction bias or None) -> (experts, weights). A new kind: its enum
# member (kinds.RouterKind), the numbers it reads (kinds.ROUTER_PARAMS, then `r.params[name]`
# here), its function here, its lines in explain_moe.py.
_ROUTE = exhaustive(RouterKind, {
    RouterKind.SOFTMAX_TOPK: _softmax_topk,
    RouterKind.TOPK_SOFTMAX: _topk_softmax,
    RouterKind.TOPK_SOFTMAX_F32: _topk_softmax_f32,
    RouterKind.NOAUX_TC: _noaux_tc,
    RouterKind.GROUPED_SCORE: _grouped_score,
    RouterKind.SPARSEMIXER: _sparsemixer,
    RouterKind.F32_ACT_TOPK: _f32_act_topk,
    RouterKind.SIGMOID_CORRECTED: _sigmoid_corrected,
    RouterKind.SIGMOID_EPS: _sigmoid_eps,
    RouterKind.SIGMOID_BIASED: _sigmoid_biased,
    RouterKind.SIGMOID_SCALED: _sigmoid_scaled,
    RouterKind.SCORED_GROUPED: _scored_grouped,
    RouterKind.CAPPED_SCORE: _capped_score,
    RouterKind.SOFTMAX_GROUP_GREEDY: _softmax_group_greedy,
    RouterKind.SOFTMAX_GROUPED: _softmax_grouped,
})
# the router kinds whose weights end cast to the block input's dtype, `weights.astype(x.dtype)`
# (minimax; Klear: scores.astype(x.dtype))
_CAST_TO_INPUT = (RouterKind.SIGMOID_CORRECTED, RouterKind.SIGMOID_BIASED, RouterKind.SIGMOID_SCALED)

# the experts' activation module, given the layer's routed clamp limit (None: SwitchGLU's shared
# SwiGLU, as mlx-lm's default argument)
_ACTIVATION = exhaustive(ExpertKind, {
    ExpertKind.GLU: lambda limit: ClampedSwiGLU(limit) if limit > 0 else None,  # step3p5: clamped
    ExpertKind.MLP_RELU2: lambda limit: nn.ReLU2(),  # nemotron_h's SwitchMLP
    ExpertKind.MLP_GELU_APPROX: lambda limit: nn.GELU(approx="precise"),  # phixtral's SwitchMLP
    ExpertKind.GLU_OAI: lambda limit: SwigluOAI(),  # gpt_oss: one instance per block, as its MLPBlock
    ExpertKind.GLU_CLIPPED: lambda limit: ClippedSiLU(),  # mlx-vlm's kimi_vl
})

_COMBINE = exhaustive(Combine, {
    Combine.SUM: lambda y, s: (y * s[..., None]).sum(axis=-2),
    Combine.SUM_CAST: lambda y, s: (y * s[..., None]).sum(axis=-2).astype(y.dtype),
    Combine.F32_SUM_CAST: lambda y, s: (y * s[..., None].astype(mx.float32)).sum(axis=-2).astype(y.dtype),
    Combine.SUM_CAST_COMPILED: _aggregate_expert_outputs,
    Combine.SUM_CAST_INPUT: lambda y, s: (y * s[..., None]).sum(axis=-2),  # the block casts to x's dtype
})


# ----------------------------------------------------------------- modules


# the gate kinds whose logits a sibling module computes (the Router is then mlxbun-only)
_SIBLING_GATE = (GateKind.LINEAR, GateKind.WRAPPED)


class Gate(nn.Module):
    """GateKind.WRAPPED: hunyuan's Gate, a module holding the router Linear, returning its logits."""

    def __init__(self, hidden: int, experts: int, bias: bool, inner: str):
        super().__init__()
        self._inner = inner
        setattr(self, inner, nn.Linear(hidden, experts, bias=bias))

    def __call__(self, x: mx.array) -> mx.array:
        return self[self._inner](x)


class Router(nn.Module):
    """Gate logits -> `Routing`. Holds the gate's parameters unless a sibling computes the
    logits (GateKind.LINEAR, WRAPPED), which the block then passes in."""

    def __init__(self, m: MoEKnobs, spec: MoESpec, hidden: int):
        super().__init__()
        r, n = m.router, m.names
        self.kind, self.select, self.gate_kind, self.group_guard = r.kind, r.select, r.gate, r.group_guard
        self.renorm = r.renorm
        self.top_k, self.norm_topk = spec.top_k, spec.norm_topk
        self.n_experts = spec.experts
        object.__setattr__(self, "params", spec.params)  # numbers, outside the module tree
        self._inner, self._bias = n.gate_inner, n.correction_bias
        if r.gate is GateKind.WEIGHT:
            self.weight = mx.zeros((spec.experts, hidden))
        elif r.gate is GateKind.NESTED:
            setattr(self, n.gate_inner, nn.Linear(hidden, spec.experts, bias=spec.gate_bias))
        # the correction bias on this module, or (BiasAt.BLOCK) on the block, which passes it in
        self._own_bias = r.kind in CORRECTED_ROUTERS and spec.corrected and r.bias_at is BiasAt.ROUTER
        if self._own_bias:
            setattr(self, n.correction_bias, mx.zeros((spec.experts,)))

    @property
    def observer(self) -> bool:
        """True when mlx-lm's tree has no module here (the gate is a sibling module)."""
        return self.gate_kind in _SIBLING_GATE

    def __call__(self, x: mx.array, logits: Optional[mx.array] = None,
                 bias: Optional[mx.array] = None) -> Routing:
        """`logits` come from the block when the gate is a sibling module; `bias` when the block
        holds the correction bias (BiasAt.BLOCK)."""
        if self.gate_kind is GateKind.WEIGHT:
            logits = x @ self["weight"].T
        elif self.gate_kind is GateKind.NESTED:
            logits = self[self._inner](x)
        if self._own_bias:
            bias = self[self._bias]
        inds, weights = _ROUTE[self.kind](self, logits, bias)
        if self.kind in _CAST_TO_INPUT:
            weights = weights.astype(x.dtype)
        return Routing(inds, weights, logits)


class MoEBlock(nn.Module):
    """The MoE block of one layer: route, run the k experts (SwitchGLU), combine, add shared.
    `limits`: the layer's clamped-SwiGLU limits (routed, shared); 0 = plain SwiGLU (step3p5)."""

    _tensor_group = None  # set by shard(): the group the block's output is all-summed over

    def __init__(self, a: UniversalArgs, d: ArchDescriptor, layer: int,
                 limits: tuple[float, float] = (0, 0)):
        super().__init__()
        m, spec = d.moe, a.moe.at(layer)
        n = m.names
        self._m = m
        D = a.hidden
        if m.router.gate in _SIBLING_GATE:
            setattr(self, n.gate, nn.Linear(D, spec.experts, bias=spec.gate_bias)
                    if m.router.gate is GateKind.LINEAR
                    else Gate(D, spec.experts, spec.gate_bias, n.gate_inner))
            setattr(self, n.router, Router(m, spec, D))
            self._router_name = n.router
        else:
            setattr(self, n.gate, Router(m, spec, D))
            self._router_name = n.gate
        # a corrected router's bias held here, beside the gate / router (minimax; Klear, afmoe:
        # float32)
        self._block_bias = (m.router.kind in CORRECTED_ROUTERS and spec.corrected
                            and m.router.bias_at is BiasAt.BLOCK)
        if self._block_bias:
            setattr(self, n.correction_bias, mx.zeros((spec.experts,), dtype=mx.float32))
        if m.router.kind in _ACT_ROUTERS:  # ernie: the activation module sits on the block
            act = _GATE_ACT[spec.params["act"]]()
            setattr(self, n.gate_act, act)
            object.__setattr__(self.router, "gate_act", act)  # outside the router's tree
        act = _ACTIVATION[m.expert](limits[0])
        setattr(self, n.switch, SwitchMLP(D, spec.size, spec.experts, act, bias=spec.expert_bias,
                                          names=(n.up_proj, n.down_proj))
                if m.expert in (ExpertKind.MLP_RELU2, ExpertKind.MLP_GELU_APPROX) else
                SwitchGLU(D, spec.size, spec.experts, bias=spec.expert_bias,
                          names=(n.gate_proj, n.up_proj, n.down_proj), activation=act))
        self._shared = m.shared.kind if spec.shared_size is not None else None
        self._routed_scale = a.fields[m.shared.scale] if m.shared is not None and m.shared.scale else None
        if self._shared is not None:
            setattr(self, n.shared, MLP(a, d, width=spec.shared_size, bias=spec.shared_bias,
                                        limit=limits[1]))
            if self._shared is SharedKind.SIGMOID_GATED:
                setattr(self, n.shared_gate, nn.Linear(D, 1, bias=False))
            elif self._shared is SharedKind.COEFFICIENT:
                setattr(self, n.coefficient, nn.Linear(D, 2))

    @property
    def router(self) -> Router:
        return self[self._router_name]

    def shard(self, group, where: str = "mlp") -> None:
        """Split across `group` as mlx-lm's Model.shard splits an MoE block (its `sharding_group`):
        every routed expert's hidden units, and the shared expert's, in place (gate / up
        all-to-sharded, down sharded-to-all; a down bias divided by the group size, as gpt_oss's);
        the router, its gate and the shared expert's gate / coefficient replicated. The block then
        all-sums once, after the routed and shared outputs are combined. Every split is checked
        before any weight moves (ShardingError names the path and the sizes)."""
        n = self._m.names
        parts = [(n.switch, self.fused_experts())]
        if self._shared is not None:
            parts.append((n.shared, self[n.shared]))
        shard_inplace_all([(f"{where}.{name}.{child}", part[child], sharding, segments)
                           for name, part in parts for child, sharding, segments in part.split_pieces()],
                          group)
        self._tensor_group = group

    def fused_experts(self) -> SwitchGLU | SwitchMLP:
        """The fused routed experts (all of them; a token reads `router.top_k` of each tensor's rows).
        A method, not a property: mlx-lm names the module itself "experts" in some files."""
        return self[self._m.names.switch]

    def route(self, x: mx.array) -> Routing:
        """The experts each token goes to and their weights (the gate, then the router)."""
        m = self._m
        logits = bias = None
        if m.router.gate in _SIBLING_GATE:
            logits = self[m.names.gate](x.astype(mx.float32) if m.router.gate_f32 else x)
        if self._block_bias:
            bias = self[m.names.correction_bias]
        return self.router(x, logits, bias)

    def __call__(self, x: mx.array) -> mx.array:
        m = self._m
        n = m.names
        if m.flat_tokens:  # olmoe routes the flattened tokens
            B, L_, D = x.shape
            x = x.reshape(-1, D)
        routing = self.route(x)
        y = self[n.switch](x, routing.experts)
        y = _COMBINE[m.combine](y, routing.weights)
        if m.combine is Combine.SUM_CAST_INPUT:  # laguna
            y = y.astype(x.dtype)
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
        elif self._shared is SharedKind.ROUTED_SCALED:  # laguna
            y = y * self._routed_scale + self[n.shared](x)
        if self._tensor_group is not None:  # where mlx-lm's blocks all-sum: after routed + shared
            y = mx.distributed.all_sum(y, group=self._tensor_group)
        if m.flat_tokens:
            y = y.reshape(B, L_, D)
        return y
