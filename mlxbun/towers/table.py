"""The tower rows, keyed by the VLM wrapper's model_type (as the text side's descriptor table)."""

from __future__ import annotations

from mlxbun.towers.knobs import (MergeKind, PatchEmbed, Positions, ProjectorKind, SpliceKind, TextPositions,
                                 TowerDescriptor, VideoKind,
                                 VisionKeys, VitAct, VitKnobs, VitLayout, VitMlp, VitNorm)

__all__ = ["TOWERS", "tower_for"]

def _pixtral_family(model_type: str, projector: ProjectorKind, notes: str) -> TowerDescriptor:
    """A row with mlx-vlm's pixtral VisionModel (pixtral's and mistral3's wrappers)."""
    return TowerDescriptor(
        model_type, vision_types=("pixtral", "clip_vision_model"), tower_prefix="vision_tower.vision_model",
        projector_prefix="multi_modal_projector",
        vit=VitKnobs(layout=VitLayout.PIXTRAL, patch=PatchEmbed.CONV2D, positions=Positions.ROPE_2D_PIXTRAL,
                     post_norm=False, norm=VitNorm.RMSNORM, mlp=VitMlp.SWIGLU, qkv_bias=False, mlp_bias=False),
        projector=projector, merge=MergeKind.IN_ORDER, splice=SpliceKind.ROWS, vision_keys=VisionKeys.PIXTRAL,
        vision_defaults={"num_hidden_layers": 24, "hidden_size": 1024, "head_dim": 64, "intermediate_size": 4096,
                         "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "num_channels": 3,
                         "rms_norm_eps": 1e-5, "rope_theta": 10000.0},
        image_token_key="image_token_index", placeholder_key="image_token_index", lead="{placeholder}",
        break_token="[IMG_BREAK]", end_token="[IMG_END]", notes=notes)


