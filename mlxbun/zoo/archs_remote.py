"""The zoo's rows for archs whose hub configs are remote code (no transformers configuration
class, or one that writes other keys than the ones mlx-lm reads, or names its sizes in keys the
zoo's shrink does not know: gpt2's n_embd / n_head): each tiny config is the keys of a real hub
config, shrunk to the zoo's sizes (`arch_row.py`)."""

from __future__ import annotations

from mlxbun.zoo.arch_row import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    MAX_POSITIONS,
    MOE_EXPERTS,
    MOE_TOP_K,
    SLIDING_WINDOW,
    Arch,
)
from mlxbun.zoo.tokenizer import VOCAB_SIZE

__all__ = ["REMOTE_CODE_ROWS"]

REMOTE_CODE_ROWS = (
    # no transformers class (remote code): keys of internlm/internlm2_5-7b-chat's config; GQA so
    # the kv-group-major wqkv layout holds 2 query heads per KV head
    Arch("internlm2", "InternLM2ForCausalLM", base={
        "model_type": "internlm2", "attn_implementation": "eager", "bias": False, "hidden_act": "silu",
        "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS, "num_attention_heads": HEADS,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"type": "dynamic", "factor": 2.0}, "rope_theta": 1000000,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # EXAONE 3.5: the keys of LGAI-EXAONE/EXAONE-3.5-2.4B-Instruct's config (remote-code names
    # num_layers / layer_norm_epsilon / activation_function, which mlx-lm reads; transformers'
    # ExaoneConfig writes others), llama3 rope with the context shrunk
    Arch("exaone", "ExaoneForCausalLM", base={
        "model_type": "exaone", "activation_function": "silu", "attention_dropout": 0.0,
        "embed_dropout": 0.0, "head_dim": HEAD_DIM, "hidden_size": HIDDEN, "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE, "layer_norm_epsilon": 1e-05,
        "max_position_embeddings": MAX_POSITIONS, "num_attention_heads": HEADS,
        "num_key_value_heads": 2, "num_layers": 2,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": MAX_POSITIONS // 8, "rope_type": "llama3"},
        "rope_theta": 1000000.0, "tie_word_embeddings": True, "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # MiMo-7B: the keys of XiaomiMiMo/MiMo-7B-RL's config (qwen2's, plus num_nextn_predict_layers)
    Arch("mimo", "MiMoForCausalLM", base={
        "model_type": "mimo", "attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS, "max_window_layers": 2, "num_attention_heads": HEADS,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "num_nextn_predict_layers": 1,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 640000, "sliding_window": MAX_POSITIONS,
        "tie_word_embeddings": False, "use_cache": True, "use_sliding_window": False,
        "vocab_size": VOCAB_SIZE}),
    # TeleChat3: llama's keys with its telechat3-yarn rope_scaling (initialize_rope's yarn), the
    # original context shrunk so a 40-token prompt reaches the scaled region
    Arch("telechat3", "Telechat3ForCausalLM", base={
        "model_type": "telechat3", "attention_bias": False, "attention_dropout": 0.0, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE, "max_position_embeddings": MAX_POSITIONS, "mlp_bias": False,
        "num_attention_heads": HEADS, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-06, "rope_scaling": {"type": "telechat3-yarn", "factor": 4.0,
                                                "original_max_position_embeddings": 32,
                                                "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                                "mscale_all_dim": 1.0},
        "rope_theta": 1000000.0, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": VOCAB_SIZE}),
    # GPT-2: the keys of openai-community/gpt2's config (n_ctx, which mlx-lm requires and
    # transformers 5's GPT2Config no longer writes, included)
    Arch("gpt2", "GPT2LMHeadModel", base={
        "model_type": "gpt2", "activation_function": "gelu_new", "attn_pdrop": 0.1, "embd_pdrop": 0.1,
        "initializer_range": 0.02, "layer_norm_epsilon": 1e-05, "n_ctx": MAX_POSITIONS, "n_embd": HIDDEN,
        "n_head": HEADS, "n_layer": 2, "n_positions": MAX_POSITIONS, "resid_pdrop": 0.1,
        "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
        "summary_type": "cls_index", "summary_use_proj": True, "vocab_size": VOCAB_SIZE}),
    # SantaCoder / StarCoder: the keys of bigcode/gpt_bigcode-santacoder's config (multi-query)
    Arch("gpt_bigcode", "GPTBigCodeForCausalLM", base={
        "model_type": "gpt_bigcode", "activation_function": "gelu_pytorch_tanh",
        "attention_softmax_in_fp32": True, "attn_pdrop": 0.1, "embd_pdrop": 0.1, "initializer_range": 0.02,
        "layer_norm_epsilon": 1e-05, "multi_query": True, "n_embd": HIDDEN, "n_head": HEADS,
        "n_inner": INTERMEDIATE, "n_layer": 2, "n_positions": MAX_POSITIONS, "resid_pdrop": 0.1,
        "scale_attention_softmax_in_fp32": True, "scale_attn_weights": True, "summary_activation": None,
        "summary_first_dropout": 0.1, "summary_proj_to_labels": True, "summary_type": "cls_index",
        "summary_use_proj": True, "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # Qwen (v1): the keys of Qwen/Qwen-7B-Chat's config (remote code), MLP width intermediate_size // 2
    Arch("qwen", "QWenLMHeadModel", base={
        "model_type": "qwen", "attn_dropout_prob": 0.0, "bf16": False, "emb_dropout_prob": 0.0, "fp16": False,
        "fp32": False, "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": 2 * INTERMEDIATE,
        "kv_channels": HEAD_DIM, "layer_norm_epsilon": 1e-06, "max_position_embeddings": MAX_POSITIONS,
        "no_bias": True, "num_attention_heads": HEADS, "num_hidden_layers": 2, "onnx_safe": None,
        "rotary_emb_base": 10000, "rotary_pct": 1.0, "scale_attn_weights": True, "seq_length": MAX_POSITIONS,
        "softmax_in_fp32": False, "tie_word_embeddings": False, "use_cache": True, "use_cache_kernel": False,
        "use_cache_quantization": False, "use_dynamic_ntk": True, "use_flash_attn": "auto",
        "use_logn_attn": True, "vocab_size": VOCAB_SIZE}),
    # GPT-J: the keys of EleutherAI/gpt-j-6b's config; rope on 8 of each head's 16 dims
    Arch("gptj", "GPTJForCausalLM", base={
        "model_type": "gptj", "activation_function": "gelu_new", "attn_pdrop": 0.0, "embd_pdrop": 0.0,
        "gradient_checkpointing": False, "initializer_range": 0.02, "layer_norm_epsilon": 1e-05,
        "n_embd": HIDDEN, "n_head": HEADS, "n_inner": None, "n_layer": 2, "n_positions": MAX_POSITIONS,
        "resid_pdrop": 0.0, "rotary": True, "rotary_dim": HEAD_DIM // 2, "scale_attn_weights": True,
        "summary_activation": None, "summary_first_dropout": 0.1, "summary_proj_to_labels": True,
        "summary_type": "cls_index", "summary_use_proj": True, "tie_word_embeddings": False,
        "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # Nanbeige: llama's keys with the loop fields of mlx-lm's nanbeige (the stack run twice)
    Arch("nanbeige", "NanbeigeForCausalLM", base={
        "model_type": "nanbeige", "attention_bias": False, "attention_dropout": 0.0, "head_dim": HEAD_DIM,
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE, "max_position_embeddings": MAX_POSITIONS, "mlp_bias": False,
        "num_attention_heads": HEADS, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_loops": 2,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 70000000.0,
        "skip_loop_final_norm": False, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": VOCAB_SIZE}),
    # PLaMo: the keys of pfnet/plamo-13b's config (40 heads sharing 8 KV heads: n_shared_head 5)
    Arch("plamo", "PlamoForCausalLM", base={
        "model_type": "plamo", "hidden_size": HIDDEN, "initializer_range": 0.02,
        "intermediate_size": INTERMEDIATE, "max_position_embeddings": MAX_POSITIONS, "n_shared_head": 2,
        "num_attention_heads": HEADS, "num_hidden_layers": 2, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # OpenELM: the keys of apple/OpenELM-270M's config, two layers of different head counts and widths
    Arch("openelm", "OpenELMForCausalLM", base={
        "model_type": "openelm", "activation_fn_name": "swish", "ffn_dim_divisor": 64,
        "ffn_multipliers": [1.0, 2.0], "ffn_with_glu": True, "head_dim": HEAD_DIM, "initializer_range": 0.02,
        "max_context_length": MAX_POSITIONS, "model_dim": HIDDEN, "normalization_layer_name": "rms_norm",
        "normalize_qk_projections": True, "num_gqa_groups": 2, "num_kv_heads": [2, 1],
        "num_query_heads": [HEADS, 2], "num_transformer_layers": 2, "qkv_multipliers": [0.5, 1.0],
        "rope_freq_constant": 10000, "rope_max_length": 2 * MAX_POSITIONS, "share_input_output_layers": True,
        "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # PLaMo 3: mlx-lm's plamo3 ModelArgs keys (pfnet's hub config); one sliding, one global layer
    Arch("plamo3", "Plamo3ForCausalLM", base={
        "model_type": "plamo3", "head_dim": HEAD_DIM, "hidden_size": HIDDEN, "image_feature_size": None,
        "image_proj_type": "linear", "image_token_id": None, "intermediate_size": INTERMEDIATE,
        "linear_type": "normal", "max_position_embeddings": MAX_POSITIONS, "num_attention_heads": HEADS,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_local_theta": 10000,
        "rope_theta": 1000000, "sliding_window": None, "sliding_window_pattern": 2,
        "tie_word_embeddings": True, "use_cache": True, "vocab_size": VOCAB_SIZE,
        "window_size": SLIDING_WINDOW}),
    # Phixtral: the keys mlx-lm's phixtral reads (hub phi-msft configs carry phi-2's sizes as
    # n_embd / n_head / n_layer / vocab_size, which must agree: written alike); rope on 8 of 16 dims
    Arch("phixtral", "PhiForCausalLM", base={
        "model_type": "phixtral", "model_dim": HIDDEN, "n_embd": HIDDEN, "n_head": HEADS, "n_layer": 2,
        "num_experts_per_tok": MOE_TOP_K, "num_heads": HEADS, "num_layers": 2, "num_local_experts": MOE_EXPERTS,
        "num_vocab": VOCAB_SIZE, "rotary_dim": HEAD_DIM // 2, "vocab_size": VOCAB_SIZE}),
    # Spark 2.5: mlx-lm's spark2_5 ModelArgs keys; one sliding (window 16, half-rotary) and one full layer
    Arch("spark2_5", "Spark2_5ForCausalLM", base={
        "model_type": "spark2_5", "attention_bias": False, "gate_attn_act_mode": "sigmoid", "head_dim": HEAD_DIM,
        "headwise_attn_output_gate": True, "hidden_act": "gelu", "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": MAX_POSITIONS, "mlp_bias": False, "num_attention_heads": HEADS,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_parameters": {"full_attention": {"rope_theta": 1000000.0},
                            "sliding_attention": {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}},
        "sliding_window": SLIDING_WINDOW, "tie_word_embeddings": True, "vocab_size": VOCAB_SIZE}),
    # IQuest-Loop-Coder: llama's keys with loop_num 2 and a loop window of 16 (a 40-token prompt
    # passes it)
    Arch("iquestloopcoder", "IQuestLoopCoderForCausalLM", base={
        "model_type": "iquestloopcoder", "attention_bias": False, "head_dim": HEAD_DIM, "hidden_act": "silu",
        "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": INTERMEDIATE, "loop_num": 2,
        "loop_window_size": SLIDING_WINDOW, "max_position_embeddings": MAX_POSITIONS, "mlp_bias": False,
        "num_attention_heads": HEADS, "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "use_cache": True,
        "vocab_size": VOCAB_SIZE}),
    # Nemotron-NAS: the keys of nvidia/Llama-3_1-Nemotron-51B-Instruct's config (DeciLM), four layers
    # covering every block_configs shape: attention (2 KV heads), a linear replacement, a no-op, attention
    # (1 KV head); MLPs of ffn_mult 2.0 / 1.0, a linear replacement, a no-op; no rope_scaling (the real
    # config's llama3 dict makes transformers 5's tokenizer loading fail on this model_type's
    # per-layer config: the knob cases run it)
    Arch("nemotron-nas", "DeciLMForCausalLM", base={
        "model_type": "nemotron-nas", "attention_bias": False,
        "block_configs": [
            {"attention": {"n_heads_in_group": 2, "no_op": False, "replace_with_linear": False},
             "ffn": {"ffn_mult": 2.0, "no_op": False, "replace_with_linear": False}},
            {"attention": {"n_heads_in_group": None, "no_op": False, "replace_with_linear": True},
             "ffn": {"ffn_mult": 1.0, "no_op": False, "replace_with_linear": False}},
            {"attention": {"n_heads_in_group": None, "no_op": True, "replace_with_linear": False},
             "ffn": {"ffn_mult": None, "no_op": False, "replace_with_linear": True}},
            {"attention": {"n_heads_in_group": 4, "no_op": False, "replace_with_linear": False},
             "ffn": {"ffn_mult": None, "no_op": True, "replace_with_linear": False}}],
        "hidden_act": "silu", "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": None,
        "max_position_embeddings": MAX_POSITIONS, "mlp_bias": False, "num_attention_heads": HEADS,
        "num_hidden_layers": 4, "num_key_value_heads": None, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": None, "rope_theta": 500000.0, "tie_word_embeddings": False, "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # Talkie: mlx-lm's talkie ModelArgs keys (its fp32-default rms eps)
    Arch("talkie", "TalkieForCausalLM", base={
        "model_type": "talkie", "head_dim": HEAD_DIM, "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "max_position_embeddings": MAX_POSITIONS, "num_attention_heads": HEADS, "num_hidden_layers": 2,
        "rms_norm_eps": 1.1920928955078125e-07, "rope_theta": 1000000.0, "vocab_size": VOCAB_SIZE}),
    # DBRX: the keys of databricks/dbrx-instruct's config (nested attn_config / ffn_config), 4 experts of 2
    Arch("dbrx", "DbrxForCausalLM", base={
        "model_type": "dbrx", "attn_config": {"clip_qkv": 8, "kv_n_heads": 2, "rope_theta": 500000},
        "d_model": HIDDEN, "emb_pdrop": 0.0,
        "ffn_config": {"ffn_hidden_size": INTERMEDIATE, "moe_jitter_eps": 0, "moe_loss_weight": 0.05,
                       "moe_num_experts": MOE_EXPERTS, "moe_top_k": MOE_TOP_K},
        "initializer_range": 0.02, "max_seq_len": MAX_POSITIONS, "n_heads": HEADS, "n_layers": 2,
        "output_router_logits": False, "resid_pdrop": 0.0, "router_aux_loss_coef": 0.05,
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # Baichuan-M1: mlx-lm's baichuan_m1 keys (baichuan-inc/Baichuan-M1-14B's): layer 1 of 2 slides, with
    # its own head counts (2 heads of 32, 2 KV heads)
    Arch("baichuan_m1", "BaichuanM1ForCausalLM", base={
        "model_type": "baichuan_m1", "conv_window": 2, "hidden_act": "silu", "hidden_size": HIDDEN,
        "initializer_range": 0.02, "intermediate_size": INTERMEDIATE, "max_position_embeddings": MAX_POSITIONS,
        "num_attention_heads": HEADS, "num_hidden_layers": 2, "num_key_value_heads": 2,
        "num_swa_attention_heads": 2, "num_swa_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0, "sliding_window": SLIDING_WINDOW, "sliding_window_layers": [1],
        "tie_word_embeddings": False, "use_cache": True, "vocab_size": VOCAB_SIZE}),
    # PLaMo 2: mlx-lm's plamo2 ModelArgs keys (pfnet/plamo-2-1b's); mamba / attention / mamba / attention
    Arch("plamo2", "Plamo2ForCausalLM", base={
        "model_type": "plamo2", "attention_window_size": MAX_POSITIONS, "full_attention_idx": [],
        "hidden_size": HIDDEN, "hidden_size_per_head": HEAD_DIM, "intermediate_size": INTERMEDIATE,
        "mamba_chunk_size": 256, "mamba_d_conv": 4, "mamba_d_state": 16, "mamba_enabled": True,
        "mamba_num_heads": 8, "mamba_step": 2, "max_position_embeddings": MAX_POSITIONS,
        "num_attention_heads": HEADS, "num_hidden_layers": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True, "vocab_size": VOCAB_SIZE}),
    # RecurrentGemma: the keys of google/recurrentgemma-2b's config; recurrent / attention / recurrent,
    # a 16-token attention window
    Arch("recurrent_gemma", "RecurrentGemmaForCausalLM", base={
        "model_type": "recurrent_gemma", "attention_bias": False, "attention_window_size": SLIDING_WINDOW,
        "block_types": ["recurrent", "attention", "recurrent"], "conv1d_width": 4, "embeddings_scale_by_sqrt_dim": True,
        "final_w_init_variance_scale": 0.0769, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": HIDDEN,
        "intermediate_size": 2 * INTERMEDIATE, "logits_soft_cap": 30.0, "lru_width": HIDDEN,
        "num_attention_heads": HEADS, "num_hidden_layers": 3, "num_key_value_heads": 1,
        "partial_rotary_factor": 0.5, "rms_norm_eps": 1e-06, "rope_theta": 10000.0, "vocab_size": VOCAB_SIZE,
        "w_init_variance_scale": 0.01}),
    # RWKV-7: mlx-lm's rwkv7 keys (fla-hub/rwkv7-0.1B-g1's): 4 heads of 16, low-rank dims 16 / 32
    Arch("rwkv7", "RWKV7ForCausalLM", base={
        "model_type": "rwkv7", "a_low_rank_dim": 16, "decay_low_rank_dim": 16, "gate_low_rank_dim": 32,
        "head_dim": HEAD_DIM, "hidden_act": "sqrelu", "hidden_size": HIDDEN, "intermediate_size": 4 * HIDDEN,
        "norm_eps": 1e-05, "num_hidden_layers": 2, "tie_word_embeddings": False, "use_cache": True,
        "v_low_rank_dim": 16, "vocab_size": VOCAB_SIZE}),
    # Llama 4 text: the keys mlx-lm's llama4_text reads (a Llama4TextConfig's dense subset), layer 1 NoPE
    Arch("llama4_text", "Llama4ForCausalLM", base={
        "model_type": "llama4_text", "head_dim": HEAD_DIM, "hidden_size": HIDDEN, "intermediate_size": 2 * INTERMEDIATE,
        "intermediate_size_mlp": INTERMEDIATE, "no_rope_layers": [1, 0], "num_attention_heads": HEADS,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "use_qk_norm": True, "vocab_size": VOCAB_SIZE}),
    # Gear: mlx-lm's gear keys; conv mixer / sliding (window 16) / full layers, attention softcap 50
    Arch("gear", "GearForCausalLM", base={
        "model_type": "gear", "attention_bias": False, "attn_logit_softcapping": 50.0, "conv_L_cache": 3,
        "final_logit_softcapping": 30.0, "head_dim": HEAD_DIM, "hidden_activation": "gelu_pytorch_tanh",
        "hidden_size": HIDDEN, "intermediate_size": INTERMEDIATE,
        "layer_types": ["conv_mixer", "sliding_attention", "full_attention"], "max_position_embeddings": MAX_POSITIONS,
        "num_attention_heads": HEADS, "num_hidden_layers": 3, "num_key_value_heads": 2, "query_pre_attn_scalar": 16,
        "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000.0, "rope_scaling": None, "rope_theta": 1000000.0,
        "sliding_window": SLIDING_WINDOW, "tie_word_embeddings": True, "vocab_size": VOCAB_SIZE}),
    # Muse Glimmer's text tower: its ModelArgs keys; 4 layers (3 sliding in window 16, then 1 full NoPE)
    Arch("muse_glimmer", "MuseGlimmerForConditionalGeneration", base={
        "model_type": "muse_glimmer", "final_logit_softcapping": 20.0, "head_dim": HEAD_DIM, "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "max_position_embeddings": MAX_POSITIONS, "num_attention_heads": HEADS,
        "num_hidden_layers": 4, "num_key_value_heads": 2, "output_multiplier": 0.5, "post_norm_eps": 1e-08,
        "qk_scale_factor": 3.87, "rms_norm_eps": 1e-06, "rope_theta": 500000.0, "sliding_window": SLIDING_WINDOW,
        "tie_word_embeddings": False, "vocab_size": VOCAB_SIZE}),
    # AFM 7: its ModelArgs keys; 3 layers, the last a KV-reuse layer (float variants only: mlx-lm cannot
    # quantize its FusedLinear)
    Arch("afm7", "AFMForCausalLM", base={
        "model_type": "afm7", "hidden_dim": HIDDEN, "hidden_dim_scale_factor": 3.25, "num_heads": HEADS,
        "num_kv_heads": 2, "num_kv_reuse_layers": 1, "num_layers": 3, "rms_norm_eps": 1e-05, "rope_theta": 50000,
        "vocab_size": VOCAB_SIZE}, unquantizable=True),
)
