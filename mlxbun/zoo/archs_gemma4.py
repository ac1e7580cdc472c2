"""The zoo's gemma4 rows: a tiny config in which every gemma4_text feature mlx-lm 0.32.2 runs
appears (transformers' Gemma4TextConfig, plus the keys mlx-lm reads that the config class turns
into its per_layer_config: global_head_dim, num_global_key_value_heads).

gemma4_text: 6 layers [s s f s s f] with the last 3 KV-shared (layers 3 and 4 read layer 1's
keys / values, layer 5 reads layer 2's), per-layer inputs, k = v attention on the full layers
(one global kv head), global_head_dim 64 (4x the sliding 16, proportional rope on a quarter of
it), the double-wide MLP on the shared layers and the final softcap."""

from __future__ import annotations

from mlxbun.zoo.arch_row import HEAD_DIM, SLIDING_WINDOW, Arch

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


GEMMA4_ROWS = (
    Arch("gemma4_text", "Gemma4ForCausalLM", "Gemma4TextConfig", layers=6, kv_heads=2,
         legacy_rope=False, knobs=GEMMA4_TEXT_KNOBS, post=gemma4_text_post),
)