def _qwen3_vl_family(model_type: str, vision_types: tuple[str, ...], act: VitAct, merger_act: VitAct) -> TowerDescriptor:
    """A row with mlx-vlm's qwen3_vl (or its qwen3_vl_moe copy) VisionModel."""
    return TowerDescriptor(
        model_type, vision_types=vision_types, tower_prefix="vision_tower",
        projector_prefix="vision_tower.merger",
        vit=VitKnobs(layout=VitLayout.QWEN_VL, patch=PatchEmbed.CONV3D, positions=Positions.ROPE_2D_INTERP,
                     act=act, post_norm=False, mlp=VitMlp.LINEAR_FC, patch_bias=True, sdpa_pad=True,
                     merger_act=merger_act),
        projector=ProjectorKind.QWEN3_MERGER, merge=MergeKind.SCATTER, splice=SpliceKind.REPEAT,
        vision_keys=VisionKeys.QWEN3_VL,
        vision_defaults={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 1536,
                         "num_heads": 16, "image_size": 384, "patch_size": 14, "in_channels": 3,
                         "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
                         "deepstack_visual_indexes": []},
        top_defaults={"image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                      "video_token_id": 151656},
        image_token_key="image_token_id", boi_key="vision_start_token_id", eoi_key="vision_end_token_id",
        placeholder_key="image_token_id", lead="{boi}{placeholder}{eoi}",
        text_positions=TextPositions.MROPE_INTERLEAVED, video=VideoKind.TIMESTAMPS, video_token_key="video_token_id",
        notes="Qwen3-VL's ViT (interpolated learned positions, deepstack mergers) + its merger",
    )


TOWERS: dict[str, TowerDescriptor] = {d.model_type: d for d in (
    # mlx-vlm's gemma3: a SigLIP tower (vision.py: conv patches, learned positions, pre-LN blocks
    # with biased q/k/v/out and a precise-GELU fc1/fc2 MLP, post_layernorm at nn.LayerNorm's
    # default eps) and Gemma3MultiModalProjector
    TowerDescriptor(
        "gemma3", vision_types=("siglip_vision_model", "gemma3", "gemma3_vision"),
        tower_prefix="vision_tower.vision_model", projector_prefix="multi_modal_projector",
        vit=VitKnobs(), projector=ProjectorKind.GEMMA3_AVGPOOL, merge=MergeKind.GEMMA3_SCALED,
        splice=SpliceKind.GEMMA3,
        vision_defaults={"image_size": 224, "num_channels": 3, "layer_norm_eps": 1e-6},
        boi_key="boi_token_index", eoi_key="eoi_token_index",
        notes="SigLIP + average-pooled, RMS-normed projection to mm_tokens_per_image soft tokens",
    ),
    # mlx-vlm's pixtral (LlavaForConditionalGeneration with a pixtral vision_config): conv patches at
    # each image's own size, ln_pre, RMSNorm blocks with Pixtral's 2-D rotary and a block-diagonal
    # mask, bias-free SwiGLU; vision_feature_layer's stage through the llava projector; the prompt's
    # [IMG] becomes rows of [IMG] split by [IMG_BREAK], closed by [IMG_END]
    _pixtral_family("pixtral", ProjectorKind.LLAVA, "Pixtral's ViT + the llava projector"),
    # mlx-vlm's mistral3: pixtral's tower (its VisionModel) and splice, the processor's patch the
    # tower's x spatial_merge_size; the projector RMS-norms the patches and merges each 2x2 of them
    _pixtral_family("mistral3", ProjectorKind.MISTRAL3, "Pixtral's ViT + Mistral 3's patch-merging projector"),
    # mlx-vlm's qwen2_vl: Conv3d patches over the processor's dynamic-resolution grid, 2-D rotary
    # q / k, fused qkv, each image attending within itself, quick-GELU MLP, no final norm; the
    # PatchMerger (vision_tower.merger) to one soft token per 2x2 patches
    TowerDescriptor(
        "qwen2_vl", vision_types=("qwen2_vl",), tower_prefix="vision_tower",
        projector_prefix="vision_tower.merger",
        vit=VitKnobs(layout=VitLayout.QWEN_VL, patch=PatchEmbed.CONV3D, positions=Positions.ROPE_2D,
                     act=VitAct.GELU_FAST, post_norm=False),
        projector=ProjectorKind.PATCH_MERGER, merge=MergeKind.IN_ORDER, splice=SpliceKind.REPEAT, vision_keys=VisionKeys.QWEN2_VL,
        vision_defaults={"depth": 32, "embed_dim": 1280, "num_heads": 16, "image_size": 384, "patch_size": 14,
                         "mlp_ratio": 4.0, "in_channels": 3, "spatial_merge_size": 2, "temporal_patch_size": 2},
        top_defaults={"image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                      "video_token_id": 151656},
        image_token_key="image_token_id", boi_key="vision_start_token_id", eoi_key="vision_end_token_id",
        placeholder_key="image_token_id", lead="{boi}{placeholder}{eoi}", text_positions=TextPositions.MROPE,
        video=VideoKind.REPEAT, video_token_key="video_token_id",
        notes="Qwen2-VL's ViT + PatchMerger; the text side at mRoPE positions (towers/mrope.py)",
    ),
    # mlx-vlm's qwen3_vl: biased Conv3d patches plus a learned position table interpolated to each
    # grid, 2-D rotary, linear_fc GELU (tanh) MLPs, the heads padded to the fused SDPA's width; the
    # merger (LayerNorm first) and the deepstack mergers (after the concatenation) whose tokens the
    # text model adds to its first layers' outputs at the image rows
    _qwen3_vl_family("qwen3_vl", ("qwen3_vl", "qwen3_vl_vision"), VitAct.GELU_TANH, VitAct.GELU),
    # mlx-vlm's qwen3_vl_moe: its own copy of the tower, the blocks' GELU erf and the mergers' tanh
    # (qwen3_vl's the other way round); the text side over a MoE text model
    _qwen3_vl_family("qwen3_vl_moe", ("qwen3_vl_moe",), VitAct.GELU, VitAct.GELU_TANH),
    # mlx-vlm's lfm2-vl: a Siglip2 NaFlex tower (SigLIP's blocks over linear patch rows, the learned
    # position table resized to each view, padding rows masked) and its pixel-unshuffle projector;
    # the processor tiles a large image (row / column markers, a thumbnail) and the prompt's <image>
    # becomes start, the views' tokens, end
    TowerDescriptor(
        "lfm2-vl", vision_types=("lfm2_vl", "siglip2_vision_model"), tower_prefix="vision_tower",
        projector_prefix="multi_modal_projector",
        vit=VitKnobs(layout=VitLayout.SIGLIP, patch=PatchEmbed.LINEAR, positions=Positions.LEARNED_RESIZED,
                     act=VitAct.GELU_TANH, post_norm=True, post_norm_eps=None),
        projector=ProjectorKind.LFM2, merge=MergeKind.SCATTER, splice=SpliceKind.TILES,
        vision_keys=VisionKeys.SIGLIP2,
        vision_defaults={"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
                         "num_attention_heads": 12, "num_channels": 3, "image_size": 224, "patch_size": 16,
                         "num_patches": 256, "layer_norm_eps": 1e-6},
        top_defaults={"image_token_id": 396}, image_token_key="image_token_id", placeholder_key="image_token_id",
        lead="{placeholder}", start_token="<|image_start|>", image_end_token="<|image_end|>",
        thumbnail_token="<|img_thumbnail|>", special_tokens=False,
        notes="LFM2-VL's Siglip2 NaFlex tower + pixel-unshuffle projector, tiled images",
    ),
    # mlx-vlm's qwen2_5_vl: qwen2_vl's shape with RMSNorm blocks, a biased SwiGLU MLP, window
    # attention (the patches reordered window by window; fullatt_block_indexes attend per image)
    # and an RMSNorm merger whose tokens go back to image order
    TowerDescriptor(
        "qwen2_5_vl", vision_types=("qwen2_5_vl",), tower_prefix="vision_tower",
        projector_prefix="vision_tower.merger",
        vit=VitKnobs(layout=VitLayout.QWEN_VL, patch=PatchEmbed.CONV3D, positions=Positions.ROPE_2D,
                     post_norm=False, norm=VitNorm.RMSNORM, mlp=VitMlp.SWIGLU, windows=True),
        projector=ProjectorKind.PATCH_MERGER_RMS, merge=MergeKind.IN_ORDER, splice=SpliceKind.REPEAT, vision_keys=VisionKeys.QWEN2_5_VL,
        vision_defaults={"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "out_hidden_size": 1536,
                         "num_heads": 16, "image_size": 384, "patch_size": 14, "in_channels": 3,
                         "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
                         "fullatt_block_indexes": [7, 15, 23, 31]},
        top_defaults={"image_token_id": 151655, "vision_start_token_id": 151652, "vision_end_token_id": 151653,
                      "video_token_id": 151656},
        image_token_key="image_token_id", boi_key="vision_start_token_id", eoi_key="vision_end_token_id",
        placeholder_key="image_token_id", lead="{boi}{placeholder}{eoi}", text_positions=TextPositions.MROPE,
        video=VideoKind.REPEAT, video_token_key="video_token_id",
        notes="Qwen2.5-VL's windowed ViT + RMSNorm PatchMerger; the text side at mRoPE positions",
    ),
    # mlx-vlm's kimi_vl: MoonViT (towers/moonvit.py: per-patch conv, a learned table bicubically
    # resized to each image's grid, a complex 2-D rotary, each image attending within itself, 2x2
    # windows gathered) and its LayerNorm -> linear -> GELU -> linear projector; the processor
    # crops each image to whole 2x2 windows and the prompt's <|media_pad|> becomes one per window
    TowerDescriptor(
        "kimi_vl", vision_types=("moonvit",), tower_prefix="vision_tower", projector_prefix="multi_modal_projector",
        vit=VitKnobs(layout=VitLayout.MOONVIT, positions=Positions.MOONVIT, act=VitAct.GELU),
        projector=ProjectorKind.KIMI_VL, merge=MergeKind.IN_ORDER, splice=SpliceKind.REPEAT,
        vision_keys=VisionKeys.MOONVIT,
        vision_defaults={"depth": 27, "embed_dim": 1152, "hidden_size": 1152, "num_heads": 16,
                         "intermediate_size": 4304, "image_size": 384, "patch_size": 14, "num_channels": 3,
                         "init_pos_emb_height": 64, "spatial_merge_size": 2},
        top_defaults={"media_placeholder_token_id": 163606},
        image_token_key="media_placeholder_token_id", placeholder_key="media_placeholder_token_id",
        lead="<|media_start|>image<|media_content|>{placeholder}<|media_end|>",
        notes="Kimi-VL's MoonViT + its patch-window projector",
    ),
)}


def tower_for(model_type: str) -> TowerDescriptor | None:
    return TOWERS.get(model_type)
