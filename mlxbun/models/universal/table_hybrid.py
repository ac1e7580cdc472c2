"""The hybrid rows of the descriptor table: archs whose layers mix tokens with attention on
some layers and a recurrent mixer (`mixers/`) on the others (`ArchDescriptor.hybrid`).
Same schema and rules as `table.py`'s rows; `table.DESCRIPTORS` holds them all."""

from __future__ import annotations

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
    StackExperts,
)
from mlxbun.models.universal.schema_hybrid import HybridKnobs

__all__ = ["HYBRID_ROWS"]

_LFM2_NAMES = dict(o="out_proj", mlp="feed_forward", final_norm="embedding_norm",
                   norms=NormNames(pre_attn="operator_norm", pre_mlp="ffn_norm"))
_LFM2_QK_NORM = QKNormKnobs("rms", "heads", names=("q_layernorm", "k_layernorm"))
_LFM2_CONV = HybridKnobs("short_conv", "index_list", field="full_attn_idxs", name="conv",
                         layer_types=("conv",))
_LFM2_CONV_LAYOUT = SanitizeRule("conv1d_layout", ("conv.weight", "last_gt_middle"),
                                 "torch's depthwise conv1d layout [C, 1, K] -> mlx's [C, K, 1]")
_LFM2_TIED = {"tie_embedding": "mlx-lm's lfm2 files always tie the head to the embedding",
              "tie_word_embeddings": "mlx-lm's lfm2 files always tie the head to the embedding"}

HYBRID_ROWS = [
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
        names=Names(gate="w1", up="w3", down="w2", **_LFM2_NAMES),
        qk_norm=_LFM2_QK_NORM,
        rope=RopeKnobs(traditional=False, scaling=None),
        mlp=MlpKnobs(intermediate="lfm2"),
        norm=NormKnobs(eps="norm_eps"),
        head=HeadKnobs(tie=True),
        hybrid=_LFM2_CONV, sanitize=(_LFM2_CONV_LAYOUT,), ignored_keys=_LFM2_TIED,
        notes="lfm2: gated short convolutions (in_proj -> B * x -> causal depthwise conv1d -> "
              "C * . -> out_proj) on the layers full_attn_idxs leaves, attention with per-head "
              "q/k RMSNorm on the others; SwiGLU w1/w3/w2 sized by block_ff_dim (auto-adjusted); "
              "final embedding_norm; the head is the embedding.",
    ),
    ArchDescriptor(
        "lfm2_moe",
        {"model_type": REQUIRED, "vocab_size": REQUIRED, "hidden_size": REQUIRED,
         "intermediate_size": REQUIRED, "moe_intermediate_size": REQUIRED, "num_hidden_layers": REQUIRED,
         "num_experts": REQUIRED, "num_experts_per_tok": REQUIRED, "norm_topk_prob": REQUIRED,
         "num_attention_heads": REQUIRED, "num_key_value_heads": REQUIRED,
         "max_position_embeddings": REQUIRED, "use_expert_bias": REQUIRED, "num_dense_layers": REQUIRED,
         "norm_eps": REQUIRED, "conv_bias": REQUIRED, "conv_L_cache": REQUIRED, "rope_theta": 1000000.0,
         "routed_scaling_factor": 1.0, "rope_parameters": None, "full_attn_idxs": None,
         "layer_types": None},
        ("rope_parameters_theta", "full_attn_idxs"),
        head_dim="split", names=Names(**_LFM2_NAMES), qk_norm=_LFM2_QK_NORM,
        rope=RopeKnobs(traditional=False, scaling=None),
        norm=NormKnobs(eps="norm_eps"),
        head=HeadKnobs(tie=True),
        hybrid=_LFM2_CONV,
        moe=MoEKnobs(layers="num_dense",
                     router=RouterKnobs("sigmoid_scaled", select="last", norm_topk="norm_topk_prob",
                                        corrected="use_expert_bias", bias_at="block",
                                        params={"scaling": "routed_scaling_factor"}),
                     names=MoENames(correction_bias="expert_bias")),
        sanitize=(_LFM2_CONV_LAYOUT,
                  SanitizeRule("rename_substrings", (("w1.weight", "gate_proj.weight"),
                                                     ("w2.weight", "down_proj.weight"),
                                                     ("w3.weight", "up_proj.weight")),
                               "the HF MLP names w1 / w2 / w3"),
                  SanitizeRule("stack_experts", StackExperts(keys=("weight",)),
                               "per-expert HF tensors stacked into switch_mlp")),
        ignored_keys={**_LFM2_TIED, "output_router_logits": "training-time router output"},
        notes="lfm2's short-conv / attention layers with an MoE feed_forward from layer "
              "num_dense_layers on: router sigmoid(gate(x)) in x's dtype, top-k of it (+ the float32 "
              "expert_bias when use_expert_bias), the k sigmoid scores renormalized by sum + 1e-6, "
              "times routed_scaling_factor.",
    ),
]
