"""`mlxbun explain gemma3n`: the forward the gemma3n port runs, as an mlx-lm-style listing in the
universal graph's `Explanation` form (sizes symbolic, given once; layers grouped by what differs:
attention kind, which cache they own or read, activation sparsity, MLP width)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxbun.config_reader import thaw
from mlxbun.models.gemma3n.config import FULL, MODEL_TYPE, check_coverage, gemma3n_args
from mlxbun.models.universal.explain import Explanation, LayerGroup, Line

__all__ = ["explain_gemma3n"]

_NOTES = ("a dedicated port (models/gemma3n/), held bit-exact to mlx-lm like the rows; the vision and "
          "audio towers (model.vision_tower / audio_tower / embed_vision / embed_audio) are dropped at load")


def _sections(a) -> tuple:
    n = a.altup_num_inputs
    clip = f"clip(w, +-{a.altup_coef_clip})" if a.altup_coef_clip is not None else "w (no clip)"
    embedding = (
        Line("h0 = embed_tokens(ids) * D**0.5", "python-float scale"),
        Line("p = embed_tokens_per_layer(where(ids < Vp, ids, 0)) * P**0.5", "reshaped [B, L, N, P]"),
        Line("q = per_layer_projection_norm(per_layer_model_projection(h0) * D**-0.5)", "RMSNorm over P"),
        Line("per_layer = (q + p) * 2**-0.5", "layer i reads per_layer[:, :, i]"),
        Line(f"h = stack([h0] + [altup_projections[j](h0) for j in 1..{n - 1}])", f"{n} AltUp streams"),
        Line("h[1:] *= rms(h0) / maximum(rms(h[1:]), finfo.min)", "mlx-lm's magnitude match"),
    )
    block = (
        Line("m = tanh(altup.modality_router(altup.router_norm(h[a]) * D**-1.0).astype(f32))",
             f"a = altup_active_idx = {a.altup_active_idx}"),
        Line(f"pred = h + h.permuted @ (m @ {clip.replace('w', 'altup.prediction_coefs.w', 1)}.T)",
             "float32, cast back to h's dtype"),
        Line("x = input_layernorm(pred[a])"),
        Line("laurel = x + laurel.post_laurel_norm(laurel.linear_right(laurel.linear_left(x)))",
             f"LAuReL rank {a.laurel_rank}"),
        Line("y = (pred[a] + post_attention_layernorm(self_attn(x)) + laurel) * 2**-0.5"),
        Line("y = y + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(y)))"),
        Line("h = pred + (y - pred[a]) * (m' @ altup.correction_coefs.w.T + 1.0)",
             "m' = router over y; float32; cast to y's dtype"),
        Line("g = gelu_approx(per_layer_input_gate(h[a] * altup.correct_output_scale))"
             if a.altup_correct_scale else "g = gelu_approx(per_layer_input_gate(h[a]))",
             "altup_correct_scale" if a.altup_correct_scale else ""),
        Line("h[1:] += post_per_layer_input_norm(per_layer_projection(g * per_layer[i]))"),
    )
    attention = (
        Line("q = q_norm(q_proj(x) as [B, L, H, hd]); rope(q, offset)", "RMSNorm per head"),
        Line("k = k_norm(k_proj(x)); v = v_norm(v_proj(x))", "v_norm: RMS norm without weight"),
        Line("k = rope(k, offset); k, v = cache.update_and_fetch(k, v)", "owner layers"),
        Line("k, v = cache.keys_and_values()", "KV-shared layers: the owner's cache, no k/v projection"),
        Line("o = o_proj(sdpa(q, k, v, scale=1.0, mask))",
             "the cache attends (plain / quantized / TurboQuant)"),
        Line("offset = cache[0].offset", "one offset for the whole forward, read before any layer"),
    )
    mlp = (
        Line("g = gate_proj(x)"),
        Line("g = gelu_approx(maximum(0, g - (mean(g) + std(g) * sqrt(2) * erfinv(2p - 1))))",
             "sparse layers (p > 0): mlx-lm's compiled gelu_topk"),
        Line("g = gelu_approx(g)", "dense layers"),
        Line("down_proj(g * up_proj(x))"),
    )
    head = (
        Line("h[1:] = altup_unembed_projections[j](h[j]); h[1:] *= rms(h[0]) / maximum(rms(h[1:]), finfo.min)"),
        Line("h = mean(h, axis=0); norm(h)"),
        Line("logits = embed_tokens.as_linear(h)", "always tied"),
        Line(f"logits = tanh(logits / {a.final_logit_softcapping}) * {a.final_logit_softcapping}"
             if a.final_logit_softcapping is not None else "(no final softcap)", "compiled logit_softcap"),
    )
    return (("embedding (per-layer inputs, AltUp streams)", embedding),
            (f"block (AltUp predict / correct around the active stream, {n} streams)", block),
            ("attention (q/k norms, scale 1.0, KV sharing)", attention),
            ("mlp (gelu, gaussian top-k sparsity)", mlp),
            ("final norm and head", head))


def _layer_groups(a) -> tuple[LayerGroup, ...]:
    groups: dict[tuple, list[int]] = {}
    for i in range(a.num_hidden_layers):
        kind = a.layer_types[i]
        attention = "global" if kind == FULL else f"sliding window {a.sliding_window}"
        rope = f"rope base {a.rope_theta if kind == FULL else a.rope_local_base_freq}"
        owner = a.cache_idx[i]
        cache = (f"reads layer {owner}'s cache (KV-shared)" if i >= a.first_kv_shared
                 else ("KVCache" if kind == FULL else f"RotatingKVCache({a.sliding_window})") + f", cache {i}")
        sp = a.sparsity(i)
        mlp = f"width {a.intermediate(i)}" + (f", sparsity {sp}" if sp > 0 else "")
        groups.setdefault((attention, rope, cache, mlp), []).append(i)
    return tuple(LayerGroup(tuple(idx), *key) for key, idx in groups.items())


def explain_gemma3n(config: Mapping[str, Any], *, target: str, source: str) -> Explanation:
    """Explain the forward a gemma3n config.json dict (the wrapper level) resolves to."""
    raw = thaw(config)
    a = gemma3n_args(raw, source)
    report = check_coverage(raw, source)
    coverage = (f"ok ({len(report.understood)} keys understood)" if report.ok
                else "REFUSED: " + "; ".join(f"'{k}' ({why})" for k, why in report.offending.items()))
    inter = a.intermediate_size
    sizes = (("D", "hidden_size", a.hidden_size), ("N", "num_hidden_layers", a.num_hidden_layers),
             ("H", "num_attention_heads", a.num_attention_heads), ("KV", "num_key_value_heads", a.num_key_value_heads),
             ("hd", "head_dim", a.head_dim), ("I", "intermediate_size", list(inter) if isinstance(inter, tuple) else inter),
             ("V", "vocab_size", a.vocab_size), ("Vp", "vocab_size_per_layer_input", a.vocab_size_per_layer_input),
             ("P", "hidden_size_per_layer_input", a.hidden_size_per_layer_input),
             ("shared", "num_kv_shared_layers", a.num_kv_shared_layers))
    return Explanation(model_type=MODEL_TYPE, target=target, config_source=source,
                       mlx_lm_file="models/gemma3n.py", sizes=sizes, sections=_sections(a),
                       layers=_layer_groups(a), coverage=coverage, notes=_NOTES,
                       graph="the gemma3n port")
