"""UniversalDense: one config-driven module for every arch in the descriptor table.

(The name predates the MoE rows: a row with `moe` knobs runs `moe.py`'s MoEBlock in
place of the dense MLP on the layers its rule picks; everything else is shared.)

Each branch is a transcription of the mlx-lm 0.32.2 file of the arch that takes
it (same ops, order, casts, python-float constants, compiled kernels, mask and
attention dispatch), and the module tree uses that file's attribute names, so
parameter paths, safetensors keys and tap paths are identical to mlx-lm's.
The descriptor (`schema.ArchDescriptor`, a row of `table.py`) selects branches,
as enums the row checked when it was built; `resolve.resolve_args` supplies the
numbers.

`forward_hidden` returns the final-normed hidden state (what feeds the head);
`logits_from_hidden` applies the head and its post-processing, so
`model(ids) == logits_from_hidden(forward_hidden(ids))` bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.attention import softcapped_attention
from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.cache_list import CacheList
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models import layers as L
from mlxbun.models import rope as R
from mlxbun.models.base import create_attention_mask, create_ssm_mask, scaled_dot_product_attention
from mlxbun.models.taps import capture
from mlxbun.models.universal.kinds import (
    BLOCK_SLOTS,
    QKV,
    AttnKind,
    AttnOutGate,
    EmbedScale,
    FinalSoftcap,
    HybridBlock,
    MakeCache,
    MixerKind,
    NormKind,
    NormSlot,
    ParallelMlpNorm,
    ParallelSum,
    PostOp,
    QKNormAt,
    QKNormKind,
    Residual,
    RopeKind,
    TiedOp,
    exhaustive,
)
from mlxbun.models.universal.mixers import MIXERS
from mlxbun.models.universal.mlp import MLP
from mlxbun.models.universal.moe import MoEBlock
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, RopeSpec, UniversalArgs

__all__ = ["UniversalDense"]


def _phi3_rope(s: RopeSpec) -> nn.Module:
    # phi3.py builds its rope by hand
    if s.scaling and s.scaling["type"] in ["longrope", "su"]:
        return R.SuScaledRoPE(
            s.dims, base=s.base, max_position_embeddings=s.max_positions,
            original_max_position_embeddings=s.original_max_positions,
            short_factor=s.scaling["short_factor"], long_factor=s.scaling["long_factor"],
        )
    rope_scale = 1.0
    if s.scaling and s.scaling["type"] == "linear":
        rope_scale = 1 / s.scaling["factor"]
    return nn.RoPE(s.dims, traditional=s.traditional, base=s.base, scale=rope_scale)


def _su_scaled_rope(s: RopeSpec) -> nn.Module:
    # phimoe: a null rope_scaling means plain RoPE; any other is su-scaled with its mscales
    if s.scaling is None:
        return nn.RoPE(s.dims, base=s.base)
    return R.SuScaledRoPE(
        s.dims, base=s.base, max_position_embeddings=s.max_positions,
        original_max_position_embeddings=s.original_max_positions,
        short_factor=s.scaling["short_factor"], long_factor=s.scaling["long_factor"],
        short_mscale=s.scaling["short_mscale"], long_mscale=s.scaling["long_mscale"],
    )


_ROPES = exhaustive(RopeKind, {
    RopeKind.INITIALIZE: lambda s: R.initialize_rope(s.dims, s.base, s.traditional, s.scaling,
                                                     s.max_positions),
    RopeKind.PHI3: _phi3_rope,
    RopeKind.NEMOTRON: lambda s: nn.RoPE(s.dims, base=s.base, scale=s.scale),
    RopeKind.HUNYUAN_ALPHA: lambda s: R.DynamicNTKAlphaRoPE(s.dims, base=s.base, scaling_alpha=s.alpha),
    RopeKind.NANOCHAT: lambda s: R.NanochatRoPE(s.dims, base=s.base),
    RopeKind.SU_SCALED: _su_scaled_rope,
    RopeKind.LAYER_TYPE_PARAMS: lambda s: R.initialize_rope(s.dims, s.base, s.traditional, s.scaling,
                                                            s.max_positions),
    RopeKind.PER_LAYER_LISTS: lambda s: R.initialize_rope(s.dims, s.base, s.traditional, s.scaling,
                                                          s.max_positions),
    RopeKind.LAYER_TYPE_PARTIAL: lambda s: R.initialize_rope(s.dims, s.base, s.traditional, s.scaling,
                                                             s.max_positions),
})


def _make_rope(spec: RopeSpec | None) -> nn.Module:
    return R.NoPE() if spec is None else _ROPES[spec.kind](spec)


# a norm module, or None for the parameter-free functional RMSNorm
_NORMS = exhaustive(NormKind, {
    NormKind.RMS: lambda dims, eps, bias: nn.RMSNorm(dims, eps=eps),
    NormKind.GEMMA_RMS: lambda dims, eps, bias: L.GemmaRMSNorm(dims, eps=eps),
    NormKind.LAYERNORM: lambda dims, eps, bias: nn.LayerNorm(dims, eps=eps, bias=bias),
    NormKind.LAYERNORM1P: lambda dims, eps, bias: L.NemotronLayerNorm1P(dims, eps=eps),
    NormKind.FUNCTIONAL_RMS: lambda dims, eps, bias: None,
})

# (q norm, k norm) modules for H query heads, KV key heads of width hd (None: functional)
_QK_NORMS = exhaustive(QKNormKind, {
    QKNormKind.RMS: lambda qd, kd, H, KV, hd, eps: (nn.RMSNorm(qd, eps=eps), nn.RMSNorm(kd, eps=eps)),
    QKNormKind.GEMMA_RMS: lambda qd, kd, H, KV, hd, eps: (L.GemmaRMSNorm(qd, eps=eps),
                                                          L.GemmaRMSNorm(kd, eps=eps)),
    QKNormKind.LAYERNORM_2D: lambda qd, kd, H, KV, hd, eps: (L.LayerNorm2D(H, hd, eps=eps),
                                                             L.LayerNorm2D(KV, hd, eps=eps)),
    QKNormKind.LAYERNORM_PER_HEAD: lambda qd, kd, H, KV, hd, eps: (L.LayerNormPerHead(hd, H, eps=eps),
                                                                   L.LayerNormPerHead(hd, KV, eps=eps)),
    QKNormKind.FUNCTIONAL_RMS: lambda qd, kd, H, KV, hd, eps: None,
})


# (q, k, v, cache, scale, mask, softcap, sinks) -> o; only SDPA takes sinks (the row checks it)
def _sdpa_f32_if_f16(queries, keys, values, cache, scale, mask, softcap, sinks):  # cohere2
    sdpa_type = mx.float32 if queries.dtype == mx.float16 else queries.dtype
    return scaled_dot_product_attention(
        queries.astype(sdpa_type), keys, values, cache=cache, scale=scale, mask=mask,
    ).astype(queries.dtype)


def _sdpa_q_f32(queries, keys, values, cache, scale, mask, softcap, sinks):  # phi
    return scaled_dot_product_attention(
        queries.astype(mx.float32), keys, values, cache=cache, scale=scale, mask=mask,
    ).astype(values.dtype)


def _sdpa_qk_f32(queries, keys, values, cache, scale, mask, softcap, sinks):  # stablelm
    queries = queries.astype(mx.float32)
    keys = keys.astype(mx.float32)
    return scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=scale, mask=mask).astype(values.dtype)


_ATTENTION = exhaustive(AttnKind, {
    AttnKind.SDPA: lambda q, k, v, cache, scale, mask, softcap, sinks: scaled_dot_product_attention(
        q, k, v, cache=cache, scale=scale, mask=mask, sinks=sinks),
    AttnKind.SOFTCAP: lambda q, k, v, cache, scale, mask, softcap, sinks: softcapped_attention(
        q, k, v, scale, softcap, mask),
    AttnKind.SDPA_F32_IF_F16: _sdpa_f32_if_f16,
    AttnKind.SDPA_Q_F32: _sdpa_q_f32,
    AttnKind.SDPA_QK_F32: _sdpa_qk_f32,
})


class Attention(nn.Module):
    def __init__(self, a: UniversalArgs, d: ArchDescriptor, spec: LayerSpec):
        super().__init__()
        self._d, self._n = d, d.names
        H, KV = spec.heads or (a.n_heads, a.n_kv_heads)  # step3p5, mimo: sliding layers' own counts
        hd, vd = spec.dims or (a.head_dim, a.head_dim)  # mimo_v2_flash: own q/k and value dims
        self._h, self._kv, self._hd = H, KV, hd
        self._scale = a.attn_scale if spec.scale is None else spec.scale
        self._softcap = a.attn_softcap
        self._value_scale = a.fields[d.value_scale] if d.value_scale else None
        self._attend = _ATTENTION[d.attention]
        D, n = a.hidden, d.names
        # KVShare.CLA (hunyuan): takes (and returns) the key / value projections
        self._cla = d.layers.kv_share is not None
        self._sinks = spec.sinks
        if spec.sinks:  # gpt_oss: first in its AttentionBlock's tree, as there
            setattr(self, n.sinks, mx.zeros((H,)))
        self._gate = d.attn_gate if (d.attn_gate_when is None or a.fields[d.attn_gate_when]) else None
        if d.qkv is QKV.SEPARATE:
            q_width = H * hd * (2 if self._gate is AttnOutGate.QUERY_SIGMOID else 1)
            setattr(self, n.q, nn.Linear(D, q_width, bias=a.attn_bias))
            if spec.kv_proj:
                setattr(self, n.k, nn.Linear(D, KV * hd, bias=a.attn_bias))
                setattr(self, n.v, nn.Linear(D, KV * vd, bias=a.attn_bias))
        elif d.qkv is QKV.FUSED:
            setattr(self, n.qkv, nn.Linear(D, H * hd + 2 * (KV * hd), bias=a.attn_bias))
        else:  # QKV.FUSED_NEOX
            setattr(self, n.qkv, nn.Linear(D, 3 * D, bias=a.attn_bias))
        setattr(self, n.o, nn.Linear(H * vd, D, bias=a.out_bias))
        if self._gate is not None and self._gate is not AttnOutGate.QUERY_SIGMOID:  # no bias
            width = H * hd if self._gate is AttnOutGate.SIGMOID else H
            setattr(self, n.attn_gate, nn.Linear(D, width, bias=False))

        self._qk = d.qk_norm if a.qk_norm else None
        if self._qk is not None:
            qd, kd = (H * hd, KV * hd) if self._qk.at is QKNormAt.FLAT else (hd, hd)
            modules = _QK_NORMS[self._qk.kind](qd, kd, H, KV, hd, a.eps)
            if modules is not None:
                for name, module in zip(self._qk.names, modules):
                    setattr(self, name, module)
        if d.block.inner_norms:
            setattr(self, n.inner_norm, nn.RMSNorm(D, eps=a.eps))
        rope = _make_rope(spec.rope)
        # the call goes through _rope_fn; the tree holds `rope` only where mlx-lm's does
        object.__setattr__(self, "_rope_fn", rope)
        if d.rope.child and (spec.rope is not None or d.rope.nope_child):
            self.rope = rope

    def _qk_norm(self, q, k):
        if self._qk.kind is QKNormKind.FUNCTIONAL_RMS:
            return L.rms_norm_no_weight(q), L.rms_norm_no_weight(k)
        qn, kn = self._qk.names
        return self[qn](q), self[kn](k)

    def __call__(self, x, mask=None, cache=None, attn_scale=None, kv_states=None):
        d, n = self._d, self._n
        H, KV, hd = self._h, self._kv, self._hd
        B, L_, _ = x.shape
        if d.block.inner_norms:
            x = self[n.inner_norm](x)
        at = self._qk.at if self._qk is not None else None

        if d.qkv is QKV.FUSED_NEOX:
            qkv = self[n.qkv](x)
            qkv = qkv.reshape(*(qkv.shape[:-1] + (H, 3 * hd)))
            queries, keys, values = [t.transpose(0, 2, 1, 3) for t in qkv.split(3, -1)]
        else:
            if d.qkv is QKV.FUSED:
                qkv = self[n.qkv](x)
                q_size = H * hd
                queries, keys, values = mx.split(qkv, [q_size, q_size + KV * hd], axis=-1)
            elif self._cla:  # hunyuan: a sharing layer takes the projecting layer's k / v
                queries = self[n.q](x)
                if kv_states is None:
                    keys, values = self[n.k](x), self[n.v](x)
                    kv_states = keys, values
                else:
                    keys, values = kv_states
            else:
                queries, keys, values = self[n.q](x), self[n.k](x), self[n.v](x)
            if self._gate is AttnOutGate.QUERY_SIGMOID:  # qwen3_next: per head [q | gate]
                queries, q_gate = mx.split(queries.reshape(B, L_, H, -1), 2, axis=-1)
                q_gate = q_gate.reshape(B, L_, -1)
            if at is QKNormAt.FLAT:
                queries, keys = self._qk_norm(queries, keys)
            queries = queries.reshape(B, L_, H, -1)
            keys = keys.reshape(B, L_, KV, -1)
            if at is QKNormAt.HEADS:
                queries, keys = self._qk_norm(queries, keys)
            queries = queries.transpose(0, 2, 1, 3)
            keys = keys.transpose(0, 2, 1, 3)
            values = values.reshape(B, L_, KV, -1).transpose(0, 2, 1, 3)
            if at is QKNormAt.HEADS_TRANSPOSED:
                queries, keys = self._qk_norm(queries, keys)
            if self._value_scale is not None:  # mimo_v2_flash
                values = values * self._value_scale

        offset = cache.offset if cache is not None else 0
        queries = self._rope_fn(queries, offset=offset)
        keys = self._rope_fn(keys, offset=offset)
        if at is QKNormAt.AFTER_ROPE:
            queries, keys = self._qk_norm(queries, keys)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        if attn_scale is not None:
            queries = queries * attn_scale

        sinks = self[n.sinks] if self._sinks else None
        output = self._attend(queries, keys, values, cache, self._scale, mask, self._softcap, sinks)
        output = output.transpose(0, 2, 1, 3)
        if self._gate is AttnOutGate.HEAD_SIGMOID:
            output = output * mx.sigmoid(self[n.attn_gate](x))[..., None]
        elif self._gate is AttnOutGate.HEAD_SOFTPLUS:  # laguna
            gate = nn.softplus(self[n.attn_gate](x).astype(mx.float32)).astype(output.dtype)
            output = output * gate[..., None]
        output = output.reshape(B, L_, -1)
        if self._gate is AttnOutGate.SIGMOID:
            output = output * mx.sigmoid(self[n.attn_gate](x))
        elif self._gate is AttnOutGate.QUERY_SIGMOID:
            output = output * mx.sigmoid(q_gate)
        if self._cla:
            return self[n.o](output), kv_states
        return self[n.o](output)


_RESIDUAL = exhaustive(Residual, {
    Residual.PLAIN: lambda x, r, s: x + r,
    Residual.SCALED: lambda x, r, s: x + r * s,
    Residual.CLIP_F16: lambda x, r, s: L.clip_residual(x, r),
})


class Block(nn.Module):
    def __init__(self, a: UniversalArgs, d: ArchDescriptor, spec: LayerSpec):
        super().__init__()
        self._d, self._n = d, d.names
        self._parallel = a.parallel
        self._residual_scale = a.residual_scale
        self._residual = _RESIDUAL[d.block.residual]
        self.use_sliding = spec.sliding  # mlx-lm's llama/ministral3 attribute
        self.mixer_kind = spec.mixer
        self._beside = spec.mixer is not MixerKind.ATTENTION and d.hybrid.block is HybridBlock.PARALLEL
        if spec.mixer is MixerKind.ATTENTION:
            self._mixer_name = d.names.attn
            setattr(self, d.names.attn, Attention(a, d, spec))
        else:  # a hybrid's recurrent layer: the row's mixer, called with the ssm mask
            self._mixer_name = d.hybrid.name
            setattr(self, d.hybrid.name, MIXERS[spec.mixer](a, d.hybrid.mixer_knobs(), spec.index))
            if self._beside:  # falcon_h1: attention beside the mixer
                setattr(self, d.names.attn, Attention(a, d, spec))
        # the MoE block on the layers the row's moe rule picks, else the dense MLP
        self._mlp_name = (d.moe.names.block or d.names.mlp) if spec.moe else d.names.mlp
        setattr(self, self._mlp_name, MoEBlock(a, d, spec.index, spec.swiglu_limits) if spec.moe
                else MLP(a, d, limit=spec.swiglu_limits[1]))
        self._cla = d.layers.kv_share is not None
        slots = d.block.norm_slots(a.parallel)
        self._norm_names = d.names.norms
        if spec.mixer is not MixerKind.ATTENTION and d.hybrid.mixer_block is not None:
            # the mixer layers' own norms (olmo_hybrid: pre-norm, the attention layers post-norm)
            slots, self._norm_names = BLOCK_SLOTS[d.hybrid.mixer_block], d.hybrid.mixer_norms
        self._slots = frozenset(slots)  # a tuple would join the module tree
        for slot in slots:
            norm = _NORMS[d.norm.kind](a.hidden, a.eps, a.norm_bias)
            if norm is not None:
                setattr(self, self._norm_names.of(slot), norm)

    def _norm(self, slot: NormSlot, x):
        if slot not in self._slots:
            return x
        if self._d.norm.kind is NormKind.FUNCTIONAL_RMS:
            return L.rms_norm_no_weight(x)
        return self[self._norm_names.of(slot)](x)

    def _add(self, x, r):
        return self._residual(x, r, self._residual_scale)

    def __call__(self, x, mask=None, cache=None, attn_scale=None, kv_states=None):
        attn, mlp = self[self._mixer_name], self[self._mlp_name]
        if self._beside:
            # HybridBlock.PARALLEL: mask (ssm, attention), cache a CacheList(mixer's, attention's)
            h = self._norm(NormSlot.PRE_ATTN, x)
            mc, ac = (None, None) if cache is None else (cache[0], cache[1])
            h = x + attn(h, mask[0], mc) + self[self._n.attn](h, mask[1], ac, attn_scale)
            return self._add_mlp(h, mlp)
        if self.mixer_kind is not MixerKind.ATTENTION:
            r = attn(self._norm(NormSlot.PRE_ATTN, x), mask, cache)
            return self._add_mlp(self._add(x, self._norm(NormSlot.POST_ATTN, r)), mlp)
        if self._parallel:
            b = self._d.block
            h = self._norm(NormSlot.PRE_ATTN, x)
            attn_h = attn(h, mask, cache, attn_scale)
            ff_h = mlp(h if b.parallel_mlp_norm is ParallelMlpNorm.SHARED
                       else self._norm(NormSlot.PRE_MLP, x))
            if b.parallel_sum is ParallelSum.ATTN_FF_X:
                return attn_h + ff_h + x
            return x + attn_h + ff_h
        if self._cla:  # hunyuan: the block hands the k / v projections on, as mlx-lm's does
            r, kv_states = attn(self._norm(NormSlot.PRE_ATTN, x), mask, cache, attn_scale, kv_states)
        else:
            r = attn(self._norm(NormSlot.PRE_ATTN, x), mask, cache, attn_scale)
        r = self._norm(NormSlot.POST_ATTN, r)
        out = self._add_mlp(self._add(x, r), mlp)
        return (out, kv_states) if self._cla else out

    def _add_mlp(self, h, mlp):
        r = mlp(self._norm(NormSlot.PRE_MLP, h))
        return self._add(h, self._norm(NormSlot.POST_MLP, r))


class SingleOpBlock(nn.Module):
    """A hybrid's one-op layer (HybridBlock.SINGLE: mamba2, nemotron_h): x + op(norm(x)), the op
    the row's mixer, the attention or the MLP, held as the `hybrid.name` attribute."""

    def __init__(self, a: UniversalArgs, d: ArchDescriptor, spec: LayerSpec):
        super().__init__()
        h = d.hybrid
        self.use_sliding = spec.sliding
        self.mixer_kind = spec.mixer
        self._ffn = spec.ffn_only
        self._mixer_name, self._norm_name = h.name, d.names.norms.pre_attn
        eps = a.eps if h.norm_eps is None else h.norm_eps
        setattr(self, self._norm_name, _NORMS[d.norm.kind](a.hidden, eps, a.norm_bias))
        if spec.ffn_only:  # the MoE block where the row's moe rule picks the layer
            op = (MoEBlock(a, d, spec.index, spec.swiglu_limits) if spec.moe
                  else MLP(a, d, limit=spec.swiglu_limits[1]))
        elif spec.mixer is MixerKind.ATTENTION:
            op = Attention(a, d, spec)
        else:
            op = MIXERS[spec.mixer](a, h.mixer_knobs(), spec.index)
        setattr(self, h.name, op)

    def __call__(self, x, mask=None, cache=None, attn_scale=None):
        op, h = self[self._mixer_name], self[self._norm_name](x)
        if self._ffn:
            return x + op(h)
        if self.mixer_kind is MixerKind.ATTENTION:
            return x + op(h, mask, cache, attn_scale)
        return x + op(h, mask, cache)


