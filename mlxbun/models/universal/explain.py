"""`explain_config(config)`: the forward a config resolves to on the universal graph, as a short
mlx-lm-style listing (`mlxbun.explain.explain` takes arch and model names).

The listing is read off the descriptor row and its resolution against a config
(a checkpoint's config.json, or the zoo's tiny config of an arch): embedding,
block form, attention step by step (projections, q/k norm and where it sits,
rope, cache, scale, dtype casts), MLP, final norm and head, then the layers
grouped by what differs between them (sliding window, rope, NoPE, cache).
Sizes stay symbolic (D, H, KV, hd, I, V, N) and are given once in the header,
so the structure reads the same for any checkpoint of the arch.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxbun.config import MODEL_REMAPPING
from mlxbun.config_reader import thaw
from mlxbun.errors import ConfigError
from mlxbun.models.universal.coverage import check_coverage
from mlxbun.models.universal.explain_gemma4 import GEMMA4_MODEL_TYPES, gemma4_layer_groups, gemma4_sections
from mlxbun.models.universal.explain_hybrid import hybrid_lines, hybrid_title, mixer_label, parallel_block, single_block
from mlxbun.models.universal.explain_mla import mla_lines, mla_sizes
from mlxbun.models.universal.explain_moe import moe_layer_label, moe_lines, moe_sizes, moe_title
from mlxbun.models.universal.explain_forms import own_forward
from mlxbun.models.universal.explain_rope import rope_text
from mlxbun.models.universal.explain_shapes import own_shapes
from mlxbun.models.universal.kinds import (
    BLOCK_SLOTS,
    COMPILED_SOFTCAP,
    POST_OVER,
    QKV,
    Act,
    AttnKind,
    AttnOutGate,
    AttnScale,
    BlockKind,
    EmbedScale,
    FinalSoftcap,
    HeadDim,
    KVShare,
    MakeCache,
    MlpKind,
    MlpSize,
    NormKind,
    NormSlot,
    ParallelMlpNorm,
    ParallelSum,
    PostOp,
    PreDivide,
    QKNormAt,
    QKNormKind,
    Residual,
    ResidualScale,
    TiedOp,
    TieRule,
)
from mlxbun.models.universal.kinds_hybrid import (
    MixerKind,
)
from mlxbun.models.universal.resolve import descriptor_for, resolve_args
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, UniversalArgs

__all__ = ["Explanation", "Line", "explain_config"]


@dataclass(frozen=True)
class Line:
    code: str  # mlx-lm-style pseudo-code
    note: str = ""  # shapes, constants, where a value comes from


@dataclass(frozen=True)
class LayerGroup:
    layers: tuple[int, ...]
    attention: str  # "global" or "sliding window W"
    rope: str  # the layer's rope, "NoPE" when it has none
    cache: str
    mlp: str = ""  # MoE rows: "MoE (E experts, top k)" or "dense mlp"; "" otherwise


@dataclass(frozen=True)
class Explanation:
    model_type: str
    target: str
    config_source: str
    mlx_lm_file: str
    sizes: tuple[tuple[str, str, Any], ...]  # (symbol, where it comes from, value)
    sections: tuple[tuple[str, tuple[Line, ...]], ...]
    layers: tuple[LayerGroup, ...]
    coverage: str
    notes: str = ""
    descriptor: Mapping[str, Any] = field(default_factory=dict)
    graph: str = "the universal graph"  # a dedicated port names itself (gemma3n: models/gemma3n/)

    def text(self) -> str:
        out = [f"{self.model_type}: {self.graph}'s forward, as mlx-lm 0.32.2 "
               f"{self.mlx_lm_file} runs it",
               f"config: {self.config_source}",
               f"coverage: {self.coverage}",
               textwrap.fill("sizes: " + ", ".join(f"{s} = {src} = {v}" for s, src, v in self.sizes),
                             width=100, subsequent_indent="  ")]
        for title, lines in self.sections:
            out.append(title)
            width = max(len(ln.code) for ln in lines) + 4
            for ln in lines:
                out.append(f"  {ln.code:<{width}}# {ln.note}".rstrip() if ln.note else f"  {ln.code}")
        out.append("layers")
        for g in self.layers:
            out.append(f"  {_ranges(g.layers)}: {g.attention}; {g.rope}; cache {g.cache}"
                       + (f"; {g.mlp}" if g.mlp else ""))
        if self.notes:
            out.append(f"note: {self.notes}")
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model_type": self.model_type, "target": self.target, "graph": self.graph,
            "config_source": self.config_source, "mlx_lm_file": self.mlx_lm_file,
            "coverage": self.coverage,
            "sizes": [{"symbol": s, "from": src, "value": v} for s, src, v in self.sizes],
            "sections": {title: [dataclasses.asdict(ln) for ln in lines]
                         for title, lines in self.sections},
            "layers": [dataclasses.asdict(g) for g in self.layers],
            "notes": self.notes, "descriptor": dict(self.descriptor),
        }


def explain_config(config: Mapping[str, Any], *, target: str, source: str,
                   model_type: str | None = None) -> Explanation:
    """Explain the forward a config.json dict resolves to."""
    raw = thaw(config)
    mt = model_type or raw.get("model_type")
    if not isinstance(mt, str):
        raise ConfigError(f"{source}: required key 'model_type' is missing or not a string")
    raw.setdefault("model_type", mt)
    d = descriptor_for(mt, raw)
    a = resolve_args(d, raw)
    report = check_coverage(mt, raw)
    coverage = (f"ok ({len(report.understood)} keys understood)" if report.ok
                else "REFUSED: " + report.describe())
    sections, layers = _sections(d, a), _layer_groups(d, a)
    if d.model_type in GEMMA4_MODEL_TYPES:  # its own forward (gemma4.py)
        sections = tuple((t, tuple(Line(*p) for p in pairs)) for t, pairs in gemma4_sections(d, a))
        layers = tuple(LayerGroup(*g) for g in gemma4_layer_groups(a))
    return Explanation(
        model_type=d.model_type, target=target, config_source=source,
        mlx_lm_file=f"models/{MODEL_REMAPPING.get(mt, mt)}.py", sizes=_sizes(d, a),
        sections=sections, layers=layers, coverage=coverage,
        notes=d.notes, descriptor=_descriptor_dict(d),
    )


# ----------------------------------------------------------------- sizes


def _sizes(d: ArchDescriptor, a: UniversalArgs) -> tuple[tuple[str, str, Any], ...]:
    head_dim = {HeadDim.SPLIT: "D // H", HeadDim.FIELD: "head_dim",
                HeadDim.OR_SPLIT: "head_dim or D // H"}[d.head_dim]
    inter = d.mlp.intermediate
    inter = {MlpSize.FOUR_X_HIDDEN: "4 * D",
             MlpSize.LILLE: "256 * round(int(8 * D / 3) / 256)",
             MlpSize.HALF_INTERMEDIATE: "intermediate_size // 2",
             MlpSize.SCALED_HIDDEN: "int(D * hidden_dim_scale_factor)"}.get(inter, inter)
    kv = (f"ceil(H / {d.kv_tile})" if d.kv_tile else d.n_kv_heads or d.layers.kv_heads_per_layer
          or "H (multi-head)")
    heads = (("KV", kv, a.n_kv_heads), ("hd", head_dim, a.head_dim))
    if d.mla is not None:  # MLA: no kv heads, its own head dims
        heads = mla_sizes(d, a)
    return (("D", d.hidden, a.hidden), ("N", d.n_layers, a.n_layers), ("H", d.n_heads or d.layers.heads_per_layer, a.n_heads),
            *heads, ("I", inter, a.intermediate), ("V", d.vocab, a.vocab)) + moe_sizes(d, a)


# ----------------------------------------------------------------- sections


def _field_note(spec: bool | str, value: Any) -> str:
    return f"{value} ({spec})" if isinstance(spec, str) else str(value)


_NORM_TEXT = {
    NormKind.RMS: "RMSNorm({dims}, eps={eps})",
    NormKind.GEMMA_RMS: "GemmaRMSNorm({dims}, eps={eps}): x * (1 + weight)",
    NormKind.LAYERNORM: "LayerNorm({dims}, eps={eps}, bias={bias})",
    NormKind.LAYERNORM1P: "LayerNorm1P({dims}, eps={eps}): weight + 1",
    NormKind.FUNCTIONAL_RMS: "rms_norm, no weight, eps {eps}",
    NormKind.OFFSET_RMS: "RMSNorm({dims}, eps={eps}): x * (weight + offset), offset 1.0 but {offsets}",
}


def _norm(d: ArchDescriptor, a: UniversalArgs, dims: str = "D", kind: NormKind | None = None) -> str:
    return _NORM_TEXT[kind or d.norm.kind].format(dims=dims, eps=a.eps, bias=a.norm_bias, offsets=", ".join(
        f"{k} {v}" for k, v in d.norm.offsets.items()))


def _sections(d: ArchDescriptor, a: UniversalArgs) -> tuple[tuple[str, tuple[Line, ...]], ...]:
    n = d.names
    # a hybrid's one-op layers may run no attention (mamba2) or no MLP
    attends = any(s.mixer is MixerKind.ATTENTION and not s.ffn_only for s in a.layers) or bool(
        parallel_block(d))
    mlp = single_block(d) is None or any(s.ffn_only for s in a.layers)
    return (
        *(((f"wrapper ({n.wrapper})", (Line(f"{n.wrapper}.{n.root}, {n.wrapper}.{n.head}",
                                            "a VLM wrapper: every path below is under it; the "
                                            "args are text_config's" + "".join(
                                                f", {k} the top-level one (default {v})"
                                                for k, v in d.wrapper_fields.items())
                                            + "".join(f", {k} always {v!r}" for k, v in d.wrapper_sets.items())
                                            + "; the text model runs alone"),)),)
          if n.wrapper else ()),
        ("embedding", tuple(_embedding(d, a))),
        (f"block ({n.root}.{n.layers}[i], i < N): {_block_form(d, a)}", tuple(_block(d, a))),
        ("norms", (Line(_norm(d, a), "every block norm" + (
            f"; eps from {d.norm.eps}" if isinstance(d.norm.eps, str) and d.norm.kind is not NormKind.FUNCTIONAL_RMS
            else "") + "".join(f"; {k} at eps {a.fields[f]} ({f})" for k, f in d.norm.slot_eps.items())),)),
        *(((f"attention ({n.root}.{n.layers}[i].{n.attn})", tuple(_attention(d, a))),)
          if attends and d.mla is None else ()),
        *(((f"attention ({n.root}.{n.layers}[i].{n.attn}): multi-head latent",
            tuple(Line(c, note) for c, note in mla_lines(d, a))),) if d.mla is not None else ()),
        *(((hybrid_title(d), tuple(Line(c, note) for c, note in hybrid_lines(d, a))),)
          if d.hybrid is not None else ()),
        *(_mlp_sections(d, a) if mlp else ()),
        ("final norm and head", tuple(_head(d, a))),
    )


def _mlp_sections(d: ArchDescriptor, a: UniversalArgs):
    """The dense mlp (where a layer runs it), then the MoE block (where a layer routes)."""
    n = d.names
    routed = [s.moe for s in a.layers]
    if not all(routed):
        mixed = " on the dense layers" if any(routed) else ""
        yield f"mlp ({n.root}.{n.layers}[i].{n.mlp}){mixed}", tuple(_mlp(d, a))
    if any(routed):
        yield moe_title(d), tuple(Line(code, note) for code, note in moe_lines(d, a))


def _embedding(d: ArchDescriptor, a: UniversalArgs):
    n = d.names
    yield Line(f"h = {n.root}.{n.embed}(ids)", "Embedding(V, D)")
    if d.positions is not None:
        p = d.positions
        yield Line(f"h = h + {n.root}.{p.name}(arange(L) + cache[0].offset)",
                   f"Embedding({p.size} = {a.fields[p.size]}, D): learned absolute positions")
    es = d.embed_scale
    if es is EmbedScale.SQRT_HIDDEN:
        yield Line("h = h * D**0.5", f"= {a.fields['hidden_size'] ** 0.5}")
    elif es is EmbedScale.SQRT_HIDDEN_BF16:
        yield Line("h = h * array(D**0.5, bfloat16).astype(h.dtype)",
                   "the factor rounded to bfloat16 first")
    elif es is EmbedScale.SQRT_HIDDEN_MUP:
        on = a.fields["mup_enabled"]
        yield Line("h = h * math.sqrt(D)" if on else "(no embedding scale)",
                   f"mup_enabled = {on}" + (f"; = {math.sqrt(a.fields['hidden_size'])}" if on else ""))
    elif es is not None:
        yield Line(f"h = h * {es}", f"= {a.embed_scale}")
    if d.embed_norm:
        yield Line("h = rms_norm(h)", f"no weight, eps {a.eps}")


def _block_form(d: ArchDescriptor, a: UniversalArgs) -> str:
    if d.block.inner_norms:
        form = "pre-norm inside attention and mlp"
    elif a.parallel:
        form = "parallel attention and mlp"
    else:
        form = _FORMS[d.block.kind]
    if isinstance(d.block.parallel, str):
        form += f" ({d.block.parallel} = {a.parallel})"
    h = d.hybrid
    if h is not None and h.mixer_block is not None:
        form += f" on the attention layers, {_FORMS[h.mixer_block]} on the {h.mixer.value} layers"
    return form + own_forward(d, a)


_FORMS = {BlockKind.PRE: "pre-norm", BlockKind.SANDWICH: "sandwich norms", BlockKind.POST: "post-norm"}


def _block(d: ArchDescriptor, a: UniversalArgs):
    n, b = d.names, d.block
    slots = set(b.norm_slots(a.parallel))
    functional = d.norm.kind is NormKind.FUNCTIONAL_RMS

    def norm(slot: NormSlot, x: str, slots=slots, names=n.norms) -> str:
        if slot not in slots:
            return x
        return f"rms_norm({x})" if functional else f"{names.of(slot)}({x})"

    one_op = single_block(d)
    if one_op is not None:  # a hybrid's one-op layers (mamba2, nemotron_h)
        yield Line(*one_op)
        return
    if parallel_block(d) is not None:  # falcon_h1: the mixer beside attention
        yield from (Line(code, note) for code, note in parallel_block(d))
        return
    if a.parallel:
        if b.parallel_mlp_norm is ParallelMlpNorm.SHARED:
            yield Line(f"x = {norm(NormSlot.PRE_ATTN, 'h')}", "attention and mlp share it")
            attn, ff = f"{n.attn}(x)", f"{n.mlp}(x)"
        else:
            attn = f"{n.attn}({norm(NormSlot.PRE_ATTN, 'h')})"
            ff = f"{n.mlp}({norm(NormSlot.PRE_MLP, 'h')})"
        total = (f"{attn} + {ff} + h" if b.parallel_sum is ParallelSum.ATTN_FF_X
                 else f"h + {attn} + {ff}")
        yield Line(f"h = {total}", "one residual, summed in this order")
        return
    add = {Residual.PLAIN: "h = h + {r}",
           Residual.SCALED: "h = h + {r} * s",
           Residual.CLIP_F16: "h = clip_residual(h, {r})"}[b.residual]
    note = {Residual.PLAIN: "",
            Residual.SCALED: f"s = {_residual_scale(d)} = {a.residual_scale}",
            Residual.CLIP_F16: "float16: added in float32, clipped to the float16 range"}[b.residual]
    h = d.hybrid
    if h is not None and h.mixer_block is not None:  # the mixer layers have their own norms
        own = {"slots": set(BLOCK_SLOTS[h.mixer_block]), "names": h.mixer_norms}
        for mixer, kw, where in ((n.attn, {}, "attention layers"),
                                 (h.name, own, f"{h.mixer.value} layers (see layers)")):
            attn = norm(NormSlot.POST_ATTN, f"{mixer}({norm(NormSlot.PRE_ATTN, 'h', **kw)})", **kw)
            ff = norm(NormSlot.POST_MLP, f"{n.mlp}({norm(NormSlot.PRE_MLP, 'h', **kw)})", **kw)
            yield Line(add.format(r=attn), f"the {where}; {note}".rstrip("; "))
            yield Line(add.format(r=ff), note)
        return
    mixer = n.attn if h is None else f"{n.attn}|{h.name}"
    attn = norm(NormSlot.POST_ATTN, f"{mixer}({norm(NormSlot.PRE_ATTN, 'h')})")
    ff = norm(NormSlot.POST_MLP, f"{n.mlp}({norm(NormSlot.PRE_MLP, 'h')})")
    yield Line(add.format(r=attn), note if h is None else
               f"{h.name} on the {h.mixer.value} layers (see layers); {note}".rstrip("; "))
    yield Line(add.format(r=ff), note)


def _residual_scale(d: ArchDescriptor) -> str:
    s = d.block.residual_scale
    return "scale_depth / N**0.5" if s is ResidualScale.MINICPM_DEPTH else str(s)


_SCALE_TEXT = {
    AttnScale.HEAD_DIM: "hd**-0.5",
    AttnScale.QPAS_INV_SQRT: "1 / query_pre_attn_scalar**0.5",
    AttnScale.QPAS_POW: "query_pre_attn_scalar**-0.5",
    AttnScale.SQRT_INV: "sqrt(1 / hd)",
    AttnScale.ATTENTION_MULTIPLIER: "attention_multiplier",
    AttnScale.INV_SQRT: "1 / sqrt(hd)",
}

_QK_TEXT = {
    QKNormKind.RMS: "RMSNorm({w}, eps={eps})",
    QKNormKind.GEMMA_RMS: "GemmaRMSNorm({w}, eps={eps})",
    QKNormKind.FUNCTIONAL_RMS: "rms_norm, no weight, eps {eps}",
    QKNormKind.LAYERNORM_2D: "LayerNorm2D: one LayerNorm weight per head, eps={eps}",
    QKNormKind.LAYERNORM_PER_HEAD: "a LayerNorm module per head, eps={eps}",
}

_QK_PLACE = {
    QKNormAt.FLAT: "flat, on the projections before the head split",
    QKNormAt.HEADS: "per head, on [B, L, heads, hd] before the transpose",
    QKNormAt.HEADS_TRANSPOSED: "per head, on [B, heads, L, hd]",
    QKNormAt.AFTER_ROPE: "after rope",
}


def _attention(d: ArchDescriptor, a: UniversalArgs):
    n = d.names
    bias = _field_note(d.attn_bias, a.attn_bias)
    if d.block.inner_norms:
        yield Line(f"x = {n.inner_norm}(x)", "RMSNorm(D) inside the attention")
    if d.qkv is QKV.SEPARATE and d.attn_gate is AttnOutGate.QUERY_SIGMOID:
        yield Line(f"q, gate = split({n.q}(x).reshape(B, L, H, 2*hd), 2); k, v = {n.k}(x), {n.v}(x)",
                   f"Linear(D, 2*H*hd) per head [q | gate], Linear(D, KV*hd) x2; bias={bias}")
    elif d.qkv is QKV.SEPARATE:
        yield Line(f"q, k, v = {n.q}(x), {n.k}(x), {n.v}(x)",
                   f"Linear(D, H*hd), Linear(D, KV*hd) x2; bias={bias}")
        if d.layers.kv_share is KVShare.CLA:
            f = a.fields
            yield Line("k, v = kv_states (sharing layers)",
                       f"cross-layer KV sharing (use_cla = {f['use_cla']}, cla_share_factor = "
                       f"{f['cla_share_factor']}): a layer with i % factor != 0 has no {n.k} / {n.v} "
                       f"and takes the last projecting layer's {n.k}(x), {n.v}(x) of these tokens; "
                       f"each layer ropes / norms them and fills its own cache")
    elif d.qkv is QKV.FUSED:
        yield Line(f"q, k, v = split({n.qkv}(x), [H*hd, H*hd + KV*hd])",
                   f"Linear(D, (H + 2*KV)*hd); bias={bias}")
    elif d.qkv is QKV.FUSED_GROUPED:
        yield Line(f"g = {n.qkv}(x).reshape(B, L, KV, H/KV + 2, hd); q, k, v = g[..., :H/KV, :], "
                   "g[..., -2, :], g[..., -1, :]",
                   f"Linear(D, (H + 2*KV)*hd), per KV head its H/KV queries, key, value; bias={bias}")
    else:
        yield Line(f"q, k, v = split({n.qkv}(x).reshape(B, L, H, 3*hd), 3)",
                   f"Linear(D, 3*D), q|k|v interleaved per head; bias={bias}")
    qk = d.qk_norm if a.qk_norm else None
    qk_line = None
    if qk is not None:
        flat = qk.at is QKNormAt.FLAT
        width = "H*hd / KV*hd" if flat else "hd"
        code = ("q, k = rms_norm(q), rms_norm(k)" if qk.kind is QKNormKind.FUNCTIONAL_RMS
                else f"q, k = {qk.names[0]}(q), {qk.names[1]}(k)")
        scale = f"; q = q * {qk.q_scale} (= {a.fields[qk.q_scale]})" if qk.q_scale else ""
        qk_line = Line(code, f"{_QK_TEXT[qk.kind].format(w=width, eps=a.eps)}; {_QK_PLACE[qk.at]}{scale}")
    elif d.qk_norm is not None:
        yield Line("(no q/k norm)", f"{d.qk_norm.enabled} = False")
    if qk_line and qk.at is QKNormAt.FLAT:
        yield qk_line
    if d.qkv is not QKV.FUSED_NEOX:
        yield Line("q, k, v = heads(q), heads(k), heads(v)", "reshape [B, L, heads, hd], "
                   "transpose [B, heads, L, hd]")
    if qk_line and qk.at in (QKNormAt.HEADS, QKNormAt.HEADS_TRANSPOSED):
        yield qk_line
    ropes = {rope_text(s, d, a) for s in a.layers}
    where = ropes.pop() if len(ropes) == 1 else "per layer, see layers"
    yield Line("q, k = rope(q, offset), rope(k, offset)", where)
    if qk_line and qk.at is QKNormAt.AFTER_ROPE:
        yield qk_line
    other = sorted({s.heads for s in a.layers if s.heads and d.layers.sliding_heads})
    if other:
        yield Line("(sliding layers: H, KV = " + ", ".join(f"{h}, {kv}" for h, kv in other) + ")",
                   f"from {d.layers.sliding_heads}")
    yield from (Line(code, note) for code, note in own_shapes(d, a))
    yield Line("k, v = cache.update_and_fetch(k, v)")
    if d.kv_tile:
        yield Line("k, v = tile(k, [1, H // KV, 1, 1]), tile(v, ...)", "query head j reads KV head j % KV")
    if a.llama4 is not None:
        beta, max_pos = a.llama4
        yield Line("q = q * (1 + beta * log(1 + floor(pos / M)))",
                   f"llama-4 query scale, beta = {beta}, M = {max_pos}; cast to h.dtype")
    scale = f"scale = {_SCALE_TEXT[d.attn_scale]} = {a.attn_scale}"
    mask = "; mask as a bool array" if d.layers.mask_array else ""
    if d.sinks:
        mask += (f"; sinks [H] ({n.sinks}): one learned logit per head joins each row's softmax "
                 "(quantized KV refuses: no sinks in quantized sdpa)")
    if d.sinks_when:
        mask += (f"; only on layers whose switch is true: full {d.sinks_when[0]} = "
                 f"{a.fields[d.sinks_when[0]]}, sliding {d.sinks_when[1]} = {a.fields[d.sinks_when[1]]}")
    yield {
        AttnKind.SDPA: Line("o = sdpa(q, k, v, scale, mask" + (", sinks)" if d.sinks else ")"),
                            scale + mask),
        AttnKind.SOFTCAP: Line("o = softmax(tanh((q * scale) @ k.T / c) * c + mask) @ v",
                               f"{scale}; c = attn_logit_softcapping = {a.attn_softcap}; "
                               f"eager, precise softmax{mask}"),
        AttnKind.SDPA_F32_IF_F16: Line("o = sdpa(q.astype(f32 if q is f16), k, v).astype(q.dtype)",
                                       scale + mask),
        AttnKind.SDPA_Q_F32: Line("o = sdpa(q.astype(float32), k, v).astype(v.dtype)", scale + mask),
        AttnKind.SDPA_QK_F32: Line("o = sdpa(q.astype(float32), k.astype(float32), v)"
                                   ".astype(v.dtype)", scale + mask),
    }[d.attention]
    gate_on = d.attn_gate is not None and (d.attn_gate_when is None or a.fields[d.attn_gate_when])
    when = f"; {d.attn_gate_when} = True" if d.attn_gate_when else ""
    if gate_on and d.attn_gate is AttnOutGate.SIGMOID:
        yield Line(f"o = o * sigmoid({n.attn_gate}(x))",
                   f"output gate: {n.attn_gate} Linear(D, H*hd), no bias; heads concatenated{when}")
    elif gate_on and d.attn_gate is AttnOutGate.QUERY_SIGMOID:
        yield Line("o = o * sigmoid(gate)", f"output gate: the second half of {n.q}'s heads; "
                   "heads concatenated")
    elif gate_on and d.attn_gate in (AttnOutGate.HEAD_SOFTPLUS, AttnOutGate.HEAD_SIGMOID_F32):
        fn = "softplus" if d.attn_gate is AttnOutGate.HEAD_SOFTPLUS else "sigmoid"
        bias = f"bias={a.attn_bias}" if d.attn_gate is AttnOutGate.HEAD_SIGMOID_F32 else "no bias"
        yield Line(f"o = o * {fn}({n.attn_gate}(x).astype(float32)).astype(o.dtype)[..., None]",
                   f"per-head output gate on [B, L, H, hd]: {n.attn_gate} Linear(D, H), {bias}{when}")
    elif gate_on:  # AttnOutGate.HEAD_SIGMOID
        yield Line(f"o = o * sigmoid({n.attn_gate}(x))[..., None]",
                   f"per-head output gate on [B, L, H, hd]: {n.attn_gate} Linear(D, H), no bias{when}")
    yield Line(f"out = {n.o}(o)", f"Linear(H*hd, D); bias={_field_note(d.out_bias, a.out_bias)}")


_ACT_TEXT = {
    Act.SILU: "silu", Act.GELU: "gelu", Act.GELU_APPROX: "gelu_approx",
    Act.RELU_SQUARED: "relu_squared", Act.RELU2: "relu2", Act.SILU_EAGER: "silu",
}


def _mlp(d: ArchDescriptor, a: UniversalArgs):
    n, m = d.names, d.mlp
    bias = f"bias={_field_note(m.bias, a.mlp_bias)}"
    if d.block.inner_norms:
        yield Line(f"x = {n.inner_norm}(x)", "RMSNorm(D) inside the mlp")
    act = _ACT_TEXT.get(m.act, n.act)
    compiled = {Act.SILU: "; compiled swiglu",
                Act.SILU_EAGER: "; compiled silu, the product outside it"}.get(m.act, "")
    if m.kind is MlpKind.GATED:
        yield Line(f"out = {n.down}({act}({n.gate}(x)) * {n.up}(x))",
                   f"{n.gate}/{n.up} Linear(D, I), {n.down} Linear(I, D); {bias}{compiled}")
    elif m.kind is MlpKind.GATED_FUSED:
        yield Line(f"gate, u = split({n.gate_up}(x), 2)", f"Linear(D, 2*I); {bias}")
        yield Line(f"out = {n.down}({act}(gate) * u)", f"Linear(I, D){compiled}")
    else:
        note = {Act.GELU_APPROX: "; gelu with the tanh approximation",
                Act.RELU_SQUARED: "; relu(x)**2, compiled",
                Act.XIELU: f"; {n.act} is a XieLU module (learned alpha_p, alpha_n)"}.get(m.act, "")
        yield Line(f"out = {n.down}({act}({n.up}(x)))",
                   f"{n.up} Linear(D, I), {n.down} Linear(I, D); {bias}{note}")


def _head(d: ArchDescriptor, a: UniversalArgs):
    n, h = d.names, d.head
    if d.norm.kind is NormKind.FUNCTIONAL_RMS:
        yield Line("h = rms_norm(h)", f"no weight, eps {a.eps}")
    else:
        where = f"{n.head}.{n.final_norm}" if h.holds_norm else f"{n.root}.{n.final_norm}"  # (phixtral)
        yield Line(f"h = {where}(h)", _norm(d, a, kind=d.norm.final_kind))
    embed = f"{n.root}.{n.embed}"
    tied_code = (f"logits = {embed}.as_linear(h)" if h.tied_op is TiedOp.AS_LINEAR
                 else f"logits = h @ {embed}.weight.T")
    if h.in_root:
        yield Line(f"logits = {n.root}.{n.head}(h)", f"Linear(D, V), bias={h.bias}; never tied")
    elif h.tie is TieRule.CHECKPOINT:
        yield Line(f"logits = {n.head}(h)", "when the checkpoint has lm_head.weight, else: "
                   + tied_code.removeprefix("logits = "))
    elif a.tie:
        yield Line(tied_code, "tied to the embedding" + (
            f" ({h.tie} = True)" if isinstance(h.tie, str) else "")
            + (f"; {n.head} exists anyway (mlx-lm builds it)" if h.always else ""))
    else:
        if h.pre_divide is PreDivide.WIDTH_RATIO:
            yield Line("h = h / (hidden_size / dim_model_base)", f"= {a.head_pre_divide}")
        head = f"{n.head}.{h.holds_norm}" if h.holds_norm else n.head
        yield Line(f"logits = {head}(h)", f"Linear(D, V), bias={h.bias}; untied"
                   + (f" ({h.tie} = False)" if isinstance(h.tie, str) else ""))
    if a.head_post is not None:
        op, value = a.head_post
        sym = "/" if op is PostOp.DIV else "*"
        by = (f"({h.post.by} / {POST_OVER[h.post.op]})" if h.post.op in POST_OVER else h.post.by)
        yield Line(f"logits = logits {sym} {by}", f"= {value}" + (
            "; tied heads only" if h.post.op in POST_OVER else ""))
    if h.softcap is FinalSoftcap.COMPILED:
        yield Line("logits = c * tanh(logits / c)", f"compiled softcap, constant c = {COMPILED_SOFTCAP}")
    elif a.final_softcap_value is not None:
        yield Line("logits = tanh(logits / c) * c",
                   f"c = final_logit_softcapping = {a.final_softcap_value}")
    elif h.softcap is FinalSoftcap.FIELD:
        yield Line("(no final softcap)", "final_logit_softcapping is null")


# ----------------------------------------------------------------- layers


def _layer_groups(d: ArchDescriptor, a: UniversalArgs) -> tuple[LayerGroup, ...]:
    rotating = d.layers.make_cache is MakeCache.ROTATING_SLIDING
    one_rope = len({rope_text(s, d, a) for s in a.layers}) == 1

    def describe(s: LayerSpec) -> tuple[str, str, str, str]:
        recurrent = mixer_label(d, a, s)
        ff = "no feed-forward" if single_block(d) is not None and not s.ffn_only else moe_layer_label(d, a, s)
        if recurrent is not None:  # a parallel layer's attention has the rope
            rope = ("rope as above" if one_rope else rope_text(s, d, a)) if parallel_block(d) else "no rope"
            return recurrent[0], rope, recurrent[1], ff
        if s.sliding:
            attention = f"sliding window {a.sliding_window}" + (
                f" (mask window + {d.layers.mask_window_extra})" if d.layers.mask_window_extra else "")
            cache = f"RotatingKVCache({a.sliding_window})" if rotating else "KVCache (windowed mask)"
        else:
            attention, cache = "global", ("CacheList(KVCache, KVCache)" if d.mla is not None
                                          and d.mla.indexer is not None else "KVCache")
        if not s.kv_proj:
            owner = max(t.index for t in a.layers[:s.index + 1] if t.kv_proj)
            attention += f", k/v projections of layer {owner}"
        rope = "rope as above" if one_rope else rope_text(s, d, a)
        return attention, rope, cache, ff

    groups: dict[tuple[str, str, str, str], list[int]] = {}
    for s in a.layers:
        groups.setdefault(describe(s), []).append(s.index)
    return tuple(LayerGroup(tuple(idx), *key) for key, idx in groups.items())


def _ranges(idx: tuple[int, ...]) -> str:
    """(0, 1, 2, 4) -> 'layers 0-2, 4'."""
    parts, start = [], idx[0]
    for prev, cur in zip(idx, idx[1:] + (None,)):
        if cur != prev + 1:
            parts.append(f"{start}-{prev}" if prev > start else f"{start}")
            start = cur
    return ("layers " if len(idx) > 1 else "layer ") + ", ".join(parts)


def _descriptor_dict(d: ArchDescriptor) -> dict[str, Any]:
    """The row's knobs (json-ready: enums are their string values)."""
    row = dataclasses.asdict(d)
    for key in ("fields", "ignored_keys", "accepted_values", "aliases", "notes"):
        row.pop(key)
    row["text_rows"] = sorted(d.text_rows)  # the text model_types with a row of their own
    return row
