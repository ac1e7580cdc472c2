"""tower_bringup.ipynb on kimi_vl's vision tower (MoonViT: mlxbun.towers.moonvit) held to mlx-vlm
over the patch grid.

One image goes through Kimi-VL's processor (a shrink past its patch limit, a centre crop to whole
2x2 merge windows, cut into 14-pixel patches; mlxbun's patches and grid checked equal to mlx-vlm's),
then through mlxbun's tower and mlx-vlm's, stage by stage: the patch embeddings (the position table
resized to the grid), every block, the final norm, the patch merger's 2x2 windows (drawn back on the
patch grid), the projector's soft tokens. Per stage, the largest |mlxbun - mlx-vlm| of each patch (of
each soft token for the projector), row-major as MoonViT runs them; beside it the image as the tower
sees it (its patches put back together) with its patches, the soft tokens merged into the prompt's
media rows, a block's attention maps.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.experiments.tower_bringup_result import TowerBringup, row_diffs, seen_image
from mlxbun.multimodal import VisionLanguageModel
from mlxbun.towers.images import load_image

__all__ = ["kimi_bringup", "oracle_moonvit_stages"]


def oracle_moonvit_stages(model, pixel_values: mx.array, grid: mx.array) -> list[mx.array]:
    """mlx-vlm's kimi_vl VisionModel.__call__ stage by stage with its own modules and functions (its
    __call__ returns only the windows), then its projector: the patch embeddings, each block, the
    final norm, the patch merger's windows (concatenated), the projector's tokens. `pixel_values`
    and `grid` (image_grid_hws) as its processor gives them."""
    from mlx_vlm.models.kimi_vl.vision import make_block_attention_mask, patch_merger

    tower = model.vision_tower
    h = tower.patch_embed(pixel_values.transpose(0, 2, 3, 1), grid)
    rope = tower.rope_pos_emb.get_freqs_cis(grid)
    cu = mx.cumsum(mx.concatenate((mx.zeros((1,), dtype=grid.dtype), grid[:, 0] * grid[:, 1])).astype(mx.int32))
    mask = make_block_attention_mask(cu, h.shape[0])
    out = [h]
    for blk in tower.blocks:
        out.append(h := blk(h, cu_seqlens=cu, rotary_pos_emb=rope, attention_mask=mask))
    out.append(h := tower.final_layernorm(h))
    merged = patch_merger(h, grid, merge_kernel_size=tower.merge_kernel_size)
    return out + [mx.concatenate(merged, axis=0), model.multi_modal_projector(merged)]


def kimi_bringup(vlm: VisionLanguageModel, oracle, image, prompt: Optional[str] = None,
                 attention_layer: Optional[int] = None) -> TowerBringup:
    """Hold kimi_vl's MoonViT and projector to mlx-vlm's (`oracle`: its model and processor) on
    `image`; `prompt` None: the image's placeholders written out, then "describe"."""
    from mlx_vlm.utils import prepare_inputs

    model, processor = oracle
    v = vlm.vision
    pil = load_image(image)
    text = vlm.placeholders("describe" if prompt is None else prompt, 1)
    ref = prepare_inputs(processor, images=[pil], prompts=[text], add_special_tokens=True)
    ours = vlm.prepare(text, [pil])
    mine = v.blocks(ours.pixel_values, None, ours.grid)
    theirs = oracle_moonvit_stages(model, ref["pixel_values"], ref["image_grid_hws"])
    rows, cols = (int(x) for x in np.asarray(ours.grid)[0])
    m = v.tower.config.spatial_merge_size
    grids = {}
    for (name, a), b in zip(mine, theirs):
        g = row_diffs(a, b)
        if name == "merged":  # [windows, m * m] back to the patch grid
            g = g.reshape(rows // m, cols // m, m, m).transpose(0, 2, 1, 3)
        grids[name] = g.reshape((rows // m, cols // m) if name == "projector" else (rows, cols))
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], image_grid_hws=ref["image_grid_hws"])
    p = v.processor.patch_size
    patches = np.array(ours.pixel_values).reshape(rows, cols, 3, p, p).transpose(0, 3, 1, 4, 2)
    layer = len(v.tower.layers) - 1 if attention_layer is None else attention_layer
    attention = v.tower.attention_maps(v.pixels(ours.pixel_values, None), layer, ours.grid)[0]
    return TowerBringup(
        path=vlm.path, media="image", stages=[n for n, _ in mine], grids=grids,
        inputs_equal=bool(mx.array_equal(ours.pixel_values, ref["pixel_values"])
                          and mx.array_equal(ours.grid, ref["image_grid_hws"])),
        ids_equal=ours.ids.tolist() == ref["input_ids"][0].tolist(),
        embeddings_equal=bool(mx.array_equal(ours.embeddings, merged.inputs_embeds)),
        soft_tokens=np.array(ours.features.astype(mx.float32)), prompt_ids=ours.ids.tolist(),
        token_id=v.image_token_id, image=seen_image(patches.reshape(rows * p, cols * p, 3), v.processor),
        patch_size=p, attention=np.array(attention), attention_layer=layer, grid_shape=(rows, cols))
