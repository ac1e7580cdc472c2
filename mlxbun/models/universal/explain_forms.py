"""The block-form tail `mlxbun explain` adds for the rows whose forward is not the universal block
loop: nanbeige's repeated stack (looped.py), iquestloopcoder's gated second loop (loop_gated.py),
nemotron-nas's per-layer shapes (nas.py), talkie's gains (talkie.py), dbrx's experts (dbrx.py), afm7's KV-reuse layers (afm7.py)."""

from __future__ import annotations

from mlxbun.models.universal.afm7 import AFM7_TYPES
from mlxbun.models.universal.baichuan_m1 import BAICHUAN_M1_TYPES
from mlxbun.models.universal.dbrx import DBRX_TYPES
from mlxbun.models.universal.gear import GEAR_TYPES
from mlxbun.models.universal.loop_gated import LOOP_GATED_TYPES
from mlxbun.models.universal.looped import loop_count
from mlxbun.models.universal.nas import NAS_TYPES, nas_shape
from mlxbun.models.universal.plamo2 import PLAMO2_TYPES, plamo2_is_mamba
from mlxbun.models.universal.recurrent_gemma import RECURRENT_GEMMA_TYPES
from mlxbun.models.universal.rwkv7 import RWKV7_TYPES
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs
from mlxbun.models.universal.talkie import TALKIE_TYPES

__all__ = ["own_forward"]


def own_forward(d: ArchDescriptor, a: UniversalArgs) -> str:
    """"; ..." describing the row's own forward, or "" for the universal one."""
    f = a.fields
    if d.model_type in LOOP_GATED_TYPES:
        return (f"; the stack runs twice, the second loop's attention sigmoid(gate_projections[i](q)) * "
                f"global (the first loop's keys / values) + (1 - gate) * its own over a "
                f"{f['loop_window_size']}-token window")
    if d.model_type in NAS_TYPES:
        return "; per layer (attention KV heads | linear | none, MLP width | linear | none): " + ", ".join(
            f"{i}: {nas_shape(c, a.n_heads, a.hidden)}" for i, c in enumerate(f["block_configs"]))
    if d.model_type in TALKIE_TYPES:
        return (f"; every norm weightless (eps {f['rms_norm_eps']}); x += attn_gain(attn(rms(x))); "
                "x += mlp_gain(mlp(rms(x))); x += embed_skip(e_x), e_x the normed embedding; in the "
                "attention q, k rotated by negated frequencies -(theta ** (2i / hd)), then rms-normed, "
                "q * head_gain; logits = lm_head_gain(h @ lm_head.T), lm_head a bare [V, D] parameter")
    if d.model_type in DBRX_TYPES:
        c, ffn = f["attn_config"], f["ffn_config"]
        return (f"; attention: Wqkv clipped to +-{c['clip_qkv']}, KV = {c['kv_n_heads']} heads; ffn: "
                f"router.layer Linear(D, E), softmax in float32 over E = {ffn['moe_num_experts']} experts, top "
                f"{ffn['moe_top_k']}, the weights / their L1 norm, then per token the chosen experts[e] "
                f"(w2(swiglu(w1(x), v1(x))), width {ffn['ffn_hidden_size']}) stacked and summed")
    if d.model_type in BAICHUAN_M1_TYPES:
        return (f"; k and v each pass conv_k / conv_v (per KV head, previous * w0 + current * w1, the previous "
                f"raw token kept in the layer's ArraysCache) before the rope and W_pack's KV cache; layers "
                f"{list(f['sliding_window_layers'])} slide over {f['sliding_window']} tokens; each cache "
                "CacheList(ArraysCache, KVCache | RotatingKVCache)")
    if d.model_type in PLAMO2_TYPES:
        kinds = ", ".join("mamba" if plamo2_is_mamba(f, i) else "attention" for i in range(a.n_layers))
        return (f"; layers: {kinds}; each x + post_mixer_norm(mixer(pre_mixer_norm(x))), then the MLP alike "
                "(norms x * (weight + offset): 1 before, 1/5 and 1/5**1.5 after); the Mamba mixer: in_proj per "
                "head [z | x], conv1d + silu (ArraysCache slot 0), bcdt_proj -> B, C, dt each rms-normed "
                "(dt_norm_weight, B_norm_weight, C_norm_weight), dt_proj, ssm_update (slot 1; dt_bias, A_log, "
                "D), out_proj(swiglu(z, y)); the attention: qkv_proj, weightless rms * q_weight / k_weight, rope")
    if d.model_type in RECURRENT_GEMMA_TYPES:
        kinds = [f["block_types"][i % len(f["block_types"])] for i in range(a.n_layers)]
        return (f"; temporal blocks {kinds}: recurrent = linear_out(gelu_approx(linear_y(x)) * rg_lru(conv_1d("
                "linear_x(x)))) (conv state and RG-LRU state in an ArraysCache), attention = local attention "
                f"(one KV head, rope over hd // 2, a {f['attention_window_size']}-token RotatingKVCache); "
                "x += temporal_block(temporal_pre_norm(x)); x += mlp_block(channel_pre_norm(x)) (gelu_approx "
                f"gate * up, width I // 2); embeddings * sqrt(D); logits soft-capped at {f['logits_soft_cap']}")
    if d.model_type in RWKV7_TYPES:
        return ("; every layer (layer 0 after a pre_norm): x += attn(attn_norm(x)), the time mixing (token shift, "
                "addcmul lerps x_r / x_w / x_k / x_v / x_a / x_g, r_proj / k_proj / v_proj, LoRA gates w_lora / "
                "a_lora / v_lora / g_lora, the WKV-7 state token by token, g_norm per head, the k_k / k_a / r_k "
                "bonus, o_proj); x += ffn(ffn_norm(x)), the channel mixing (token shift, key, relu^2, value); "
                "v_first (layer 0's values) through the layers; an ArraysCache(3) per layer")
    if d.model_type in GEAR_TYPES:
        return (f"; layers {list(f['layer_types'])}: attention (q / k (1 + w) norms, rope_theta or on sliding layers "
                "rope_local_base_freq, scale query_pre_attn_scalar ** -0.5, attn_logit_softcapping when set) or the "
                "conv mixer local_mixer (q_proj / k_proj / v_proj, q_norm / k_norm, key_conv / value_conv causal "
                "depthwise convs with their states in an ArraysCache, sigmoid(q * k) * v, o_proj); sandwich norms "
                "input / post_attention / pre_feedforward / post_feedforward; embeddings * sqrt(D)")
    if d.model_type in AFM7_TYPES:
        n, reuse = f["num_layers"], f["num_kv_reuse_layers"]
        return (f"; layers 0-{n - reuse - 1} (model.layers): q, k, v = qkv_proj(x) split, k and v fake-8-bit "
                f"quantized by quant_key_scale / quant_value_scale after q_norm / k_norm; the last {reuse} "
                "(model.kv_reuse_layers): only q_proj, rope at offset S - L, q_norm, attending to the last "
                "regular layer's cached keys / values, out_proj; caches only for the regular layers")
    if d.loops is not None:
        skip = f[d.loops.skip_final_norm]
        return (f"; the stack runs {loop_count(f, d.loops, d.model_type)} times, each with its own "
                f"caches, {'the final norm once at the end' if skip else 'the final norm after each'}")
    return ""
