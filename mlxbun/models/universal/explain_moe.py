"""The MoE part of `mlxbun explain`: the block's sizes, its forward line by line, and the label
each layer gets (MoE or dense). `explain.py` places them; a new router kind, combine, shared
kind or layer rule adds its text here (the tables are checked exhaustive at import).
Lines are (code, note) pairs; explain.py makes them its `Line`s."""

from __future__ import annotations

from typing import Any

from mlxbun.models.universal.kinds import (
    BiasAt,
    Combine,
    ExpertKind,
    GateAct,
    GateKind,
    GroupGuard,
    MoeLayers,
    RouterKind,
    ScoreFunc,
    SharedKind,
    SharedSize,
    SharedWhen,
    TopkMethod,
    TopKRenorm,
    TopKSelect,
    exhaustive,
)
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, UniversalArgs


def Line(code: str, note: str = "") -> tuple[str, str]:  # noqa: N802 (explain.Line's shape)
    return code, note

__all__ = ["moe_layer_label", "moe_lines", "moe_sizes", "moe_title"]

_SELECT = exhaustive(TopKSelect, {
    TopKSelect.NEG_FIRST: "argpartition(-{s}, kth=k - 1)[..., :k]",
    TopKSelect.LAST: "argpartition({s}, kth=-k)[..., -k:]",
})

_COMBINE = exhaustive(Combine, {
    Combine.SUM: "y = (y * w[..., None]).sum(axis=-2)",
    Combine.SUM_CAST: "y = (y * w[..., None]).sum(axis=-2).astype(y.dtype)",
    Combine.F32_SUM_CAST: "y = (y * w[..., None].astype(float32)).sum(axis=-2).astype(y.dtype)",
    Combine.SUM_CAST_COMPILED: "y = (y * w[..., None]).sum(axis=-2).astype(y.dtype)",
    Combine.SUM_CAST_INPUT: "y = (y * w[..., None]).sum(axis=-2).astype(x.dtype)",
})

_GLU = exhaustive(ExpertKind, {
    ExpertKind.GLU: "{d}(silu({g}(x)) * {u}(x))",
    ExpertKind.MLP_RELU2: "{d}(relu2({u}(x)))",
    ExpertKind.MLP_GELU_APPROX: "{d}(gelu_approx({u}(x)))",
    ExpertKind.GLU_OAI: "{d}((clip({u}(x), -7, 7) + 1) * g * sigmoid(1.702 * g)), g = min({g}(x), 7)",
    ExpertKind.GLU_CLIPPED: "{d}(clip(silu({g}(x)), -100, 100) * {u}(x))",
})

_LAYER_RULE = exhaustive(MoeLayers, {
    MoeLayers.ALL: "every layer",
    MoeLayers.SPARSE_STEP: "i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0",
    MoeLayers.FIRST_K_DENSE: "i >= first_k_dense_replace",
    MoeLayers.FIRST_K_DENSE_FREQ: "i >= first_k_dense_replace and i % moe_layer_freq == 0",
    MoeLayers.IS_MOE_LAYER: "is_moe_layer[i]",
    MoeLayers.NOT_SINGLE_EXPERT: "every layer unless the expert count is 1",
    MoeLayers.START_END_INTERVAL: "(i + 1) % moe_layer_interval == 0 and moe_layer_start_index <= "
                                  "i <= moe_layer_end_index (null: the last layer)",
    MoeLayers.NUM_DENSE: "i >= num_dense_layers",
    MoeLayers.ENUM_STRING: "i in moe_layers_enum (unset: every layer but 0)",
    MoeLayers.FREQ_LIST: "moe_layer_freq[i] == 1",
    MoeLayers.MLP_LAYER_TYPES: "mlp_layer_types[i] == \"sparse\"",
    MoeLayers.PATTERN_E: "hybrid_override_pattern[i] == \"E\"",
    MoeLayers.OFFSET_PERIOD: "experts > 1 and (i + expert_layer_offset) % expert_layer_period == 0",
})

_RENORM = exhaustive(TopKRenorm, {TopKRenorm.SUM: " / sum", TopKRenorm.SUM_EPS: " / (sum + 1e-20)"})

_SHARED_WHEN = exhaustive(SharedWhen, {SharedWhen.NOT_NONE: "is null",
                                       SharedWhen.POSITIVE: "is null or 0",
                                       SharedWhen.POSITIVE_INT: "is 0"})


