"""tower_bringup.ipynb: a checkpoint's tower held to mlx-vlm, stage by stage (experiment
"tower_bringup"): an image tower over the patch grid, an audio tower over the frames.

One image goes through the processor (mlxbun's preprocessing, checked equal to mlx-vlm's), then
through mlxbun's tower (`mlxbun.towers`) and mlx-vlm's, stage by stage: the patch embeddings,
every encoder block, the final norm, the projector's soft tokens. Per stage, the largest
|mlxbun - mlx-vlm| of each patch (over the hidden features) on the patch grid: a port bug shows
where it starts and which patches it touches; 0 everywhere is bit-exact. Beside it: the image with
its patches, the soft tokens merged into the prompt's rows, and the attention maps of a block
(softmax(q k^T) recomputed in float32 for the picture; the forward runs the fused SDPA).
gemma4's vision tower: tower_bringup_gemma4; gemma3n's MobileNetV5 (over its feature maps):
tower_bringup_gemma3n; kimi_vl's MoonViT: tower_bringup_kimi; audio towers (gemma3n's, gemma4's):
over the audio frames, tower_bringup_audio. The result: tower_bringup_result.TowerBringup.
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.errors import UnsupportedModelError
from mlxbun.experiments.common import model_path
from mlxbun.experiments.tower_bringup_audio import audio_bringup
from mlxbun.experiments.tower_bringup_gemma3n import gemma3n_bringup
from mlxbun.experiments.tower_bringup_gemma4 import gemma4_bringup
from mlxbun.experiments.tower_bringup_kimi import kimi_bringup
from mlxbun.experiments.tower_bringup_result import MEDIA, TowerBringup, load_oracle, seen_image
from mlxbun.multimodal import (Gemma3nImageModel, Gemma4ImageModel, VisionLanguageModel, open_alm, open_vlm,
                                refuse_audio, refuse_images)
from mlxbun.names import NamingError
from mlxbun.towers.errors import NoTowerError
from mlxbun.towers.knobs import ProjectorKind, SpliceKind, VitLayout

__all__ = ["TowerBringup", "default_image", "oracle_stages", "patch_order", "pick_media", "tower_bringup"]


def default_image() -> str:
    """matplotlib's sample photograph (an installed file: no download)."""
    import matplotlib.cbook as cbook

    return str(cbook.get_sample_data("grace_hopper.jpg", asfileobj=False))


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
    # each frame (temporal patch) of each image / video attends within itself, as its tower's cu_seqlens
    cu = mx.pad(mx.cumsum(mx.array([int(g[1] * g[2]) for g in grid.tolist() for _ in range(int(g[0]))])
                          .astype(mx.int32)), (1, 0))
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


def pick_media(path, media: Optional[str] = None) -> str:
    """`media` checked ("image" | "audio"), or for None: "image" where the checkpoint holds a vision
    tower mlxbun builds, else "audio" where it holds an audio tower (NoTowerError naming both
    reasons where it holds neither)."""
    if media is not None:
        if media not in MEDIA:
            raise NamingError(f"media {media!r}: the bring-up feeds a tower {' or '.join(MEDIA)}")
        return media
    try:
        refuse_images(path)
        return "image"
    except NoTowerError as no_vision:
        try:
            refuse_audio(path)
        except NoTowerError as no_audio:
            raise NoTowerError(f"{path}: no tower to bring up ({no_vision}; {no_audio})") from None
        return "audio"


