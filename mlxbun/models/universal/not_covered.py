"""The mlx-lm model files the descriptor table does not cover, and why.

tests/test_universal_parity.py checks that every file in mlx-lm's models/ is
a descriptor row, infrastructure, or explained here.
"""

__all__ = ["INFRASTRUCTURE_FILES", "NOT_COVERED"]

# mlx-lm model files that are infrastructure, not architectures.
INFRASTRUCTURE_FILES = (
    "__init__", "base", "cache", "rope_utils", "activations", "switch_layers", "ssm",
    "gated_delta", "mla", "bitlinear_layers", "pipeline",
)

_MOE = ("mixture-of-experts: needs a router / layer rule / expert kind the MoE knobs "
        "(models/universal/moe.py) do not have yet")
_HYBRID = "recurrent / SSM / linear-attention layers: needs a dedicated port"
# VLM files whose language model is their own (not another file's text model, which a wrapper
# row in table_wrappers.py runs)
_OWN_TEXT = "a VLM whose text stack is its own, not another mlx-lm file's"

NOT_COVERED: dict[str, str] = {
    "llama4": f"{_MOE}: a text_config wrapper (ModelArgs.text_config, every tensor and lm_head "
              "under language_model.*: the universal loader reads top-level ModelArgs and one "
              "root module) around chunked-attention layers (ChunkedKVCache with "
              "maybe_trim_front / start_position and a chunk mask built from cache[0], which no "
              "mlxbun cache has), a hard-coded every-4th global NoPE layer with temperature-tuned "
              "queries; top-1 sigmoid router that scales the expert input",
    **dict.fromkeys(
        ["bailing_hybrid", "bailing_moe_linear", "bailing_moe_v3",
         "kimi_linear", "longcat_flash_ngram",
         "kimi_k3"], _HYBRID),
    "longcat_flash": "multi-head latent attention (deepseek_v3's absorbed kind, with q / kv latents "
                     "scaled by sqrt(hidden / rank)) in a layer shape the block has no form for: two "
                     "attention + dense-MLP sub-blocks per layer (self_attn.0/1, mlps.0/1, norms as "
                     "lists, a CacheList of two KVCaches) and a shortcut MoE fed from the first sub-block "
                     "and added after the second; its router (softmax + correction bias, last-k "
                     "argpartition, classifier with optional bias, kept 8-bit by its quant_predicate) "
                     "picks among n_routed_experts + zero_expert_num experts, the zero ones identity "
                     "experts weighting x: needs a dedicated port",
    "minimax_m3_vl": f"{_OWN_TEXT}: MiniMax-M3's (sparse attention config, gemma-style q/k norms, "
                     "clamped SwiGLU experts with shared and dense MLPs per mlp_layer_types)",
    "muse_spark": f"{_OWN_TEXT}: input-scaled RMSNorms, precise SwiGLU MoE, its own kernels",
    "prism_hadamard_qwen35": "qwen3_5 (covered) whose linears / embedding are 2-bit packs with a "
                             "blockwise Hadamard rotation folded in (HadamardQuantizedLinear): "
                             "needs that quantized module kind",
    "deepseek_v41": "DeepSeek-V4.1 attention (compressed/indexed KV) with MoE: "
                    "needs a dedicated port",
    "bitnet": "ternary BitLinear weights (2-bit packed, a weight scale): mlx-lm's BitLinear computes "
              "only through a Metal kernel (mx.fast.metal_kernel), so no oracle runs on the CPU or CUDA "
              "backends this project gates on",
    "olmo": "no oracle: mlx-lm's olmo.py calls sys.exit(1) at import unless hf_olmo (the ai2-olmo "
            "package, which pulls in torch) is importable, and it is not installed here; the graph itself "
            "(non-affine LayerNorm, fused att_proj / ff_proj under transformer.blocks) is not the obstacle",
    "phi3small": "its head writes -inf into the logits at 91 fixed tokenizer ids (100256..100351) on every "
                 "row, by design: the parity gate (parity/gate.py) fails any non-finite logits, so no variant can "
                 "pass, and those ids need a vocabulary of at least 100352 (a zoo port then takes ~3 min on 2 "
                 "cores; below it mlx-lm's scatter is out of range). A port of its graph (block-sparse "
                 "attention, gegelu MLP, muP scales) was bit-equal to mlx-lm by mx.array_equal (the -inf ids "
                 "included) on float32 / bfloat16 / q4 prefill and decode, but cannot be gated as the gate stands",
}
