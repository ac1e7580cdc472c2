"""The hybrid part of `mlxbun explain`: the recurrent mixer's forward line by line and the label
each of its layers gets. `explain.py` places them; a new mixer kind adds its lines here (the
table is checked exhaustive at import). Lines are (code, note) pairs, as explain_moe's."""

from __future__ import annotations

from typing import Any

from mlxbun.models.universal.kinds import HybridBlock, MixerKind, exhaustive
from mlxbun.models.universal.mixers.mamba2 import GatedNorm
from mlxbun.models.universal.mixers import MIXERS
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


_LINES = exhaustive(MIXERS, {
    MixerKind.SHORT_CONV: _short_conv,
    MixerKind.MAMBA2: _mamba2,
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