def moe_sizes(d: ArchDescriptor, a: UniversalArgs) -> tuple[tuple[str, str, Any], ...]:
    """E, k, Ie (and Is, the shared expert's width) for the sizes header."""
    m, spec = d.moe, a.moe
    if m is None or spec is None:
        return ()
    if m.per_layer:  # int or per-layer list: each MoE layer's own numbers are in the layers
        listed = " / ".join(f for f in (m.top_k, m.size, m.shared.count if m.shared else None) if f)
        return (("E", m.experts, spec.experts),
                ("k / Ie / Is", f"{listed} (int or per-layer list)", "per layer, see layers"))
    size_src = f"{m.size} or {m.size_fallback}" if m.size_fallback else m.size
    sizes = (("E", m.experts, spec.experts), ("k", m.top_k, spec.top_k), ("Ie", size_src, spec.size))
    if spec.shared_size is not None:
        sh = m.shared
        src = {SharedSize.MOE_TIMES_N: f"{m.size} * {sh.count}",
               SharedSize.SHARED_OR_MOE_TIMES_N: f"(moe_shared_expert_intermediate_size or {m.size}) "
                                                 f"* {sh.count}"}.get(sh.size, sh.size)
        sizes += (("Is", src, spec.shared_size),)
    return sizes


def moe_title(d: ArchDescriptor) -> str:
    n = d.names
    return f"mlp ({n.root}.{n.layers}[i].{d.moe.names.block or n.mlp}): mixture of experts"


