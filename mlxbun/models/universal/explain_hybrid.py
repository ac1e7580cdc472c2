"""The hybrid part of `mlxbun explain`: the recurrent mixer's forward line by line and the label
each of its layers gets. `explain.py` places them; a new mixer kind adds its lines here (the
table is checked exhaustive at import). Lines are (code, note) pairs, as explain_moe's."""

from __future__ import annotations

from typing import Any

from mlxbun.models.universal.kinds import (
    exhaustive,
)
from mlxbun.models.universal.kinds_hybrid import (
    HybridBlock,
    MixerKind,
)
from mlxbun.models.universal.mixers import MIXERS
from mlxbun.models.universal.mixers.gated_delta import GdnProjections
from mlxbun.models.universal.mixers.mamba2 import GatedNorm
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, UniversalArgs

__all__ = ["hybrid_lines", "hybrid_title", "mixer_label", "parallel_block", "single_block"]


def _short_conv(d: ArchDescriptor, a: UniversalArgs, knobs: Any) -> list[tuple[str, str]]:
    k, bias = a.fields[knobs.kernel], bool(a.fields[knobs.bias])
    return [
        ("B, C, x = split(in_proj(x), 3)", f"Linear(D, 3*D); bias={bias}"),
        ("Bx = where(mask, B * x, 0)", "mask: the ssm mask (batch padding), None otherwise"),
        ("Bx = concat([state, Bx]); state = Bx[:, -(K - 1):]",
         f"K = {knobs.kernel} = {k}; state starts at zeros; cache slot 0"),
        ("y = C * conv(Bx)", f"Conv1d(D, D, K, groups=D) (depthwise, causal); bias={bias}"),
        ("out = out_proj(y)", f"Linear(D, D); bias={bias}"),
    ]


def _gated_delta(d: ArchDescriptor, a: UniversalArgs, knobs: Any) -> list[tuple[str, str]]:
    f = a.fields
    hv, hk = f[knobs.num_v_heads], f[knobs.num_k_heads]
    dk, dv, k = f[knobs.head_k_dim], f[knobs.head_v_dim], f[knobs.conv_kernel]
    sizes = (f"Hv = {knobs.num_v_heads} = {hv}, Hk = {knobs.num_k_heads} = {hk}, "
             f"Dk = {knobs.head_k_dim} = {dk}, Dv = {knobs.head_v_dim} = {dv}")
    if knobs.projections is GdnProjections.QKVZ_BA:
        proj = [("q, k, v, z = split(in_proj_qkvz(x)); b, a = split(in_proj_ba(x))",
                 f"Linear(D, 2*Hk*Dk + 2*Hv*Dv), Linear(D, 2*Hv), no bias, grouped per key head; "
                 f"{sizes}"),
                ("qkv = concat([q, k, v])", "")]
    else:  # GdnProjections.QKV_Z_B_A
        proj = [("qkv, z, b, a = in_proj_qkv(x), in_proj_z(x), in_proj_b(x), in_proj_a(x)",
                 f"Linear(D, 2*Hk*Dk + Hv*Dv), Linear(D, Hv*Dv), Linear(D, Hv) x2, no bias; {sizes}")]
    return proj + [
        ("qkv = where(mask, qkv, 0)", "mask: the ssm mask (batch padding), None otherwise"),
        ("qkv = concat([conv_state, qkv]); conv_state = qkv[:, -(K - 1):]",
         f"K = {knobs.conv_kernel} = {k}; starts at zeros; cache slot 0"),
        ("q, k, v = split(silu(conv1d(qkv)))", "Conv1d(C, C, K, groups=C) (depthwise, causal), no bias"),
        ("q, k = Dk**-1 * rms_norm(q), Dk**-0.5 * rms_norm(k)",
         "l2 norm (eps 1e-6 on sum(x^2)), readout scale folded into q"),
        ("g = exp(-exp(A_log) * softplus(a + dt_bias)); beta = sigmoid(b)",
         "A_log, dt_bias [Hv]; compiled; g in float32"),
        ("S = g * S; S += k (beta * (v - S k)); y = S q",
         "the gated delta rule per token (compiled step; Metal kernel on Apple GPUs); "
         "S [B, Hv, Dv, Dk] float32, q / k repeated Hv / Hk times; cache slot 1"),
        ("y = rms_norm(y) * norm.weight * silu(z)",
         f"gated RMSNorm(Dv), eps {a.eps}; silu(z) * . in float32, cast back"),
        ("out = out_proj(y)", "Linear(Hv*Dv, D), no bias"),
    ]


