"""`mlxbun explain` for the gemma4 rows: gemma4.py's forward (not the shared blocks'), op for op,
with the config's numbers; `explain.py` wraps these (code, note) pairs in its Lines and groups."""

from __future__ import annotations

from collections.abc import Iterator

from mlxbun.models.universal.gemma4_args import GEMMA4_MODEL_TYPES, Gemma4Layer, first_kv_shared, gemma4_layers
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["GEMMA4_MODEL_TYPES", "gemma4_layer_groups", "gemma4_sections"]

Pairs = tuple[tuple[str, str], ...]


def _embedding(a: UniversalArgs) -> Iterator[tuple[str, str]]:
    f = a.fields
    yield "h = model.embed_tokens(ids) * D**0.5", f"Embedding(V, D); D**0.5 = {f['hidden_size'] ** 0.5}"
    P = f["hidden_size_per_layer_input"]
    if not P:
        return
    yield ("e = model.embed_tokens_per_layer(ids) * P**0.5",
           f"per-layer inputs: Embedding({f['vocab_size_per_layer_input']}, N*P), P = "
           f"hidden_size_per_layer_input = {P}; unflattened to [B, L, N, P]")
    yield ("p = model.per_layer_projection_norm(model.per_layer_model_projection(h) * D**-0.5)",
           f"Linear(D, N*P), unflattened, RMSNorm(P, eps={a.eps})")
    yield "per_layer = (p + e) * 2**-0.5", "layer i reads per_layer[:, :, i]"


def _block(a: UniversalArgs) -> Iterator[tuple[str, str]]:
    f = a.fields
    yield ("h = h + post_attention_layernorm(self_attn(input_layernorm(h)))",
           "self_attn also returns (keys, values, offset) for the KV-shared layers")
    if f["enable_moe_block"]:
        yield ("h1 = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(h)))", "the dense MLP")
        yield ("h2 = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(h), *router(h)))",
               "the MoE block beside it, routed on the un-normed h")
        yield "h = h + post_feedforward_layernorm(h1 + h2)", ""
    else:
        yield "h = h + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(h)))", ""
    if f["hidden_size_per_layer_input"]:
        yield ("h = h + post_per_layer_input_norm(per_layer_projection(gelu_approx("
               "per_layer_input_gate(h)) * per_layer[i]))", "Linear(D, P), Linear(P, D)")
    yield "h = h * layer_scalar", "a learned [1] per layer"


def _attention(a: UniversalArgs) -> Iterator[tuple[str, str]]:
    f = a.fields
    yield "q = rope(q_norm(heads(q_proj(x))), offset)", "q_norm RMSNorm(hd_i) per head; hd_i per layer"
    yield ("k = rope(k_norm(heads(k_proj(x))), offset = cache.offset)",
           "projecting layers only; KV_i kv heads of hd_i")
    yield ("v = rms_norm(heads(v_proj(x)))  |  rms_norm(heads(k_proj(x)))",
           "RMS without a scale; k = v layers: the values are the key projection")
    yield ("k, v, offset = intermediates[previous_kvs[i]]",
           f"KV-shared layers (i >= N - num_kv_shared_layers = {first_kv_shared(f)}): the keys, values "
           "and offset their type's last projecting layer computed in this forward")
    yield "k, v = cache.update_and_fetch(k, v)", "projecting layers (the shared ones hold no cache)"
    yield "o = sdpa(q, k, v, scale=1.0, mask)", ("the mask of the layer's type; a shared layer: no cache, "
                                                 "or its producer's over packed quantized keys")
    yield "out = o_proj(o)", "Linear(H*hd_i, D); no biases anywhere"


def _mlp(a: UniversalArgs) -> Iterator[tuple[str, str]]:
    f = a.fields
    yield ("out = down_proj(gelu_approx(gate_proj(x)) * up_proj(x))",
           f"width I = {f['intermediate_size']}, 2*I on the KV-shared layers when use_double_wide_mlp "
           f"(= {f['use_double_wide_mlp']}); compiled geglu")
    if f["enable_moe_block"]:
        yield ("i, w = top_k(router.proj(rms_norm(h, router.scale * D**-0.5)))",
               f"E = num_experts = {f['num_experts']}, k = top_k_experts = {f['top_k_experts']}; "
               "argpartition, softmax over the k, times per_expert_scale[i]")
        yield ("out = sum(w * experts.switch_glu(x, i))",
               f"SwitchGLU(D, moe_intermediate_size = {f['moe_intermediate_size']}, E), geglu")


def _head(a: UniversalArgs) -> Iterator[tuple[str, str]]:
    f = a.fields
    yield "h = model.norm(h)", f"RMSNorm(D, eps={a.eps})"
    yield (("logits = model.embed_tokens.as_linear(h)", "tied (tie_word_embeddings)") if a.tie
           else ("logits = lm_head(h)", "Linear(D, V)"))
    cap = f["final_logit_softcapping"]
    if cap is not None:
        yield "logits = tanh(logits / c) * c", f"compiled; c = final_logit_softcapping = {cap}"


def gemma4_sections(d: ArchDescriptor, a: UniversalArgs) -> tuple[tuple[str, Pairs], ...]:
    wrapper = d.names.wrapper
    return (
        *(((f"wrapper ({wrapper})", ((f"{wrapper}.model, {wrapper}.lm_head",
                                      "a VLM wrapper: every path below is under it; the args are "
                                      "text_config's, vocab_size the top-level one; the text model runs "
                                      "alone"),)),)
          if wrapper else ()),
        ("embedding", tuple(_embedding(a))),
        ("block (model.layers[i], i < N)", tuple(_block(a))),
        ("norms", ((f"RMSNorm(D, eps={a.eps})", "every block norm (a plain weight, not 1 + w); eps from "
                                                 "rms_norm_eps"),)),
        ("attention (model.layers[i].self_attn)", tuple(_attention(a))),
        ("mlp (model.layers[i].mlp)" + (", router, experts" if a.fields["enable_moe_block"] else ""),
         tuple(_mlp(a))),
        ("final norm and head", tuple(_head(a))),
    )


def _describe(s: Gemma4Layer, a: UniversalArgs) -> tuple[str, str, str, str]:
    f = a.fields
    attn = f"sliding window {f['sliding_window']}" if s.sliding else "global"
    attn += f", hd_i {s.head_dim}, KV_i {s.n_kv_heads}" + (", k = v" if s.k_eq_v else "")
    rope = s.rope.get("rope_type", "default")
    partial = s.rope.get("partial_rotary_factor", 1.0) if rope == "proportional" else 1.0
    rope = (f"{rope} rope, base {s.rope.get('rope_theta', 10000.0)}"
            + (f", {int(s.head_dim * partial)} of {s.head_dim} dims rotated" if partial != 1.0 else ""))
    if s.has_kv:
        cache = f"RotatingKVCache({f['sliding_window']})" if s.sliding else "KVCache"
    else:
        cache = f"none (reads layer {s.previous_kv}'s keys / values)"
    return attn, rope, cache, f"mlp width {s.mlp_width}"


def gemma4_layer_groups(a: UniversalArgs) -> tuple[tuple[tuple[int, ...], str, str, str, str], ...]:
    """(layers, attention, rope, cache, mlp) groups of consecutive-or-not layers alike."""
    groups: dict[tuple[str, str, str, str], list[int]] = {}
    for s in gemma4_layers(a.fields):
        groups.setdefault(_describe(s, a), []).append(s.index)
    return tuple((tuple(idx), *desc) for desc, idx in groups.items())