def _router_lines(d: ArchDescriptor, a: UniversalArgs):
    m, spec = d.moe, a.moe
    r, n = m.router, m.names
    where = {GateKind.LINEAR: f"{n.gate}(x.astype(float32))" if r.gate_f32 else f"{n.gate}(x)",
             GateKind.WEIGHT: f"x @ {n.gate}.weight.T",
             GateKind.NESTED: f"{n.gate}.{n.gate_inner}(x)",
             GateKind.WRAPPED: f"{n.gate}(x)"}[r.gate]
    note = {GateKind.LINEAR: f"Linear(D, E), bias={spec.gate_bias}; routed in {n.router} "
                             f"(parameter-free, mlxbun only: taps read routing there)",
            GateKind.WEIGHT: f"{n.gate} is the router module, weight [E, D] (never quantized)",
            GateKind.WRAPPED: f"{n.gate} a module returning {n.gate_inner}(x), {n.gate_inner} "
                              f"Linear(D, E), bias={spec.gate_bias}; routed in {n.router} "
                              f"(parameter-free, mlxbun only: taps read routing there)",
            GateKind.NESTED: f"{n.gate} is the router module, {n.gate_inner} Linear(D, E), "
                             f"bias={spec.gate_bias}"}[r.gate]
    yield Line(f"logits = {where}", note)
    renorm = (f"; renormalized ({r.norm_topk} = {spec.norm_topk})" if isinstance(r.norm_topk, str)
              else "; renormalized" if spec.norm_topk else "")
    if r.kind is RouterKind.SOFTMAX_TOPK:
        yield Line("p = softmax(logits, precise=True)")
        yield Line(f"experts = {_SELECT[r.select].format(s='p')}", "the order the outputs are summed in")
        yield Line("w = take_along_axis(p, experts)" + (" / sum" if spec.norm_topk else ""),
                   "top-k probabilities" + renorm)
    elif r.kind in (RouterKind.TOPK_SOFTMAX, RouterKind.TOPK_SOFTMAX_F32):
        yield Line(f"experts = {_SELECT[r.select].format(s='logits')}", "top-k of the raw logits")
        yield Line("w = softmax(take_along_axis(logits, experts)"
                   + (".astype(float32))" if r.kind is RouterKind.TOPK_SOFTMAX_F32 else ", precise=True)"),
                   "softmax over the k chosen only")
    elif r.kind is RouterKind.GROUPED_SCORE:
        yield from _grouped_score_lines(d, a, renorm)
    elif r.kind is RouterKind.SOFTMAX_GROUP_GREEDY:
        p = spec.params
        yield Line("p = softmax(logits, precise=True)")
        if p["method"] is TopkMethod.GROUP_LIMITED_GREEDY:
            yield Line("p: zero the n_group - topk_group groups with the lowest max",
                       f"n_group = {p['n_group']}, topk_group = {p['topk_group']}")
        yield Line("experts = argpartition(-p, kth=k - 1)[..., :k]", "the order the outputs are summed in")
        yield Line("w = take_along_axis(p, experts) * scaling",
                   f"{r.params['scaling']} = {p['scaling']}; {r.params['method']} = {p['method'].value!r}; "
                   f"never renormalized")
    elif r.kind is RouterKind.SOFTMAX_GROUPED:
        p = spec.params
        yield Line("p = softmax(logits.astype(float32))", "compiled with the rest of the selection")
        if p["n_group"] > 1:
            yield Line("p: zero the n_group - topk_group groups with the lowest top-2 sums (for the choice)",
                       f"n_group = {p['n_group']}, topk_group = {p['topk_group']}")
        yield Line("experts = argpartition(-p, kth=k - 1)[..., :k]", "the order the outputs are summed in")
        yield Line("w = take_along_axis(p, experts)" + (" / (sum + 1e-20)" if spec.norm_topk else ""),
                   f"the ungrouped softmax{renorm} (no k > 1 guard)")
        yield Line(f"w = w * {r.params['scaling']}", f"= {p['scaling']}")
    elif r.kind is RouterKind.SPARSEMIXER:
        eps = spec.params["jitter_eps"]
        yield Line("masked = logits; for each of the k rounds:",
                   f"sparsemixer (inference path); jitter_eps = {r.params['jitter_eps']} = {eps}")
        yield Line("  e = argmax(masked); top = max(masked)", "the round's expert, in pick order")
        yield Line("  band = where((top - logits) / maximum(|logits|, top) > 2 * jitter_eps, -inf, masked)",
                   "only the logits near the round's max stay")
        yield Line("  w_e = softmax(band, precise=True)[e]; masked[e] = -inf",
                   "weights not renormalized")
    elif r.kind is RouterKind.F32_ACT_TOPK:
        act = spec.params["act"]
        module = "nn.Softmax()" if act is GateAct.SOFTMAX else "nn.Sigmoid()"
        yield Line(f"p = {n.gate_act}(logits.astype(float32))",
                   f"{module} (compiled, not precise); {r.params['act']} = {act.value!r}")
        yield Line(f"experts = {_SELECT[r.select].format(s='p')}", "the order the outputs are summed in")
        yield Line("w = take_along_axis(p, experts); w = w / maximum(w.sum(), 1e-12)",
                   "always renormalized (float32 weights)")
    elif r.kind is RouterKind.SIGMOID_CORRECTED:
        on = n.gate if r.bias_at is BiasAt.ROUTER else "the MoE block"
        yield Line("s = sigmoid(logits)", f"{n.correction_bias} [E] on {on} (kept float32)")
        yield Line(f"experts = {_SELECT[r.select].format(s=f'(s + {n.correction_bias})')}",
                   "the bias steers the choice, not the weights")
        yield Line("w = take_along_axis(s, experts); w = w / (w.sum() + 1e-20)", "always renormalized")
        yield Line("w = w.astype(x.dtype)")
    elif r.kind is RouterKind.SIGMOID_EPS:
        yield Line("s = sigmoid(logits.astype(float32))",
                   f"compiled with the rest of the selection; {n.correction_bias} [E] on {n.gate}")
        yield Line(f"experts = argpartition(-(s + {n.correction_bias}), kth=k - 1)[..., :k]",
                   "the bias steers the choice, not the weights")
        yield Line("w = take_along_axis(s, experts)" + (" / (sum + 1e-20)" if spec.norm_topk else ""),
                   f"sigmoid scores{renorm} (no k > 1 guard)")
        yield Line(f"w = w * {r.params['scaling']}", f"= {spec.params['scaling']}")
    elif r.kind is RouterKind.SIGMOID_BIASED:
        yield Line("s = sigmoid(logits.astype(float32))", f"{n.correction_bias} [E] float32, on the block")
        yield Line(f"experts = argpartition(-(s + {n.correction_bias}), kth=k - 1)[..., :k]",
                   "the bias steers the choice, not the weights")
        yield Line("w = take_along_axis(s, experts)" + (" / sum" if spec.norm_topk else ""),
                   f"sigmoid scores{renorm} (no k > 1 guard)")
        yield Line("w = w.astype(x.dtype)", "the weights in the block input's dtype")
    elif r.kind is RouterKind.SIGMOID_SCALED:
        sel = _SELECT[r.select]
        yield Line("s = sigmoid(logits)", "in the logits' dtype")
        yield Line(f"experts = {sel.format(s=f's.astype(float32) + {n.correction_bias}')}" if spec.corrected
                   else f"experts = {sel.format(s='s')}",
                   f"{n.correction_bias} [E] float32, on the block: the bias steers the choice, not the "
                   "weights" if spec.corrected else f"{r.corrected} = False: no expert bias")
        yield Line("w = take_along_axis(s, experts)" + (" / (sum + 1e-6)" if spec.norm_topk else ""),
                   f"sigmoid scores{renorm}")
        yield Line(f"w = (w * {r.params['scaling']}).astype(x.dtype)", f"= {spec.params['scaling']}")
    elif r.kind is RouterKind.SCORED_GROUPED:
        p = spec.params
        fn = "sigmoid" if p["score_func"] == "sigmoid" else "softmax"
        bias_on = n.gate if r.bias_at is BiasAt.ROUTER else "the block"
        yield Line(f"s = {fn}(logits.astype(float32))", f"{r.params['score_func']} = "
                   f"{p['score_func']!r} (anything but 'sigmoid' is softmax); not compiled")
        yield Line(f"sel = s + {n.correction_bias}", f"{n.correction_bias} [E] on {bias_on}; "
                   "the bias steers the choice, not the weights")
        yield Line("sel: zero all but the topk_group best groups", f"if n_group > 1: n_group = "
                   f"{p['n_group']}, topk_group = {p['topk_group']}, a group's score = its top-2 sum")
        yield Line("experts = argpartition(-sel, kth=k - 1)[..., :k]")
        yield Line("w = take_along_axis(s, experts)" + (" / sum" if spec.norm_topk and spec.top_k > 1 else ""),
                   f"the k scores{renorm if spec.top_k > 1 else ''}")
        yield Line(f"w = w * {r.params['scaling']}", f"= {p['scaling']}")
    elif r.kind is RouterKind.CAPPED_SCORE:
        p = spec.params
        fn = "sigmoid(logits)" if p["score_fn"] is ScoreFunc.SIGMOID else "sqrt(softplus(logits))"
        yield Line("logits = logits.astype(float32)")
        if p["softcap"] > 0.0:
            yield Line("logits = tanh(logits / c) * c", f"c = {r.params['softcap']} = {p['softcap']}")
        yield Line(f"s = {fn}", f"{r.params['score_fn']} = {p['score_fn'].value!r}; "
                                f"{n.correction_bias} [E] on {n.gate} (kept float32)")
        yield Line(f"experts = argpartition(-(s + {n.correction_bias}), kth=k - 1)[..., :k]",
                   "the bias steers the choice, not the weights")
        yield Line("w = take_along_axis(s, experts) / sum", "always renormalized; not compiled")
    else:  # RouterKind.NOAUX_TC
        guard = {GroupGuard.N_GROUP_GT_1: "n_group > 1", GroupGuard.N_GROUP_GT_1_ARGSORT: "n_group > 1",
                 GroupGuard.K_NONZERO: "n_group != topk_group"}[r.group_guard]
        yield Line("s = sigmoid(logits.astype(float32))",
                   f"compiled with the rest of the selection; {n.correction_bias} [E] on {n.gate}")
        yield Line(f"sel = s + {n.correction_bias}", "the bias steers the choice, not the weights")
        p = spec.params
        yield Line("sel: zero all but the topk_group best groups", f"if {guard}: n_group = {p['n_group']}, "
                   f"topk_group = {p['topk_group']}, a group's score = its top-2 sum")
        yield Line("experts = argpartition(-sel, kth=k - 1)[..., :k]",
                   "ungrouped: argsort(sel)[..., -k:]" if r.group_guard is GroupGuard.N_GROUP_GT_1_ARGSORT else "")
        yield Line("w = take_along_axis(s, experts)"
                   + (_RENORM[r.renorm] if spec.norm_topk and spec.top_k > 1 else ""),
                   f"sigmoid scores{renorm if spec.top_k > 1 else ''}")
        yield Line(f"w = w * {r.params['scaling']}", f"= {spec.params['scaling']}")