def _gated_delta_split(d: ArchDescriptor, a: UniversalArgs, knobs: Any) -> list[tuple[str, str]]:
    f = a.fields
    hv, hk = f[knobs.num_v_heads], f[knobs.num_k_heads]
    dk, dv, k = f[knobs.head_k_dim], f[knobs.head_v_dim], f[knobs.conv_kernel]
    neg = f[knobs.allow_neg_eigval]
    return [
        ("q, k, v = q_proj(x), k_proj(x), v_proj(x)",
         f"Linear(D, Hk*Dk) x2, Linear(D, Hv*Dv), no bias; Hv = {knobs.num_v_heads} = {hv}, "
         f"Hk = {knobs.num_k_heads} = {hk}, Dk = {knobs.head_k_dim} = {dk}, "
         f"Dv = {knobs.head_v_dim} = {dv}"),
        *((f"{t} = concat([{t}_state, {t}]); {t}_state = {t}[:, -(K - 1):]; {t} = silu({t}_conv1d({t}))",
           f"Conv1d({c}, {c}, K, groups={c}) (depthwise, causal), no bias; K = {knobs.conv_kernel} = "
           f"{k}; the state starts at zeros; cache slot {slot}" + ("; inputs not masked" if t == "q" else ""))
          for slot, (t, c) in enumerate((("q", "Hk*Dk"), ("k", "Hk*Dk"), ("v", "Hv*Dv")))),
        ("q, k = Dk**-1 * rms_norm(q), Dk**-0.5 * rms_norm(k)",
         "l2 norm (eps 1e-6 on sum(x^2)), readout scale folded into q"),
        ("g = exp(-exp(A_log) * softplus(a_proj(x) + dt_bias)); beta = sigmoid(b_proj(x))"
         + (" * 2.0" if neg else ""),
         f"A_log, dt_bias [Hv]; compiled; g in float32; {knobs.allow_neg_eigval} = {neg}"),
        ("S = g * S; S += k (beta * (v - S k)); y = S q",
         "the gated delta rule per token, masked by the ssm mask (compiled step; Metal kernel on "
         "Apple GPUs); S [B, Hv, Dv, Dk] float32, q / k repeated Hv / Hk times; cache slot 3"),
        ("y = rms_norm(y) * o_norm.weight * silu(g_proj(x))",
         f"gated RMSNorm(Dv) on [B*S*Hv, Dv] rows, eps {knobs.norm_eps} = {f[knobs.norm_eps]}; "
         "silu(gate) * . in float32, cast back"),
        ("out = o_proj(y)", "Linear(Hv*Dv, D), no bias"),
    ]


