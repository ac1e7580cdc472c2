"""What the fused decode step reads of a model: its layers' weights and facts, or why it cannot.

`fused_plan(model)` returns a `FusedPlan` for a `UniversalDense` graph of the standard dense shape
(pre-norm blocks of RMSNorm, separate q / k / v projections (+ biases), an optional per-head RMS
q / k norm, RoPE over the whole head (plain or llama3 frequencies), SDPA, a SiLU-gated MLP, the
final RMSNorm and a head, tied or not): llama, qwen2, qwen3, mistral and every row with their
knobs. Anything else raises `FusedGap` naming the knob, so the caller runs the compiled step
instead and says why. The plan holds the model's own arrays (nothing is copied).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.fast.fused_knobs import knob_gap
from mlxbun.fast.static_cache import CompileGap
from mlxbun.kernels.common import Gap
from mlxbun.kernels.fused_decode import MAX_HEAD_DIM, Weights, dtype_gap, rope_inv_freq, weights_gap
from mlxbun.models import rope as R
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.kinds import (QKV, Act, AttnKind, BlockKind, FinalSoftcap, MlpKind, NormKind, QKNormAt,
                                           QKNormKind, Residual)
from mlxbun.models.universal.kinds_hybrid import MixerKind

__all__ = ["FusedAttention", "FusedGap", "FusedLayer", "FusedPlan", "fused_plan"]


class FusedGap(CompileGap):
    """The fused decode step does not apply (the reason is the message): a CompileGap, so a
    decode loop that stops the compiled step on one stops the fused step alike."""


@dataclass(frozen=True)
class FusedAttention:
    """One layer's attention facts; `buffer` / `pos` are set per step (`at`)."""

    hq: int
    hkv: int
    head_dim: int
    scale: float
    inv_freq: mx.array
    rope_scale: float
    traditional: bool
    bias: Optional[tuple] = None  # (q, k, v) bias vectors
    q_norm: Optional[mx.array] = None
    k_norm: Optional[mx.array] = None
    qk_eps: float = 0.0
    capacity: int = 0
    buffer: Any = None  # [2, HKV, capacity, D]: keys, then values
    pos: Any = None  # int32 [1]: where the new token goes

    def at(self, buffer: mx.array, pos: mx.array) -> "FusedAttention":
        return replace(self, buffer=buffer, pos=pos, capacity=buffer.shape[2])


@dataclass(frozen=True)
class FusedLayer:
    attn_norm: tuple  # (weight, eps)
    q: Weights
    k: Weights
    v: Weights
    attn: FusedAttention
    o: Weights
    mlp_norm: tuple
    gate: Weights
    up: Weights
    down: Weights


@dataclass(frozen=True)
class FusedPlan:
    layers: tuple[FusedLayer, ...]
    final_norm: tuple
    head: Weights
    embed: nn.Module
    dtype: Any
    hidden: int

    @staticmethod
    def kernels_per_layer(rope_attention: bool = False) -> int:
        """Launches per layer: the q / k / v projection; its bias / norms / RoPE / K/V rows and the
        attention's two (`rope_attention`: those three as one); o + residual, norm + gate/up, down +
        residual."""
        return 5 if rope_attention else 7

    def kernels_per_step(self, scatter: bool = False, rope_attention: bool = False) -> int:
        """Launches the step's fused part makes (the embedding gather and any sampling come on top)."""
        return len(self.layers) * (self.kernels_per_layer(rope_attention) + int(scatter)) + 1


def _weights(module: Any, where: str) -> Weights:
    if type(module) is nn.Linear:
        return Weights.dense(module.weight)
    if type(module) in (nn.QuantizedLinear, nn.QuantizedEmbedding):
        if getattr(module, "mode", "affine") != "affine" or module.get("biases") is None:
            raise FusedGap(f"{where}: quantization mode {getattr(module, 'mode', None)!r} (the kernels do affine)")
        return Weights(module["weight"], module["scales"], module["biases"], module.bits, module.group_size)
    if type(module) is nn.Embedding:
        return Weights.dense(module.weight)
    raise FusedGap(f"{where}: a {type(module).__name__} (the kernels read Linear and affine QuantizedLinear)")


