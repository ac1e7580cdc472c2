"""The attention section of `mlxbun explain` for an MLA row (`ArchDescriptor.mla`): mla.py's
steps, op for op, per MlaKind, with the config's ranks, head dims, rope and the softmax scale."""

from __future__ import annotations

from collections.abc import Iterator

from mlxbun.models.universal.kinds_mla import MlaKind, MlaMscale, MlaRope
from mlxbun.models.universal.mla import mla_attention
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["mla_lines", "mla_sizes"]


def _rope_note(m, attn, a: UniversalArgs) -> str:
    scaling = a.fields[m.scaling]
    where = f"base {a.fields[m.theta]}, {m.scaling} = {dict(scaling) if scaling else None}"
    if m.rope is MlaRope.DEEPSEEK_YARN:
        mscale = f"x * {attn.rope.mscale}, then " if attn.rope.mscale != 1.0 else ""
        return f"deepseek_v2's yarn: {mscale}traditional rope over dr with yarn freqs; {where}"
    if m.rope is MlaRope.SU_SCALED:
        return (f"SuScaledRoPE over dr (the long factors; x[..., :dr] * {attn.rope._scale}), "
                f"max positions {a.fields[m.max_positions]}; {where}")
    trad = f" ({m.traditional})" if isinstance(m.traditional, str) else ""
    return f"initialize_rope over dr, traditional={attn.rope.traditional}{trad}; {where}"


def _scale_note(m, attn, scaling) -> str:
    if m.mscale is MlaMscale.NONE:
        return f"scale = (dn+dr)**-0.5 = {attn.scale}"
    if m.mscale is MlaMscale.APPLY_YARN:
        return f"scale = apply_yarn_mscale((dn+dr)**-0.5, {m.scaling}) = {attn.scale}"
    if not scaling or not scaling.get("mscale_all_dim"):
        return f"scale = (dn+dr)**-0.5 = {attn.scale} (no mscale_all_dim in {m.scaling})"
    return f"scale = (dn+dr)**-0.5 * mscale(factor, mscale_all_dim)**2 = {attn.scale}"


def mla_sizes(d: ArchDescriptor, a: UniversalArgs) -> tuple[tuple[str, str, object], ...]:
    """The sizes an MLA row's attention runs on, in place of KV and hd: the head dims are
    qk_nope_head_dim + qk_rope_head_dim (q, k) and the value dims, never a config's head_dim
    (transformers writes qk_rope_head_dim there; mlx-lm does not read it)."""
    m = d.mla
    attn = mla_attention(a.fields, m, a.model_type, a.hidden, a.n_heads, a.attn_bias)
    return (("dn", m.nope_dim, attn.qk_nope_head_dim), ("dr", m.rope_dim, attn.qk_rope_head_dim),
            ("dv", m.v_dim or "D // H", attn.v_head_dim), ("kv", m.kv_lora_rank, attn.kv_lora_rank),
            ("q/k head dim", "dn + dr (a config's head_dim is not read)", attn.q_head_dim))


def _indexer_lines(m, attn) -> Iterator[tuple[str, str]]:
    ix, n = attn.indexer, m.indexer
    yield ("c, k_pe = cache[0].update_and_fetch(c, k_pe); ki = cache[1] <- indexer keys",
           "each layer's cache: CacheList(KVCache (latent, rope key), KVCache (the indexer's keys))")
    yield ("qi = heads(indexer.wq_b(q_a_layernorm(q_a_proj(x)))); ki = k_norm(indexer.wk(x))",
           f"{n.heads} = {ix.n_heads} heads of {n.head_dim} = {ix.head_dim}; k_norm LayerNorm; rope over dr "
           f"({n.traditional}: traditional={ix.rope.traditional})")
    yield ("top = argpartition(where(mask, sum_h(relu(qi @ ki.T) * w_h), -inf), -topk)[..., -topk:]",
           f"w = weights_proj(x) * H_i**-0.5 * hd_i**-0.5; only once the cache holds more than "
           f"{n.topk} = {ix.index_topk} positions")
    yield ("L > 1: mask = mask & (positions in top); L == 1: c, k_pe = gather(c, top), gather(k_pe, top)",
           "the attention sees the indexer's top-k only")


