"""The zoo's VLM wrapper configs: a text row's tiny config moved into text_config beside a tiny
vision_config, under the wrapper's transformers configuration class (its top-level keys as the
hub configs write them). The zoo builds no vision weights: mlx-lm's wrappers build no tower."""

from __future__ import annotations

from typing import Callable, Mapping

from mlxbun.zoo.hf_configs import quiet_transformers, transformers_config_class
from mlxbun.zoo.tokenizer import BOS_ID, EOS_ID

__all__ = ["KIMI_VL_VISION", "LFM2_VL_VISION", "PIXTRAL_VISION", "QWEN2_VL_VISION", "QWEN3_VL_VISION", "qwen2_vl_text",
           "qwen3_vl_moe_text", "qwen3_vl_text", "vlm_post"]

# tiny towers (one layer, width 32) in each wrapper's vision_config
PIXTRAL_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2, "head_dim": 16, "image_size": 32, "patch_size": 16}
QWEN2_VL_VISION = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "num_heads": 2, "mlp_ratio": 2}
QWEN3_VL_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                   "out_hidden_size": 64, "deepstack_visual_indexes": []}
KIMI_VL_VISION = {"model_type": "moonvit", "patch_size": 14, "init_pos_emb_height": 8,
                  "init_pos_emb_width": 8, "num_attention_heads": 2, "num_hidden_layers": 1,
                  "hidden_size": 32, "intermediate_size": 64, "merge_kernel_size": [2, 2]}
LFM2_VL_VISION = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                  "num_attention_heads": 2}


def vlm_post(outer: str | None, text_type: str, vision: Mapping, *,
             inner: Callable[[dict], None] | None = None,
             top: Mapping | None = None) -> Callable[[dict], None]:
    """An `Arch.post`: `inner` first (the text row's own fix-up), then the text config becomes
    text_config (its model_type `text_type`) of `outer`'s defaults (None: no class) with
    `vision`; `top` adds top-level keys the hub configs carry and the class does not write."""
    def post(cfg: dict) -> None:
        if inner is not None:
            inner(cfg)
        text = {k: v for k, v in cfg.items() if k not in ("architectures", "transformers_version")}
        text["model_type"] = text_type
        if outer is None:  # no transformers class (remote code): the hub's keys only
            wrapper = {"vision_config": dict(vision)}
        else:
            with quiet_transformers():
                wrapper = transformers_config_class(outer)(vision_config=dict(vision)).to_diff_dict()
        cfg.clear()
        cfg.update(wrapper, **dict(top or {}), text_config=text)
    return post


def qwen2_vl_text(cfg: dict) -> None:
    # Qwen2-VL / Qwen2.5-VL hub configs: rope_theta and an mrope rope_scaling (transformers 5
    # folds it into rope_parameters as type default, which mlx-lm's qwen2 does not read), and
    # tie_word_embeddings among the text keys (the text class has none; qwen2's default ties)
    rp = cfg.pop("rope_parameters")
    cfg["tie_word_embeddings"] = False
    cfg["rope_scaling"] = {"type": "mrope", "mrope_section": rp["mrope_section"]}


def qwen3_vl_text(cfg: dict) -> None:
    # Qwen3-VL hub text_configs: rope_theta, an interleaved-mrope rope_scaling of type default,
    # tie_word_embeddings (qwen3 requires it) and the bos / eos ids (the text class writes none)
    cfg.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID)
    rp = cfg.pop("rope_parameters")
    cfg["tie_word_embeddings"] = False
    cfg["rope_scaling"] = {"mrope_interleaved": True, "mrope_section": rp["mrope_section"],
                           "rope_type": "default"}


def qwen3_vl_moe_text(cfg: dict) -> None:
    # Qwen3-VL-MoE hub text_configs: qwen3_vl's rope keys, num_experts (transformers 5 writes
    # num_local_experts) and norm_topk_prob (mlx-lm's qwen3_moe requires both)
    qwen3_vl_text(cfg)
    cfg.update(num_experts=cfg.pop("num_local_experts"), norm_topk_prob=True)
