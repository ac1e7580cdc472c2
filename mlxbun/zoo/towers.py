"""Tiny VLM checkpoints WITH their towers, held to mlx-vlm (the towers' oracle): the zoo's text
row's tiny config as text_config, a tiny vision_config, and every tensor of mlx-vlm's own model
class (text model, vision tower, projector) seeded and perturbed by name as every zoo arch,
cast and quantized the way `mlx_vlm.convert` does it (the towers and projectors kept in the
checkpoint's dtype: convert's `skip_multimodal_module`); the tokenizer is the zoo's with the
VLM's media tokens added, plus the processor's preprocessor_config.json / processor_config.json.

    cached_tower_checkpoint("gemma3-vision", dtype="bfloat16", quant=4)  # -> .../tiny-gemma3-vision-bf16-q4

Each row is also a zoo name (`zoo:gemma3-vision@q8`, `mlxbun zoo build gemma3-vision`: the
registry's builders): NAME is the text arch and what the checkpoint carries beyond the text
model (`-vision`, `-audio`, `-towers`: both), a suffix no text arch name has, so `zoo:gemma3`
stays the text-only wrapper and `zoo:gemma3-vision` is this other checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlxbun.zoo.common import (
    Variant,
    ZooArgumentError,
    build_into,
    build_once,
    cache_root,
    check_dtype_and_seed,
    parse_quant,
    zoo_fingerprint,
)
from mlxbun.zoo.mobilenet import TINY_LAYOUT, mobilenet_patch
from mlxbun.zoo.tokenizer import tokenizer_config, tokenizer_json, write_tokenizer_files

__all__ = ["TOWER_ARCHS", "TOWER_SUFFIXES", "cached_tower_checkpoint", "carries", "describe", "make_tower_checkpoint",
           "tower_config", "variant"]


# what a tower row's name ends with: what the checkpoint carries beyond the text model (no text arch
# name ends so: tests/test_zoo.py)
TOWER_SUFFIXES = ("-vision", "-audio", "-towers")


@dataclass(frozen=True)
class TowerArch:
    """A VLM the zoo builds with its towers: the zoo text arch whose tiny config becomes
    text_config, what is written over it, and the processor's files."""

    name: str  # the zoo name: <text arch>-vision / -audio / -towers (TOWER_SUFFIXES)
    text_arch: str  # the zoo arch whose config is the starting point (text_config inside)
    media_tokens: tuple[tuple[str, str], ...]  # (tokenizer attribute, token) added after the vocab
    fix: Callable[[dict, dict[str, int]], None]  # edits the config given the media token ids
    preprocessor: dict
    processor: dict
    # mlx-vlm's model class builds its vision tower at full size (gemma3n's MobileNetV5 block
    # layout is hard-coded, ~300M parameters): the checkpoint is built and loaded without it
    no_vision_tower: bool = False
    # the checkpoint's tensors under HF's names (model.language_model.*, model.audio_tower.*), which
    # mlx-lm's text model and mlx-vlm's sanitize both read
    hf_names: bool = False


# tiny SigLIP tower: 64x64 images in 16x16 patches (a 4x4 grid), two layers of width 64 (a quant
# group), the projector average-pooling 2x2 patches into 4 soft tokens per image
GEMMA3_VISION = {"model_type": "siglip_vision_model", "hidden_size": 64, "intermediate_size": 128,
                 "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 64, "patch_size": 16,
                 "layer_norm_eps": 1e-6}
GEMMA3_TOKENS_PER_IMAGE = 4


def _gemma3_fix(cfg: dict, ids: dict[str, int]) -> None:
    vocab = max(ids.values()) + 1
    cfg["vision_config"] = dict(GEMMA3_VISION)
    cfg.update(vocab_size=vocab, mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE,
               boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
               image_token_index=ids["image_token"])
    # mlx-vlm's projector reads text_config.mm_tokens_per_image (the hub configs leave it at 256)
    cfg["text_config"].update(vocab_size=vocab, mm_tokens_per_image=GEMMA3_TOKENS_PER_IMAGE)