class Backbone(nn.Module):
    """mlx-lm's inner model (`model` / `transformer`): embedding, blocks, final norm."""

    def __init__(self, a: UniversalArgs, d: ArchDescriptor):
        super().__init__()
        n = d.names
        setattr(self, n.embed, nn.Embedding(a.vocab, a.hidden))
        single = d.hybrid is not None and d.hybrid.block is HybridBlock.SINGLE
        setattr(self, n.layers, [(SingleOpBlock if single else Block)(a, d, spec) for spec in a.layers])
        if n.final_norm is not None:
            norm = _NORMS[d.norm.kind](a.hidden, a.eps, a.norm_bias)
            if norm is not None:
                setattr(self, n.final_norm, norm)
        if d.head.in_root:
            setattr(self, n.head, nn.Linear(a.hidden, a.vocab, bias=d.head.bias))


class UniversalDense(nn.Module):
    """A dense decoder for any descriptor in `table.DESCRIPTORS`, parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        super().__init__()
        d, n = descriptor, descriptor.names
        self.descriptor = d
        self.args = args
        self.config = config  # mlxbun.config.TextConfig when known
        self.raw_config = MappingProxyType(dict(raw_config or {}))
        self.profile = None
        self._tied = args.tie
        if n.wrapper is not None:  # a VLM wrapper (qwen3_5): Model.<wrapper> holds root and head
            setattr(self, n.wrapper, nn.Module())
        self.text_model[n.root] = Backbone(args, d)  # an item: mamba2's root is named like the property
        if not d.head.in_root and (not args.tie or d.head.always):
            setattr(self.text_model, n.head, nn.Linear(args.hidden, args.vocab, bias=d.head.bias))
        # mlx-lm's cache list leaves out the one-op MLP / MoE layers (nemotron_h's - and E): layer
        # i's cache is cache[_cache_idx[i]]; mlx-lm takes each mask from the cache of the first
        # layer of its kind
        cached = [s for s in args.layers if not s.ffn_only]
        slots = iter(range(len(cached)))
        self._cache_idx = None if len(cached) == len(args.layers) else [
            None if s.ffn_only else next(slots) for s in args.layers]
        attends = [s.sliding if s.mixer is MixerKind.ATTENTION else None for s in cached]
        self._full_idx = attends.index(False) if False in attends else None
        self._swa_idx = attends.index(True) if True in attends else None
        recurrent = [s.mixer is not MixerKind.ATTENTION for s in cached]
        self._ssm_idx = recurrent.index(True) if any(recurrent) else None
        self._parallel_hybrid = d.hybrid is not None and d.hybrid.block is HybridBlock.PARALLEL

    # ------------------------------------------------------------- structure

    @property
    def model_type(self) -> str:
        return self.descriptor.model_type

    @property
    def text_model(self) -> nn.Module:
        """The module holding root and head: the wrapper's (qwen3_5: language_model), else self."""
        wrapper = self.descriptor.names.wrapper
        return self if wrapper is None else self[wrapper]

    @property
    def backbone(self) -> Backbone:
        return self.text_model[self.descriptor.names.root]

    @property
    def layers(self) -> list:
        return self.backbone[self.descriptor.names.layers]

    @property
    def attention_sinks(self) -> bool:
        """Whether attention adds per-head sink logits (generation refuses quantized KV for them)."""
        return self.descriptor.sinks

    @property
    def tied(self) -> bool:
        return self._tied

    def tie_to_embedding(self) -> None:
        """gemma3_text: no lm_head in the checkpoint means a tied head (mlx-lm's sanitize)."""
        if self.descriptor.names.head in self.text_model:
            self.text_model.pop(self.descriptor.names.head)
        self._tied = True

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's caches: the file's own make_cache, else make_prompt_cache's default."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        if self.descriptor.layers.make_cache is MakeCache.ROTATING_SLIDING:
            # mlx-lm's file ignores max_kv_size here; mlxbun bounds the full-attention layers too.
            w = self.args.sliding_window
            full = (lambda: RotatingKVCache(max_size=max_kv_size, keep=4)) if max_kv_size else KVCache
            return [RotatingKVCache(max_size=w) if s.sliding else full() for s in self.args.layers]
        if self._ssm_idx is not None:  # a hybrid: mlx-lm's make_cache (max_kv_size bounds attention)
            def attn():
                return RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache()
            if self._parallel_hybrid:  # falcon_h1: CacheList(ArraysCache, KVCache) per layer
                return [CacheList(ArraysCache(size=layer[layer._mixer_name].cache_slots), attn())
                        for layer in self.layers]
            return [ArraysCache(size=layer[layer._mixer_name].cache_slots)
                    if spec.mixer is not MixerKind.ATTENTION else attn()
                    for layer, spec in zip(self.layers, self.args.layers) if not spec.ffn_only]
        if max_kv_size is not None:
            return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in self.args.layers]
        return [KVCache() for _ in self.args.layers]

    def layers_tap(self, paths: Any = None):
        return capture(self, paths)

    # ------------------------------------------------------------- forward

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        """The final-normed hidden state [B, L, H] that feeds the head."""
        d, a, n, root = self.descriptor, self.args, self.descriptor.names, self.backbone
        h = root[n.embed](ids)
        es = d.embed_scale
        if es is EmbedScale.SQRT_HIDDEN:
            h = h * (a.fields["hidden_size"] ** 0.5)
        elif es is EmbedScale.SQRT_HIDDEN_BF16:
            h = h * mx.array(a.fields["hidden_size"] ** 0.5, mx.bfloat16).astype(h.dtype)
        elif es is EmbedScale.SQRT_HIDDEN_MUP:
            if a.fields["mup_enabled"]:
                h = h * math.sqrt(a.fields["hidden_size"])
        elif es is not None:
            h = h * a.embed_scale
        if d.embed_norm:
            h = L.rms_norm_no_weight(h)

        blocks = root[n.layers]
        attn_scale = None
        if a.llama4 is not None:
            offset = 0 if cache is None else cache[0].offset
            attn_scale = R.llama4_attn_scale(ids.shape[1], offset, *a.llama4).astype(h.dtype)
        if cache is None:
            cache = [None] * len(blocks)
        fa_mask = swa_mask = None
        if self._full_idx is not None:
            fa_mask = create_attention_mask(h, cache[self._full_idx],
                                            return_array=d.layers.mask_array)
        if self._swa_idx is not None:
            swa_mask = create_attention_mask(h, cache[self._swa_idx], window_size=a.sliding_window)
        ssm_mask = None if self._ssm_idx is None else create_ssm_mask(h, cache[self._ssm_idx])
        if self._parallel_hybrid:  # falcon_h1: both masks from layer 0's CacheList children
            c = (None, None) if cache[0] is None else cache[0]
            ssm_mask = (create_ssm_mask(h, c[0]),
                        create_attention_mask(h, c[1], return_array=d.layers.mask_array))
        if self._cache_idx is not None:  # layer by layer (the one-op MLP / MoE layers hold none)
            cache = [None if j is None else cache[j] for j in self._cache_idx]
        shared_kv = None
        for layer, spec, c in zip(blocks, a.layers, cache):
            mask = ssm_mask if spec.mixer is not MixerKind.ATTENTION else (
                swa_mask if layer.use_sliding else fa_mask)
            if d.layers.kv_share is None:
                h = layer(h, mask, c, attn_scale)
                continue
            if spec.kv_proj:  # KVShare.CLA: a projecting layer starts a new sharing group
                shared_kv = None
            out = layer(h, mask, c, attn_scale, shared_kv)
            # a block the layer-skip drafter skips is the identity: h alone (the skipped blocks
            # are the last ones, so no later layer reads the k / v they would have passed on)
            h, shared_kv = out if isinstance(out, tuple) else (out, shared_kv)

        if d.norm.kind is NormKind.FUNCTIONAL_RMS:
            return L.rms_norm_no_weight(h)
        return root[n.final_norm](h)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        d, a, n = self.descriptor, self.args, self.descriptor.names
        if d.head.in_root:
            out = self.backbone[n.head](h)
        elif self._tied:
            embed = self.backbone[n.embed]
            out = embed.as_linear(h) if d.head.tied_op is TiedOp.AS_LINEAR else h @ embed.weight.T
        else:
            if a.head_pre_divide is not None:
                h = h / a.head_pre_divide
            out = self.text_model[n.head](h)
        if a.head_post is not None:
            op, value = a.head_post
            out = out / value if op is PostOp.DIV else out * value
        if a.final_softcap is FinalSoftcap.COMPILED:
            out = L.softcap_compiled(out)
        elif a.final_softcap_value is not None:
            out = L.logit_softcap(out, a.final_softcap_value)
        return out

    def __call__(self, ids: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.logits_from_hidden(self.forward_hidden(ids, cache))
