"""tower_bringup.ipynb on gemma4's vision tower (mlxbun.towers.gemma4_vision) held to mlx-vlm over
the patch grid.

One image goes through gemma4's image processor (its aspect-preserving resize into the patch
budget; mlxbun's pixels checked equal to mlx-vlm's), then through mlxbun's tower and mlx-vlm's,
stage by stage: the patch embeddings, every block, the pooler's tokens (k x k patches averaged,
scaled), embed_vision's soft tokens. Per stage, the largest |mlxbun - mlx-vlm| of each patch (of
each soft token after the pooler) on the image's grid; beside it the image with its patches, the
soft tokens merged into the prompt's image-token rows, a block's attention maps.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.experiments.tower_bringup_result import TowerBringup, row_diffs, seen_image
from mlxbun.multimodal import Gemma4ImageModel
from mlxbun.towers.images import load_image
from mlxbun.towers.splice import count_placeholders

__all__ = ["gemma4_bringup", "image_prompt", "oracle_gemma4_stages"]


def oracle_gemma4_stages(model, pixels: mx.array) -> list[mx.array]:
    """mlx-vlm's gemma4 vision tower stage by stage on one image [1, 3, H, W] with its own modules
    (its __call__ returns only the end): the patch embeddings at its patch positions, each block
    under its padding mask, the pooled tokens (its __call__), embed_vision's soft tokens."""
    tower = model.vision_tower
    h, w = pixels.shape[2:]
    n = (h // tower.patch_size) * (w // tower.patch_size)
    positions, padding, _ = tower._patch_positions_single(h, w, max_patches=n)
    positions, padding = mx.array(positions[None]), mx.array(padding[None])
    x = tower.patch_embedder(pixels, positions, padding)
    valid = ~padding
    mask = mx.where(mx.expand_dims(valid, 1) * mx.expand_dims(valid, 2), mx.array(0.0, dtype=x.dtype),
                    mx.array(-1e4, dtype=x.dtype))[:, None]
    out = [x]
    for layer in tower.encoder.layers:
        out.append(x := layer(x, positions, mask))
    pooled = tower(pixels)
    return out + [pooled, model.embed_vision(pooled)]


def image_prompt(vlm: Gemma4ImageModel, processor, image, prompt: Optional[str] = None):
    """(mlx-vlm's prepare_inputs, mlxbun's prepared prompt) of one image spliced into `prompt`
    (None: the image's placeholder, then "describe"): gemma4's and gemma3n's image token."""
    from mlx_vlm.utils import prepare_inputs

    pil = load_image(image)
    token = vlm.tokenizer.id_to_token(vlm.vision.image_token_id)
    text, _ = count_placeholders("describe" if prompt is None else prompt, token, 1, token)
    return prepare_inputs(processor, images=[pil], prompts=[text], add_special_tokens=True), vlm.prepare(text, [pil])


def gemma4_bringup(vlm: Gemma4ImageModel, oracle, image, prompt: Optional[str] = None,
                   attention_layer: Optional[int] = None) -> TowerBringup:
    """Hold gemma4's vision tower to mlx-vlm's (`oracle`: its model and processor) on `image`;
    `prompt` None: the image's placeholder, then "describe"."""
    model, processor = oracle
    v = vlm.vision
    ref, ours = image_prompt(vlm, processor, image, prompt)
    pixels = ours.pixel_values[0][None]
    taps: list = []
    pooled = v.tower(pixels, taps=taps)
    mine = ([("embeddings", taps[0])] + [(f"layers.{i}", t) for i, t in enumerate(taps[1:])]
            + [("pooler", pooled), ("projector", v.embed_vision(pooled[None]))])
    theirs = oracle_gemma4_stages(model, pixels)
    spec, k = v.spec, v.spec.pooling_kernel_size
    shape = (pixels.shape[2] // spec.patch_size, pixels.shape[3] // spec.patch_size)
    pooled_shape = (shape[0] // k, shape[1] // k)
    grids = {name: row_diffs(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])).reshape(
        pooled_shape if name in ("pooler", "projector") else shape) for (name, a), b in zip(mine, theirs)}
    px = ref["pixel_values"] if isinstance(ref["pixel_values"], list) else list(ref["pixel_values"])
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"])
    layer = len(v.tower.encoder.layers) - 1 if attention_layer is None else attention_layer
    return TowerBringup(
        path=vlm.path, media="image", stages=[n for n, _ in mine], grids=grids,
        inputs_equal=len(px) == 1 and bool(mx.array_equal(ours.pixel_values[0], px[0])),
        ids_equal=ours.ids.tolist() == ref["input_ids"][0].tolist(),
        embeddings_equal=bool(mx.array_equal(ours.embeddings, merged.inputs_embeds)),
        soft_tokens=np.array(ours.features.astype(mx.float32)), prompt_ids=ours.ids.tolist(),
        token_id=v.image_token_id, image=seen_image(np.array(ours.pixel_values[0]).transpose(1, 2, 0), spec,
                                                      spec.do_normalize),
        patch_size=spec.patch_size, attention=np.array(v.tower.attention_maps(pixels, layer)[0]),
        attention_layer=layer, grid_shape=shape)
