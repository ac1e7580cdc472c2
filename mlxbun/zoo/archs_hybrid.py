"""The zoo's hybrid rows (recurrent mixers on some layers): every layer kind of each arch appears
in its tiny config."""

from __future__ import annotations

from mlxbun.zoo.arch_row import (
    HEAD_DIM,
    HIDDEN,
    MOE_EXPERTS,
    MOE_INTERMEDIATE,
    MOE_TOP_K,
    Arch,
)
from mlxbun.zoo.gated_delta_configs import QWEN3_5_KNOBS, qwen3_5_post, qwen3_next_post

__all__ = ["HYBRID_ROWS", "LFM2_KNOBS", "lfm2_post"]


def lfm2_post(cfg: dict) -> None:
    # real hub configs carry block_dim / block_ff_dim (mlx-lm requires block_dim) and
    # tie_embedding (the config class reads it, mlx-lm always ties)
    cfg.update(block_dim=cfg["hidden_size"], block_ff_dim=cfg["intermediate_size"],
               tie_embedding=cfg["tie_word_embeddings"])


LFM2_KNOBS = {"layer_types": ["conv", "full_attention", "conv"], "block_multiple_of": 32}

# hybrid rows: attention on some layers, a recurrent mixer on the others (every kind appears)
HYBRID_ROWS = (
    # conv, attention, conv: the attention mask comes from layer 1, the conv mask from layer 0
    Arch("lfm2", "Lfm2ForCausalLM", "Lfm2Config", layers=3, kv_heads=2,
         knobs=LFM2_KNOBS, post=lfm2_post),
    # delta, attention, delta; Qwen3-Next's knobs (renormalized top-k, a shared expert), layer 2
    # dense (mlp_only_layers); key heads of 32 (mlx-lm's Metal kernel needs Dk % 32 == 0)
    Arch("qwen3_next", "Qwen3NextForCausalLM", "Qwen3NextConfig", layers=3, kv_heads=2,
         knobs={"full_attention_interval": 2, "linear_num_value_heads": 4,
                "linear_num_key_heads": 2, "linear_key_head_dim": 32, "linear_value_head_dim": 16,
                "num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE,
                "shared_expert_intermediate_size": MOE_INTERMEDIATE, "mlp_only_layers": [2]},
         post=qwen3_next_post),
    # delta, attention, delta behind the VLM wrapper
    Arch("qwen3_5", "Qwen3_5ForConditionalGeneration", "Qwen3_5TextConfig", layers=3, kv_heads=2,
         legacy_rope=False, knobs=QWEN3_5_KNOBS, post=qwen3_5_post),
    Arch("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeTextConfig", layers=3,
         kv_heads=2, legacy_rope=False,
         knobs={**QWEN3_5_KNOBS, "num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE,
                "shared_expert_intermediate_size": MOE_INTERMEDIATE},
         post=qwen3_5_post),
    # conv, attention, conv; layer 0 dense, layers 1-2 MoE (sigmoid router with expert bias)
    Arch("lfm2_moe", "Lfm2MoeForCausalLM", "Lfm2MoeConfig", layers=3, kv_heads=2,
         knobs={"layer_types": ["conv", "full_attention", "conv"], "num_dense_layers": 1,
                "num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE, "routed_scaling_factor": 1.5}),
    # delta, attention, delta: the attention (post-norm) and delta (pre-norm) blocks, beta * 2
    # (linear_allow_neg_eigval's default); key heads of 32 (mlx-lm's Metal kernel needs Dk % 32 == 0);
    # rope_parameters only, as transformers-5 hub configs write it
    Arch("olmo_hybrid", "OlmoHybridForCausalLM", "OlmoHybridConfig", layers=3, kv_heads=2,
         legacy_rope=False,
         knobs={"layer_types": ["linear_attention", "full_attention", "linear_attention"],
                "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 32,
                "linear_value_head_dim": 16}),
    # every layer the Mamba2 mixer: 8 heads x 16 = 2 * hidden, 2 groups of state 16; mlx-lm
    # requires intermediate_size, which transformers 5's Mamba2Config no longer writes
    Arch("mamba2", "Mamba2ForCausalLM", "Mamba2Config", legacy_rope=False,
         knobs={"num_heads": 8, "state_size": 16, "n_groups": 2}, extra={"intermediate_size": 2 * HIDDEN}),
    # every layer the Mamba (v1) mixer, width 2 * hidden, state 16; falcon_mamba (mlx-lm's mamba.py
    # with delta / B / C rms-normed) with time_step_rank "auto" (ceil(64 / 16))
    Arch("mamba", "MambaForCausalLM", "MambaConfig", legacy_rope=False, knobs={"time_step_rank": 4}),
    Arch("falcon_mamba", "FalconMambaForCausalLM", "FalconMambaConfig", legacy_rope=False,
         knobs={"time_step_rank": "auto"}),
    # mamba, attention + MoE, mamba, attention + MoE (attn / expert period 2, offset 1)
    Arch("jamba", "JambaForCausalLM", "JambaConfig", layers=4, kv_heads=2, legacy_rope=False,
         knobs={"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
                "num_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K, "mamba_dt_rank": 32}),
    # mamba, MoE, attention, MLP, mamba: mlx-lm's cache list skips the MoE and MLP layers (the
    # attention mask comes from cache 1, layer 2); two expert groups, one kept; routed scaling
    Arch("nemotron_h", "NemotronHForCausalLM", "NemotronHConfig", layers=5, kv_heads=2,
         legacy_rope=False,
         knobs={"mamba_num_heads": 8, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 2,
                "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp",
                                      "linear_attention"],
                "n_routed_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE,
                "moe_shared_expert_intermediate_size": MOE_INTERMEDIATE, "n_group": 2,
                "topk_group": 1, "routed_scaling_factor": 2.5}),
    # Granite 4.0 H without experts, NoPE: layer_types spelled as hub configs do (transformers 5
    # writes linear_attention / full_attention, which mlx-lm 0.32.2 refuses)
    Arch("granitemoehybrid", "GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig", layers=3,
         kv_heads=2, extra={"layer_types": ["mamba", "attention", "mamba"]},
         knobs={"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 2,
                "num_local_experts": 0, "layer_types": ["mamba", "attention", "mamba"],
                "position_embedding_type": "nope", "embedding_multiplier": 12.0,
                "attention_multiplier": 0.0625, "residual_multiplier": 0.22, "logits_scaling": 8.0}),
    # mamba2 beside attention in each layer (8 heads x 16, 2 groups, gated norm); tied head scaled
    # by lm_head / embedding multiplier (the others fold into HF-layout weights: tests/test_hybrid_falcon)
    Arch("falcon_h1", "FalconH1ForCausalLM", "FalconH1Config", kv_heads=2, extra={"head_dim": HEAD_DIM},
         knobs={"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                "mamba_n_groups": 2, "mamba_rms_norm": True, "mamba_norm_before_gate": False,
                "tie_word_embeddings": True, "embedding_multiplier": 5.656854249492381,
                "lm_head_multiplier": 0.0390625}),
)
