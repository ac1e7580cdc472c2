"""tower_bringup.ipynb on gemma3n's vision tower (MobileNetV5: mlxbun.towers.mobilenet5 and
gemma3n_vision) held to mlx-vlm over its feature maps.

One image goes through gemma3n's processor (a fixed-size resize; mlxbun's pixels checked equal to
mlx-vlm's), then through mlxbun's tower and mlx-vlm's (built under the checkpoint's own layout where
it gives one: zoo.mobilenet), stage by stage: the conv stem, every block of every stage (named as
the checkpoint's `blocks.stage.block`), the MSFA's map, get_image_features' rows before its
embed_vision (the map read column by column, scaled), embed_vision's soft tokens. Per stage, the
largest |mlxbun - mlx-vlm| of each cell of its feature map (rows x columns; the MSFA's and the
tokens' on the output grid); beside it the image with the regions its soft tokens pool, numbered in
token order, and the soft tokens merged into the prompt's image-token rows. No attention maps
(MobileNetV5's multi-query attention is not drawn).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.errors import UnsupportedModelError
from mlxbun.experiments.tower_bringup_gemma4 import image_prompt
from mlxbun.experiments.tower_bringup_result import TowerBringup, row_diffs, seen_image
from mlxbun.multimodal import Gemma3nImageModel

__all__ = ["gemma3n_bringup", "oracle_mobilenet_stages"]


def oracle_mobilenet_stages(model, pixel_values: mx.array) -> list[mx.array]:
    """mlx-vlm's gemma3n vision side stage by stage with its own modules, in its VisionTower.__call__'s
    order (which returns only the end): the stem, each block, the MSFA (its __call__),
    get_image_features with embed_vision left out (an identity in its place), then with it."""
    tm = model.vision_tower.timm_model
    x = tm.conv_stem(pixel_values.transpose(0, 2, 3, 1))
    out = [x]
    for group in tm.blocks:
        for block in group:
            out.append(x := block(x))
    rows = model.get_image_features(pixel_values, model.vision_tower, model.config, lambda inputs_embeds: inputs_embeds)
    tokens = model.get_image_features(pixel_values, model.vision_tower, model.config, model.embed_vision)
    return out + [model.vision_tower(pixel_values), rows, tokens]


def _our_stages(vlm: Gemma3nImageModel, pixels: mx.array) -> list[tuple[str, mx.array]]:
    """mlxbun's stages (mlxbun's modules, as Gemma3nVision.soft_tokens runs them), named."""
    v = vlm.vision
    taps: list = []
    msfa = v.tower(pixels, taps)
    rows = v.image_rows(msfa)
    names = [f"blocks.{s}.{b}" for s, stage in enumerate(v.tower.layout.stages) for b in range(len(stage))]
    return ([("stem", v.tower.conv_stem(pixels.transpose(0, 2, 3, 1)))] + list(zip(names, taps))
            + [("msfa", msfa), ("get_image_features", rows), ("embed_vision", v.embed_vision.soft(rows))])


def gemma3n_bringup(vlm: Gemma3nImageModel, oracle, image, prompt: Optional[str] = None,
                    attention_layer: Optional[int] = None) -> TowerBringup:
    """Hold gemma3n's vision tower to mlx-vlm's (`oracle`: its model and processor) on `image`;
    `prompt` None: the image's placeholder, then "describe". `attention_layer` is refused (no maps)."""
    if attention_layer is not None:
        raise UnsupportedModelError(f"{vlm.path}: attention_layer {attention_layer}: MobileNetV5's bring-up draws "
                                    "no attention maps")
    model, processor = oracle
    v = vlm.vision
    ref, ours = image_prompt(vlm, processor, image, prompt)
    pixels = ours.pixel_values[:1]
    mine = _our_stages(vlm, pixels)
    theirs = oracle_mobilenet_stages(model, pixels)
    out_rows, out_cols = v.tower.layout.msfa_output_resolution
    grids = {}
    for (name, a), b in zip(mine, theirs):
        g = row_diffs(a, b)[0]
        if name == "msfa":  # the map keeps the MSFA's (W, H) swap
            g = g.T
        elif g.ndim == 1:  # tokens, read column by column
            g = g.reshape(out_cols, out_rows).T
        grids[name] = g
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"])
    spec = v.spec
    return TowerBringup(
        path=vlm.path, media="image", stages=[n for n, _ in mine], grids=grids,
        inputs_equal=bool(mx.array_equal(ours.pixel_values, ref["pixel_values"])),
        ids_equal=ours.ids.tolist() == ref["input_ids"][0].tolist(),
        embeddings_equal=bool(mx.array_equal(ours.embeddings, merged.inputs_embeds)),
        soft_tokens=np.array(ours.features[0].astype(mx.float32)), prompt_ids=ours.ids.tolist(),
        token_id=v.image_token_id,
        image=seen_image(np.array(pixels[0]).transpose(1, 2, 0), spec, spec.do_normalize),
        patch_size=(spec.height // out_rows, spec.width // out_cols),
        patch_numbers=np.arange(out_rows * out_cols).reshape(out_cols, out_rows).T,
        grid_shape=(out_rows, out_cols), cell="cell")
