"""The zoo's arch table: one row per model_type, and `tiny_config(arch)`.

A tiny config is the arch's REAL default config (its transformers configuration
class, else the keys of a real hub config) shrunk to hidden 64 / 4 heads x 16 /
intermediate 128 / vocab 512, with every other knob kept. transformers 5 writes
rope as `rope_parameters`; mlx-lm 0.32.2 mostly reads the pre-v5 keys
(`rope_theta`, `rope_scaling`, `partial_rotary_factor`), which real hub
checkpoints carry, so both are written and agree.

Adding an arch is one `Arch(...)` row in `_ROWS` (a hybrid: `archs_hybrid.HYBRID_ROWS`; a
remote-code config written from a hub config's keys: `archs_remote.REMOTE_CODE_ROWS`); `Arch` and
the tiny sizes are `arch_row.py`.
"""

from __future__ import annotations

import copy

from mlxbun.errors import UnsupportedModelError
from mlxbun.zoo.arch_row import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    MAX_POSITIONS,
    MINISTRAL3_KNOBS,
    MOE_EXPERTS,
    MOE_INTERMEDIATE,
    MOE_TOP_K,
    SLIDING_WINDOW,
    Arch,
)
from mlxbun.zoo.archs_gemma4 import GEMMA4_ROWS
from mlxbun.zoo.archs_hybrid import HYBRID_ROWS
from mlxbun.zoo.archs_remote import REMOTE_CODE_ROWS
from mlxbun.zoo.archs_wrappers import WRAPPER_ROWS, wrapped_text_rows
from mlxbun.zoo.config_fixups import (
    cohere2_post,
    exaone4_post,
    exaone_moe_post,
    gemma3_post,
    gemma3_wrapper_post,
    gemma3n_wrapper_post,
    gpt_neox_post,
    mellum_post,
    minimax_m2_post,
    qwen3_moe_post,
)
from mlxbun.zoo.hf_configs import quiet_transformers, transformers_config_class
from mlxbun.zoo.tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE

# PretrainedConfig bookkeeping that real hub configs (saved with to_diff_dict) do not carry.
_GENERIC_KEYS = (
    "_name_or_path",
    "id2label",
    "label2id",
    "return_dict",
    "output_attentions",
    "output_hidden_states",
    "chunk_size_feed_forward",
    "problem_type",
    "is_encoder_decoder",
    "is_decoder",
    "dtype",
    "torch_dtype",
)


def _llama3(theta: float, factor: float) -> dict:
    # Llama 3.1 parameters with the context shrunk: max / original = factor (8192 * 8 -> 64 * 8)
    return {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": int(MAX_POSITIONS // factor),
    }



