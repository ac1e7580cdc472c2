"""The zoo's VLM wrapper rows: a text row's tiny config as text_config of the wrapper's
transformers configuration class (wrapper_configs.py); no vision weights are built."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from mlxbun.zoo.arch_row import HEAD_DIM, MINISTRAL3_KNOBS, MOE_EXPERTS, MOE_INTERMEDIATE, MOE_TOP_K, Arch
from mlxbun.zoo.archs_hybrid import LFM2_KNOBS, lfm2_post
from mlxbun.zoo.wrapper_configs import (
    KIMI_VL_VISION,
    LFM2_VL_VISION,
    PIXTRAL_VISION,
    QWEN2_VL_VISION,
    QWEN3_VL_VISION,
    qwen2_vl_text,
    qwen3_vl_moe_text,
    qwen3_vl_text,
    vlm_post,
)

__all__ = ["WRAPPER_ROWS", "wrapped_text_rows"]

WRAPPER_ROWS = (
    # mistral's text model (run as llama) behind Pixtral's wrapper: the hub's Pixtral-12B is a
    # LlavaConfig with a pixtral vision_config (mlx-lm's pixtral file reads text_config only)
    Arch("pixtral", "LlavaForConditionalGeneration", "MistralConfig",
         knobs={"sliding_window": None},
         post=vlm_post("LlavaConfig", "mistral", {**PIXTRAL_VISION, "model_type": "pixtral"})),
    # mistral's text model (run as llama) behind Mistral 3's wrapper (Mistral3Config)
    Arch("mistral3", "Mistral3ForConditionalGeneration", "MistralConfig",
         knobs={"sliding_window": None}, post=vlm_post("Mistral3Config", "mistral", PIXTRAL_VISION)),
    # ministral3's text model behind Mistral 3's wrapper (the Ministral 3 VLMs): mlx-lm's
    # mistral3 picks it by text_config.model_type; the ministral3 row's yarn + llama-4 scaling
    Arch("mistral3-ministral3", "Mistral3ForConditionalGeneration", "Ministral3Config",
         legacy_rope=False, model_type="mistral3", knobs=MINISTRAL3_KNOBS,
         post=vlm_post("Mistral3Config", "ministral3", PIXTRAL_VISION)),
    # qwen2's text model behind Qwen2-VL's wrapper; mrope sections summing to head_dim / 2
    Arch("qwen2_vl", "Qwen2VLForConditionalGeneration", "Qwen2VLTextConfig", kv_heads=2,
         knobs={"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                    "mrope_section": [2, 3, 3]}},
         post=vlm_post("Qwen2VLConfig", "qwen2_vl_text", QWEN2_VL_VISION, inner=qwen2_vl_text)),
    # qwen3's text model behind Qwen3-VL's wrapper (interleaved mrope sections)
    Arch("qwen3_vl", "Qwen3VLForConditionalGeneration", "Qwen3VLTextConfig", kv_heads=2,
         knobs={"rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                    "mrope_section": [2, 3, 3]}},
         post=vlm_post("Qwen3VLConfig", "qwen3_vl_text", QWEN3_VL_VISION, inner=qwen3_vl_text)),
    # qwen3_moe's text model behind Qwen3-VL-MoE's wrapper (every layer MoE)
    Arch("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeTextConfig", kv_heads=2,
         knobs={"num_local_experts": MOE_EXPERTS, "num_experts_per_tok": MOE_TOP_K,
                "moe_intermediate_size": MOE_INTERMEDIATE,
                "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                    "mrope_section": [2, 3, 3]}},
         extra={"head_dim": HEAD_DIM},
         post=vlm_post("Qwen3VLMoeConfig", "qwen3_vl_moe_text", QWEN3_VL_VISION, inner=qwen3_vl_moe_text)),
    # lfm2's conv, attention, conv behind LFM2-VL's wrapper (transformers' model_type lfm2_vl,
    # mlx-lm's file and the hub's config lfm2-vl)
    Arch("lfm2-vl", "Lfm2VlForConditionalGeneration", "Lfm2Config", layers=3, kv_heads=2,
         knobs=LFM2_KNOBS, post=vlm_post("Lfm2VlConfig", "lfm2", LFM2_VL_VISION, inner=lfm2_post)),
)


def wrapped_text_rows(text: Mapping[str, Arch]) -> tuple[Arch, ...]:
    """The wrappers whose transformers has no configuration class: the text row's own zoo
    config (`text`: the zoo's rows by name) moved into text_config beside the hub's keys."""
    return (
        # mistral4's MLA / MoE text model behind Mistral 3's wrapper: mlx-lm's mistral3 picks it
        # by text_config.model_type (the mistral4 row's knobs)
        dataclasses.replace(
            text["mistral4"], name="mistral3-mistral4", architecture="Mistral3ForConditionalGeneration",
            model_type="mistral3", post=vlm_post("Mistral3Config", "mistral4", PIXTRAL_VISION)),
        # deepseek_v3's MLA / MoE text model behind Kimi-VL's wrapper (moonvit tower)
        dataclasses.replace(
            text["deepseek_v3"], name="kimi_vl", architecture="KimiVLForConditionalGeneration",
            post=vlm_post(None, "deepseek_v3", KIMI_VL_VISION,
                          top={"media_placeholder_token_id": 163605, "ignore_index": -100})),
        # deepseek_v3's text model behind Kimi-K2.5's wrapper (text_config's model_type kimi_k2,
        # which mlx-lm remaps to deepseek_v3)
        dataclasses.replace(
            text["deepseek_v3"], name="kimi_k25", architecture="KimiK25ForConditionalGeneration",
            post=vlm_post(None, "kimi_k2", KIMI_VL_VISION,
                          top={"media_placeholder_token_id": 163605, "ignore_index": -100})),
    )
