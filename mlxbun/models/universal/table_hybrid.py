"""The hybrid rows of the descriptor table: archs whose layers mix tokens with attention on
some layers and a recurrent mixer (`mixers/`) on the others (`ArchDescriptor.hybrid`).
Same schema and rules as `table.py`'s rows; `table.DESCRIPTORS` holds them all."""

from __future__ import annotations

from mlxbun.models.universal.schema import (
    REQUIRED,
    ArchDescriptor,
    HeadKnobs,
    MlpKnobs,
    Names,
    NormKnobs,
    NormNames,
    QKNormKnobs,
    RopeKnobs,
    SanitizeRule,
)
from mlxbun.models.universal.schema_hybrid import HybridKnobs

__all__ = ["HYBRID_ROWS"]

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
