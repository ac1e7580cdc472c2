"""Multi-head latent attention (`ArchDescriptor.mla`), op for op as mlx-lm 0.32.2 computes it.
Every kind: q through q_lora_rank (q_a_proj -> q_a_layernorm -> q_b_proj) or a direct q_proj;
kv_a_proj_with_mqa split into the KV latent and one rope key shared by all heads.

MlaKind.EXPANDED (deepseek_v2.py; minicpm3, youtu_llm): kv_b_proj(kv_a_layernorm(latent)) split per head into
k_nope | values; deepseek_v2's own yarn rope on the rope parts; the scale q_head_dim ** -0.5 times
yarn's mscale(mscale_all_dim) squared; the cache holds the full per-head keys [k_nope | k_pe] and
the values.

MlaKind.ABSORBED (deepseek_v3.py): the cache holds the normed latent (as keys, one head) and k_pe
(as values); the rope scores (q_pe * scale) @ k_pe^T, masked, are the sdpa's additive mask; a
prefill expands the latent per head (embed_q / unembed_out), a decode step absorbs embed_q into q
and unembed_out after the sdpa; rope by initialize_rope (traditional).

MlaKind.ABSORBED_DECODE (mistral4.py): ABSORBED's cache and decode step; a prefill attends over
[q_nope | q_pe] and [embed_q(latent) | k_pe broadcast to the heads] with the plain mask; q_nope and
q_pe are times the llama-4 query scale after the rope.

MlaKind.ABSORBED_INDEXED (deepseek_v32.py): ABSORBED with the DSA indexer (mla_indexer.py) choosing
which cached positions each query sees once the cache is longer than index_topk.

The rope (MlaRope), the scale's mscale (MlaMscale) and the latent norms' eps are the row's knobs.

Tensor parallelism (`shard`, as mlx-lm's Model.shard): the heads split across the ranks (q and
kv_b_proj all-to-sharded, embed_q / unembed_out cut to a rank's heads, o_proj sharded-to-all);
the latent, the shared rope key and the indexer are computed whole on every rank."""

from __future__ import annotations

import math
from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import MlxbunError
from mlxbun.models import rope as R
from mlxbun.models.base import scaled_dot_product_attention
from mlxbun.models.multi_linear import MultiLinear
from mlxbun.models.sharding import ALL_TO_SHARDED, SHARDED_TO_ALL, check_heads, shard_linear, slice_heads_inplace
from mlxbun.models.universal.kinds import exhaustive
from mlxbun.models.universal.kinds_mla import MlaKind, MlaMscale, MlaRope
from mlxbun.models.universal.mla_indexer import Indexer
from mlxbun.models.universal.schema_mla import MlaKnobs

__all__ = ["DeepseekV2YarnRoPE", "MlaAbsorbedAttention", "MlaAbsorbedDecodeAttention", "MlaAttention",
           "MlaIndexedAttention", "mla_attention", "mla_dims"]

_ROPE_KEYS = ("original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim")


def _yarn_get_mscale(scale=1, mscale=1):
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn_linear_ramp_mask(min_val, max_val, dim):
    if min_val == max_val:
        max_val += 0.001  # Prevent singularity
    linear_func = (mx.arange(dim, dtype=mx.float32) - min_val) / (max_val - min_val)
    return mx.clip(linear_func, 0, 1)


def _yarn_correction_dim(num_rotations, dim, base, max_position_embeddings):
    return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (
        2 * math.log(base))