def _check(reason_if: list[tuple[bool, str]]) -> None:
    for bad, reason in reason_if:
        if bad:
            raise FusedGap(reason)


def _rope(rope: Any, head_dim: int, where: str) -> tuple[mx.array, float, bool]:
    """(inverse frequencies, position scale, traditional) of a rope module the kernel reproduces."""
    if type(rope) is nn.RoPE:
        dims, base, scale = rope.dims, rope.base, rope.scale
        inv = rope_inv_freq(dims, base=base)
    elif type(rope) is R.Llama3RoPE:
        dims, scale = rope.dims, 1.0
        inv = rope_inv_freq(dims, freqs=rope._freqs)
    else:
        raise FusedGap(f"{where}: rope {type(rope).__name__} (the kernel does RoPE and Llama3RoPE)")
    if dims != head_dim:
        raise FusedGap(f"{where}: rope over {dims} of {head_dim} head dims (the kernel rotates whole heads)")
    return inv, float(scale), bool(rope.traditional)


def _layer(block: Any, spec: Any, a: Any, d: Any, where: str) -> FusedLayer:
    n = d.names
    _check([(spec.mixer is not MixerKind.ATTENTION, f"{where}: a {spec.mixer} mixer"),
            (spec.sliding, f"{where}: sliding-window attention"),
            (spec.moe or spec.ffn_only, f"{where}: an MoE or MLP-only layer"),
            (spec.sinks, f"{where}: attention sinks"),
            (spec.heads is not None or spec.dims is not None or spec.scale is not None,
             f"{where}: per-layer head counts, dims or scale"),
            (spec.rope is None, f"{where}: a layer without RoPE")])
    attn, mlp = block[n.attn], block[n.mlp]
    if attn._gate is not None:
        raise FusedGap(f"{where}: an attention output gate ({attn._gate})")
    hq, hkv, hd = attn._h, attn._kv, attn._hd
    if hd % 2 or hd > MAX_HEAD_DIM:
        raise FusedGap(f"{where}: head dim {hd} (qkv_rope takes even head dims up to {MAX_HEAD_DIM})")
    inv, rope_scale, trad = _rope(attn._rope_fn, hd, where)
    q, k, v = (_weights(attn[name], f"{where}.{n.attn}.{name}") for name in (n.q, n.k, n.v))
    bias = None
    if a.attn_bias:
        bias = tuple(attn[name].bias for name in (n.q, n.k, n.v))
    q_norm = k_norm = None
    qk_eps = 0.0
    if attn._qk is not None:
        if attn._qk.kind is not QKNormKind.RMS or attn._qk.at is not QKNormAt.HEADS:
            raise FusedGap(f"{where}: a {attn._qk.kind} q/k norm at {attn._qk.at} (the kernel does rms per head)")
        qn, kn = (attn[name] for name in attn._qk.names)
        q_norm, k_norm, qk_eps = qn.weight, kn.weight, float(qn.eps)
        if float(kn.eps) != qk_eps:
            raise FusedGap(f"{where}: q and k norms with different eps")
    norms = d.names.norms
    ln_in, ln_mlp = block[norms.pre_attn], block[norms.pre_mlp]
    for norm, name in ((ln_in, norms.pre_attn), (ln_mlp, norms.pre_mlp)):
        if type(norm) is not nn.RMSNorm:
            raise FusedGap(f"{where}.{name}: a {type(norm).__name__} (the kernels do RMSNorm)")
    fused_attn = FusedAttention(hq, hkv, hd, float(attn._scale), inv, rope_scale, trad, bias, q_norm, k_norm,
                                qk_eps)
    return FusedLayer((ln_in.weight, float(ln_in.eps)), q, k, v, fused_attn,
                      _weights(attn[n.o], f"{where}.{n.attn}.{n.o}"), (ln_mlp.weight, float(ln_mlp.eps)),
                      *(_weights(mlp[name], f"{where}.{n.mlp}.{name}") for name in (n.gate, n.up, n.down)))


