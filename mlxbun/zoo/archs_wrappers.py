"""The zoo's VLM wrapper rows: a text row's tiny config as text_config of the wrapper's
transformers configuration class (wrapper_configs.py); no vision weights are built."""

from __future__ import annotations

from mlxbun.zoo.arch_row import Arch
from mlxbun.zoo.wrapper_configs import PIXTRAL_VISION, vlm_post

__all__ = ["WRAPPER_ROWS"]

WRAPPER_ROWS = (
    # mistral's text model (run as llama) behind Pixtral's wrapper: the hub's Pixtral-12B is a
    # LlavaConfig with a pixtral vision_config (mlx-lm's pixtral file reads text_config only)
    Arch("pixtral", "LlavaForConditionalGeneration", "MistralConfig",
         knobs={"sliding_window": None},
         post=vlm_post("LlavaConfig", "mistral", {**PIXTRAL_VISION, "model_type": "pixtral"})),
)