def _grouped_score_lines(d: ArchDescriptor, a: UniversalArgs, renorm: str):
    m, spec = d.moe, a.moe
    r, n, p = m.router, m.names, spec.params
    score = "sigmoid(logits.astype(float32))" if p["score"] == "sigmoid" else \
        "softmax(logits.astype(float32))"
    yield Line(f"s = {score}", f"{r.params['score']} = {p['score']!r}; compiled with the rest of "
                               "the selection")
    if spec.corrected:
        yield Line(f"sel = s + {n.correction_bias}", f"[E] on {n.gate}; the bias steers the choice, "
                                                      "not the weights")
    else:
        yield Line("sel = s", f"no correction bias ({r.corrected} = False)")
    yield Line("sel: zero all but the topk_group best groups", f"if n_group > 1: n_group = "
               f"{p['n_group']}, topk_group = {p['topk_group']}, a group's score = its top-2 sum")
    yield Line("experts = argpartition(sel, kth=-k)[..., -k:]")
    yield Line("w = take_along_axis(s, experts)"
               + (" / (sum + 1e-20)" if spec.norm_topk and spec.top_k > 1 else ""),
               f"scores{renorm if spec.top_k > 1 else ''}")
    yield Line(f"w = (w * {r.params['scaling']}).astype(logits.dtype)", f"= {p['scaling']}")