def fused_plan(model: Any) -> FusedPlan:
    """The model's FusedPlan (see the module docstring); FusedGap names what does not fit."""
    if type(model) is not UniversalDense:
        raise FusedGap(f"a {type(model).__name__} graph (the fused step runs UniversalDense rows)")
    d, a = model.descriptor, model.args
    reason = knob_gap(d)  # a knob the kernels do not do (fused_knobs places every knob)
    if reason is not None:
        raise FusedGap(reason)
    names = d.names.norms
    _check([(d.moe is not None or a.moe is not None, "an MoE row"), (d.hybrid is not None, "a hybrid row"),
            (d.mla is not None, "an MLA row"), (d.qkv is not QKV.SEPARATE, f"q/k/v projections {d.qkv}"),
            (d.attention is not AttnKind.SDPA, f"attention {d.attention}"),
            (a.attn_softcap is not None, "an attention softcap"),
            (d.value_scale is not None, "scaled values"), (d.layers.kv_share is not None, "KV shared across layers"),
            (d.block.kind is not BlockKind.PRE or a.parallel, f"a {d.block.kind} block (parallel: {a.parallel})"),
            (d.block.residual is not Residual.PLAIN or a.residual_scale is not None, "a scaled residual"),
            (d.block.inner_norms, "inner norms"),
            (d.norm.kind is not NormKind.RMS, f"{d.norm.kind} norms (the kernels do RMSNorm)"),
            (names.post_attn is not None or names.post_mlp is not None, "post norms"),
            (d.mlp.kind is not MlpKind.GATED or d.mlp.act is not Act.SILU, f"a {d.mlp.kind} {d.mlp.act} MLP"),
            (a.mlp_bias or a.out_bias, "MLP or output-projection biases"),
            (d.embed_scale is not None or d.embed_norm, "a scaled or normed embedding"),
            (d.head.in_root or a.head_pre_divide is not None or a.head_post is not None, "a scaled head"),
            (a.final_softcap is FinalSoftcap.COMPILED or a.final_softcap_value is not None, "a logit softcap"),
            (a.embed_scale not in (None, 1, 1.0), "an embedding multiplier")])
    root = model.backbone
    embed = root[d.names.embed]
    dtype = (embed.scales if isinstance(embed, nn.QuantizedEmbedding) else embed.weight).dtype
    gap = dtype_gap(dtype)
    if gap is not None:
        raise FusedGap(gap.reason)
    layers = tuple(_layer(block, spec, a, d, f"layers.{i}")
                   for i, (block, spec) in enumerate(zip(root[d.names.layers], a.layers)))
    if model.tied:
        head = _weights(embed, d.names.embed)
    else:
        head = _weights(model.text_model[d.names.head], d.names.head)
    final = root[d.names.final_norm]
    if type(final) is not nn.RMSNorm:
        raise FusedGap(f"{d.names.final_norm}: a {type(final).__name__}")
    plan = FusedPlan(layers, (final.weight, float(final.eps)), head, embed, dtype, a.hidden)
    _check_widths(plan)
    return plan


def _check_widths(plan: FusedPlan) -> None:
    hidden, dtype = plan.hidden, plan.dtype
    for i, layer in enumerate(plan.layers):
        hq, hd = layer.attn.hq, layer.attn.head_dim
        for name, ws, width in (("q/k/v", [layer.q, layer.k, layer.v], hidden), ("o_proj", [layer.o], hq * hd),
                                ("gate/up", [layer.gate, layer.up], hidden),
                                ("down_proj", [layer.down], layer.gate.rows)):
            gap: Optional[Gap] = weights_gap(f"layers.{i}.{name}", ws, width, dtype)
            if gap is not None:
                raise FusedGap(gap.reason)
    gap = weights_gap("head", [plan.head], hidden, dtype)
    if gap is not None:
        raise FusedGap(gap.reason)