_MLA_KNOBS = {"n_routed_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
              "moe_intermediate_size": MOE_INTERMEDIATE, "first_k_dense_replace": 1, "q_lora_rank": 32,
              "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
_DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32, "beta_slow": 1,
                  "original_max_position_embeddings": MAX_POSITIONS // 4}  # DeepSeek's, factor 4

_ROWS = (
    Arch("llama", "LlamaForCausalLM", "LlamaConfig", kv_heads=2,
         knobs={"rope_parameters": _llama3(500000.0, 8.0)}),
    # mlx-lm runs mistral as llama and ignores sliding_window without layer_types; v0.2+ has none
    Arch("mistral", "MistralForCausalLM", "MistralConfig", knobs={"sliding_window": None}),
    Arch("smollm3", "SmolLM3ForCausalLM", "SmolLM3Config", layers=4),  # layer 3 is NoPE
    Arch("qwen2", "Qwen2ForCausalLM", "Qwen2Config", kv_heads=2),
    Arch("qwen3", "Qwen3ForCausalLM", "Qwen3Config", kv_heads=2),
    Arch("gemma", "GemmaForCausalLM", "GemmaConfig", kv_heads=1),  # MQA like gemma-2b
    # mlx-lm's gemma2 has no sliding attention: a window no prompt can cross keeps it equal to HF.
    # query_pre_attn_scalar != head_dim (as in gemma-2-27b) so scaling by head_dim is caught.
    Arch("gemma2", "Gemma2ForCausalLM", "Gemma2Config",
         knobs={"sliding_window": MAX_POSITIONS, "query_pre_attn_scalar": 24}),
    Arch("gemma3_text", "Gemma3ForCausalLM", "Gemma3TextConfig", layers=4,
         knobs={"sliding_window_pattern": 3, "query_pre_attn_scalar": 24,
              "rope_parameters": {
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
         post=gemma3_post),
    # gemma3_text's layers behind the VLM wrapper (text_config; the checkpoint holds
    # language_model.* only, as mlx-lm's Model builds no vision tower)
    Arch("gemma3", "Gemma3ForConditionalGeneration", "Gemma3TextConfig", layers=4,
         knobs={"sliding_window_pattern": 3, "query_pre_attn_scalar": 24,
              "rope_parameters": {
                  "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                  "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}},
         post=gemma3_wrapper_post),
    # gemma3n's language model behind its wrapper (text_config; a dedicated port, models/gemma3n/):
    # 5 layers, the last 2 KV-shared (one sliding, one full: they read layers 2 and 1's caches),
    # activation sparsity on the first two, per-layer MLP widths, 4 AltUp streams, LAuReL rank 8,
    # per-layer inputs of 16 over a per-layer vocab of 384 (ids past it read row 0), a coefficient
    # clip the perturbed AltUp weights cross
    Arch("gemma3n", "Gemma3nForConditionalGeneration", "Gemma3nTextConfig", layers=5,
         knobs={"intermediate_size": [INTERMEDIATE, 192, INTERMEDIATE, 64, INTERMEDIATE],
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                "sliding_attention", "full_attention"],
                "num_kv_shared_layers": 2, "activation_sparsity_pattern": [0.95, 0.95, 0.0, 0.0, 0.0],
                "laurel_rank": 8, "hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 384,
                "altup_coef_clip": 0.3},
         post=gemma3n_wrapper_post),
    # phi-4-mini style: partial rotary + longrope (mlx-lm applies the long factors)
    Arch("phi3", "Phi3ForCausalLM", "Phi3Config", kv_heads=2, rope_type_key="type",
         knobs={"partial_rotary_factor": 0.75, "original_max_position_embeddings": 128,
              "rope_parameters": {
                  "rope_type": "longrope", "rope_theta": 10000.0,
                  "long_factor": [1.0, 1.25, 1.9, 3.4, 6.1, 11.0],
                  "short_factor": [1.0, 1.0, 1.02, 1.05, 1.1, 1.2]}}),
    Arch("olmo2", "Olmo2ForCausalLM", "Olmo2Config"),
    Arch("olmo3", "Olmo3ForCausalLM", "Olmo3Config", layers=4),
    Arch("glm4", "Glm4ForCausalLM", "Glm4Config"),
    Arch("glm", "GlmForCausalLM", "GlmConfig"),  # GLM-4-9B-chat-hf: q/k/v biases, partial_rotary_factor 0.5
    # granite-3 multipliers (attention_multiplier = 1/head_dim, not head_dim**-0.5)
    Arch("granite", "GraniteForCausalLM", "GraniteConfig", kv_heads=2,
         knobs={"embedding_multiplier": 12.0, "attention_multiplier": 0.0625,
              "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    Arch("starcoder2", "Starcoder2ForCausalLM", "Starcoder2Config"),
    Arch("cohere", "CohereForCausalLM", "CohereConfig"),
    Arch("cohere2", "Cohere2ForCausalLM", "Cohere2Config", layers=4, kv_heads=2,
         post=cohere2_post),
    Arch("ernie4_5", "Ernie4_5ForCausalLM", "Ernie4_5Config"),
    Arch("exaone4", "Exaone4ForCausalLM", "Exaone4Config", layers=4, kv_heads=2,
         knobs={"sliding_window_pattern": 4, "rope_parameters": _llama3(1000000.0, 16.0)},
         extra={"head_dim": HEAD_DIM}, post=exaone4_post),
    Arch("helium", "HeliumForCausalLM", "HeliumConfig"),
    Arch("internlm3", "InternLM3ForCausalLM", "InternLM3Config",
         knobs={"rope_parameters": {"rope_type": "dynamic", "factor": 6.0, "rope_theta": 50000000.0}},
         extra={"bias": False, "qkv_bias": False}),
    Arch("seed_oss", "SeedOssForCausalLM", "SeedOssConfig"),
    # no transformers class: keys of openbmb/MiniCPM-2B-sft's config; untied (mlx-lm copies
    # embed_tokens into lm_head on load only when untied); dim_model_base keeps hidden/base = 4
    Arch("minicpm", "MiniCPMForCausalLM", base={
        "model_type": "minicpm", "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.1, "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS, "num_attention_heads": HEADS,
        "num_hidden_layers": 2, "num_key_value_heads": HEADS, "rms_norm_eps": 1e-05,
        "rope_theta": 10000.0, "use_cache": True, "vocab_size": VOCAB_SIZE,
        "scale_emb": 12, "dim_model_base": 16, "scale_depth": 1.4, "tie_word_embeddings": False}),
    Arch("nemotron", "NemotronForCausalLM", "NemotronConfig", kv_heads=2),
    Arch("stablelm", "StableLmForCausalLM", "StableLmConfig", knobs={"use_qkv_bias": True}),
    # no transformers class: mlx-lm's ModelArgs keys (the MLP width is derived from n_embd)
    Arch("lille-130m", "Lille130mForCausalLM", base={
        "model_type": "lille-130m", "block_size": MAX_POSITIONS, "layer_norm_eps": 1e-05,
        "n_embd": HIDDEN, "n_head": HEADS, "n_kv_heads": 2, "n_layer": 2,
        "rope_theta": 10000.0, "vocab_size": VOCAB_SIZE, "tie_word_embeddings": True}),
    Arch("gpt_neox", "GPTNeoXForCausalLM", "GPTNeoXConfig", post=gpt_neox_post),
    Arch("phi", "PhiForCausalLM", "PhiConfig"),
    # Hunyuan-7B's dynamic-alpha NTK rope and qk norm
    Arch("hunyuan_v1_dense", "HunYuanDenseV1ForCausalLM", "HunYuanDenseV1Config", kv_heads=2,
         rope_type_key="type",
         knobs={"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 1.0,
                                  "alpha": 1000.0, "beta_fast": 32, "beta_slow": 1,
                                  "mscale": 1.0, "mscale_all_dim": 1.0}},
         extra={"use_qk_norm": True}),
    Arch("apertus", "ApertusForCausalLM", "ApertusConfig", kv_heads=2,
         knobs={"rope_parameters": _llama3(12000000.0, 8.0)},
         extra={"mlp_bias": False, "qk_norm": True, "post_norm": False}),
    # Ministral 3: yarn + llama-4 attention scaling, read from rope_parameters only; original
    # context 32 so a 40-token prompt reaches the scaled region (real: 16384 * 16 = 262144)
    Arch("ministral3", "Ministral3ForCausalLM", "Ministral3Config", legacy_rope=False,
         knobs=MINISTRAL3_KNOBS),
    Arch("nanochat", "NanoChatForCausalLM", "NanoChatConfig"),
    # ---- mixture of experts
    # Qwen3-30B-A3B's knobs: renormalized top-k, every layer MoE
    Arch("qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig", kv_heads=2,
         knobs={"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE, "norm_topk_prob": True},
         extra={"head_dim": HEAD_DIM}, post=qwen3_moe_post),
    Arch("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig", kv_heads=2,
         knobs={"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE,
                "shared_expert_intermediate_size": INTERMEDIATE}),
    Arch("mixtral", "MixtralForCausalLM", "MixtralConfig", kv_heads=2,
         knobs={"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K}),
    Arch("olmoe", "OlmoeForCausalLM", "OlmoeConfig",
         knobs={"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K}),
    # granite-3 MoE multipliers, as the dense granite row
    Arch("granitemoe", "GraniteMoeForCausalLM", "GraniteMoeConfig", kv_heads=2,
         knobs={"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "embedding_multiplier": 12.0, "attention_multiplier": 0.0625,
                "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    # GLM-4.5's knobs: layer 0 dense, one shared expert, routed scaling 2.5, q/k biases
    Arch("glm4_moe", "Glm4MoeForCausalLM", "Glm4MoeConfig", kv_heads=2,
         knobs={"n_routed_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE, "n_shared_experts": 1,
                "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "attention_bias": True},
         extra={"head_dim": HEAD_DIM}),
    # transformers' class has no dense-layer, MLP-width or rotary-fraction keys, which mlx-lm's
    # ModelArgs require: every layer MoE and full rotary (what the class means), dense width 128
    Arch("solar_open", "SolarOpenForCausalLM", "SolarOpenConfig", kv_heads=2,
         knobs={"n_routed_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE, "routed_scaling_factor": 2.5},
         extra={"intermediate_size": INTERMEDIATE, "first_k_dense_replace": 0,
                "partial_rotary_factor": 1.0}),
    # K-EXAONE's knobs: layer 0 dense, one shared expert, 3 sliding layers then a global one
    Arch("exaone_moe", "ExaoneMoEForCausalLM", "ExaoneMoeConfig", layers=4, kv_heads=2,
         knobs={"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE, "num_shared_experts": 1,
                "first_k_dense_replace": 1, "sliding_window_pattern": 4,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
         extra={"head_dim": HEAD_DIM}, post=exaone_moe_post),
    # no transformers class (5.24 has bailing_hybrid only): the keys mlx-lm's ModelArgs reads,
    # with Ling-mini-2.0's knobs (sigmoid grouped router with expert bias, layer 0 dense, q/k
    # norm, half rotary, one shared expert) shrunk
    Arch("bailing_moe", "BailingMoeV2ForCausalLM", base={
        "model_type": "bailing_moe", "hidden_act": "silu", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "max_position_embeddings": MAX_POSITIONS,
        "moe_intermediate_size": MOE_INTERMEDIATE, "num_experts": MOE_EXPERTS,
        "num_shared_experts": 1, "moe_shared_expert_intermediate_size": MOE_INTERMEDIATE,
        "norm_topk_prob": True, "num_attention_heads": HEADS, "num_experts_per_tok": MOE_TOP_K,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 600000, "rope_scaling": None, "vocab_size": VOCAB_SIZE,
        "first_k_dense_replace": 1, "use_bias": False, "use_qkv_bias": False, "norm_head": False,
        "norm_softmax": False, "use_qk_norm": True, "tie_word_embeddings": False,
        "partial_rotary_factor": 0.5, "rotary_dim": HEAD_DIM // 2,
        "moe_router_enable_expert_bias": True, "routed_scaling_factor": 2.5,
        "score_function": "sigmoid", "n_group": 2, "topk_group": 1, "head_dim": HEAD_DIM,
        "initializer_range": 0.02, "use_cache": True, "output_router_logits": False}),
    # no transformers class for mlx-lm's "hunyuan" (transformers' HunYuanMoEV1Config is
    # hunyuan_v1_moe, without CLA or per-layer lists): the keys mlx-lm's ModelArgs reads, with
    # Hunyuan-A13B's knobs (NTK-alpha rope, q/k norm, mixed MLP + MoE, tied head) and Hunyuan-Large's
    # CLA (share factor 2); per-layer top-k / shared count / expert width lists that differ
    Arch("hunyuan", "HunYuanMoEV1ForCausalLM", layers=4, base={
        "model_type": "hunyuan", "hidden_act": "silu", "vocab_size": VOCAB_SIZE, "hidden_size": HIDDEN,
        "num_hidden_layers": 4, "intermediate_size": INTERMEDIATE, "num_attention_heads": HEADS,
        "num_key_value_heads": 2, "attention_bias": False, "moe_topk": [2, 1, 2, 2],
        "num_experts": MOE_EXPERTS, "num_shared_expert": [1, 1, 2, 1], "use_mixed_mlp_moe": True,
        "use_qk_norm": True, "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "use_cla": True,
        "cla_share_factor": 2, "moe_intermediate_size": [MOE_INTERMEDIATE, MOE_INTERMEDIATE,
                                                         2 * MOE_INTERMEDIATE, MOE_INTERMEDIATE],
        "rope_scaling": {"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0,
                         "mscale": 1.0, "mscale_all_dim": 1.0, "type": "dynamic"},
        "tie_word_embeddings": True, "max_position_embeddings": MAX_POSITIONS,
        "initializer_range": 0.02, "use_cache": True}),
    # dots.llm1's knobs: layer 0 dense, renormalized top-k, routed scaling 2.5
    Arch("dots1", "Dots1ForCausalLM", "Dots1Config", kv_heads=2,
         knobs={"n_routed_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE, "n_shared_experts": 2,
                "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True}),
    # Phi-3.5-MoE's knobs: attention and lm_head biases, longrope with mscales (context shrunk:
    # original 128 of 512, as the phi3 row), sparsemixer band router_jitter_noise 0.01
    Arch("phimoe", "PhiMoEForCausalLM", "PhimoeConfig", kv_heads=2, rope_type_key="type",
         knobs={"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "attention_bias": True, "lm_head_bias": True,
                "rope_parameters": {
                    "rope_type": "longrope", "rope_theta": 10000.0,
                    "long_factor": [1.0, 1.3, 2.0, 3.6, 6.4, 11.0, 19.0, 33.0],
                    "short_factor": [1.0, 1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.5],
                    "long_mscale": 1.243163121016122, "short_mscale": 1.243163121016122,
                    "original_max_position_embeddings": 128}}),
    # ERNIE-4.5-21B-A3B's knobs (two shared experts, tied), with layer 0 dense as its
    # moe_layer_start_index 1 and the MoE layers ending at 2 so the last layer is dense again
    Arch("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", layers=4,
         knobs={"moe_num_experts": MOE_EXPERTS, "moe_k": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE, "moe_num_shared_experts": 2,
                "moe_layer_start_index": 1, "moe_layer_end_index": 2}),
    # MiniMax-M2 (transformers' MiniMaxConfig is MiniMax-Text-01, lightning-attention layers
    # mlx-lm's minimax.py does not run): rotary_dim half of head_dim, q/k norms over all heads;
    # mlx-lm's required keys the class lacks as the hub config carries them
    Arch("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMaxM2Config", kv_heads=2,
         knobs={"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "intermediate_size": MOE_INTERMEDIATE, "rotary_dim": HEAD_DIM // 2},
         extra={"shared_intermediate_size": 0, "use_qk_norm": True, "qk_norm_type": "per_layer",
                "scoring_func": "sigmoid", "use_routing_bias": True},
         post=minimax_m2_post),
    # no transformers class: the keys of deepseek-ai/deepseek-moe-16b-base's config
    Arch("deepseek", "DeepseekForCausalLM", base={
        "model_type": "deepseek", "attention_bias": False, "attention_dropout": 0.0,
        "aux_loss_alpha": 0.001, "first_k_dense_replace": 1, "hidden_act": "silu",
        "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS, "moe_intermediate_size": MOE_INTERMEDIATE,
        "moe_layer_freq": 1, "n_routed_experts": MOE_EXPERTS, "n_shared_experts": 2,
        "norm_topk_prob": False, "num_attention_heads": HEADS, "num_experts_per_tok": MOE_TOP_K,
        "num_hidden_layers": 2, "num_key_value_heads": HEADS, "pretraining_tp": 1,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000, "scoring_func": "softmax",
        "seq_aux": True, "tie_word_embeddings": False, "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # DeepSeek-V2-Lite / V3 knobs (yarn, context shrunk 4096 * 40 -> 128 * 4), layer 0 dense,
    # q_lora_rank set; v3: grouped noaux_tc routing, embed_q / unembed_out inputs (32, 64) quantizable
    Arch("deepseek_v2", "DeepseekV2ForCausalLM", "DeepseekV2Config", kv_heads=4, rope_type_key="type",
         knobs={**_MLA_KNOBS, "n_shared_experts": 2, "kv_lora_rank": 32,
                "rope_parameters": {**_DEEPSEEK_YARN, "mscale": 0.707, "mscale_all_dim": 0.707}}),
    Arch("deepseek_v3", "DeepseekV3ForCausalLM", "DeepseekV3Config", kv_heads=4, rope_type_key="type",
         knobs={**_MLA_KNOBS, "n_shared_experts": 1, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5,
                "rope_parameters": {**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    # DeepSeek-V3.2's knobs: v3's, plus the DSA indexer with index_topk 8 so a 40-token prompt
    # (and its decode steps) attend to the indexer's choice only
    Arch("deepseek_v32", "DeepseekV32ForCausalLM", "DeepseekV32Config", kv_heads=4, rope_type_key="type",
         knobs={**_MLA_KNOBS, "n_shared_experts": 1, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "index_topk": 8,
                "index_n_heads": 4, "index_head_dim": 16,
                "rope_parameters": {**_DEEPSEEK_YARN, "mscale": 1.0, "mscale_all_dim": 1.0}}),
    # GLM-5's knobs (deepseek_v32's graph, rope_parameters only, plain rope); mlx-lm requires the
    # router keys the hub config carries and transformers does not write
    Arch("glm_moe_dsa", "GlmMoeDsaForCausalLM", "GlmMoeDsaConfig", kv_heads=4, legacy_rope=False,
         knobs={**_MLA_KNOBS, "n_shared_experts": 1, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                "n_group": 2, "topk_group": 1, "index_topk": 8, "index_n_heads": 4, "index_head_dim": 16,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
         extra={"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1}),
    # GLM-4.7-Flash's knobs (deepseek_v3's absorbed MLA, plain rope): layer 0 dense (mlx-lm reads
    # first_k_dense_replace, which the hub config carries; transformers writes mlp_layer_types),
    # grouped noaux_tc routing; embed_q / unembed_out inputs (32, 64) quantizable
    Arch("glm4_moe_lite", "Glm4MoeLiteForCausalLM", "Glm4MoeLiteConfig", kv_heads=4,
         knobs={**_MLA_KNOBS, "n_shared_experts": 1, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                "n_group": 2, "topk_group": 1, "routed_scaling_factor": 1.8,
                "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}},
         extra={"first_k_dense_replace": 1}),
    # Mistral 4's knobs (transformers' default rope_parameters: yarn + llama-4 query scaling, read
    # from rope_parameters only; original context 16 so a 40-token prompt reaches the scaled region),
    # layer 0 dense, grouped routing; embed_q / unembed_out inputs (32, 64) quantizable
    Arch("mistral4", "Mistral4ForCausalLM", "Mistral4Config", kv_heads=4, legacy_rope=False,
         knobs={**_MLA_KNOBS, "n_shared_experts": 1, "kv_lora_rank": 64, "qk_nope_head_dim": 32,
                "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.0,
                "rope_parameters": {"type": "yarn", "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                    "original_max_position_embeddings": 16, "max_position_embeddings": MAX_POSITIONS,
                                    "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                    "llama_4_scaling_beta": 0.1, "partial_rotary_factor": 0.2}},
         extra={"head_dim": 40}),  # Mistral4Config's own value: dn + dr (mlx-lm does not read it)
    # MiniCPM3-4B's knobs (longrope over the rope part, context shrunk so max / original = 4),
    # q_lora_rank set, v_head_dim None (hidden // heads); untied: with a tied head the scaled
    # random embedding predicts each input id back, so every greedy trajectory repeats one token
    Arch("minicpm3", "MiniCPM3ForCausalLM", "MiniCPM3Config", rope_type_key="type",
         knobs={"tie_word_embeddings": False, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                "scale_emb": 12, "dim_model_base": 16, "scale_depth": 1.4,
                "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                    "original_max_position_embeddings": MAX_POSITIONS // 4,
                                    "long_factor": [1.0, 1.3, 2.2, 5.1], "short_factor": [1.0, 1.0, 1.1, 1.2]}}),
    # Youtu-LLM-2B's knobs (expanded MLA, initialize_rope, q_lora_rank set); mlx-lm names it
    # youtu_llm (transformers: youtu)
    Arch("youtu_llm", "YoutuForCausalLM", "YoutuConfig",
         knobs={"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
                "v_head_dim": 24, "rope_parameters": {"rope_type": "default", "rope_theta": 1600000.0}},
         extra={"head_dim": 8}),  # YoutuConfig's own value: qk_rope_head_dim (mlx-lm does not read it)
    # gpt-oss's knobs: sliding / full layers (window 16 here), attention sinks, yarn with the
    # original context shrunk as the max (131072 / 32 -> 512 / 32), clamped SwiGLU experts
    Arch("gpt_oss", "GptOssForCausalLM", "GptOssConfig", layers=4, kv_heads=2,
         extra_variants=("mxfp4",),
         knobs={"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "intermediate_size": MOE_INTERMEDIATE,
                "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                    "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                                    "original_max_position_embeddings": MAX_POSITIONS // 32}}),
    # no transformers class: the keys mlx-lm's Klear ModelArgs reads (+ hidden_act), with
    # Klear-46B-A2.5B's shape knobs (1 shared expert, GQA, renormalized top-k, every layer MoE)
    Arch("Klear", "KlearForCausalLM", base={
        "model_type": "Klear", "attention_bias": False, "decoder_sparse_step": 1,
        "hidden_act": "silu", "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS, "mlp_only_layers": [],
        "moe_intermediate_size": MOE_INTERMEDIATE, "n_shared_experts": 1, "norm_topk_prob": True,
        "num_attention_heads": HEADS, "num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": VOCAB_SIZE}),
    # transformers' class lacks score_func / route_norm / n_group / topk_group (mlx-lm's defaults
    # apply). Layers [sliding, full], layer 0 dense; mup on and mlx-lm's route_scale so the
    # scaled embedding and the routed scaling are exercised
    Arch("afmoe", "AfmoeForCausalLM", "AfmoeConfig",
         knobs={"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE, "global_attn_every_n_layers": 2,
                "mup_enabled": True, "route_scale": 2.826}),
    # no transformers class (it has Step3p7 only): the keys mlx-lm's step3p5 ModelArgs reads, with
    # every per-layer knob exercised: sliding layers with their own head counts, per-layer rope
    # bases and rotary fractions, yarn on the full layers only, clamped SwiGLU limits small
    # enough to clip (null / 0 entries: plain), layer 0 dense
    Arch("step3p5", "Step3p5ForCausalLM", layers=4, base={
        "model_type": "step3p5", "hidden_act": "silu", "hidden_size": HIDDEN,
        "num_hidden_layers": 4, "vocab_size": VOCAB_SIZE, "num_attention_heads": HEADS,
        "num_attention_groups": 2, "head_dim": HEAD_DIM, "intermediate_size": INTERMEDIATE,
        "rms_norm_eps": 1e-05, "max_position_embeddings": MAX_POSITIONS,
        "sliding_window": SLIDING_WINDOW,
        "layer_types": ["full_attention", "sliding_attention", "full_attention", "sliding_attention"],
        "attention_other_setting": {"num_attention_heads": 8, "num_attention_groups": 2},
        "rope_theta": [1000000.0, 10000.0, 1000000.0, 10000.0],
        "partial_rotary_factors": [0.5, 1.0, 0.5, 1.0],
        "rope_scaling": {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 256,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        "yarn_only_types": ["full_attention"], "use_head_wise_attn_gate": True,
        "moe_num_experts": MOE_EXPERTS, "moe_top_k": MOE_TOP_K,
        "moe_intermediate_size": MOE_INTERMEDIATE, "share_expert_dim": MOE_INTERMEDIATE,
        "moe_layers_enum": "1,2,3", "moe_router_scaling_factor": 3.0, "norm_expert_weight": True,
        "swiglu_limits": [None, 0.0, 0.5, 0.5], "swiglu_limits_shared": [0.5, 0.0, 0.0, 0.5],
        "tie_word_embeddings": False, "use_cache": True}),
    # transformers' MiMoV2FlashConfig writes the converted schema (layer_types, mlp_layer_types,
    # rope_parameters) that mlx-lm's ModelArgs does not read, so the keys of the hub config.json
    # (XiaomiMiMo/MiMo-V2-Flash) with tiny sizes: full and sliding layers with their own head
    # counts, q/k and value head dims, rope bases and sink-bias switches (real: sinks on sliding
    # layers only); routed_scaling_factor null as on the hub; a shared expert and two expert groups
    # to exercise those branches; layer 0 dense; partial_rotary_factor 0.5 (hub: 0.334 of 192)
    # keeps the tiny rotary dims even
    Arch("mimo_v2_flash", "MiMoV2FlashForCausalLM", layers=4, base={
        "model_type": "mimo_v2_flash", "hidden_size": HIDDEN, "num_hidden_layers": 4,
        "vocab_size": VOCAB_SIZE, "intermediate_size": INTERMEDIATE,
        "num_attention_heads": HEADS, "num_key_value_heads": 2, "head_dim": HEAD_DIM, "v_head_dim": 8,
        "swa_num_attention_heads": 8, "swa_num_key_value_heads": 2, "swa_head_dim": 24,
        "swa_v_head_dim": 16, "partial_rotary_factor": 0.5, "rope_theta": 5000000.0,
        "swa_rope_theta": 10000.0, "hybrid_layer_pattern": [0, 1, 1, 0],
        "sliding_window_size": SLIDING_WINDOW, "add_full_attention_sink_bias": False,
        "add_swa_attention_sink_bias": True, "attention_value_scale": 0.707,
        "layernorm_epsilon": 1e-05, "max_position_embeddings": MAX_POSITIONS,
        "moe_layer_freq": [0, 1, 1, 1], "n_routed_experts": MOE_EXPERTS,
        "num_experts_per_tok": MOE_TOP_K, "moe_intermediate_size": MOE_INTERMEDIATE,
        "n_shared_experts": 1, "routed_scaling_factor": None, "topk_method": "noaux_tc",
        "scoring_func": "sigmoid", "norm_topk_prob": True, "n_group": 2, "topk_group": 1,
        "hidden_act": "silu", "attention_bias": False, "tie_word_embeddings": False,
        "use_cache": True}),
    # full and sliding layers (each with its rope_parameters entry: partial rope on the full ones),
    # per-layer query head counts, layer 0 dense; a router softcap and a routed scaling factor
    # (defaults 0.0 / 1.0: those branches off) to exercise them
    Arch("laguna", "LagunaForCausalLM", "LagunaConfig", layers=4, kv_heads=2, legacy_rope=False,
         knobs={"num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE,
                "shared_expert_intermediate_size": MOE_INTERMEDIATE,
                "layer_types": ["full_attention", "sliding_attention", "sliding_attention",
                                "full_attention"],
                "num_attention_heads_per_layer": [HEADS, 8, 8, HEADS],
                "moe_router_logit_softcapping": 2.0, "moe_routed_scaling_factor": 2.5}),
    # one sliding and one full layer (each with its rope_parameters entry); rope read only from
    # rope_parameters, so no legacy keys
    Arch("mellum", "MellumForCausalLM", "MellumConfig", kv_heads=2, legacy_rope=False,
         knobs={"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE,
                "layer_types": ["sliding_attention", "full_attention"]},
         post=mellum_post),
)



_TEXT_TABLE = {row.name: row for row in _ROWS + REMOTE_CODE_ROWS + GEMMA4_ROWS + HYBRID_ROWS}
ARCH_TABLE: dict[str, Arch] = {row.name: row for row in (*_TEXT_TABLE.values(), *WRAPPER_ROWS,
                                                         *wrapped_text_rows(_TEXT_TABLE))}
ARCHS: tuple[str, ...] = tuple(ARCH_TABLE)


def get_arch(arch: str) -> Arch:
    try:
        return ARCH_TABLE[arch]
    except (KeyError, TypeError):
        raise UnsupportedModelError(
            f"unknown zoo arch {arch!r}; known archs: {', '.join(ARCHS)}"
        ) from None


def _descriptor(arch: str):
    """The universal graph's descriptor row of a zoo arch (None for the dedicated graphs)."""
    from mlxbun.config import MODEL_REMAPPING
    from mlxbun.models.universal.table import DESCRIPTORS

    row = get_arch(arch)
    if row.model_type is not None:  # a wrapper's second text model: the row its config picks
        from mlxbun.models.universal.resolve import descriptor_for

        return descriptor_for(row.model_type, tiny_config(arch))
    return DESCRIPTORS.get(MODEL_REMAPPING.get(arch, arch))


def has_experts(arch: str) -> bool:
    """True when the zoo arch's descriptor row routes through mixture-of-experts blocks (or its
    config does: `Arch.routed`)."""
    d = _descriptor(arch)
    return (d is not None and d.moe is not None) or get_arch(arch).routed


def has_recurrent_layers(arch: str) -> bool:
    """True when the zoo arch's descriptor row is a hybrid (recurrent mixers on some layers)."""
    d = _descriptor(arch)
    return d is not None and d.hybrid is not None


def hybrid_archs() -> tuple[str, ...]:
    """The zoo archs with recurrent layers (hybrids), in table order."""
    return tuple(a for a in ARCHS if has_recurrent_layers(a))


def moe_archs() -> tuple[str, ...]:
    """The zoo archs with mixture-of-experts layers, in table order."""
    return tuple(a for a in ARCHS if has_experts(a))


def runnable_variants(arch: str) -> tuple[str, ...]:
    """The weight variants (`mlxbun.names.ZOO_VARIANTS`) of `arch` that mlx can run on this
    device: all six, except unquantized float16 / bfloat16 experts where `gather_mm` takes
    float32 only (mlx's CPU backend) and the quantized ones of an unquantizable row (afm7), plus
    the opt-in ones the arch's row lists (mxfp4 for gpt_oss). `mlxbun port`'s default 'all' means
    these."""
    from mlxbun.models.switch_layers import gather_mm_supported
    from mlxbun.names import OPT_IN_VARIANTS, ZOO_VARIANTS

    row = get_arch(arch)
    experts = has_experts(arch)
    return tuple(v for v, opts in ZOO_VARIANTS.items()
                 if not (experts and "dtype" in opts and not gather_mm_supported(opts["dtype"]))
                 and (v not in OPT_IN_VARIANTS or v in row.extra_variants)
                 and not (row.unquantizable and "quant" in opts))


def _shrink_kwargs(row: Arch, defaults: dict) -> dict:
    sizes = {
        "hidden_size": HIDDEN,
        "num_attention_heads": HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": row.layers,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": MAX_POSITIONS,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    kwargs = {k: v for k, v in sizes.items() if k in defaults}
    if "num_key_value_heads" in defaults:
        kv, heads = defaults["num_key_value_heads"], defaults["num_attention_heads"]
        gqa = kv is not None and kv < heads
        kwargs["num_key_value_heads"] = row.kv_heads or (2 if gqa else HEADS)
    if defaults.get("sliding_window") is not None:
        kwargs["sliding_window"] = SLIDING_WINDOW
    if "eod_token_id" in defaults:
        kwargs["eod_token_id"] = EOS_ID
    kwargs.update(copy.deepcopy(dict(row.knobs)))
    return kwargs


def _legacy_rope(row: Arch, cfg: dict) -> None:
    """Add the pre-transformers-5 rope keys (what hub checkpoints of the arch carry)."""
    rp = cfg["rope_parameters"]
    if "rope_theta" not in rp:  # per-layer-type rope: the full-attention one is the model's
        rp = rp["full_attention"]
    cfg["rope_theta"] = rp["rope_theta"]
    if "partial_rotary_factor" in rp:
        cfg["partial_rotary_factor"] = rp["partial_rotary_factor"]
    kind = rp.get("rope_type", "default")
    if kind == "default":
        cfg["rope_scaling"] = None
    else:
        scaling = {k: v for k, v in rp.items()
                   if k not in ("rope_theta", "partial_rotary_factor", "rope_type", "type")}
        scaling[row.rope_type_key] = kind
        cfg["rope_scaling"] = dict(sorted(scaling.items()))


def tiny_config(arch: str) -> dict:
    """The shrunk config.json dict of `arch` (float32; the builder sets torch_dtype/quantization)."""
    row = get_arch(arch)
    if row.hf_config is not None:
        cls = transformers_config_class(row.hf_config)
        with quiet_transformers():
            defaults = cls().to_dict()
            cfg = cls(**_shrink_kwargs(row, defaults)).to_dict()
        for key in _GENERIC_KEYS:
            cfg.pop(key, None)
        if row.legacy_rope:
            _legacy_rope(row, cfg)
    else:
        cfg = copy.deepcopy(dict(row.base))
        cfg.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    cfg.update(copy.deepcopy(dict(row.extra)))
    if row.post is not None:
        row.post(cfg)
    cfg["model_type"] = row.model_type or row.name
    cfg["architectures"] = [row.architecture]
    cfg["torch_dtype"] = "float32"
    return dict(sorted(cfg.items()))
