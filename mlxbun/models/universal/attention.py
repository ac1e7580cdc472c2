"""The universal graph's attention: the rope each layer builds (`RopeSpec` -> module), the
q/k norm kinds, the SDPA variants some archs run in float32, and `Attention`, op for op as the
mlx-lm file of each row computes it (parameter names from the row's `Names`)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxbun.attention import softcapped_attention
from mlxbun.errors import MlxbunError
from mlxbun.models import layers as L
from mlxbun.models import rope as R
from mlxbun.models.base import scaled_dot_product_attention
from mlxbun.models.sharding import (
    ALL_TO_SHARDED,
    SHARDED_TO_ALL,
    ShardedRMSNorm,
    ShardingError,
    check_heads,
    repeat_heads,
    repeat_rows,
    shard_linear,
    slice_heads,
)
from mlxbun.models.universal.kinds import (
    QKV,
    AttnKind,
    AttnOutGate,
    QKNormAt,
    QKNormKind,
    RopeKind,
    exhaustive,
)
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, RopeSpec, UniversalArgs

__all__ = ["Attention", "rope_and_cache"]


def rope_and_cache(rope, queries, keys, values, cache):
    """mlx-lm's common step: queries and keys rotated at the cache's offset (0 without one), then the
    keys and values through the cache; returns (queries, keys, values)."""
    if cache is None:
        return rope(queries), rope(keys), values
    queries, keys = rope(queries, offset=cache.offset), rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    return queries, keys, values


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
    RopeKind.LAYER_TYPE_PLAIN: lambda s: nn.RoPE(s.dims, traditional=False, base=s.base),
})


def _make_rope(spec: RopeSpec | None) -> nn.Module:
    return R.NoPE() if spec is None else _ROPES[spec.kind](spec)


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
        self._qk_eps = a.eps  # a functional q/k norm's (nanochat's 1e-5; llama4_text's rms_norm_eps)
        self._softcap = a.attn_softcap
        self._value_scale = a.fields[d.value_scale] if d.value_scale else None
        self._q_scale = a.fields[d.qk_norm.q_scale] if d.qk_norm and d.qk_norm.q_scale else None
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
        elif d.qkv in (QKV.FUSED, QKV.FUSED_GROUPED):
            setattr(self, n.qkv, nn.Linear(D, H * hd + 2 * (KV * hd), bias=a.attn_bias))
        else:  # QKV.FUSED_NEOX
            setattr(self, n.qkv, nn.Linear(D, 3 * D, bias=a.attn_bias))
        setattr(self, n.o, nn.Linear(H * vd, D, bias=a.out_bias))
        if self._gate is not None and self._gate is not AttnOutGate.QUERY_SIGMOID:
            width = H * hd if self._gate is AttnOutGate.SIGMOID else H  # biased: spark2_5's only
            setattr(self, n.attn_gate, nn.Linear(D, width, bias=self._gate is AttnOutGate.HEAD_SIGMOID_F32
                                                 and a.attn_bias))

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
            setattr(self, d.names.rope, rope)

    def shard(self, group, where: str = "attention") -> None:
        """Split the heads across `group` (mlx-lm's Model.shard: q / k / v all-to-sharded, o
        sharded-to-all; KV heads fewer than the ranks repeated as mlx-lm's qwen3_5 does); the
        per-head pieces (sinks, gates, per-head norms) follow their heads. Checked first: a split
        that cannot be made raises ShardingError before any weight moves."""
        d, n, N = self._d, self._n, group.size()
        H, KV = self._h, self._kv
        check_heads(where, H, N)
        if d.kv_tile:  # plamo: query head j reads KV head j % KV, so every rank keeps every KV head
            if (H // N) % KV or self._qk is not None or self._gate is not None or self._sinks:
                raise ShardingError(f"{where}: tiled KV heads ({KV}) split only under {H // N} query heads "
                                    "per rank that tile them, without q/k norms, gates or sinks")
            layers = {n.q: shard_linear(self[n.q], ALL_TO_SHARDED, group, where=f"{where}.{n.q}"),
                      n.o: shard_linear(self[n.o], SHARDED_TO_ALL, group, where=f"{where}.{n.o}")}
            for name, module in layers.items():
                setattr(self, name, module)
            self._h = H // N
            return
        repeat_kv = KV % N != 0
        if repeat_kv and (N % KV or d.qkv not in (QKV.SEPARATE, QKV.FUSED)):
            raise ShardingError(f"{where}: {KV} KV heads neither split across {N} ranks nor repeat "
                                f"to one per rank" + ("" if d.qkv is QKV.SEPARATE else f" ({d.qkv} q/k/v)"))
        qk = self._qk
        if qk is not None and qk.at is QKNormAt.FLAT and qk.kind is not QKNormKind.RMS:
            raise ShardingError(f"{where}: a {qk.kind} q/k norm over all heads has no sharded form")
        if qk is not None and repeat_kv and (qk.at is QKNormAt.FLAT or qk.kind in (
                QKNormKind.LAYERNORM_2D, QKNormKind.LAYERNORM_PER_HEAD)):
            raise ShardingError(f"{where}: a {qk.kind} k norm over {KV} KV heads cannot follow heads "
                                f"repeated to {N} ranks")
        layers = {}  # every split computed (and checked) before any is set
        if d.qkv is QKV.SEPARATE:
            layers[n.q] = shard_linear(self[n.q], ALL_TO_SHARDED, group, where=f"{where}.{n.q}")
        elif d.qkv is QKV.FUSED and not repeat_kv:  # (repeated KV heads: last, below)
            q_size = H * self._hd
            layers[n.qkv] = shard_linear(self[n.qkv], ALL_TO_SHARDED, group, where=f"{where}.{n.qkv}",
                                         segments=[q_size, q_size + KV * self._hd])
        else:  # QKV.FUSED_NEOX: [heads, 3 * head_dim] rows, so a contiguous split keeps whole heads;
            # QKV.FUSED_GROUPED: [KV, (H/KV + 2) * head_dim] rows, whole KV groups (KV % N == 0 here)
            layers[n.qkv] = shard_linear(self[n.qkv], ALL_TO_SHARDED, group, where=f"{where}.{n.qkv}")
        layers[n.o] = shard_linear(self[n.o], SHARDED_TO_ALL, group, where=f"{where}.{n.o}")
        if self._gate is not None and self._gate is not AttnOutGate.QUERY_SIGMOID:
            layers[n.attn_gate] = shard_linear(self[n.attn_gate], ALL_TO_SHARDED, group,
                                               where=f"{where}.{n.attn_gate}")
        if qk is not None and qk.at is QKNormAt.FLAT:
            for name in qk.names:
                layers[name] = ShardedRMSNorm.from_rms_norm(self[name], group, where=f"{where}.{name}")
        kv = [name for name in (n.k, n.v) if d.qkv is QKV.SEPARATE and name in self]  # CLA sharers: none
        if not repeat_kv:
            for name in kv:
                layers[name] = shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
        for name in kv if repeat_kv else ():  # last: repeated to N heads, the split always works
            repeat_heads(self[name], KV, N)
            layers[name] = shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
        if repeat_kv and d.qkv is QKV.FUSED:  # last, alike: the k rows, then the v rows, repeated
            q_size, hd = H * self._hd, self._hd  # (gpt_bigcode's multi-query c_attn)
            for start in (q_size, q_size + N * hd):
                repeat_rows(self[n.qkv], KV, N, rows=(start, start + KV * hd))
            layers[n.qkv] = shard_linear(self[n.qkv], ALL_TO_SHARDED, group, where=f"{where}.{n.qkv}",
                                         segments=[q_size, q_size + N * hd])
        for name, module in layers.items():
            setattr(self, name, module)
        if qk is not None and qk.kind is QKNormKind.LAYERNORM_2D:  # weight [heads, head_dim]
            for name in qk.names:
                self[name].weight = slice_heads(self[name].weight, group)
        elif qk is not None and qk.kind is QKNormKind.LAYERNORM_PER_HEAD:  # one norm per head
            for name in qk.names:
                norms = self[name].norms
                per = len(norms) // N
                self[name].norms = norms[group.rank() * per:(group.rank() + 1) * per]
        if self._sinks:
            setattr(self, n.sinks, slice_heads(self[n.sinks], group))
        self._h, self._kv = H // N, max(KV // N, 1)

    def _qk_norm(self, q, k):
        if self._qk.kind is QKNormKind.FUNCTIONAL_RMS:
            q, k = L.rms_norm_no_weight(q, self._qk_eps), L.rms_norm_no_weight(k, self._qk_eps)
        else:
            qn, kn = self._qk.names
            q, k = self[qn](q), self[kn](k)
        return (q, k) if self._q_scale is None else (q * self._q_scale, k)  # muse_glimmer's qk_scale_factor

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
            elif d.qkv is QKV.FUSED_GROUPED:  # internlm2: per KV head [its queries | key | value]
                groups = H // KV
                qkv = self[n.qkv](x).reshape(B, L_, -1, 2 + groups, hd)
                queries = qkv[..., :groups, :].reshape(B, L_, -1, hd)
                keys, values = qkv[..., -2, :], qkv[..., -1, :]
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
        if self._d.kv_tile:  # plamo: KV head j % KV for query head j
            if not isinstance(keys, mx.array):
                raise MlxbunError(f"{d.model_type}: tiled KV heads take a plain KV cache (mlx-lm's mx.tile "
                                  f"cannot tile a {type(cache).__name__}'s quantized keys)")
            keys, values = (mx.tile(t, [1, H // KV, 1, 1]) for t in (keys, values))
        if attn_scale is not None:
            queries = queries * attn_scale

        sinks = self[n.sinks] if self._sinks else None
        output = self._attend(queries, keys, values, cache, self._scale, mask, self._softcap, sinks)
        output = output.transpose(0, 2, 1, 3)
        if self._gate is AttnOutGate.HEAD_SIGMOID:
            output = output * mx.sigmoid(self[n.attn_gate](x))[..., None]
        elif self._gate is AttnOutGate.HEAD_SIGMOID_F32:  # spark2_5
            output = output * mx.sigmoid(self[n.attn_gate](x).astype(mx.float32)).astype(output.dtype)[..., None]
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