class DeepseekV2YarnRoPE(nn.Module):
    """deepseek_v2.py's DeepseekV2YarnRotaryEmbedding (not rope.py's YarnRoPE: it scales all of x)."""

    def __init__(self, dim, base=10000, scaling_factor=1.0, original_max_position_embeddings=4096,
                 beta_fast=32, beta_slow=1, mscale=1, mscale_all_dim=0):
        super().__init__()
        self.mscale = _yarn_get_mscale(scaling_factor, mscale) / _yarn_get_mscale(
            scaling_factor, mscale_all_dim)
        freq_extra = base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim)
        freq_inter = scaling_factor * base ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim)
        low = math.floor(_yarn_correction_dim(beta_fast, dim, base, original_max_position_embeddings))
        high = math.ceil(_yarn_correction_dim(beta_slow, dim, base, original_max_position_embeddings))
        low, high = max(low, 0), min(high, dim - 1)
        freq_mask = 1.0 - _yarn_linear_ramp_mask(low, high, dim // 2)
        self._freqs = (freq_inter * freq_extra) / (freq_inter * freq_mask + freq_extra * (1 - freq_mask))

    def __call__(self, x, offset=0):
        if self.mscale != 1.0:
            x = self.mscale * x
        return mx.fast.rope(x, x.shape[-1], traditional=True, base=None, scale=1.0, offset=offset,
                            freqs=self._freqs)


def _int(fields: Mapping, key: str, model_type: str, optional: bool = False):
    v = fields.get(key)
    if v is None and optional:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise MlxbunError(f"{model_type}: config key {key!r} must be a positive integer"
                          f"{' or null' if optional else ''} (got {v!r})")
    return v


def _literal_or_field(fields: Mapping, value, kind: type, key: str, model_type: str, if_none=None):
    """A knob that is a literal or names a field: the literal, else the field's value, checked
    (a null field reads `if_none` when that is set)."""
    if not isinstance(value, str):
        return value
    v = fields.get(value)
    if v is None and if_none is not None:
        return if_none
    if isinstance(v, bool) is not (kind is bool) or not isinstance(v, kind):
        raise MlxbunError(f"{model_type}: config key {value!r} must be a {kind.__name__} ({key}; got {v!r})")
    return v


def mla_dims(fields: Mapping, m: MlaKnobs, model_type: str, hidden: int, heads: int) -> dict:
    """The MLA numbers of a config, each checked (a bad value names its key)."""
    dims = dict(q_lora_rank=_int(fields, m.q_lora_rank, model_type, optional=m.q_direct),
                kv_lora_rank=_int(fields, m.kv_lora_rank, model_type),
                nope=_int(fields, m.nope_dim, model_type), rope=_int(fields, m.rope_dim, model_type),
                v=hidden // heads if m.v_dim is None else _int(fields, m.v_dim, model_type),
                eps=_literal_or_field(fields, m.norm_eps, float, "the latent norms' eps", model_type))
    if dims["rope"] % 2:
        raise MlxbunError(f"{model_type}: config key {m.rope_dim!r} must be even (got {dims['rope']})")
    scaling = fields.get(m.scaling)
    if scaling is not None or m.rope is not MlaRope.INITIALIZE:  # initialize_rope allows none
        if not isinstance(scaling, Mapping):
            raise MlxbunError(f"{model_type}: config key {m.scaling!r} must be a dict (got {scaling!r})")
        needs_factor = m.rope is MlaRope.DEEPSEEK_YARN or (
            m.mscale is MlaMscale.ALL_DIM and scaling.get("mscale_all_dim"))
        if needs_factor and not isinstance(scaling.get("factor"), (int, float)):
            raise MlxbunError(f"{model_type}: config key {m.scaling!r} needs a numeric 'factor' (mlx-lm's "
                              f"{model_type} reads {m.scaling}['factor']; got {scaling!r})")
    dims["scaling"] = scaling
    return dims


def _softmax_scale(scale: float, m: MlaKnobs, scaling) -> float:
    """q_head_dim ** -0.5, times yarn's mscale(mscale_all_dim) squared per MlaMscale, as mlx-lm's
    deepseek_v2 / v3 compute it (the same float either way: v2 multiplies by 1.0 * 1.0 at factor <= 1)
    or rope_utils.apply_yarn_mscale (mistral4)."""
    if m.mscale is MlaMscale.APPLY_YARN:
        return R.apply_yarn_mscale(scale, scaling)
    if m.mscale is MlaMscale.ALL_DIM and scaling is not None:
        mscale_all_dim = scaling.get("mscale_all_dim", 0)
        if mscale_all_dim:
            scaling_factor = scaling["factor"]
            if scaling_factor > 1:
                s = 0.1 * mscale_all_dim * math.log(scaling_factor) + 1.0
                scale = scale * s * s
    return scale


def _mla_rope(fields: Mapping, m: MlaKnobs, model_type: str, dims: int, scaling) -> nn.Module:
    """The rope over the rope part of q and k, per MlaRope."""
    if m.rope is MlaRope.DEEPSEEK_YARN:
        rope_kwargs = {key: scaling[key] for key in _ROPE_KEYS if key in scaling}
        return DeepseekV2YarnRoPE(dims, base=fields[m.theta], scaling_factor=scaling["factor"], **rope_kwargs)
    if m.rope is MlaRope.SU_SCALED:
        return R.SuScaledRoPE(dims=dims, base=fields[m.theta], max_position_embeddings=fields[m.max_positions],
                              original_max_position_embeddings=scaling.get("original_max_position_embeddings",
                                                                           4096),
                              short_factor=scaling.get("short_factor", 1.0),
                              long_factor=scaling.get("long_factor", 1.0))
    traditional = _literal_or_field(fields, m.traditional, bool, "the rope's traditional", model_type,
                                    m.traditional_if_none)
    return R.initialize_rope(dims, fields[m.theta], traditional, scaling, fields[m.max_positions])


def _init_q_kv_a(self, dm: dict, hidden: int, heads: int, bias: bool) -> None:
    """The projections both kinds share, as mlx-lm builds them."""
    self.num_heads = heads
    self.q_lora_rank, self.kv_lora_rank = dm["q_lora_rank"], dm["kv_lora_rank"]
    self.qk_nope_head_dim, self.qk_rope_head_dim = dm["nope"], dm["rope"]
    self.v_head_dim = dm["v"]
    self.q_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
    self.scale = self.q_head_dim**-0.5
    eps = dm["eps"]
    if self.q_lora_rank is None:
        self.q_proj = nn.Linear(hidden, heads * self.q_head_dim, bias=False)
    else:
        self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias)
        self.q_a_layernorm = nn.RMSNorm(self.q_lora_rank, eps=eps)
        self.q_b_proj = nn.Linear(self.q_lora_rank, heads * self.q_head_dim, bias=False)
    self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
    self.kv_a_layernorm = nn.RMSNorm(self.kv_lora_rank, eps=eps)