def _mamba2(d: ArchDescriptor, a: UniversalArgs, knobs: Any) -> list[tuple[str, str]]:
    f = a.fields
    heads, hd, state, groups = (f[k] for k in (knobs.heads, knobs.head_dim, knobs.state, knobs.groups))
    inner = f[knobs.intermediate] if knobs.intermediate else heads * hd
    tsl = f[knobs.time_step_limit] if isinstance(knobs.time_step_limit, str) else knobs.time_step_limit
    norm_on = knobs.norm_when is None or f[knobs.norm_when]
    before = (f[knobs.norm_before_gate] if isinstance(knobs.norm_before_gate, str)
              else knobs.norm_before_gate)
    gated = ("y = swiglu(gate, y)" if not norm_on else
             "y = norm(y, gate)")
    norm_note = ("no norm module" if not norm_on else
                 f"{knobs.norm.value}: swiglu(gate, y), rms_norm without weight per group of "
                 f"I/G = {inner // groups}, * weight; eps = {knobs.eps} = {f[knobs.eps]}"
                 if knobs.norm is GatedNorm.GROUPED else
                 f"{knobs.norm.value}: rms_norm(., weight, eps) over I "
                 f"{'before' if before else 'after'} swiglu(gate, .); eps = {knobs.eps} = {f[knobs.eps]}")
    return [
        ("gate, xBC, dt = split(in_proj(x), [I, I + C])",
         f"Linear(D, 2*I + 2*G*N + H); I = {inner}, H = {knobs.heads} = {heads} heads of "
         f"{knobs.head_dim} = {hd}, G = {knobs.groups} = {groups}, N = {knobs.state} = {state}, "
         f"C = I + 2*G*N; bias={f[knobs.in_bias]}"),
        ("xBC = where(mask, xBC, 0)", "mask: the ssm mask (batch padding), None otherwise"),
        ("xBC = silu(conv1d(concat([state0, xBC])))",
         f"Conv1d(C, C, K, groups=C) (depthwise, causal), K = {knobs.conv_kernel} = "
         f"{f[knobs.conv_kernel]}; state0: the last K - 1 inputs, cache slot 0; "
         f"bias={f[knobs.conv_bias]}"),
        ("x, B, C = split(xBC, [I, I + G*N])", "x per head [H, I/H], B and C per group [G, N]"),
        ("y, state1 = ssd_scan(x, A_log, B, C, D, dt, dt_bias, state1)",
         f"dt = clip(softplus(dt + dt_bias), {tsl[0]}, {tsl[1]}) in float32; chunks of 256 "
         f"(mlx-lm's ssm_attn; a Metal kernel for one-token steps on Apple GPUs); state1 "
         f"[H, I/H, N], cache slot 1" + ("; D cast to x's dtype" if knobs.d_cast else "")
         + ("" if knobs.scan_lengths else "; the cache's lengths not passed")),
        (gated, norm_note),
        ("out = out_proj(y)", f"Linear(I, D); bias={f[knobs.out_bias]}"),
    ]


def _mamba(d: ArchDescriptor, a: UniversalArgs, knobs: Any) -> list[tuple[str, str]]:
    f = a.fields
    inner, state, k, r = (f[x] for x in (knobs.intermediate, knobs.state, knobs.conv_kernel, knobs.time_step_rank))
    rms = f[knobs.bcdt_rms]
    return [
        ("x, z = split(in_proj(x), 2)", f"Linear(D, 2*I); I = {knobs.intermediate} = {inner}; "
                                        f"bias={f[knobs.bias]}"),
        ("x = silu(conv1d(concat([state0, x])))",
         f"Conv1d(I, I, K, groups=I) (depthwise, causal), K = {knobs.conv_kernel} = {k}; state0: the "
         f"last K - 1 inputs (zeros padded first), cache slot 0; bias={f[knobs.conv_bias]}; no mask"),
        ("delta, B, C = split(x_proj(x_t), [R, R + N])",
         f"per token t; Linear(I, R + 2*N), no bias; R = {knobs.time_step_rank} = {r}, "
         f"N = {knobs.state} = {state}"),
        *((("delta, B, C = rms_norm(delta), rms_norm(B), rms_norm(C)",
            f"no weight, eps {knobs.rms_eps} = {f[knobs.rms_eps]} ({knobs.bcdt_rms}: falcon_mamba)"),)
          if rms else ()),
        ("S = (softplus(dt_proj(delta)) * x_t) B + S * exp(delta A); y_t = S C + D * x_t",
         "A = -exp(A_log) [I, N], D [I]; S [I, N], cache slot 1"),
        ("out = out_proj(swiglu(z, y))", f"Linear(I, D); bias={f[knobs.bias]}"),
    ]