def moe_lines(d: ArchDescriptor, a: UniversalArgs):
    """The MoE block's forward, mlx-lm style."""
    m, spec = d.moe, a.moe
    n = m.names
    if m.flat_tokens:
        yield Line("x = x.reshape(-1, D)", "tokens routed flattened; the sum is reshaped back")
    yield from _router_lines(d, a)
    fused = "SwitchMLP" if m.expert in (ExpertKind.MLP_RELU2, ExpertKind.MLP_GELU_APPROX) else "SwitchGLU"
    yield Line(f"y = {n.switch}(x, experts)",
               f"{fused}: {_GLU[m.expert].format(g=n.gate_proj, u=n.up_proj, d=n.down_proj)} per "
               f"chosen expert, [E, Ie, D] weights, bias={spec.expert_bias}; gather_mm (gather_qmm "
               f"quantized), tokens sorted by expert from 64 picks")
    if d.swiglu_clamp is not None:
        limits = sorted({s.swiglu_limits for s in a.layers if s.moe})
        yield Line("(clamped SwiGLU where swiglu_limits[i] > 0: min(silu(gate), l) * clip(up, -l, l))",
                   f"(routed, shared) limits on the MoE layers: {limits}; the shared expert "
                   f"reads swiglu_limits_shared[i]")
    yield Line(_COMBINE[m.combine],
               "compiled, shapeless (as mlx-lm)" if m.combine is Combine.SUM_CAST_COMPILED else "")
    if spec.shared_size is not None:
        if m.shared.kind is SharedKind.PLAIN:
            yield Line(f"y = y + {n.shared}(x)", f"a dense MLP of width Is; bias={spec.shared_bias}")
        elif m.shared.kind is SharedKind.SIGMOID_GATED:
            yield Line(f"y = y + sigmoid({n.shared_gate}(x)) * {n.shared}(x)",
                       f"{n.shared}: a dense MLP of width Is; {n.shared_gate} Linear(D, 1)")
        elif m.shared.kind is SharedKind.ROUTED_SCALED:
            yield Line(f"y = y * {m.shared.scale} + {n.shared}(x)",
                       f"{m.shared.scale} = {a.fields[m.shared.scale]}; {n.shared}: a dense MLP of "
                       f"width Is; bias={spec.shared_bias}")
        else:  # SharedKind.COEFFICIENT
            yield Line(f"c = softmax({n.coefficient}(x), precise=True)",
                       f"{n.coefficient} Linear(D, 2) with bias: the routed / shared mix")
            yield Line(f"y = y * c[..., :1] + {n.shared}(x) * c[..., 1:]",
                       f"{n.shared}: a dense MLP of width Is; bias={spec.shared_bias}")
    elif m.shared is not None:
        yield Line("(no shared expert)", f"{m.shared.when} {_SHARED_WHEN[m.shared.when_rule]}")
    dense = not all(s.moe for s in a.layers)
    yield Line("routed on: " + _LAYER_RULE[m.layers],
               "the other layers run the dense mlp above" if dense else "")


def moe_layer_label(d: ArchDescriptor, a: UniversalArgs, spec: LayerSpec) -> str:
    """'' for a row without MoE, else what the layer's mlp is."""
    if d.moe is None:
        return ""
    if spec.moe:
        moe = a.moe.at(spec.index)
        if not d.moe.per_layer:
            return f"MoE ({moe.experts} experts, top {moe.top_k})"
        shared = f", Is {moe.shared_size}" if moe.shared_size is not None else ""
        return f"MoE ({moe.experts} experts, top {moe.top_k}, Ie {moe.size}{shared})"
    return "dense mlp"
