"""tower_bringup.ipynb: a VLM's vision tower held to mlx-vlm over the patch grid (experiment
"tower_bringup").

One image goes through the processor (mlxbun's preprocessing, checked equal to mlx-vlm's), then
through mlxbun's tower (`mlxbun.towers`) and mlx-vlm's, stage by stage: the patch embeddings,
every encoder block, the final norm, the projector's soft tokens. Per stage, the largest
|mlxbun - mlx-vlm| of each patch (over the hidden features) on the patch grid: a port bug shows
where it starts and which patches it touches; 0 everywhere is bit-exact. Beside it: the image with
its patches, the soft tokens merged into the prompt's rows, and the attention maps of a block
(softmax(q k^T) recomputed in float32 for the picture; the forward runs the fused SDPA).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.errors import MlxbunError
from mlxbun.towers.knobs import ProjectorKind, SpliceKind, VitLayout

__all__ = ["TowerBringup", "default_image", "oracle_stages", "patch_order", "tower_bringup"]


def default_image() -> str:
    """matplotlib's sample photograph (an installed file: no download)."""
    import matplotlib.cbook as cbook

    return str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))


@dataclass
class TowerBringup:
    """The bring-up of one tower on one image against mlx-vlm."""

    path: Path
    stages: list[str]  # embeddings, layers.i, post_layernorm, projector
    grids: dict[str, np.ndarray]  # stage -> [side, side] max |diff| per patch (per soft token: projector)
    stage_max: dict[str, float]
    pixels_equal: bool  # mlxbun's preprocessing == mlx-vlm's processor
    ids_equal: bool  # the spliced prompt ids == mlx-vlm's
    embeddings_equal: bool  # the merged rows == mlx-vlm's get_input_embeddings
    image: np.ndarray  # the resized image the tower sees [H, W, 3] uint8
    patch_size: int
    soft_tokens: np.ndarray  # [T, D] the image's soft tokens (float32)
    prompt_ids: list[int]
    image_token_id: int
    attention: np.ndarray  # [heads, P, P] of block `attention_layer`
    attention_layer: int
    grid_shape: tuple[int, int] = (0, 0)  # patches (rows, columns) of the image
    run_id: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    @property
    def bit_exact(self) -> bool:
        return (all(v == 0.0 for v in self.stage_max.values()) and self.pixels_equal and self.ids_equal
                and self.embeddings_equal)

    def verdict(self) -> str:
        if self.bit_exact:
            return f"PASS: {len(self.stages)} stages bit-exact vs mlx-vlm, pixels, ids and merged rows equal"
        first = next((s for s in self.stages if self.stage_max[s] != 0.0), None)
        return (f"FAIL: first stage that differs: {first}; pixels equal: {self.pixels_equal}, ids equal: "
                f"{self.ids_equal}, merged rows equal: {self.embeddings_equal}")

    def require_pass(self) -> None:
        if not self.bit_exact:
            raise MlxbunError(self.verdict())

    def table(self):
        import pandas as pd

        return pd.DataFrame({"stage": self.stages, "max_abs_diff": [self.stage_max[s] for s in self.stages],
                             "patches_differing": [int((self.grids[s] > 0).sum()) for s in self.stages]})


