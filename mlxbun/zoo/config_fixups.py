"""The zoo's config fix-ups (`Arch.post`) for the dense and MoE rows: the last edits that make a
transformers configuration dict read like the arch's real hub config.json (the keys mlx-lm reads
that transformers 5 no longer writes, or writes under another name)."""

from __future__ import annotations

from mlxbun.zoo.hf_configs import quiet_transformers, transformers_config_class

__all__ = ["cohere2_post", "exaone4_post", "exaone_moe_post", "gemma3_post", "gemma3_wrapper_post",
           "gemma3n_wrapper_post",
           "gpt_neox_post", "mellum_post", "minimax_m2_post", "qwen3_moe_post"]


def gemma3_post(cfg: dict) -> None:
    # mlx-lm reads sliding_window_pattern and rope_local_base_freq (the pre-v5 hub keys)
    cfg["sliding_window_pattern"] = cfg.pop("_sliding_window_pattern")
    cfg["rope_local_base_freq"] = cfg["rope_parameters"]["sliding_attention"]["rope_theta"]


# a tiny SigLIP tower for the wrapper's vision_config (the zoo builds no vision weights: mlx-lm's
# gemma3.Model has no vision tower)
_GEMMA3_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "image_size": 32, "patch_size": 16}


def gemma3_wrapper_post(cfg: dict) -> None:
    # Gemma 3 VLM hub configs: transformers' Gemma3Config (Gemma3ForConditionalGeneration) holds
    # the text model in text_config beside the vision_config (the zoo keeps the head counts,
    # which mlx-lm's wrapper defaults to 8 / 4: tests/test_wrappers.py); mlx-lm's wrapper writes
    # the top-level vocab_size (262208 when absent, as in the hub configs) over text_config's,
    # so the tiny vocab is written there
    gemma3_post(cfg)
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    text["model_type"] = "gemma3_text"
    with quiet_transformers():
        outer = transformers_config_class("Gemma3Config")(vision_config=_GEMMA3_VISION).to_diff_dict()
    cfg.clear()
    cfg.update(outer, text_config=text, vocab_size=text["vocab_size"])


def gemma3n_wrapper_post(cfg: dict) -> None:
    # Gemma 3n hub configs: transformers' Gemma3nConfig holds the text model in text_config beside
    # the vision (MobileNet) and audio configs, which the zoo leaves at their defaults (no tower
    # weights: mlx-lm's gemma3n builds neither). mlx-lm's TextConfig requires rope_theta and
    # rope_local_base_freq (the pre-v5 hub keys), written beside rope_parameters
    text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
    text["model_type"] = "gemma3n_text"
    text["rope_local_base_freq"] = text["rope_parameters"]["sliding_attention"]["rope_theta"]
    with quiet_transformers():
        outer = transformers_config_class("Gemma3nConfig")().to_diff_dict()
    outer.pop("text_config", None)
    cfg.clear()
    cfg.update(outer, text_config=dict(sorted(text.items())))


def cohere2_post(cfg: dict) -> None:
    kinds = cfg["layer_types"]
    cfg["sliding_window_pattern"] = kinds.index("full_attention") + 1


def exaone4_post(cfg: dict) -> None:
    # real EXAONE 4.0 configs spell the pattern as a string of Local/Global, as mlx-lm expects
    cfg["sliding_window_pattern"] = "".join(
        "L" if t == "sliding_attention" else "G" for t in cfg["layer_types"]
    )


def gpt_neox_post(cfg: dict) -> None:
    # pythia-style hub configs use the original GPT-NeoX names, which mlx-lm reads
    cfg["rotary_emb_base"] = cfg["rope_theta"]
    cfg["rotary_pct"] = cfg["partial_rotary_factor"]


def mellum_post(cfg: dict) -> None:
    # transformers' class spells the expert count num_local_experts; mlx-lm's ModelArgs requires
    # num_experts (what a checkpoint mlx-lm loads carries)
    cfg["num_experts"] = cfg.pop("num_local_experts")


def qwen3_moe_post(cfg: dict) -> None:
    # transformers 5 spells the expert count num_local_experts; Qwen3 MoE hub configs (and
    # mlx-lm) say num_experts
    cfg["num_experts"] = cfg.pop("num_local_experts")


def exaone_moe_post(cfg: dict) -> None:
    # mlx-lm reads is_moe_layer (K-EXAONE's hub config carries it); transformers writes mlp_layer_types
    cfg["is_moe_layer"] = [t == "sparse" for t in cfg["mlp_layer_types"]]


def minimax_m2_post(cfg: dict) -> None:
    # MiniMax-M2 hub configs give partial rope as rotary_dim only (transformers 5 derives the
    # fraction into rope_parameters; other transformers versions do not write it at all)
    cfg.pop("partial_rotary_factor", None)
