"""The hybrid rows of the descriptor table: archs whose layers mix tokens with attention on
some layers and a recurrent mixer (`mixers/`) on the others (`ArchDescriptor.hybrid`).
Same schema and rules as `table.py`'s rows; `table.DESCRIPTORS` holds them all."""

from __future__ import annotations

from mlxbun.models.universal.kinds import ConvLayout, HfCheckpoint
from mlxbun.models.universal.mixers.gated_delta import GatedDeltaKnobs, GdnProjections
from mlxbun.models.universal.schema import (
    REQUIRED,
    ArchDescriptor,
    HeadKnobs,
    MlpKnobs,
    MoEKnobs,
    MoENames,
    Names,
    NormKnobs,
    NormNames,
    QKNormKnobs,
    RopeKnobs,
    RouterKnobs,
    SanitizeRule,
    SharedKnobs,
    StackExperts,
)
from mlxbun.models.universal.schema_hybrid import HybridKnobs

__all__ = ["HYBRID_ROWS"]

# qwen3_next / qwen3_5: their (1 + w) RMSNorms run as plain RMSNorm; a transformers checkpoint's
# weights get the + 1 in sanitize (the gated norm of the delta net excepted)
_QWEN3_NEXT_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                     "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
_GDN_CONV = SanitizeRule("conv1d_layout", ("conv1d.weight", ConvLayout.LAST_NE_ONE),
                         "torch's depthwise conv1d layout [C, 1, K] -> mlx's [C, K, 1]")
_QWEN3_NEXT_MOE = MoEKnobs(
    router=RouterKnobs("softmax_topk", select="last", norm_topk="norm_topk_prob"),
    layers="sparse_step", shared=SharedKnobs("sigmoid_gated", size="shared_expert_intermediate_size"),
    names=MoENames(shared="shared_expert"))

HYBRID_ROWS = [
    ArchDescriptor(
        "qwen3_next",
        {"model_type": REQUIRED, "hidden_size": REQUIRED, "num_hidden_layers": REQUIRED,
         "intermediate_size": REQUIRED, "num_attention_heads": REQUIRED,
         "linear_num_value_heads": REQUIRED, "linear_num_key_heads": REQUIRED,
         "linear_key_head_dim": REQUIRED, "linear_value_head_dim": REQUIRED,
         "linear_conv_kernel_dim": REQUIRED, "num_experts": REQUIRED, "num_experts_per_tok": REQUIRED,
         "decoder_sparse_step": REQUIRED, "shared_expert_intermediate_size": REQUIRED,
         "mlp_only_layers": REQUIRED, "moe_intermediate_size": REQUIRED, "rms_norm_eps": REQUIRED,
         "vocab_size": REQUIRED, "num_key_value_heads": REQUIRED, "rope_theta": REQUIRED,
         "partial_rotary_factor": REQUIRED, "max_position_embeddings": REQUIRED,
         "head_dim": REQUIRED, "norm_topk_prob": False, "tie_word_embeddings": False,
         "attention_bias": False, "rope_scaling": None, "full_attention_interval": 4},
        head_dim="field", attn_bias="attention_bias", out_bias="attention_bias",
        qk_norm=QKNormKnobs("rms", "heads"), attn_gate="query_sigmoid",
        rope=RopeKnobs(traditional=False, partial="partial_rotary_factor"),
        moe=_QWEN3_NEXT_MOE,
        hybrid=HybridKnobs("gated_delta", "interval", field="full_attention_interval",
                           name="linear_attn", knobs=GatedDeltaKnobs(GdnProjections.QKVZ_BA),
                           layer_types=("linear_attention",)),
        sanitize=(SanitizeRule("norm_plus_one", (_QWEN3_NEXT_NORMS, HfCheckpoint.EXPERT_WEIGHTS),
                               "a transformers checkpoint's (1 + w) norm weights + 1"),
                  SanitizeRule("drop_containing", "mtp.", "multi-token-prediction weights"),
                  SanitizeRule("drop_tied_head", None, "tied embeddings: the head is the embedding"),
                  SanitizeRule("stack_experts", StackExperts(keys=("weight",)),
                               "per-expert HF weights stacked into the fused SwitchGLU"),
                  _GDN_CONV),
        accepted_values={"hidden_act": ("silu",)},
        ignored_keys={"output_router_logits": "training-time router loss output",
                      "router_aux_loss_coef": "training-time router loss"},
        notes="qwen3_next: gated DeltaNet layers (fused in_proj_qkvz / in_proj_ba, causal conv1d, "
              "q/k l2-norm, the gated delta rule, gated RMSNorm) on the layers "
              "full_attention_interval leaves; the others attend with a sigmoid output gate from "
              "q_proj's second half, q/k RMSNorm and partial rope; qwen3_moe-style router with a "
              "sigmoid-gated shared expert, the routed sum uncast. mlx-lm's sanitize touches only "
              "transformers checkpoints (per-expert weights): norm weights + 1, conv1d layout, "
              "MTP weights dropped.",
    ),
    ArchDescriptor(
        "lfm2",
        {"model_type": REQUIRED, "vocab_size": REQUIRED, "hidden_size": REQUIRED,
         "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED, "num_key_value_heads": REQUIRED,
         "max_position_embeddings": REQUIRED, "norm_eps": REQUIRED, "conv_bias": REQUIRED,
         "conv_L_cache": REQUIRED, "block_dim": REQUIRED, "block_multiple_of": REQUIRED,
         "block_ffn_dim_multiplier": REQUIRED, "block_auto_adjust_ff_dim": REQUIRED,
         "block_ff_dim": None, "intermediate_size": None, "rope_theta": 1000000.0,
         "rope_parameters": None, "full_attn_idxs": None, "layer_types": None},
        ("lfm2_ff_dim", "rope_parameters_theta", "kv_heads_default", "full_attn_idxs"),
        head_dim="split",
        names=Names(o="out_proj", mlp="feed_forward", gate="w1", up="w3", down="w2",
                    final_norm="embedding_norm",
                    norms=NormNames(pre_attn="operator_norm", pre_mlp="ffn_norm")),
        qk_norm=QKNormKnobs("rms", "heads", names=("q_layernorm", "k_layernorm")),
        rope=RopeKnobs(traditional=False, scaling=None),
        mlp=MlpKnobs(intermediate="lfm2"),
        norm=NormKnobs(eps="norm_eps"),
        head=HeadKnobs(tie=True),
        hybrid=HybridKnobs("short_conv", "index_list", field="full_attn_idxs", name="conv",
                           layer_types=("conv",)),
        sanitize=(SanitizeRule("conv1d_layout", ("conv.weight", "last_gt_middle"),
                               "torch's depthwise conv1d layout [C, 1, K] -> mlx's [C, K, 1]"),),
        ignored_keys={"tie_embedding": "mlx-lm's lfm2 always ties the head to the embedding",
                      "tie_word_embeddings": "mlx-lm's lfm2 always ties the head to the embedding"},
        notes="lfm2: gated short convolutions (in_proj -> B * x -> causal depthwise conv1d -> "
              "C * . -> out_proj) on the layers full_attn_idxs leaves, attention with per-head "
              "q/k RMSNorm on the others; SwiGLU w1/w3/w2 sized by block_ff_dim (auto-adjusted); "
              "final embedding_norm; the head is the embedding.",
    ),
]