def mla_lines(d: ArchDescriptor, a: UniversalArgs) -> Iterator[tuple[str, str]]:
    m = d.mla
    attn = mla_attention(a.fields, m, a.model_type, a.hidden, a.n_heads, a.attn_bias)
    r, kv, dn, dr, dv = (attn.q_lora_rank, attn.kv_lora_rank, attn.qk_nope_head_dim,
                         attn.qk_rope_head_dim, attn.v_head_dim)
    bias = f"bias={a.attn_bias} ({d.attn_bias})" if isinstance(d.attn_bias, str) else f"bias={a.attn_bias}"
    eps = f"eps={attn.kv_a_layernorm.eps}" + (f" ({m.norm_eps})" if isinstance(m.norm_eps, str) else "")
    dv_from = f"{m.v_dim} = {dv}" if m.v_dim is not None else f"D // H = {dv} (not read from the config)"
    if r is None:
        yield "q = q_proj(x)", f"Linear(D, H*(dn+dr)); {m.q_lora_rank} = None; dn = {dn}, dr = {dr}"
    else:
        yield ("q = q_b_proj(q_a_layernorm(q_a_proj(x)))",
               f"{m.q_lora_rank} = {r}: Linear(D, {r}) ({bias}), RMSNorm({r}, {eps}), "
               f"Linear({r}, H*(dn+dr)); dn = {dn} ({m.nope_dim}), dr = {dr} ({m.rope_dim})")
    yield "q_nope, q_pe = split(heads(q), [dn])", "[B, H, L, dn] and [B, H, L, dr]"
    yield ("c, k_pe = split(kv_a_proj_with_mqa(x), [kv])",
           f"Linear(D, kv+dr), {bias}; kv = {m.kv_lora_rank} = {kv}; k_pe one head [B, 1, L, dr]")
    scale = _scale_note(m, attn, a.fields[m.scaling])
    if m.kind is MlaKind.EXPANDED:
        yield ("k_nope, v = split(heads(kv_b_proj(kv_a_layernorm(c))), [dn])",
               f"RMSNorm(kv, {eps}), Linear(kv, H*(dn+dv)); dv = {dv_from}")
        yield "q_pe, k_pe = rope(q_pe, offset), rope(k_pe, offset)", _rope_note(m, attn, a)
        yield "k = concat([k_nope, repeat(k_pe, H)]); q = concat([q_nope, q_pe])", "[B, H, L, dn+dr]"
        yield "k, v = cache.update_and_fetch(k, v)", "the cache holds full per-head keys and values (not the latent)"
        yield "o = sdpa(q, k, v, scale, mask)", scale
    elif m.kind is MlaKind.ABSORBED_DECODE:
        yield "c = expand_dims(kv_a_layernorm(c), 1)", f"RMSNorm(kv, {eps}); one head [B, 1, L, kv]"
        yield "q_pe, k_pe = rope(q_pe, offset), rope(k_pe, offset)", _rope_note(m, attn, a)
        yield ("q_nope, q_pe = q_nope * s, q_pe * s",
               "s: the llama-4 query scale 1 + beta * log(1 + floor(pos / original_max_position_embeddings)) "
               f"from {m.scaling}, cast to h's dtype")
        yield "c, k_pe = cache.update_and_fetch(c, k_pe)", "the cache holds the latent and the rope key"
        yield ("L > 1: k = concat([embed_q(c, transpose=False), broadcast(k_pe, H)]); v = unembed_out(c)",
               f"MultiLinear [H, kv, dn] and [H, dv, kv]; dv = {dv_from}")
        yield "L > 1: o = sdpa(concat([q_nope, q_pe]), k, v, scale, mask)", f"the plain mask; {scale}"
        yield "L == 1: pe = (q_pe * scale) @ k_pe.T", "the rope scores as the sdpa's additive mask"
        yield "L == 1: o = unembed_out(sdpa(embed_q(q_nope), c, c, scale, mask=pe))", "absorbed as deepseek_v3's"
    else:  # MlaKind.ABSORBED, ABSORBED_INDEXED
        yield "c = expand_dims(kv_a_layernorm(c), 1)", f"RMSNorm(kv, {eps}); one head [B, 1, L, kv]"
        yield "q_pe, k_pe = rope(q_pe, offset), rope(k_pe, offset)", _rope_note(m, attn, a)
        if m.kind is MlaKind.ABSORBED_INDEXED:
            yield from _indexer_lines(m, attn)
        else:
            yield "c, k_pe = cache.update_and_fetch(c, k_pe)", "the cache holds the latent and the rope key"
        yield ("pe = where(mask, (q_pe * scale) @ k_pe.T, finfo.min)",
               "the rope scores, passed to the sdpa as its additive mask (mask: a boolean array)")
        yield ("L > 1: k, v = embed_q(c, transpose=False), unembed_out(c)",
               f"MultiLinear [H, kv, dn] and [H, dv, kv]; dv = {dv_from}")
        yield "L == 1: q_nope = embed_q(q_nope); k = v = c", "embed_q absorbed into q"
        yield "o = sdpa(q_nope, k, v, scale, mask=pe)", scale
        yield "L == 1: o = unembed_out(o)", "unembed_out after the sdpa"
    yield "out = o_proj(o)", f"Linear(H*dv, D), {bias}"