def tower_bringup(model="zoo:gemma3-vision", *, variant: str = "float32", media: Optional[str] = None,
                  image=None, audio=None, prompt: Optional[str] = None, attention_layer: Optional[int] = None,
                  results_path=None, record: bool = True, zoo_root=None) -> TowerBringup:
    """Hold `model`'s tower (a model name, `mlxbun.names`: the tower zoo's `zoo:gemma3-vision`,
    `zoo:gemma3n-audio`, `zoo:gemma4-towers`, `zoo:gemma3n-towers`, `zoo:kimi_vl-vision`, ..., a
    checkpoint directory; `variant` fills in a zoo name's weights) to mlx-vlm: its vision tower on
    `image` (default: matplotlib's sample photograph) or its audio tower on `audio` (a WAV file or
    samples; default: a drawn chirp), as `media` says (None: `pick_media`); `prompt` None: the
    media's placeholder, then a word."""
    from mlxbun.lab.recording import recording

    path = model_path(model, variant=variant, zoo_root=zoo_root)
    media = pick_media(path, media)
    image = default_image() if image is None and media == "image" else image
    if media == "audio":
        alm = open_alm(path)  # NoTowerError before mlx-vlm loads anything
        out = audio_bringup(alm, load_oracle(path), audio, prompt)
    else:
        vlm = open_vlm(path)
        out = _image_bringup(vlm)(vlm, load_oracle(path), image, prompt, attention_layer)
    given = image if media == "image" else audio
    params = {"model": str(model), "variant": variant, "media": media,
              media: None if given is None else str(given) if isinstance(given, (str, os.PathLike)) else "in memory"}
    with recording("tower_bringup", model=path, params=params, results_path=results_path, record=record) as run:
        if run is not None:
            out.run_id = run.run_id
            for s in out.stages:
                run.record("max_abs_diff", out.stage_max[s], unit="", stage=s)
            run.record("bit_exact", float(out.bit_exact), unit="bool")
            run.record("soft_tokens", float(out.prompt_ids.count(out.token_id)), unit="tokens")
    return out


# the ViT layouts `oracle_stages` stages with mlx-vlm's modules
STAGED_LAYOUTS = (VitLayout.SIGLIP, VitLayout.QWEN_VL, VitLayout.PIXTRAL)


def _image_bringup(vlm):
    """The bring-up that stages `vlm`'s vision tower: gemma4's, gemma3n's MobileNetV5, kimi_vl's
    MoonViT or a ViT of STAGED_LAYOUTS (the exact classes: a subclass's tower is another tower);
    UnsupportedModelError naming it where none does."""
    if type(vlm) is Gemma4ImageModel:
        return gemma4_bringup
    if type(vlm) is Gemma3nImageModel:
        return gemma3n_bringup
    if type(vlm) is VisionLanguageModel and vlm.vision.descriptor.vit.layout is VitLayout.MOONVIT:
        return kimi_bringup
    if type(vlm) is VisionLanguageModel and vlm.vision.descriptor.vit.layout in STAGED_LAYOUTS:
        return _vit_bringup
    what = (f"a {vlm.vision.descriptor.vit.layout.value} tower" if type(vlm) is VisionLanguageModel
            else f"{type(vlm).__name__}'s tower")
    raise UnsupportedModelError(f"{vlm.path}: the bring-up does not stage {what} (it stages "
                                "gemma4's, gemma3n's MobileNetV5, kimi_vl's MoonViT and the "
                                f"{', '.join(x.value for x in STAGED_LAYOUTS)} ViTs)")


def _vit_bringup(vlm: VisionLanguageModel, oracle, image, prompt: Optional[str] = None,
                 attention_layer: Optional[int] = None) -> TowerBringup:
    """Hold a ViT-shaped tower (towers/vit.py: SigLIP, Qwen-VL, Pixtral, LFM2-VL) to mlx-vlm's
    (`oracle`: its model and processor) on `image`; `prompt` None: the image alone, then "describe"."""
    from mlx_vlm.utils import prepare_inputs

    from mlxbun.towers.images import load_image

    model, processor = oracle
    v = vlm.vision
    pil = load_image(image)
    text = vlm.placeholders("describe" if prompt is None else prompt, 1)  # the image's placeholders written out
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
        resized = seen_image(view, spec)
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
    return TowerBringup(
        path=vlm.path, media="image", stages=stages, grids=grids,
        inputs_equal=bool(mx.array_equal(ours.pixel_values, ref["pixel_values"])),
        ids_equal=ours.ids.tolist() == ref["input_ids"][0].tolist(),
        embeddings_equal=bool(mx.array_equal(ours.embeddings, merged.inputs_embeds)),
        soft_tokens=np.array(features.astype(mx.float32)), prompt_ids=ours.ids.tolist(), token_id=v.image_token_id,
        image=resized, patch_size=v.tower.config.patch_size, attention=attn, attention_layer=layer, grid_shape=shape)