def oracle_stages(model, layout: VitLayout, pixel_values: mx.array, grid: Optional[mx.array], dtype,
                  windows: bool = False, mistral3: bool = False) -> list[mx.array]:
    """mlx-vlm's tower stage by stage with its own modules and methods (its __call__ returns only
    the end): the patch embeddings, each block, the final norm (SigLIP), the projector's tokens
    (Qwen: its tower's __call__ itself; Pixtral: its hidden states, `grid` the image sizes, the
    projector over the last). `pixel_values` as its processor gives them."""
    if layout is VitLayout.PIXTRAL:
        _, states = model.vision_tower(pixel_values.transpose(0, 2, 3, 1), output_hidden_states=True,
                                       image_sizes=grid)
        selected = states[model.vision_feature_layer]
        if mistral3:  # its projector takes the squeezed patches and the image sizes
            return list(states) + [model.multi_modal_projector(selected[0], grid)]
        return list(states) + [model.multi_modal_projector(selected)]
    if layout is VitLayout.SIGLIP and isinstance(grid, tuple):  # LFM2-VL: (view grids, masks)
        vt = model.vision_tower
        shapes, keep = grid
        h = vt.embeddings(pixel_values, spatial_shapes=shapes)
        h = h.astype(vt.embeddings.patch_embedding.weight.dtype)
        mask = mx.where(keep[:, None, None, :].astype(mx.bool_), mx.array(0.0), mx.array(-mx.inf)).astype(h.dtype)
        out = [h]
        for layer in vt.encoder.layers:
            h = layer(h, mask=mask)
            out.append(h)
        out.append(vt.post_layernorm(h))
        views = model.encode_images(pixel_values, spatial_shapes=shapes, pixel_attention_mask=keep)
        return out + [mx.concatenate(list(views), axis=0)]
    if layout is VitLayout.SIGLIP:
        sv = model.vision_tower.vision_model
        h = sv.embeddings(pixel_values.transpose(0, 2, 3, 1).astype(dtype))
        out = [h]
        for layer in sv.encoder.layers:
            h = layer(h)
            out.append(h)
        out.append(sv.post_layernorm(h))
        return out + [model.multi_modal_projector(out[-1])]
    vt = model.vision_tower
    x = pixel_values.astype(vt.patch_embed.proj.weight.dtype)
    h, rope = vt.patch_embed(x), vt.rot_pos_emb(grid)
    if hasattr(vt, "fast_pos_embed_interpolate"):  # Qwen3-VL's learned positions
        h = h + vt.fast_pos_embed_interpolate(grid)
    cu = mx.pad(mx.cumsum(mx.array([int(g[1] * g[2]) for g in grid.tolist()]).astype(mx.int32)), (1, 0))
    cus = [cu] * len(vt.blocks)
    if windows:
        index, cu_windows = vt.get_window_index(grid)
        unit, L = vt.spatial_merge_unit, h.shape[0]
        h = h.reshape(L // unit, unit, -1)[index, :, :].reshape(L, -1)
        rope = rope.reshape(L // unit, unit, -1)[index, :, :].reshape(L, -1)
        cus = [cu if i in vt.fullatt_block_indexes else cu_windows for i in range(len(vt.blocks))]
    out = [h]
    for block, c in zip(vt.blocks, cus):
        h = block(h, cu_seqlens=c, rotary_pos_emb=rope)
        out.append(h)
    end = vt(x, grid)
    return out + [end[0] if isinstance(end, tuple) else end]  # Qwen3-VL's: (tokens, deepstack)


def patch_order(vision, grid) -> Optional[np.ndarray]:
    """The row-major patch index at each position of a Qwen tower's sequence (merge-window order,
    then window order), for the first image; None for a SigLIP tower (already row-major)."""
    if not vision.dynamic:
        return None
    _, h, w = (int(x) for x in np.asarray(grid)[0])
    m = vision.tower.config.spatial_merge_size
    order = np.arange(h * w).reshape(h // m, m, w // m, m).transpose(0, 2, 1, 3).reshape(-1)
    if vision.descriptor.vit.windows:
        index, _ = vision.tower.window_index(np.asarray(grid)[:1])
        order = order.reshape(-1, m * m)[np.array(index)].reshape(-1)
    return order


def _patch_grid(diff: mx.array, order: Optional[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """|diff| ([1, P, D] or [P, D]) -> max over the features on the (first image's) patch grid."""
    per = np.array(diff.astype(mx.float32).max(axis=-1)).reshape(-1)
    n = shape[0] * shape[1]
    if order is None:
        return per[:n].reshape(shape)
    grid = np.empty(n, dtype=per.dtype)
    grid[order] = per[:n]
    return grid.reshape(shape)


def tower_bringup(checkpoint=None, *, tower_arch: str = "gemma3-vision", variant: str = "float32",
                  image=None, prompt: Optional[str] = None, attention_layer: Optional[int] = None,
                  results_path=None, record: bool = True, zoo_root=None) -> TowerBringup:
    """Hold `checkpoint`'s tower (default: the zoo's `tower_arch` in `variant`, a dtype name or
    dtype-q4 / q8 / mixed) to mlx-vlm on `image` (default: matplotlib's sample photograph);
    `prompt` None: the image alone, then "describe"."""
    from mlx_vlm.utils import load, prepare_inputs

    from mlxbun.lab.recording import recording
    from mlxbun.multimodal import open_vlm
    from mlxbun.towers.images import load_image
    from mlxbun.zoo.towers import cached_tower_checkpoint

    if checkpoint is None:
        dtype, _, quant = variant.partition("-q")
        path = cached_tower_checkpoint(tower_arch, dtype=dtype, quant=quant or None, root=zoo_root)
    else:
        path = Path(checkpoint)
    image = default_image() if image is None else image
    vlm = open_vlm(path)
    v = vlm.vision
    pil = load_image(image)
    text = vlm.placeholders("describe" if prompt is None else prompt, 1)  # the image's placeholders written out
    model, processor = load(str(path))
    ref = prepare_inputs(processor, images=[pil], prompts=[text], add_special_tokens=True)
    ours = vlm.prepare(text, [pil])
    dtype = vlm.text_model.embed_tokens(ours.ids[:1][None]).dtype
    mine = v.blocks(ours.pixel_values, dtype, ours.tower_grid)
    grid = ref.get("image_grid_thw", ref.get("image_sizes"))
    if "spatial_shapes" in ref:  # LFM2-VL
        grid = (ref["spatial_shapes"], ref["pixel_attention_mask"])
    theirs = oracle_stages(model, v.descriptor.vit.layout, ref["pixel_values"], grid, dtype, v.descriptor.vit.windows,
                           mistral3=v.descriptor.projector is ProjectorKind.MISTRAL3)
    order = patch_order(v, ours.grid)
    if v.descriptor.splice is SpliceKind.TILES:  # LFM2-VL: the first view (a tile, or the image)
        h, w = (int(x) for x in np.asarray(ours.grid)[0])
        f = v.processor.merge_size
        shape, token_shape = (h, w), (-(-h // f), -(-w // f))
        resized_hw = (h * v.processor.patch_size, w * v.processor.patch_size)
    elif v.descriptor.vit.layout is VitLayout.PIXTRAL:
        token_shape = v.token_shapes(np.asarray(ours.grid))[0]
        resized_hw = tuple(int(x) for x in np.asarray(ours.grid)[0])
        p = v.tower.config.patch_size
        shape = (resized_hw[0] // p, resized_hw[1] // p)
    elif v.dynamic:
        _, gh, gw = (int(x) for x in np.asarray(ours.grid)[0])
        m = v.tower.config.spatial_merge_size
        shape, token_shape = (gh, gw), (gh // m, gw // m)
        resized_hw = (gh * v.processor.patch_size, gw * v.processor.patch_size)
    else:
        side = v.tower.config.grid
        token_side = int(round(v.tokens_per_image ** 0.5))
        shape, token_shape = (side, side), (token_side, token_side)
        resized_hw = (v.processor.height, v.processor.width)
    stages = [name for name, _ in mine]
    grids = {name: _patch_grid(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)),
                               None if name == "projector" else order, token_shape if name == "projector" else shape)
             for (name, a), b in zip(mine, theirs)}
    keys = ("image_grid_thw", "image_sizes", "spatial_shapes", "pixel_attention_mask")
    kwargs = {k: ref[k] for k in keys if k in ref}
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], mask=ref["attention_mask"], **kwargs)
    if v.descriptor.splice is SpliceKind.TILES:  # the first view as the tower sees it, de-normalized
        p, spec = v.processor.patch_size, v.processor
        view = np.array(ours.pixel_values[0])[: shape[0] * shape[1]].reshape(shape[0], shape[1], p, p, 3)
        view = view.transpose(0, 2, 1, 3, 4).reshape(shape[0] * p, shape[1] * p, 3)
        view = view * np.array(spec.image_std) + np.array(spec.image_mean)
        resized = np.clip(view / spec.rescale_factor, 0, 255).round().astype(np.uint8)
    else:
        resized = np.array(pil.resize((resized_hw[1], resized_hw[0]), resample=v.processor.resample, reducing_gap=None))
    layer = len(v.tower.layers) - 1 if attention_layer is None else attention_layer
    attn = np.array(v.tower.attention_maps(v.pixels(ours.pixel_values, dtype), layer, ours.tower_grid)[0])
    attn = attn[:, : shape[0] * shape[1], : shape[0] * shape[1]]
    if order is not None:  # to row-major patches (the first image's)
        n = shape[0] * shape[1]
        inv = np.argsort(order)
        attn = attn[:, :n, :n][:, inv][:, :, inv]
    features = ours.features[0] if ours.features.ndim == 3 else ours.features
    features = features[: token_shape[0] * token_shape[1]]
    out = TowerBringup(
        path=path, stages=stages, grids=grids, stage_max={s: float(g.max()) for s, g in grids.items()},
        pixels_equal=bool(mx.array_equal(ours.pixel_values, ref["pixel_values"])),
        ids_equal=ours.ids.tolist() == ref["input_ids"][0].tolist(),
        embeddings_equal=bool(mx.array_equal(ours.embeddings, merged.inputs_embeds)),
        image=resized, patch_size=v.tower.config.patch_size,
        soft_tokens=np.array(features.astype(mx.float32)), prompt_ids=ours.ids.tolist(),
        image_token_id=v.image_token_id, attention=attn, attention_layer=layer, grid_shape=shape)
    params = {"tower_arch": tower_arch, "variant": variant, "image": str(image) if not hasattr(image, "size") else "PIL",
              "checkpoint": None if checkpoint is None else str(checkpoint)}
    with recording("tower_bringup", model=path, params=params, results_path=results_path, record=record) as run:
        if run is not None:
            out.run_id = run.run_id
            for s in stages:
                run.record("max_abs_diff", out.stage_max[s], unit="", stage=s)
            run.record("bit_exact", float(out.bit_exact), unit="bool")
            run.record("soft_tokens", float(ours.soft_tokens), unit="tokens")
    return out

