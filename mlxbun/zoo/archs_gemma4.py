"""The zoo's gemma4 rows: a tiny config in which every gemma4_text feature mlx-lm 0.32.2 runs
appears (transformers' Gemma4TextConfig, plus the keys mlx-lm reads that the config class turns
into its per_layer_config: global_head_dim, num_global_key_value_heads).

gemma4_text: 6 layers [s s f s s f] with the last 3 KV-shared (layers 3 and 4 read layer 1's
keys / values, layer 5 reads layer 2's), per-layer inputs, k = v attention on the full layers
(one global kv head), global_head_dim 64 (4x the sliding 16, proportional rope on a quarter of
it), the double-wide MLP on the shared layers and the final softcap.

gemma4: the VLM wrapper (transformers' Gemma4Config: text_config beside a tiny vision_config, as
gemma-4-26B-A4B's hub config) around the same text stack with the MoE block on (enable_moe_block:
4 experts, 2 per token, each 64 wide), so the MoE configuration has its zoo arch and manifest row
(`routed`: its experts run in float32 only on mlx's CPU gather_mm, like the MoE rows)."""

from __future__ import annotations

from mlxbun.zoo.arch_row import HEAD_DIM, MOE_EXPERTS, MOE_INTERMEDIATE, MOE_TOP_K, SLIDING_WINDOW, Arch
from mlxbun.zoo.hf_configs import quiet_transformers, transformers_config_class

__all__ = ["GEMMA4_ROWS"]

_S, _F = "sliding_attention", "full_attention"

GEMMA4_TEXT_KNOBS = {
    "layer_types": [_S, _S, _F, _S, _S, _F],
    "num_kv_shared_layers": 3,
    "hidden_size_per_layer_input": 8,
    "attention_k_eq_v": True,
    "use_double_wide_mlp": True,
    "final_logit_softcapping": 30.0,
    "sliding_window": SLIDING_WINDOW,
    "global_head_dim": 4 * HEAD_DIM,
    "num_global_key_value_heads": 1,
    "rope_parameters": {
        _F: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        _S: {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def gemma4_text_post(cfg: dict) -> None:
    """The keys mlx-lm reads that transformers' config class folds into per_layer_config (the
    published configs carry them) and its vocab for the per-layer embedding (the zoo's)."""
    cfg.update(global_head_dim=GEMMA4_TEXT_KNOBS["global_head_dim"],
               num_global_key_value_heads=GEMMA4_TEXT_KNOBS["num_global_key_value_heads"],
               vocab_size_per_layer_input=cfg["vocab_size"])


# a tiny vision tower config (the zoo builds no vision weights: mlx-lm's gemma4.Model has none)
_GEMMA4_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
                  "num_key_value_heads": 2, "head_dim": 16, "patch_size": 16}


def gemma4_wrapper_post(cfg: dict) -> None:
    """Gemma 4 VLM hub configs: text_config (model_type gemma4_text) beside the vision_config; the
    top-level vocab_size, which mlx-lm's wrapper writes over text_config's, is the tiny one."""
    gemma4_text_post(cfg)
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    text["model_type"] = "gemma4_text"
    with quiet_transformers():
        outer = transformers_config_class("Gemma4Config")(vision_config=_GEMMA4_VISION).to_diff_dict()
    cfg.clear()
    cfg.update(outer, text_config=text, vocab_size=text["vocab_size"])


GEMMA4_ROWS = (
    Arch("gemma4_text", "Gemma4ForCausalLM", "Gemma4TextConfig", layers=6, kv_heads=2,
         legacy_rope=False, knobs=GEMMA4_TEXT_KNOBS, post=gemma4_text_post),
    Arch("gemma4", "Gemma4ForConditionalGeneration", "Gemma4TextConfig", layers=6, kv_heads=2,
         legacy_rope=False, post=gemma4_wrapper_post, routed=True,
         knobs={**GEMMA4_TEXT_KNOBS, "enable_moe_block": True, "num_experts": MOE_EXPERTS,
                "top_k_experts": MOE_TOP_K, "moe_intermediate_size": MOE_INTERMEDIATE}),
)
