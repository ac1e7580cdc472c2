"""The hybrid rows of the descriptor table: archs whose layers mix tokens with attention on
some layers and a recurrent mixer (`mixers/`) on the others (`ArchDescriptor.hybrid`).
Same schema and rules as `table.py`'s rows; `table.DESCRIPTORS` holds them all."""

from __future__ import annotations

from mlxbun.models.universal.kinds_hybrid import (
    ConvLayout,
    HfCheckpoint,
)
from mlxbun.models.universal.mixers.gated_delta import GatedDeltaKnobs, GdnProjections
from mlxbun.models.universal.mixers.mamba import JambaMambaKnobs, MambaKnobs
from mlxbun.models.universal.mixers.mamba2 import GatedNorm, Mamba2Knobs
from mlxbun.models.universal.schema import (
    REQUIRED,
    ArchDescriptor,
    BlockKnobs,
    HeadKnobs,
    LogitScale,
    MlpKnobs,
    Names,
    NormKnobs,
    NormNames,
    QKNormKnobs,
    RopeKnobs,
    SanitizeRule,
)
from mlxbun.models.universal.schema_hybrid import HybridKnobs
from mlxbun.models.universal.schema_moe import (
    MoEKnobs,
    MoENames,
    RouterKnobs,
    SharedKnobs,
    StackExperts,
)

__all__ = ["HYBRID_ROWS"]

# qwen3_next / qwen3_5: their (1 + w) RMSNorms run as plain RMSNorm; a transformers checkpoint's
# weights get the + 1 in sanitize (the gated norm of the delta net excepted)
_QWEN3_NEXT_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                     "model.norm.weight", ".q_norm.weight", ".k_norm.weight")
_GDN_CONV = SanitizeRule("conv1d_layout", ("conv1d.weight", ConvLayout.LAST_NE_ONE),
                         "torch's depthwise conv1d layout [C, 1, K] -> mlx's [C, K, 1]")
# qwen3_5's TextModelArgs (qwen3_5_moe builds the same text model)
_QWEN3_5_FIELDS = {
    "model_type": "", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "rms_norm_eps": 1e-6, "vocab_size": 151936, "num_key_value_heads": 8,
    "max_position_embeddings": 131072, "linear_num_value_heads": 64, "linear_num_key_heads": 16,
    "linear_key_head_dim": 192, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "tie_word_embeddings": False, "attention_bias": False, "head_dim": None,
    "full_attention_interval": 4, "num_experts": 0, "num_experts_per_tok": 0, "decoder_sparse_step": 1,
    "shared_expert_intermediate_size": 0, "moe_intermediate_size": 0, "norm_topk_prob": True,
    "rope_parameters": {"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 100000,
                        "partial_rotary_factor": 0.25},
    "partial_rotary_factor": 0.25, "rope_theta": 100000.0, "rope_scaling": None,
}
_QWEN3_5_HYBRID = HybridKnobs("gated_delta", "interval", field="full_attention_interval",
                              name="linear_attn", knobs=GatedDeltaKnobs(GdnProjections.QKV_Z_B_A),
                              layer_types=("linear_attention",))
_QWEN3_5_WRAPPER = SanitizeRule("wrapper_keys", ("vision_tower", "model.visual"),
                                "the VLM wrapper: text weights under language_model")
_QWEN3_5_TEXT = (SanitizeRule("norm_plus_one", (_QWEN3_NEXT_NORMS, HfCheckpoint.TORCH_CONV1D),
                              "a transformers checkpoint's (1 + w) norm weights + 1"),
                 SanitizeRule("drop_containing", "mtp.", "multi-token-prediction weights"), _GDN_CONV)
_QWEN3_NEXT_MOE = MoEKnobs(
    router=RouterKnobs("softmax_topk", select="last", norm_topk="norm_topk_prob"),
    layers="sparse_step", shared=SharedKnobs("sigmoid_gated", size="shared_expert_intermediate_size"),
    names=MoENames(shared="shared_expert"))
_LFM2_NAMES = dict(o="out_proj", mlp="feed_forward", final_norm="embedding_norm",
                   norms=NormNames(pre_attn="operator_norm", pre_mlp="ffn_norm"))
_LFM2_QK_NORM = QKNormKnobs("rms", "heads", names=("q_layernorm", "k_layernorm"))
_LFM2_CONV = HybridKnobs("short_conv", "index_list", field="full_attn_idxs", name="conv",
                         layer_types=("conv",))