def _jamba_mamba(d: ArchDescriptor, a: UniversalArgs, knobs: Any) -> list[tuple[str, str]]:
    f = a.fields
    inner, state, k, r = (f[knobs.expand] * a.hidden, f[knobs.state], f[knobs.conv_kernel], f[knobs.time_step_rank])
    return [
        ("x, z = split(in_proj(x), 2)", f"Linear(D, 2*I); I = {knobs.expand} * D = {inner}; bias={f[knobs.bias]}"),
        ("x = silu(conv1d(concat([state0, x])))",
         f"Conv1d(I, I, K, groups=I) (depthwise, causal), K = {knobs.conv_kernel} = {k}; cache slot 0; "
         f"bias={f[knobs.conv_bias]}; no mask"),
        ("delta, B, C = split(x_proj(x), [R, R + N]); dt_layernorm(delta), b_layernorm(B), c_layernorm(C)",
         f"Linear(I, R + 2*N), no bias, every token at once; RMSNorm(R) / RMSNorm(N) x2, eps {knobs.eps} = "
         f"{f[knobs.eps]}; R = {knobs.time_step_rank} = {r}, N = {knobs.state} = {state}"),
        ("S_t = fma(S_{t-1}, exp(delta_t A), (softplus(dt_proj(delta)) * x)_t B_t); y = S C + D * x",
         "compiled fma per token; A = -exp(A_log) [I, N]; S [I, N], cache slot 1"),
        ("out = out_proj(swiglu(z, y))", f"Linear(I, D); bias={f[knobs.bias]}"),
    ]


_LINES = exhaustive(MIXERS, {
    MixerKind.SHORT_CONV: _short_conv,
    MixerKind.GATED_DELTA: _gated_delta,
    MixerKind.GATED_DELTA_SPLIT_CONV: _gated_delta_split,
    MixerKind.MAMBA2: _mamba2,
    MixerKind.MAMBA: _mamba,
    MixerKind.JAMBA_MAMBA: _jamba_mamba,
})


def hybrid_title(d: ArchDescriptor) -> str:
    n, h = d.names, d.hybrid
    where = {HybridBlock.SINGLE: "its layers", HybridBlock.PARALLEL: "every layer, beside attention"
             }.get(h.block, "the non-attention layers")
    return f"{h.mixer.value} mixer ({n.root}.{n.layers}[i].{h.name}) on {where}"


def single_block(d: ArchDescriptor) -> tuple[str, str] | None:
    """The one-op layer's line (HybridBlock.SINGLE), None for other rows."""
    h = d.hybrid
    if h is None or h.block is not HybridBlock.SINGLE:
        return None
    eps = "its eps" if h.norm_eps is None else f"eps {h.norm_eps} (not the config's)"
    return (f"h = h + {h.name}({d.names.norms.pre_attn}(h))",
            f"one op per layer, all named {h.name}: the {h.mixer.value} mixer, attention, the MLP"
            f"{' or the MoE block' if d.moe else ''} (see layers); {d.names.norms.pre_attn}: the "
            f"block norm, {eps}")


def parallel_block(d: ArchDescriptor) -> list[tuple[str, str]] | None:
    """The parallel layer's lines (HybridBlock.PARALLEL), None for other rows."""
    h, n = d.hybrid, d.names
    if h is None or h.block is not HybridBlock.PARALLEL:
        return None
    x = f"{n.norms.pre_attn}(h)"
    return [(f"h = h + {h.name}({x}) + {n.attn}({x})",
             f"the {h.mixer.value} mixer (ssm mask) and attention on one normed input, summed in "
             "this order; each layer's cache CacheList(ArraysCache, KVCache)"),
            (f"h = h + {n.mlp}({n.norms.pre_mlp}(h))", "")]


def hybrid_lines(d: ArchDescriptor, a: UniversalArgs) -> list[tuple[str, str]]:
    return _LINES[d.hybrid.mixer](d, a, d.hybrid.mixer_knobs())


def mixer_label(d: ArchDescriptor, a: UniversalArgs, s: LayerSpec) -> tuple[str, str] | None:
    """(what the layer runs, its cache) for a recurrent layer; None for an attention layer."""
    if s.ffn_only:
        return "no mixer, the feed-forward alone", "none (mlx-lm's list skips the layer)"
    if s.mixer is MixerKind.ATTENTION:
        return None
    slots = MIXERS[s.mixer].cache_slots
    if d.hybrid.block is HybridBlock.PARALLEL:
        return (f"{s.mixer.value} (ssm mask) beside global attention",
                f"CacheList(ArraysCache({slots}), KVCache)")
    return f"{s.mixer.value} (ssm mask)", f"ArraysCache({slots})"