def _q_and_latent(self, x):
    """q_nope, q_pe [B, H, L, .], the latent before its norm [B, L, kv], k_pe [B, 1, L, dr]."""
    B, L, D = x.shape
    if self.q_lora_rank is None:
        q = self.q_proj(x)
    else:
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
    q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
    q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
    compressed_kv = self.kv_a_proj_with_mqa(x)
    compressed_kv, k_pe = mx.split(compressed_kv, [self.kv_lora_rank], axis=-1)
    k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
    return q_nope, q_pe, compressed_kv, k_pe


def _shard_heads(self, group, where: str, extra: tuple[str, ...] = ()) -> None:
    """The heads' split every kind makes (mlx-lm's Model.shard): q_proj / q_b_proj and `extra`
    all-to-sharded, o_proj sharded-to-all, num_heads divided; every split checked before any is set."""
    check_heads(where, self.num_heads, group.size())
    q = "q_proj" if self.q_lora_rank is None else "q_b_proj"
    layers = {name: shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
              for name in (q, *extra)}
    layers["o_proj"] = shard_linear(self["o_proj"], SHARDED_TO_ALL, group, where=f"{where}.o_proj")
    for name, module in layers.items():
        setattr(self, name, module)
    self.num_heads //= group.size()


class MlaAttention(nn.Module):
    """MlaKind.EXPANDED: deepseek_v2's DeepseekV2Attention."""

    def __init__(self, fields: Mapping, m: MlaKnobs, model_type: str, hidden: int, heads: int,
                 bias: bool):
        super().__init__()
        dm = mla_dims(fields, m, model_type, hidden, heads)
        _init_q_kv_a(self, dm, hidden, heads, bias)
        self.kv_b_proj = nn.Linear(
            self.kv_lora_rank, heads * (self.q_head_dim - self.qk_rope_head_dim + self.v_head_dim),
            bias=False)
        self.o_proj = nn.Linear(heads * self.v_head_dim, hidden, bias=bias)
        self.scale = _softmax_scale(self.scale, m, dm["scaling"])
        self.rope = _mla_rope(fields, m, model_type, self.qk_rope_head_dim, dm["scaling"])

    def shard(self, group, where: str = "self_attn") -> None:
        """Split the heads across `group` as mlx-lm deepseek_v2's Model.shard: q (q_proj or
        q_b_proj) and kv_b_proj ([heads, nope | v] rows) all-to-sharded, o_proj sharded-to-all;
        the latent projections (kv_a_proj_with_mqa, q_a_proj) and their norms replicated."""
        _shard_heads(self, group, where, ("kv_b_proj",))

    def __call__(self, x, mask=None, cache=None, attn_scale=None):  # attn_scale: None (schema)
        B, L, D = x.shape
        q_nope, q_pe, compressed_kv, k_pe = _q_and_latent(self, x)
        kv = self.kv_b_proj(self.kv_a_layernorm(compressed_kv))
        kv = kv.reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)
        k_nope, values = mx.split(kv, [self.qk_nope_head_dim], axis=-1)
        if cache is not None:
            q_pe = self.rope(q_pe, cache.offset)
            k_pe = self.rope(k_pe, cache.offset)
            k_pe = mx.repeat(k_pe, self.num_heads, axis=1)
            keys, values = cache.update_and_fetch(mx.concatenate([k_nope, k_pe], axis=-1), values)
        else:
            q_pe = self.rope(q_pe)
            k_pe = self.rope(k_pe)
            k_pe = mx.repeat(k_pe, self.num_heads, axis=1)
            keys = mx.concatenate([k_nope, k_pe], axis=-1)
        queries = mx.concatenate([q_nope, q_pe], axis=-1)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                              mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output)


