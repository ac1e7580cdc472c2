"""The tower rows, keyed by the VLM wrapper's model_type (as the text side's descriptor table)."""

from __future__ import annotations

from mlxbun.towers.knobs import MergeKind, ProjectorKind, TowerDescriptor, VitKnobs

__all__ = ["TOWERS", "tower_for"]

TOWERS: dict[str, TowerDescriptor] = {d.model_type: d for d in (
    # mlx-vlm's gemma3: a SigLIP tower (vision.py: conv patches, learned positions, pre-LN blocks
    # with biased q/k/v/out and a precise-GELU fc1/fc2 MLP, post_layernorm at nn.LayerNorm's
    # default eps) and Gemma3MultiModalProjector
    TowerDescriptor(
        "gemma3", vision_types=("siglip_vision_model", "gemma3", "gemma3_vision"),
        tower_prefix="vision_tower.vision_model", projector_prefix="multi_modal_projector",
        vit=VitKnobs(), projector=ProjectorKind.GEMMA3_AVGPOOL, merge=MergeKind.GEMMA3_SCALED,
        vision_defaults={"image_size": 224, "num_channels": 3, "layer_norm_eps": 1e-6},
        boi_key="boi_token_index",
        notes="SigLIP + average-pooled, RMS-normed projection to mm_tokens_per_image soft tokens",
    ),
)}


def tower_for(model_type: str) -> TowerDescriptor | None:
    return TOWERS.get(model_type)
