"""The zoo's gated DeltaNet rows (qwen3_next, qwen3_5, qwen3_5_moe): their config fix-ups
(`Arch.post`) and shared knobs, so the tiny configs read like the real hub ones."""

from __future__ import annotations

__all__ = ["QWEN3_5_KNOBS", "qwen3_5_post", "qwen3_next_post"]


def qwen3_next_post(cfg: dict) -> None:
    # real Qwen3-Next hub configs carry full_attention_interval (mlx-lm reads it; transformers'
    # class turns it into layer_types)
    cfg["full_attention_interval"] = cfg["layer_types"].index("full_attention") + 1


def qwen3_5_post(cfg: dict) -> None:
    # Qwen3.5 hub configs: the VLM wrapper (model_type qwen3_5 / qwen3_5_moe) holds the text
    # model's keys in text_config (with full_attention_interval, which mlx-lm reads) and repeats
    # tie_word_embeddings at the top; mlx-lm reads text_config only (the vision tower is left out)
    qwen3_next_post(cfg)
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    for key in text:
        cfg.pop(key)
    cfg.update(text_config=text, tie_word_embeddings=text["tie_word_embeddings"])


# Qwen3.5's text knobs, shrunk: key heads of 32 (mlx-lm's Metal kernel needs Dk % 32 == 0);
# real rope_parameters carry mrope sections (mlx-lm applies plain partial rope to text)
QWEN3_5_KNOBS = {
    "full_attention_interval": 2, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
    "linear_key_head_dim": 32, "linear_value_head_dim": 16,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_interleaved": True, "mrope_section": [1, 1, 0]},
}