_LFM2_CONV_LAYOUT = SanitizeRule("conv1d_layout", ("conv.weight", ConvLayout.LAST_GT_MIDDLE),
                                 "torch's depthwise conv1d layout [C, 1, K] -> mlx's [C, K, 1]")
_LFM2_TIED = {"tie_embedding": "mlx-lm's lfm2 files always tie the head to the embedding",
              "tie_word_embeddings": "mlx-lm's lfm2 files always tie the head to the embedding"}
# the one-op blocks (mamba2, nemotron_h): backbone.embeddings, layers[i].norm / .mixer (the
# mixer, attention or MLP), norm_f (a one-op block has the pre_attn norm only)
_SINGLE_OP_NAMES = Names(root="backbone", embed="embeddings", final_norm="norm_f", attn="mixer",
                         mlp="mixer", norms=NormNames(pre_attn="norm"))
_CONV1D_TORCH = SanitizeRule("conv1d_layout", ("conv1d.weight", ConvLayout.LAST_NE_ONE),
                             "torch's depthwise conv1d layout [C, 1, K] -> mlx's [C, K, 1]")
# the reference implementations' initialization and training settings
_MAMBA_TRAINING = {k: "initialization / training setting" for k in (
    "time_step_floor", "rescale_prenorm_residual")}