class MlaAbsorbedAttention(nn.Module):
    """MlaKind.ABSORBED: deepseek_v3's DeepseekV3Attention (takes the boolean mask array)."""

    def __init__(self, fields: Mapping, m: MlaKnobs, model_type: str, hidden: int, heads: int,
                 bias: bool):
        super().__init__()
        dm = mla_dims(fields, m, model_type, hidden, heads)
        _init_q_kv_a(self, dm, hidden, heads, bias)
        self.embed_q = MultiLinear(self.qk_nope_head_dim, self.kv_lora_rank, heads)
        self.unembed_out = MultiLinear(self.kv_lora_rank, self.v_head_dim, heads)
        self.o_proj = nn.Linear(heads * self.v_head_dim, hidden, bias=bias)
        self.scale = _softmax_scale(self.scale, m, dm["scaling"])
        self.rope = _mla_rope(fields, m, model_type, self.qk_rope_head_dim, dm["scaling"])

    def shard(self, group, where: str = "self_attn") -> None:
        """Split the heads across `group` as mlx-lm deepseek_v3's Model.shard (also glm4_moe_lite's,
        mistral4's, deepseek_v32's): q (q_proj or q_b_proj) all-to-sharded, embed_q / unembed_out
        cut to this rank's heads, o_proj sharded-to-all; the latent, its rope key and (deepseek_v32)
        the indexer replicated, as there. Checked before any weight moves."""
        _shard_heads(self, group, where)
        slice_heads_inplace(self.embed_q, group)  # whole heads: _shard_heads checked them
        slice_heads_inplace(self.unembed_out, group)

    def __call__(self, x, mask=None, cache=None, attn_scale=None):  # attn_scale: None (schema)
        B, L, D = x.shape
        q_nope, q_pe, compressed_kv, k_pe = _q_and_latent(self, x)
        kv_latent = self.kv_a_layernorm(compressed_kv)
        offset = cache.offset if cache is not None else 0
        q_pe = self.rope(q_pe, offset)
        k_pe = self.rope(k_pe, offset)
        kv_latent = mx.expand_dims(kv_latent, axis=1)
        if cache is not None:
            kv_latent, k_pe = cache.update_and_fetch(kv_latent, k_pe)
        return self._attend_latent(q_nope, q_pe, kv_latent, k_pe, mask, cache)

    def _attend_latent(self, q_nope, q_pe, kv_latent, k_pe, mask, cache):
        """deepseek_v3's absorbed attention over the (cached) latent: the rope part as an additive
        score mask, q absorbed into the latent on a decode step, the values unembedded after it."""
        B, _, L, _ = q_nope.shape
        pe_scores = (q_pe * self.scale) @ k_pe.swapaxes(-1, -2)
        if mask is not None:
            pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
        if L == 1:
            q_nope = self.embed_q(q_nope)
            k = v = kv_latent
        else:
            k = self.embed_q(kv_latent, transpose=False)
            v = self.unembed_out(kv_latent)
        output = scaled_dot_product_attention(q_nope, k, v, cache=cache, scale=self.scale, mask=pe_scores)
        if L == 1:
            output = self.unembed_out(output)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output)


class MlaAbsorbedDecodeAttention(MlaAbsorbedAttention):
    """MlaKind.ABSORBED_DECODE: mistral4's Mistral4Attention (the plain mask; q times the llama-4
    query scale the backbone passes)."""

    def __call__(self, x, mask=None, cache=None, attn_scale=None):
        B, L, D = x.shape
        q_nope, q_rope, k_latent, k_rope = _q_and_latent(self, x)
        kv_latent = mx.expand_dims(self.kv_a_layernorm(k_latent), axis=1)
        offset = cache.offset if cache is not None else 0
        q_rope = self.rope(q_rope, offset)
        k_rope = self.rope(k_rope, offset)
        q_nope = q_nope * attn_scale
        q_rope = q_rope * attn_scale
        if cache is not None:
            kv_latent, k_rope = cache.update_and_fetch(kv_latent, k_rope)
        if L == 1:
            pe_scores = (q_rope * self.scale) @ k_rope.swapaxes(-1, -2)
            if mask is not None:
                pe_scores = mx.where(mask, pe_scores, mx.array(mx.finfo(pe_scores.dtype).min, pe_scores.dtype))
            output = scaled_dot_product_attention(self.embed_q(q_nope), kv_latent, kv_latent, cache=cache,
                                                  scale=self.scale, mask=pe_scores)
            output = self.unembed_out(output)
        else:
            k_nope = self.embed_q(kv_latent, transpose=False)
            v = self.unembed_out(kv_latent)
            k_rope = mx.broadcast_to(k_rope, [B, self.num_heads, k_rope.shape[2], self.qk_rope_head_dim])
            output = scaled_dot_product_attention(mx.concatenate([q_nope, q_rope], axis=-1),
                                                  mx.concatenate([k_nope, k_rope], axis=-1), v, cache=cache,
                                                  scale=self.scale, mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output)


