"""The zoo's VLM wrapper configs: a text row's tiny config moved into text_config beside a tiny
vision_config, under the wrapper's transformers configuration class (its top-level keys as the
hub configs write them). The zoo builds no vision weights: mlx-lm's wrappers build no tower."""

from __future__ import annotations

from typing import Callable, Mapping

from mlxbun.zoo.hf_configs import quiet_transformers, transformers_config_class

__all__ = ["LFM2_VL_VISION", "PIXTRAL_VISION", "QWEN2_VL_VISION", "QWEN3_VL_VISION", "vlm_post"]

# tiny towers (one layer, width 32) in each wrapper's vision_config
PIXTRAL_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "head_dim": 16, "image_size": 32, "patch_size": 16}
QWEN2_VL_VISION = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
QWEN3_VL_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                   "out_hidden_size": 64, "deepstack_visual_indexes": []}
LFM2_VL_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2}


def vlm_post(outer: str, text_type: str, vision: Mapping, *,
             inner: Callable[[dict], None] | None = None,
             top: Mapping | None = None) -> Callable[[dict], None]:
    """An `Arch.post`: `inner` first (the text row's own fix-up), then the text config becomes
    text_config (its model_type `text_type`) of `outer`'s defaults with `vision`; `top` adds
    top-level keys the hub configs carry and the class does not write."""
    def post(cfg: dict) -> None:
        if inner is not None:
            inner(cfg)
        text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
        text["model_type"] = text_type
        with quiet_transformers():
            wrapper = transformers_config_class(outer)(vision_config=dict(vision)).to_diff_dict()
        cfg.clear()
        cfg.update(wrapper, **dict(top or {}), text_config=text)
    return post