HYBRID_ROWS = [
    ArchDescriptor(
        "qwen3_5", _QWEN3_5_FIELDS, ("qwen3_5_rope",),
        names=Names(wrapper="language_model"), qk_norm=QKNormKnobs("rms", "heads"),
        head=HeadKnobs(split=True),
        attn_bias="attention_bias", out_bias="attention_bias", attn_gate="query_sigmoid",
        rope=RopeKnobs(traditional=False, partial="partial_rotary_factor"),
        hybrid=_QWEN3_5_HYBRID, sanitize=(_QWEN3_5_WRAPPER, *_QWEN3_5_TEXT),
        accepted_values={"hidden_act": ("silu",), "num_experts": (0,)},
        notes="qwen3_5: the text model behind the VLM wrapper (language_model.*; text_config's "
              "args; the vision tower's weights dropped): qwen3_next's layers with the delta "
              "net's own projections (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) and a dense "
              "MLP; rope from rope_parameters, mrope sections not applied (text positions: plain "
              "partial rope, as mlx-lm). Experts (num_experts > 0) are qwen3_5_moe's row.",
    ),
    ArchDescriptor(
        "qwen3_5_moe", _QWEN3_5_FIELDS, ("qwen3_5_rope",),
        names=Names(wrapper="language_model"), qk_norm=QKNormKnobs("rms", "heads"),
        head=HeadKnobs(split=True),
        attn_bias="attention_bias", out_bias="attention_bias", attn_gate="query_sigmoid",
        rope=RopeKnobs(traditional=False, partial="partial_rotary_factor"),
        moe=MoEKnobs(router=RouterKnobs("softmax_topk", select="last", norm_topk="norm_topk_prob"),
                     shared=SharedKnobs("sigmoid_gated", size="shared_expert_intermediate_size"),
                     names=MoENames(shared="shared_expert")),
        hybrid=_QWEN3_5_HYBRID,
        sanitize=(_QWEN3_5_WRAPPER,
                  SanitizeRule("split_gate_up_experts", None,
                               "HF fused experts gate_up_proj [E, 2I, D] split, down_proj renamed"),
                  *_QWEN3_5_TEXT),
        accepted_values={"hidden_act": ("silu",)},
        ignored_keys={"output_router_logits": "training-time router loss output"},
        notes="qwen3_5_moe: qwen3_5's text model with qwen3_next's MoE block (softmax router, "
              "sigmoid-gated shared expert) on every layer; HF's fused experts split in sanitize.",
    ),
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
    ArchDescriptor(
        "olmo_hybrid",
        {"model_type": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
         "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED,
         "num_key_value_heads": REQUIRED, "rms_norm_eps": REQUIRED, "vocab_size": REQUIRED,
         "max_position_embeddings": REQUIRED, "linear_num_key_heads": REQUIRED,
         "linear_num_value_heads": REQUIRED, "linear_key_head_dim": REQUIRED,
         "linear_value_head_dim": REQUIRED, "linear_conv_kernel_dim": REQUIRED,
         "linear_allow_neg_eigval": REQUIRED, "tie_word_embeddings": REQUIRED,
         "attention_bias": REQUIRED, "layer_norm_epsilon": 1e-5, "head_dim": None,
         "layer_types": None, "rope_parameters": None, "rope_theta": 10000.0},
        ("kv_heads_default", "olmo_hybrid_args"),
        attn_bias="attention_bias", out_bias="attention_bias", qk_norm=QKNormKnobs("rms", "flat"),
        rope=RopeKnobs(traditional=False, scaling=None),
        mlp=MlpKnobs(act="silu_eager"),
        names=Names(norms=NormNames(pre_attn=None, post_attn="post_attention_layernorm",
                                    pre_mlp=None, post_mlp="post_feedforward_layernorm")),
        block=BlockKnobs("post"),
        hybrid=HybridKnobs("gated_delta_split_conv", "type_list", field="layer_types",
                           name="linear_attn", layer_types=("linear_attention",),
                           mixer_block="pre", mixer_norms=NormNames()),
        sanitize=(SanitizeRule("drop_tied_head", None, "tied embeddings: the head is the embedding"),
                  SanitizeRule("conv1d_layout", ("conv1d.weight", ConvLayout.LAST_NE_ONE),
                               "torch's depthwise conv1d layout [C, 1, K] -> mlx's [C, K, 1]")),
        accepted_values={"hidden_act": ("silu",)},
        ignored_keys={k: "initialization range of the delta net's A_log / dt_bias" for k in (
            "linear_a_log_min", "linear_a_log_max", "linear_dt_min", "linear_dt_max",
            "linear_dt_init_floor")},
        notes="olmo_hybrid: gated DeltaNet layers (separate q/k/v/a/b/g projections, a causal "
              "conv1d + silu on each of q, k, v, q/k l2-norm, the gated delta rule with beta * 2 "
              "when linear_allow_neg_eigval, gated RMSNorm o_norm, o_proj) where layer_types says "
              "linear_attention, pre-norm (input_layernorm, post_attention_layernorm); every other "
              "layer attends olmo2-style, post-norm (post_attention_layernorm, "
              "post_feedforward_layernorm) with q/k RMSNorm over the flat projections. The MLP is "
              "silu(gate) * up outside a compiled swiglu. rope_theta from rope_parameters (10000.0 "
              "when it has none; no rope scaling); mlx-lm builds one layer per layer_types entry. A "
              "transformers save_pretrained checkpoint (q/k/v convs fused into linear_attn.conv1d) "
              "loads in neither.",
    ),
    ArchDescriptor(
        "mamba2",
        {"model_type": REQUIRED, "num_heads": REQUIRED, "head_dim": REQUIRED, "vocab_size": REQUIRED,
         "hidden_size": REQUIRED, "intermediate_size": REQUIRED, "state_size": REQUIRED,
         "num_hidden_layers": REQUIRED, "layer_norm_epsilon": REQUIRED, "conv_kernel": REQUIRED,
         "n_groups": REQUIRED, "use_bias": REQUIRED, "use_conv_bias": REQUIRED,
         "tie_word_embeddings": REQUIRED, "time_step_limit": REQUIRED, "time_step_rank": REQUIRED,
         "ssm_state_size": None, "max_position_embeddings": 2056},
        ("mamba2_state",),
        # no layer attends: the attention sizes resolve (from the mixer's heads) but build nothing
        n_heads="num_heads", n_kv_heads=None, head_dim="field",
        names=_SINGLE_OP_NAMES,
        rope=RopeKnobs(nope="all", nope_child=False),
        norm=NormKnobs(eps="layer_norm_epsilon"),
        hybrid=HybridKnobs("mamba2", "all", name="mixer", block="single", norm_eps=1e-5,
                           knobs=Mamba2Knobs()),
        sanitize=(_CONV1D_TORCH,),
        ignored_keys={"expand": "mlx-lm sizes the mixer by num_heads * head_dim",
                      "chunk_size": "mlx-lm's scan runs chunks of 256 whatever the config says",
                      "residual_in_fp32": "mlx-lm adds the residual in the activations' dtype",
                      "time_step_min": "initialization setting", "time_step_max": "initialization setting",
                      "hidden_act": "mlx-lm's mixer applies SiLU whatever the config says",
                      **_MAMBA_TRAINING},
        notes="mamba2: every layer is x + mixer(norm(x)) (norm: nn.RMSNorm with its default eps "
              "1e-5), the Mamba2 mixer (conv1d, SSD scan, gated RMSNorm over the full width); "
              "final norm_f.",
    ),
    ArchDescriptor(
        "mamba",
        {"model_type": REQUIRED, "vocab_size": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
         "state_size": REQUIRED, "num_hidden_layers": REQUIRED, "conv_kernel": REQUIRED, "use_bias": REQUIRED,
         "use_conv_bias": REQUIRED, "time_step_rank": REQUIRED, "tie_word_embeddings": True,
         "use_bcdt_rms": False, "mixer_rms_eps": 1e-6},
        ("mamba_args",),
        # no layer attends and no field holds head counts: the attention sizes are placeholders
        n_heads=None, n_kv_heads=None, head_dim="split", names=_SINGLE_OP_NAMES,
        rope=RopeKnobs(nope="all", nope_child=False),
        norm=NormKnobs(eps=1e-5),  # nn.RMSNorm(hidden_size): its default eps
        hybrid=HybridKnobs("mamba", "all", name="mixer", block="single", norm_eps=1e-5, knobs=MambaKnobs()),
        sanitize=(_CONV1D_TORCH,),
        ignored_keys={"expand": "mlx-lm sizes the mixer by intermediate_size",
                      "layer_norm_epsilon": "mlx-lm's norms keep nn.RMSNorm's default eps 1e-5",
                      "residual_in_fp32": "mlx-lm adds the residual in the activations' dtype",
                      "hidden_act": "mlx-lm's mixer applies SiLU whatever the config says",
                      "n_layer": "mlx-lm reads num_hidden_layers",
                      "use_mambapy": "a transformers kernel choice", "use_falcon_mambapy": "a transformers kernel choice",
                      **{k: "initialization / training setting" for k in (
                          "time_step_min", "time_step_max", "time_step_init_scheme", "time_step_scale",
                          "time_step_floor", "rescale_prenorm_residual", "use_associative_scan")}},
        notes="Mamba (falcon_mamba remaps here): every layer is x + mixer(norm(x)) (norm: nn.RMSNorm with "
              "its default eps 1e-5, layer_norm_epsilon not read), the Mamba mixer (conv1d, a per-token "
              "selective scan; falcon_mamba rms-normalizes delta, B and C without weight); final norm_f.",
    ),
    ArchDescriptor(
        "jamba",
        {"model_type": REQUIRED, "hidden_size": REQUIRED, "intermediate_size": REQUIRED,
         "num_hidden_layers": REQUIRED, "num_attention_heads": REQUIRED, "num_key_value_heads": REQUIRED,
         "attn_layer_offset": REQUIRED, "attn_layer_period": REQUIRED, "expert_layer_offset": REQUIRED,
         "expert_layer_period": REQUIRED, "mamba_d_conv": REQUIRED, "mamba_d_state": REQUIRED,
         "mamba_expand": REQUIRED, "num_experts": REQUIRED, "num_experts_per_tok": REQUIRED,
         "rms_norm_eps": REQUIRED, "max_position_embeddings": REQUIRED, "vocab_size": REQUIRED,
         "mamba_dt_rank": "auto", "mamba_proj_bias": False, "mamba_conv_bias": True, "layers_block_type": None,
         "tie_word_embeddings": True},
        ("jamba_args",), head_dim="split", rope=RopeKnobs(nope="all", nope_child=False),
        names=Names(mlp="feed_forward", norms=NormNames(pre_mlp="pre_ff_layernorm"), final_norm="final_layernorm"),
        moe=MoEKnobs(size="intermediate_size", router=RouterKnobs("topk_softmax"), layers="offset_period",
                     names=MoENames(gate="router", router="routing")),
        hybrid=HybridKnobs("jamba_mamba", "type_list", field="layers_block_type", name="mamba",
                           layer_types=("mamba",), knobs=JambaMambaKnobs()),
        sanitize=(_CONV1D_TORCH, SanitizeRule("drop_tied_head", None, "tied embeddings: the head is the embedding"),
                  SanitizeRule("stack_experts", StackExperts(keys=("weight", "bias", "scales", "biases")),
                               "per-expert HF tensors stacked into the fused SwitchGLU weights")),
        ignored_keys={"use_mamba_kernels": "a transformers kernel choice", "hidden_act": "mlx-lm's MLPs are SwiGLU",
                      "use_mambapy": "a transformers kernel choice", "use_associative_scan": "a transformers kernel choice",
                      "num_logits_to_keep": "a transformers generation setting",
                      "router_aux_loss_coef": "training only", "output_router_logits": "training only",
                      "sliding_window": "mlx-lm's jamba attends globally"},
        notes="Jamba: attention (no rope) on the layers_block_type 'attention' layers (i % attn_layer_period == "
              "attn_layer_offset by default), jamba's Mamba mixer elsewhere (width mamba_expand * hidden, "
              "delta / B / C through RMSNorm modules, a vectorized scan chained by a compiled fma); an MoE "
              "feed_forward (mixtral's top-k softmax router, SwitchGLU experts) where num_experts > 1 and "
              "(i + expert_layer_offset) % expert_layer_period == 0, a SwiGLU MLP elsewhere; the router "
              "quantizes at 8 bits (mlx-lm's quant_predicate).",
    ),
    ArchDescriptor(
        "nemotron_h",
        {"model_type": REQUIRED, "vocab_size": REQUIRED, "hidden_size": REQUIRED,
         "intermediate_size": REQUIRED, "max_position_embeddings": REQUIRED,
         "num_attention_heads": REQUIRED, "num_key_value_heads": REQUIRED, "attention_bias": REQUIRED,
         "mamba_num_heads": REQUIRED, "mamba_head_dim": REQUIRED, "mamba_proj_bias": REQUIRED,
         "ssm_state_size": REQUIRED, "conv_kernel": REQUIRED, "n_groups": REQUIRED,
         "mlp_bias": REQUIRED, "layer_norm_epsilon": REQUIRED, "use_bias": REQUIRED,
         "use_conv_bias": REQUIRED, "hybrid_override_pattern": None, "layers_block_type": None,
         "layer_types": None, "num_hidden_layers": None, "head_dim": None,
         "time_step_limit": None, "time_step_min": None, "time_step_max": None,
         # the MoE (E) layers' numbers
         **dict.fromkeys(("moe_intermediate_size", "moe_shared_expert_intermediate_size",
                          "moe_latent_size", "n_group", "n_routed_experts", "n_shared_experts",
                          "topk_group", "num_experts_per_tok", "norm_topk_prob",
                          "routed_scaling_factor"))},
        ("nemotron_pattern",),
        attn_bias="attention_bias", out_bias="attention_bias",
        names=_SINGLE_OP_NAMES,
        rope=RopeKnobs(nope="all", nope_child=False),
        mlp=MlpKnobs("plain", act="relu2", bias="mlp_bias"),
        norm=NormKnobs(eps="layer_norm_epsilon"),
        head=HeadKnobs(tie=False),
        moe=MoEKnobs(experts="n_routed_experts", combine="sum_cast", layers="pattern_e",
                     expert="mlp_relu2",
                     router=RouterKnobs("noaux_tc", gate="weight", norm_topk="norm_topk_prob",
                                        renorm="sum_eps",
                                        params={"scaling": "routed_scaling_factor", "n_group": "n_group",
                                                "topk_group": "topk_group"}),
                     shared=SharedKnobs("plain", size="moe_shared_expert_intermediate_size",
                                        when="n_shared_experts", bias="mlp_bias"),
                     names=MoENames(up_proj="fc1", down_proj="fc2")),
        hybrid=HybridKnobs("mamba2", "pattern", field="hybrid_override_pattern", name="mixer",
                           block="single",
                           knobs=Mamba2Knobs(heads="mamba_num_heads", head_dim="mamba_head_dim",
                                             in_bias="mamba_proj_bias", out_bias="mamba_proj_bias",
                                             norm=GatedNorm.GROUPED, d_cast=True, scan_lengths=False)),
        sanitize=(SanitizeRule("drop_prefix", "mtp.", "the multi-token-prediction heads"),
                  _CONV1D_TORCH,
                  SanitizeRule("stack_experts", StackExperts((("up_proj", "fc1"), ("down_proj", "fc2")),
                                                             ("weight",)),
                               "per-expert HF tensors stacked into the fused SwitchMLP weights")),
        accepted_values={"moe_latent_size": (None,)},
        ignored_keys={"expand": "mlx-lm sizes the mixer by mamba_num_heads * mamba_head_dim",
                      "chunk_size": "mlx-lm's scan runs chunks of 256 whatever the config says",
                      "residual_in_fp32": "mlx-lm adds the residual in the activations' dtype",
                      "mamba_ssm_cache_dtype": "mlx-lm keeps the SSM state in the scan's dtype",
                      "use_mamba_kernels": "CUDA kernel switch of the reference implementation",
                      "num_logits_to_keep": "generation setting",
                      "mamba_hidden_act": "mlx-lm's mixer applies SiLU whatever the config says",
                      "mlp_hidden_act": "mlx-lm's MLP applies relu2 whatever the config says",
                      "num_nextn_predict_layers": "multi-token prediction (mlx-lm drops mtp.*)",
                      "mtp_layers_block_type": "multi-token prediction (mlx-lm drops mtp.*)",
                      "moe_shared_expert_overlap": "a compute-overlap switch; mlx-lm reads none",
                      **_MAMBA_TRAINING},
        notes="nemotron_h: one op per layer, x + mixer(norm(x)), the op by "
              "hybrid_override_pattern: M the Mamba2 mixer (grouped gated RMSNorm, D cast to the "
              "input dtype), * attention without rope, - a relu2 MLP (up_proj, down_proj); only M "
              "and * layers hold a cache; E the MoE block (sigmoid router with correction bias, "
              "grouped top-k, renorm by sum + 1e-20, scaled; relu2 SwitchMLP experts fc1 / fc2; "
              "a relu2 shared expert). Latent MoE projections (moe_latent_size) are refused.",
    ),
    ArchDescriptor(
        "granitemoehybrid",
        {"model_type": REQUIRED, "vocab_size": REQUIRED, "hidden_size": REQUIRED,
         "intermediate_size": REQUIRED, "num_hidden_layers": REQUIRED,
         "max_position_embeddings": REQUIRED, "num_attention_heads": REQUIRED,
         "num_key_value_heads": REQUIRED, "attention_bias": REQUIRED, "embedding_multiplier": REQUIRED,
         "attention_multiplier": REQUIRED, "logits_scaling": REQUIRED, "residual_multiplier": REQUIRED,
         "layer_types": REQUIRED, "rms_norm_eps": REQUIRED,
         **dict.fromkeys(("num_local_experts", "num_experts_per_tok", "shared_intermediate_size",
                          "mamba_n_heads", "mamba_d_head", "mamba_proj_bias", "mamba_d_state",
                          "mamba_d_conv", "mamba_n_groups", "mamba_conv_bias")),
         "mlp_bias": False, "position_embedding_type": "rope", "tie_word_embeddings": True,
         "time_step_limit": (0.001, 100.0), "rope_theta": 10000.0, "rope_parameters": None},
        ("rope_parameters_theta",),
        head_dim="split", attn_bias="attention_bias", out_bias="attention_bias",
        attn_scale="attention_multiplier",
        rope=RopeKnobs(traditional=False, scaling=None, nope="nope_type", nope_child=False),
        mlp=MlpKnobs(bias="mlp_bias"),
        block=BlockKnobs(residual="scaled", residual_scale="residual_multiplier"),
        embed_scale="embedding_multiplier",
        head=HeadKnobs(post=LogitScale("div", "logits_scaling")),
        hybrid=HybridKnobs("mamba2", "layer_types", field="layer_types", name="mamba",
                           layer_types=("mamba",),
                           knobs=Mamba2Knobs(heads="mamba_n_heads", head_dim="mamba_d_head",
                                             state="mamba_d_state", groups="mamba_n_groups",
                                             conv_kernel="mamba_d_conv", conv_bias="mamba_conv_bias",
                                             in_bias="mamba_proj_bias", out_bias="mamba_proj_bias",
                                             eps="rms_norm_eps", d_cast=True)),
        sanitize=(_CONV1D_TORCH,
                  SanitizeRule("shared_mlp_dense", None, "HF's dense layers live in shared_mlp"),
                  SanitizeRule("drop_tied_head", None, "tied embeddings: the head is the embedding")),
        accepted_values={"num_local_experts": (0,)},
        ignored_keys={"mamba_expand": "mlx-lm sizes the mixer by mamba_n_heads * mamba_d_head",
                      "mamba_chunk_size": "mlx-lm's scan runs chunks of 256 whatever the config says",
                      "rope_scaling": "mlx-lm's granitemoehybrid builds its rope unscaled",
                      "hidden_act": "mlx-lm's MLP applies SiLU whatever the config says"},
        notes="granitemoehybrid (Granite 4.0 H) without experts: granite's block (embedding, "
              "residual and logit multipliers, attention_multiplier as the scale) with the Mamba2 "
              "mixer (mamba) in place of attention where layer_types says \"mamba\"; no rope when "
              "position_embedding_type is \"nope\"; HF's shared_mlp renamed to mlp. The MoE "
              "configs (num_local_experts > 0: a top-k precise-softmax router, SwitchGLU experts "
              "and the fused shared_mlp on every layer) are refused.",
    ),
    ArchDescriptor(
        "falcon_h1",
        {"model_type": "falcon_h1", "attention_bias": False, "attention_in_multiplier": 1.0,
         "attention_out_multiplier": 0.9375, "embedding_multiplier": 5.656854249492381,
         "head_dim": 64, "hidden_size": 1024, "intermediate_size": 2048, "key_multiplier": 0.390625,
         "lm_head_multiplier": 0.0390625, "mamba_conv_bias": True, "mamba_d_conv": 4,
         "mamba_d_head": 64, "mamba_d_ssm": 1536, "mamba_d_state": 128, "mamba_n_groups": 1,
         "mamba_n_heads": 24, "mamba_norm_before_gate": False, "mamba_proj_bias": False,
         "mamba_rms_norm": False, "max_position_embeddings": 131072, "mlp_bias": False,
         "mlp_multipliers": [0.8838834764831844, 0.5859375], "num_attention_heads": 8,
         "num_hidden_layers": 36, "num_key_value_heads": 2, "projectors_bias": False,
         "rms_norm_eps": 1e-05, "rope_traditional": False, "rope_scaling": None,
         "rope_theta": 100000000000.0, "ssm_in_multiplier": 1.25,
         "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738],
         "ssm_out_multiplier": 0.23570226039551587, "vocab_size": 32784, "tie_word_embeddings": True,
         # read by mlx-lm's ModelArgs, used by nothing it builds (the scan runs chunks of 256, the
         # mixer is sized by mamba_d_ssm, the MLP by intermediate_size, every layer holds it)
         "initializer_range": 0.02, "mamba_chunk_size": 128, "mamba_expand": 2, "mamba_use_mlp": True,
         "mlp_expansion_factor": 8},
        (),
        head_dim="field", attn_bias="attention_bias", out_bias="attention_bias",
        names=Names(mlp="feed_forward", final_norm="final_layernorm",
                    norms=NormNames(pre_mlp="pre_ff_layernorm")),
        mlp=MlpKnobs(bias="mlp_bias"),
        norm=NormKnobs(eps="rms_norm_eps"),
        head=HeadKnobs(post=LogitScale("tied_mul_ratio", "lm_head_multiplier")),
        hybrid=HybridKnobs("mamba2", "all", name="mamba", block="parallel",
                           knobs=Mamba2Knobs(heads="mamba_n_heads", head_dim="mamba_d_head",
                                             state="mamba_d_state", groups="mamba_n_groups",
                                             conv_kernel="mamba_d_conv", conv_bias="mamba_conv_bias",
                                             in_bias="mamba_proj_bias", out_bias="projectors_bias",
                                             eps="rms_norm_eps", intermediate="mamba_d_ssm",
                                             time_step_limit=(0.0, float("inf")),
                                             norm_when="mamba_rms_norm",
                                             norm_before_gate="mamba_norm_before_gate")),
        sanitize=(SanitizeRule("falcon_h1_mup", None, "muP multipliers folded into HF-layout "
                               "weights, conv1d to mlx's layout (mup.py)"),),
        ignored_keys={"time_step_limit": "mlx-lm's falcon_h1 mixer fixes the dt clip to (0, inf)",
                      "hidden_act": "mlx-lm's MLP and mixer apply SiLU whatever the config says",
                      "num_logits_to_keep": "generation setting",
                      "time_step_min": "initialization setting", "time_step_max": "initialization setting",
                      **_MAMBA_TRAINING},
        notes="falcon_h1: every layer runs the Mamba2 mixer (mamba) and attention side by side on "
              "one input_layernorm'd input, h = x + mamba + attn, then the SwiGLU feed_forward "
              "after pre_ff_layernorm; each layer's cache is CacheList(ArraysCache, KVCache). The "
              "muP multipliers are folded into HF-layout weights at load (mlx-lm's sanitize: "
              "key_multiplier never applies, v_proj is not scaled); a tied head's logits are "
              "scaled by lm_head_multiplier / embedding_multiplier.",
    ),
]
