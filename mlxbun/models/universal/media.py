"""A VLM wrapper row runs the text path only: a call that brings what mlx-lm's wrapper (or the
VLM it comes from) feeds its vision / audio tower is refused, naming the input and the row.
(Images reach a wrapper's text graph through mlxbun.multimodal: the towers of mlxbun.towers,
their merged rows fed as input embeddings.)"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxbun.errors import UnsupportedModelError

__all__ = ["MEDIA_INPUTS", "VLM_KEYS", "refuse_media"]

# the inputs a VLM's forward takes beside the token ids (transformers' processors, mlx-vlm),
# and mlx-lm's wrapper's input_embeddings (the ids' embeddings merged with the tower's)
MEDIA_INPUTS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw",
                "image_sizes", "pixel_attention_mask", "spatial_shapes", "input_features",
                "input_features_mask", "input_embeddings", "inputs_embeds")

# a VLM's own config keys (its towers, its media token ids): beside text_config, or among the
# text model's keys in a config without one (qwen2_vl's hub configs), where mlx-lm's text
# model's ModelArgs drops them; mm_tokens_per_image: mlx-vlm's gemma3 projector reads it from
# text_config (the soft tokens per image), mlx-lm's gemma3_text does not
VLM_KEYS = frozenset({"vision_config", "audio_config", "image_token_id", "video_token_id",
                      "image_token_index", "vision_start_token_id", "vision_end_token_id",
                      "vision_token_id", "mm_tokens_per_image"})


def refuse_media(model_type: str, wrapper: str | None, media: Mapping[str, Any]) -> None:
    """Raise for any `media` given: UnsupportedModelError for a tower's input, else TypeError."""
    given = [k for k, v in media.items() if v is not None]
    unknown = sorted(k for k in media if k not in MEDIA_INPUTS)
    if unknown:
        raise TypeError(f"unexpected argument(s) {', '.join(unknown)}")
    if not given:
        return
    if wrapper is None:
        raise UnsupportedModelError(f"{model_type}: {', '.join(given)} given, but {model_type} is a "
                                    "text model (token ids only)")
    raise UnsupportedModelError(
        f"{model_type}: {', '.join(given)} needs the VLM's vision / audio tower, which the text graph "
        f"does not build: {model_type} runs its text path ({wrapper}.*) on token ids only (images go "
        "through mlxbun.multimodal / generate --image where the checkpoint carries a tower mlxbun builds)")