# tiny Qwen2-VL tower: 14-pixel patches, 2x2 merge windows, two blocks of width 32; the processor
# resizes into 56x56 .. 112x112 pixels (4x4 .. 8x8 patches: 4 .. 16 soft tokens per image)
QWEN2_VL_VISION = {"model_type": "qwen2_vl", "depth": 2, "embed_dim": 32, "num_heads": 2, "mlp_ratio": 2,
                   "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
# tiny Qwen2.5-VL tower: three blocks of width 32 (block 1 attends per image, 0 and 2 per 56-pixel
# window: 2x2 merge units), a biased SwiGLU MLP of 64
QWEN2_5_VL_VISION = {"model_type": "qwen2_5_vl", "depth": 3, "hidden_size": 32, "intermediate_size": 64,
                     "num_heads": 2, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                     "in_channels": 3, "window_size": 56, "fullatt_block_indexes": [1]}
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


QWEN_MEDIA_TOKENS = (("vision_start_token", "<|vision_start|>"), ("vision_end_token", "<|vision_end|>"),
                     ("image_token", "<|image_pad|>"), ("video_token", "<|video_pad|>"))


def _qwen_preprocessor(processor_class: str, patch: int = 14) -> dict:
    """Qwen/Qwen2-VL-2B-Instruct's preprocessor_config.json, at tiny pixel bounds (4..8 patches a side)."""
    return {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": CLIP_MEAN, "image_processor_type": "Qwen2VLImageProcessor", "image_std": CLIP_STD,
            "max_pixels": (8 * patch) ** 2, "merge_size": 2, "min_pixels": (4 * patch) ** 2, "patch_size": patch,
            "processor_class": processor_class, "resample": 3, "rescale_factor": 0.00392156862745098,
            "temporal_patch_size": 2}


# tiny Pixtral tower: 16-pixel patches, images resized into 64 pixels a side (up to 4x4 patches,
# each row of them closed by [IMG_BREAK], the last by [IMG_END]), two blocks of width 32
PIXTRAL_VISION = {"model_type": "pixtral", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 2, "head_dim": 16, "image_size": 64, "patch_size": 16,
                  "rope_theta": 10000.0}


PIXTRAL_MEDIA_TOKENS = (("image_token", "[IMG]"), ("image_break_token", "[IMG_BREAK]"),
                        ("image_end_token", "[IMG_END]"))
PIXTRAL_PROCESSOR = {"image_break_token": "[IMG_BREAK]", "image_end_token": "[IMG_END]", "image_token": "[IMG]",
                     "patch_size": 16}


def _pixtral_preprocessor(processor_class: str) -> dict:
    """mistral-community/pixtral-12b's preprocessor_config.json, at a 64-pixel longest edge."""
    return {"do_convert_rgb": True, "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": CLIP_MEAN, "image_processor_type": "PixtralImageProcessor", "image_std": CLIP_STD,
            "patch_size": {"height": 16, "width": 16}, "processor_class": processor_class, "resample": 3,
            "rescale_factor": 0.00392156862745098, "size": {"longest_edge": 64}}


def _pixtral_fix(cfg: dict, ids: dict[str, int]) -> None:
    vocab = max(ids.values()) + 1
    cfg["vision_config"] = dict(PIXTRAL_VISION)
    # mistral-community/pixtral-12b's config: the last layer's patches feed the projector
    cfg.update(vocab_size=vocab, image_token_index=ids["image_token"], vision_feature_layer=-1)
    cfg["text_config"]["vocab_size"] = vocab


def _mistral3_fix(cfg: dict, ids: dict[str, int]) -> None:
    # Mistral3Config's keys: image_token_index, spatial_merge_size 2, vision_feature_layer -1
    _pixtral_fix(cfg, ids)
    cfg.update(spatial_merge_size=2)


# tiny Qwen3-VL tower: 16-pixel patches, a 4x4 learned position table, two blocks of width 32, a
# deepstack merger after block 0; the processor's bounds 64..128 pixels a side (4..16 soft tokens)
QWEN3_VL_VISION = {"model_type": "qwen3_vl", "depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                   "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                   "num_position_embeddings": 16, "deepstack_visual_indexes": [0], "hidden_act": "gelu_pytorch_tanh"}


def _qwen3_vl_fix(cfg: dict, ids: dict[str, int]) -> None:
    vocab = max(ids.values()) + 1
    cfg["vision_config"] = {**QWEN3_VL_VISION, "out_hidden_size": cfg["text_config"]["hidden_size"]}
    cfg.update(vocab_size=vocab, image_token_id=ids["image_token"], video_token_id=ids["video_token"],
               vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"])
    cfg["text_config"]["vocab_size"] = vocab


def _qwen3_vl_moe_fix(cfg: dict, ids: dict[str, int]) -> None:
    _qwen3_vl_fix(cfg, ids)
    cfg["vision_config"]["model_type"] = "qwen3_vl_moe"


# tiny LFM2-VL: a 4x4 position table resized to each view, 16-pixel patches, 2x2 pixel unshuffle;
# 64-pixel tiles and 2..4 soft tokens a view, so the photograph is tiled (a grid of tiles plus a
# thumbnail) and a small image is one view
LFM2_VL_VISION = {"model_type": "siglip2_vision_model", "hidden_size": 32, "intermediate_size": 64,
                  "num_hidden_layers": 2, "num_attention_heads": 2, "num_channels": 3, "patch_size": 16,
                  "num_patches": 16, "layer_norm_eps": 1e-6, "hidden_act": "gelu_pytorch_tanh"}
LFM2_VL_TILING = {"tile_size": 64, "min_image_tokens": 2, "max_image_tokens": 4, "encoder_patch_size": 16,
                  "downsample_factor": 2, "max_pixels_tolerance": 2.0}
# the row / column markers of a tile grid (mlx-vlm's processor tiles up to 10 x 10)
LFM2_VL_TOKENS = (("image_token", "<image>"), ("image_start_token", "<|image_start|>"),
                  ("image_end_token", "<|image_end|>"), ("image_thumbnail_token", "<|img_thumbnail|>"),
                  *((f"img_row_{r}_col_{c}", f"<|img_row_{r}_col_{c}|>") for r in range(1, 11) for c in range(1, 11)))


def _lfm2_vl_fix(cfg: dict, ids: dict[str, int]) -> None:
    vocab = max(ids.values()) + 1
    cfg["vision_config"] = dict(LFM2_VL_VISION)
    cfg.update(vocab_size=vocab, image_token_id=ids["image_token"], projector_hidden_size=64, **LFM2_VL_TILING)
    cfg["text_config"]["vocab_size"] = vocab


# tiny Kimi-VL MoonViT: 14-pixel patches, a 4x4 position table (a 56x56 image's grid, bicubically
# resized to any other), two blocks of width 32 (head width 16 for its 2-D rotary) under mlx-vlm's
# VisionConfig keys (depth, embed_dim, num_heads) and HF's beside them; 2x2 merge windows
KIMI_VL_VISION = {"model_type": "moonvit", "depth": 2, "num_hidden_layers": 2, "embed_dim": 32, "hidden_size": 32,
                  "num_heads": 2, "num_attention_heads": 2, "intermediate_size": 64, "patch_size": 14,
                  "init_pos_emb_height": 4, "init_pos_emb_width": 4, "merge_kernel_size": [2, 2]}
KIMI_VL_TOKENS = (("media_start", "<|media_start|>"), ("media_content", "<|media_content|>"),
                  ("image_token", "<|media_pad|>"), ("media_end", "<|media_end|>"))


def _kimi_vl_fix(cfg: dict, ids: dict[str, int]) -> None:
    vocab = max(ids.values()) + 1
    cfg["vision_config"] = dict(KIMI_VL_VISION)
    cfg.update(media_placeholder_token_id=ids["image_token"])
    cfg["text_config"]["vocab_size"] = vocab


def _qwen2_5_vl_fix(cfg: dict, ids: dict[str, int]) -> None:
    _qwen2_vl_fix(cfg, ids)
    cfg["model_type"] = "qwen2_5_vl"
    cfg["architectures"] = ["Qwen2_5_VLForConditionalGeneration"]
    cfg["vision_config"] = {**QWEN2_5_VL_VISION, "out_hidden_size": cfg["hidden_size"]}


def _qwen2_vl_fix(cfg: dict, ids: dict[str, int]) -> None:
    # the Qwen2-VL hub configs' layout: the text keys at the top beside vision_config (mlx-vlm's
    # qwen2_vl ModelConfig reads its text config from the top level; mlx-lm takes either)
    text = cfg.pop("text_config")
    text.pop("model_type", None)
    cfg.update({k: v for k, v in text.items() if k not in cfg or k in ("vocab_size", "tie_word_embeddings")})
    cfg["vision_config"] = {**QWEN2_VL_VISION, "hidden_size": text["hidden_size"]}
    cfg.update(vocab_size=max(ids.values()) + 1, image_token_id=ids["image_token"], video_token_id=ids["video_token"],
               vision_start_token_id=ids["vision_start_token"], vision_end_token_id=ids["vision_end_token"])


# tiny gemma3n audio (USM conformer): 32 mel bins, two conformer blocks of width 32 attending in
# chunks of 4 frames with 4 frames of left context, 8 soft tokens a clip (about a second of 16 kHz
# audio); the media vocabularies as the hub config lays them out (vision's after the per-layer
# vocabulary, audio's after vision's), two ids each
GEMMA3N_AUDIO = {"model_type": "gemma3n_audio", "input_feat_size": 32, "hidden_size": 32,
                 "conf_num_attention_heads": 2, "conf_num_hidden_layers": 2, "conf_attention_chunk_size": 4,
                 "conf_attention_context_left": 5, "conf_attention_context_right": 0,
                 "conf_attention_logit_cap": 50.0, "conf_conv_kernel_size": 5, "conf_reduction_factor": 4,
                 "conf_residual_weight": 0.5, "sscp_conv_channel_size": [8, 4], "sscp_conv_group_norm_eps": 1e-3,
                 "sscp_conv_kernel_size": [[3, 3], [3, 3]], "sscp_conv_stride_size": [[2, 2], [2, 2]],
                 "rms_norm_eps": 1e-6, "gradient_clipping": 1e10, "vocab_size": 2}
GEMMA3N_AUDIO_TOKENS = 8
GEMMA3N_MEDIA_TOKENS = (("boi_token", "<start_of_image>"), ("boa_token", "<start_of_audio>"),
                        ("eoi_token", "<end_of_image>"), ("image_token", "<image_soft_token>"),
                        ("eoa_token", "<end_of_audio>"), ("audio_token", "<audio_soft_token>"))


def _gemma3n_audio_fix(cfg: dict, ids: dict[str, int]) -> None:
    vocab = max(ids.values()) + 1
    cfg["audio_config"] = {**GEMMA3N_AUDIO, "vocab_offset": ids["eoa_token"]}
    cfg["vision_config"] = {**cfg["vision_config"], "vocab_offset": ids["eoi_token"], "vocab_size": 2,
                            "hidden_size": 32}
    cfg.update(audio_soft_tokens_per_image=GEMMA3N_AUDIO_TOKENS, audio_token_id=ids["audio_token"],
               boa_token_id=ids["boa_token"], eoa_token_id=ids["eoa_token"], boi_token_id=ids["boi_token"],
               eoi_token_id=ids["eoi_token"], image_token_id=ids["image_token"])
    # mlx-vlm's gemma3n MLP takes intermediate_size[0] in every layer: one width (as the hub configs)
    text = cfg["text_config"]
    text.update(vocab_size=vocab, vocab_size_per_layer_input=ids["eoi_token"],
                intermediate_size=[text["intermediate_size"][0]] * text["num_hidden_layers"])


def _gemma3n_towers_fix(cfg: dict, ids: dict[str, int]) -> None:
    _gemma3n_audio_fix(cfg, ids)
    # not timm's mobilenetv5_300m_enc: the zoo's own layout, which mlxbun reads from mobilenet_layout
    cfg["vision_config"].update(architecture="mlxbun_zoo_tiny_mobilenetv5", hidden_size=TINY_LAYOUT.msfa_out,
                                mobilenet_layout=TINY_LAYOUT.as_config())
    cfg.update(vision_soft_tokens_per_image=TINY_LAYOUT.tokens)


def _gemma3n_preprocessor() -> dict:
    """google/gemma-3n-E2B-it's preprocessor_config.json (its feature extractor and image processor),
    at 32 mel bins, with a per-bin mean and deviation."""
    import numpy as np

    bins = GEMMA3N_AUDIO["input_feat_size"]
    return {"feature_extractor_type": "Gemma3nAudioFeatureExtractor", "feature_size": bins, "sampling_rate": 16000,
            "frame_length_ms": 32.0, "hop_length_ms": 10.0, "min_frequency": 125.0, "max_frequency": 7600.0,
            "preemphasis": 0.97, "preemphasis_htk_flavor": True, "fft_overdrive": True, "dither": 0.0,
            "input_scale_factor": 1.0, "mel_floor": 1e-5, "padding_side": "right", "padding_value": 0.0,
            "return_attention_mask": True,
            "per_bin_mean": [round(float(x), 4) for x in np.linspace(-2.0, 1.0, bins)],
            "per_bin_stddev": [round(float(x), 4) for x in np.linspace(0.5, 1.5, bins)],
            "image_processor_type": "SiglipImageProcessor", "do_normalize": False, "do_rescale": True,
            "do_resize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "resample": 2,
            "rescale_factor": 0.00392156862745098, "size": {"height": 64, "width": 64},
            "processor_class": "Gemma3nProcessor"}


# tiny gemma4 with both towers: the zoo's tiny vision tower (one block of width 32, 16-pixel patches,
# 3x3 pooling; the processor at most 4 soft tokens an image) and a tiny audio conformer: 128 mel bins
# (mlx-vlm's subsampling stack fixes them), two blocks of width 32 in chunks of 4 frames with 4 of
# left context, clipped linears, a 32-wide output projection; a token per 40 ms of audio, at most
# 16 a clip
GEMMA4_AUDIO = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "hidden_act": "silu",
                "subsampling_conv_channels": [8, 4], "conv_kernel_size": 5, "residual_weight": 0.5,
                "attention_chunk_size": 4, "attention_context_left": 5, "attention_context_right": 0,
                "attention_logit_cap": 50.0, "attention_invalid_logits_value": -1e9, "use_clipped_linears": True,
                "rms_norm_eps": 1e-6, "gradient_clipping": 1e10, "output_proj_dims": 32, "model_type": "gemma4_audio"}
GEMMA4_AUDIO_TOKENS = 16
GEMMA4_MEDIA_TOKENS = (("boi_token", "<start_of_image>"), ("boa_token", "<start_of_audio>"),
                       ("image_token", "<|image|>"), ("audio_token", "<|audio|>"), ("eoi_token", "<end_of_image>"),
                       ("eoa_token", "<end_of_audio>"), ("video_token", "<|video|>"))


def _gemma4_towers_fix(cfg: dict, ids: dict[str, int]) -> None:
    vocab = max(ids.values()) + 1
    cfg["audio_config"] = dict(GEMMA4_AUDIO)
    cfg.update(vocab_size=vocab, audio_soft_tokens_per_image=GEMMA4_AUDIO_TOKENS, audio_ms_per_token=40,
               image_token_id=ids["image_token"], audio_token_id=ids["audio_token"], boi_token_id=ids["boi_token"],
               eoi_token_id=ids["eoi_token"], boa_token_id=ids["boa_token"], eoa_token_id=ids["eoa_token"],
               eoa_token_index=ids["eoa_token"], video_token_id=ids["video_token"])
    cfg["text_config"].update(vocab_size=vocab, vocab_size_per_layer_input=vocab)


TOWER_ARCHS: dict[str, TowerArch] = {a.name: a for a in (
    TowerArch(
        "gemma3-vision", "gemma3",
        media_tokens=(("boi_token", "<start_of_image>"), ("image_token", "<image_soft_token>"),
                      ("eoi_token", "<end_of_image>")),
        fix=_gemma3_fix,
        # google/gemma-3-4b-it's preprocessor_config.json, at the tiny image size
        preprocessor={"do_convert_rgb": None, "do_normalize": True, "do_pan_and_scan": None,
                      "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                      "image_processor_type": "Gemma3ImageProcessor", "image_seq_length": GEMMA3_TOKENS_PER_IMAGE,
                      "image_std": [0.5, 0.5, 0.5], "pan_and_scan_max_num_crops": None,
                      "pan_and_scan_min_crop_size": None, "pan_and_scan_min_ratio_to_activate": None,
                      "processor_class": "Gemma3Processor", "resample": 2,
                      "rescale_factor": 0.00392156862745098,
                      "size": {"height": GEMMA3_VISION["image_size"], "width": GEMMA3_VISION["image_size"]}},
        processor={"image_seq_length": GEMMA3_TOKENS_PER_IMAGE, "processor_class": "Gemma3Processor"},
    ),
    TowerArch("pixtral-vision", "pixtral", media_tokens=PIXTRAL_MEDIA_TOKENS, fix=_pixtral_fix,
              preprocessor=_pixtral_preprocessor("PixtralProcessor"),
              processor={**PIXTRAL_PROCESSOR, "processor_class": "PixtralProcessor", "spatial_merge_size": 1}),
    # mistral3's tower is pixtral's; the processor's patch is 16 x spatial_merge_size 2 (64-pixel
    # edge: up to 2x2 soft tokens an image)
    TowerArch("mistral3-vision", "mistral3", media_tokens=PIXTRAL_MEDIA_TOKENS, fix=_mistral3_fix,
              preprocessor=_pixtral_preprocessor("PixtralProcessor"),
              processor={**PIXTRAL_PROCESSOR, "processor_class": "Mistral3Processor", "spatial_merge_size": 2}),
    TowerArch("qwen2_vl-vision", "qwen2_vl", media_tokens=QWEN_MEDIA_TOKENS, fix=_qwen2_vl_fix,
              preprocessor=_qwen_preprocessor("Qwen2VLProcessor"),
              processor={"processor_class": "Qwen2VLProcessor"}),
    TowerArch("qwen3_vl-vision", "qwen3_vl", media_tokens=QWEN_MEDIA_TOKENS, fix=_qwen3_vl_fix,
              preprocessor=_qwen_preprocessor("Qwen3VLProcessor", patch=16),
              processor={"processor_class": "Qwen3VLProcessor"}),
    # qwen3_vl_moe: the same tower over qwen3_moe's text model (unquantized experts run in float32
    # on this CPU: mlx's gather_mm)
    TowerArch("qwen3_vl_moe-vision", "qwen3_vl_moe", media_tokens=QWEN_MEDIA_TOKENS, fix=_qwen3_vl_moe_fix,
              preprocessor=_qwen_preprocessor("Qwen3VLProcessor", patch=16),
              processor={"processor_class": "Qwen3VLProcessor"}),
    TowerArch("lfm2-vl-vision", "lfm2-vl", media_tokens=LFM2_VL_TOKENS, fix=_lfm2_vl_fix,
              # LiquidAI/LFM2-VL-450M's preprocessor_config.json, at the tiny tile and token budget
              preprocessor={"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
                            "image_processor_type": "Lfm2VlImageProcessorFast", "image_std": [0.5, 0.5, 0.5],
                            "max_num_patches": 16, "processor_class": "Lfm2VlProcessor", "resample": 3,
                            "rescale_factor": 0.00392156862745098, **LFM2_VL_TILING},
              processor={"processor_class": "Lfm2VlProcessor", "use_image_special_tokens": True}),
    TowerArch("gemma3n-audio", "gemma3n", media_tokens=GEMMA3N_MEDIA_TOKENS, fix=_gemma3n_audio_fix,
              preprocessor=_gemma3n_preprocessor(),
              processor={"audio_seq_length": GEMMA3N_AUDIO_TOKENS, "image_seq_length": 256,
                         "processor_class": "Gemma3nProcessor"},
              no_vision_tower=True, hf_names=True),
    # gemma3n with both towers: gemma3n-audio's audio tower and a tiny MobileNetV5 (zoo/mobilenet.py's
    # layout, which mlx-vlm builds with its stage list and widths patched: mobilenet_patch); the
    # processor's 64 x 64 images, 4 soft tokens an image
    TowerArch("gemma3n-towers", "gemma3n", media_tokens=GEMMA3N_MEDIA_TOKENS, fix=_gemma3n_towers_fix,
              preprocessor=_gemma3n_preprocessor(),
              processor={"audio_seq_length": GEMMA3N_AUDIO_TOKENS, "image_seq_length": TINY_LAYOUT.tokens,
                         "processor_class": "Gemma3nProcessor"},
              hf_names=True),
    TowerArch("gemma4-towers", "gemma4", media_tokens=GEMMA4_MEDIA_TOKENS, fix=_gemma4_towers_fix,
              preprocessor={"processor_class": "Gemma4Processor"},
              processor={"audio_seq_length": GEMMA4_AUDIO_TOKENS, "audio_ms_per_token": 40,
                         "feature_extractor": {}, "processor_class": "Gemma4Processor",
                         # 16-pixel patches, at most 4 soft tokens (36 patches) an image
                         "image_processor": {"patch_size": 16, "max_soft_tokens": 4, "pooling_kernel_size": 3}},
              hf_names=False),
    TowerArch("qwen2_5_vl-vision", "qwen2_vl", media_tokens=QWEN_MEDIA_TOKENS, fix=_qwen2_5_vl_fix,
              preprocessor=_qwen_preprocessor("Qwen2_5_VLProcessor"),
              processor={"processor_class": "Qwen2_5_VLProcessor"}),
    # kimi_vl: MoonViT over deepseek_v3's MLA / MoE text model (mlx-vlm's own kimi_vl copy of it);
    # moonshotai/Kimi-VL-A3B-Instruct's preprocessor_config.json, which mlx-vlm's processor does not
    # read (patch and merge from vision_config, CLIP's mean / deviation, 4096 patches)
    TowerArch("kimi_vl-vision", "kimi_vl", media_tokens=KIMI_VL_TOKENS, fix=_kimi_vl_fix,
              preprocessor={"image_processor_type": "KimiVLImageProcessor", "in_token_limit": 4096,
                            "patch_size": 14, "pad_input": False, "image_mean": [0.5, 0.5, 0.5],
                            "image_std": [0.5, 0.5, 0.5], "merge_kernel_size": [2, 2]},
              processor={"processor_class": "KimiVLProcessor"}),
)}


def _arch(name: str) -> TowerArch:
    try:
        return TOWER_ARCHS[name]
    except (KeyError, TypeError):
        raise ZooArgumentError(f"unknown tower arch {name!r}; known: {', '.join(TOWER_ARCHS)}") from None


def media_token_ids(arch: TowerArch) -> dict[str, int]:
    """The added media tokens' ids: right after the zoo tokenizer's vocabulary."""
    from mlxbun.zoo.tokenizer import VOCAB_SIZE

    return {attr: VOCAB_SIZE + i for i, (attr, _) in enumerate(arch.media_tokens)}


def tower_config(name: str) -> dict:
    """config.json of the tiny checkpoint (float32; the builder sets dtype and quantization)."""
    from mlxbun.zoo.archs import tiny_config

    arch = _arch(name)
    cfg = copy.deepcopy(tiny_config(arch.text_arch))
    arch.fix(cfg, media_token_ids(arch))
    return dict(sorted(cfg.items()))


def carries(name: str) -> tuple[str, ...]:
    """The towers the checkpoint carries: ("vision",), ("audio",) or ("vision", "audio")."""
    arch, cfg = _arch(name), tower_config(name)
    return tuple(t for t, key in (("vision", "vision_config"), ("audio", "audio_config"))
                 if key in cfg and not (t == "vision" and arch.no_vision_tower))


def describe(name: str) -> str:
    """What the checkpoint is, in words (`mlxbun zoo list`): "qwen2_5_vl with its vision tower"."""
    towers = carries(name)
    return f"{tower_config(name)['model_type']} with its {' and '.join(towers)} tower{'s' * (len(towers) > 1)}"


def variant(name: str, *, quant=None, dtype: str = "float32", seed: int = 0, head_dim=None) -> Variant:
    """The checkpoint's variant (the registry's builder interface): float32 / float16 / bfloat16 weights,
    4, 8 or mixed text weights (mlx_vlm.convert's, the towers kept in the dtype); no mxfp4, no head_dim."""
    _arch(name)
    _mlx_vlm()
    check_dtype_and_seed(dtype, seed)
    if head_dim is not None:
        raise ZooArgumentError(f"tower checkpoint {name!r} is built at its own sizes (head_dim widens the text "
                               "zoo's heads only)")
    quant = parse_quant(quant)
    if quant == "mxfp4":
        raise ZooArgumentError(f"tower checkpoint {name!r} is built float, 4, 8 or mixed (no mxfp4)")
    return Variant(name, quant, dtype, seed)


def _mlx_vlm():
    """mlx-vlm, the towers' oracle, whose model classes the tower zoo instantiates."""
    try:
        import mlx_vlm
    except ImportError:
        raise ZooArgumentError("the tower zoo builds its checkpoints with mlx-vlm (the towers' oracle), "
                               "which is not installed: pip install --no-deps -r tests/oracles.txt") from None
    return mlx_vlm


def _skip_multimodal(path: str) -> bool:
    from mlx_vlm.utils import skip_multimodal_module

    return skip_multimodal_module(path)


@contextlib.contextmanager
def without_vision_tower(model_type: str):
    """mlx-vlm's `model_type` model class built with an empty module for its vision tower (for a
    checkpoint that carries none: its audio path never calls it)."""
    import importlib

    import mlx.nn as nn

    package = importlib.import_module(f"mlx_vlm.models.{model_type}")
    modules = (package, importlib.import_module(f"mlx_vlm.models.{model_type}.{model_type}"))

    class NoVisionTower(nn.Module):
        def __init__(self, *args, **kwargs):
            super().__init__()

        def sanitize(self, weights):
            return weights

    saved = [m.VisionModel for m in modules]
    for m in modules:
        m.VisionModel = NoVisionTower
    try:
        yield
    finally:
        for m, cls in zip(modules, saved):
            m.VisionModel = cls


def hf_name(name: str) -> str:
    """mlx-vlm's parameter name as HF writes it (language_model.model.X -> model.language_model.X)."""
    if name.startswith("language_model.model."):
        return "model.language_model." + name[len("language_model.model."):]
    return "model." + name


def build_model(config: dict, seed: int):
    """mlx-vlm's model of `config`, seeded and perturbed by name (zoo.weights.perturb); a tied
    head is the embedding's copy (what mlx-vlm's sanitize makes of a tied checkpoint)."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    from mlxbun.zoo.weights import perturb

    cfg = copy.deepcopy(config)
    model_class, _ = get_model_and_args(config=cfg)
    model_config = model_class.ModelConfig.from_dict(cfg)
    model_config = update_module_configs(model_config, model_class, cfg, ["text", "vision", "audio"])
    mx.random.seed(seed)
    model = model_class.Model(model_config)
    model.update(tree_map_with_path(lambda name, p: perturb(name, p, seed), model.parameters()))
    lm = model.language_model
    if config.get("tie_word_embeddings", True) and hasattr(lm, "lm_head"):
        lm.lm_head.weight = lm.model.embed_tokens.weight
    mx.eval(model.parameters())
    return model


def quantize(model, config: dict, quant) -> dict:
    """`mlx_vlm.convert -q`'s quantization (affine, group 64; towers and projectors skipped);
    "mixed": the zoo's mixed recipe (zoo.weights.mixed_predicate) on the text model alone, the
    embedding at the tied head's 8 bits (mlx-vlm copies the embedding over the head)."""
    import io

    from mlx_vlm.quant_utils import quantize_model

    from mlxbun.zoo.weights import GROUP_SIZE, MIXED_BITS, MIXED_HIGH_BITS, mixed_predicate

    inner = mixed_predicate(model) if quant == "mixed" else (lambda p, m: True)
    bits = MIXED_BITS if quant == "mixed" else int(quant)

    def predicate(path, module):
        if _skip_multimodal(path):
            return False
        if quant == "mixed" and path.endswith("embed_tokens"):
            # a tied head is the embedding's copy in mlx-vlm (its sanitize): both at the head's bits
            return {"group_size": GROUP_SIZE, "bits": MIXED_HIGH_BITS, "mode": "affine"}
        return inner(path, module)

    with contextlib.redirect_stdout(io.StringIO()):
        _, qconfig = quantize_model(model, copy.deepcopy(config), GROUP_SIZE, bits, quant_predicate=predicate)
    return qconfig


def write_media_tokenizer(arch: TowerArch, out: Path) -> None:
    """The zoo tokenizer files with the media tokens added (special, after the vocabulary) and
    named in tokenizer_config's extra_special_tokens (the attributes the processors read)."""
    write_tokenizer_files(out)
    ids = media_token_ids(arch)
    tok = json.loads(tokenizer_json())
    for attr, content in arch.media_tokens:
        tok["added_tokens"].append({"id": ids[attr], "content": content, "single_word": False, "lstrip": False,
                                    "rstrip": False, "normalized": False, "special": True})
    (out / "tokenizer.json").write_text(json.dumps(tok, indent=2, ensure_ascii=False), encoding="utf-8")
    tc = tokenizer_config()
    for attr, content in arch.media_tokens:
        tc["added_tokens_decoder"][str(ids[attr])] = {"content": content, "lstrip": False, "normalized": False,
                                                      "rstrip": False, "single_word": False, "special": True}
    tc["extra_special_tokens"] = {attr: content for attr, content in arch.media_tokens}
    (out / "tokenizer_config.json").write_text(json.dumps(tc, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def build_files(v: Variant, out: Path) -> None:
    from mlx.utils import tree_flatten

    from mlxbun.zoo.weights import cast, save_shards

    arch = _arch(v.arch)
    config = tower_config(v.arch)
    config["torch_dtype"] = v.dtype
    with without_vision_tower(config["model_type"]) if arch.no_vision_tower else mobilenet_patch(config):
        model = build_model(config, v.seed)
    cast(model, v.dtype)
    if v.quant is not None:
        config = quantize(model, config, v.quant)
    weights = {hf_name(k) if arch.hf_names else k: w for k, w in tree_flatten(model.parameters())}
    save_shards(weights, out, total_parameters=sum(w.size for w in weights.values()), fmt="mlx")
    (out / "config.json").write_text(json.dumps(dict(sorted(config.items())), indent=4), encoding="utf-8")
    write_media_tokenizer(arch, out)
    (out / "preprocessor_config.json").write_text(json.dumps(arch.preprocessor, indent=2) + "\n", encoding="utf-8")
    (out / "processor_config.json").write_text(json.dumps(arch.processor, indent=2) + "\n", encoding="utf-8")


def cache_key() -> str:
    return f"towers-{zoo_fingerprint()}"


def make_tower_checkpoint(name: str, out_dir, *, quant=None, dtype: str = "float32", seed: int = 0) -> Path:
    """Build `out_dir/tiny-<name>[-<dtype>][-q<quant>][-s<seed>]`; same arguments, same bytes."""
    v = variant(name, quant=quant, dtype=dtype, seed=seed)
    return build_into(out_dir, v.name, lambda out: build_files(v, out))


def cached_tower_checkpoint(name: str, *, quant=None, dtype: str = "float32", seed: int = 0, root=None) -> Path:
    """The checkpoint in the zoo cache (`root`, else the default), built once under a file lock."""
    v = variant(name, quant=quant, dtype=dtype, seed=seed)
    return build_once(cache_root(root) / cache_key(), v.name, lambda out: build_files(v, out))