class MlaIndexedAttention(MlaAbsorbedAttention):
    """MlaKind.ABSORBED_INDEXED: deepseek_v32's DeepseekV32Attention (the cache a CacheList of the
    latent's KVCache and the indexer's; the boolean mask array)."""

    def __init__(self, fields: Mapping, m: MlaKnobs, model_type: str, hidden: int, heads: int,
                 bias: bool):
        super().__init__(fields, m, model_type, hidden, heads, bias)
        ix = m.indexer
        self.indexer = Indexer(hidden, self.q_lora_rank, _int(fields, ix.heads, model_type),
                               _int(fields, ix.head_dim, model_type), _int(fields, ix.topk, model_type),
                               self.qk_rope_head_dim, fields[m.theta],
                               _literal_or_field(fields, ix.traditional, bool, "the indexer rope's traditional",
                                                 model_type),
                               fields[m.scaling], fields[m.max_positions])

    def __call__(self, x, mask=None, cache=None, attn_scale=None):  # attn_scale: None (schema)
        B, L, D = x.shape
        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr)
        q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(0, 2, 1, 3)
        q_nope, q_pe = mx.split(q, [self.qk_nope_head_dim], axis=-1)
        compressed_kv = self.kv_a_proj_with_mqa(x)
        compressed_kv, k_pe = mx.split(compressed_kv, [self.kv_lora_rank], axis=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(0, 2, 1, 3)
        kv_latent = self.kv_a_layernorm(compressed_kv)
        offset = cache[0].offset if cache is not None else 0
        q_pe = self.rope(q_pe, offset)
        k_pe = self.rope(k_pe, offset)
        kv_latent = mx.expand_dims(kv_latent, axis=1)
        if cache is not None:
            kv_latent, k_pe = cache[0].update_and_fetch(kv_latent, k_pe)
        else:
            cache = [None] * 2
        topk_indices = self.indexer(x, qr, mask, cache=cache[1])
        if topk_indices is not None:
            topk_indices = mx.stop_gradient(topk_indices)
            if L == 1:
                idx = topk_indices[:, :, 0, :, None]
                kv_latent = mx.take_along_axis(
                    kv_latent, mx.broadcast_to(idx, idx.shape[:-1] + (kv_latent.shape[-1],)), axis=2)
                k_pe = mx.take_along_axis(k_pe, mx.broadcast_to(idx, idx.shape[:-1] + (k_pe.shape[-1],)), axis=2)
                if mask is not None:  # an array only over a fixed-shape cache (the compiled step's)
                    mask = mx.broadcast_to(mask, (*topk_indices.shape[:-1], mask.shape[-1]))
                    mask = mx.take_along_axis(mask, topk_indices, axis=-1)
            else:
                shape = list(topk_indices.shape)
                shape[-1] = kv_latent.shape[2]
                sparse_mask = mx.zeros(shape, dtype=mx.bool_)
                sparse_mask = mx.put_along_axis(sparse_mask, topk_indices, mx.array(True), axis=-1)
                if mask is not None:
                    sparse_mask = sparse_mask & mask
                mask = sparse_mask
        if cache[0] is not None:  # as mlx-lm: the indexer's cache evaluated with the latent's
            cache[0].keys = mx.depends(cache[0].keys, (cache[1].keys, cache[1].values))
        return self._attend_latent(q_nope, q_pe, kv_latent, k_pe, mask, cache[0])


_MLA = exhaustive(MlaKind, {MlaKind.EXPANDED: MlaAttention, MlaKind.ABSORBED: MlaAbsorbedAttention,
                            MlaKind.ABSORBED_DECODE: MlaAbsorbedDecodeAttention,
                            MlaKind.ABSORBED_INDEXED: MlaIndexedAttention})


def mla_attention(fields: Mapping, m: MlaKnobs, model_type: str, hidden: int, heads: int,
                  bias: bool) -> nn.Module:
    """The attention module of an `mla` row's kind."""
    return _MLA[m.kind](fields, m, model_type, hidden, heads, bias)
