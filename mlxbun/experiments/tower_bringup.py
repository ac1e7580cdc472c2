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

__all__ = ["TowerBringup", "default_image", "tower_bringup"]


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


def _grid(diff: mx.array) -> np.ndarray:
    """[1, P, D] |diff| -> [side, side] max over the features."""
    per = np.array(diff.astype(mx.float32).max(axis=-1))[0]
    side = int(round(per.size ** 0.5))
    return per.reshape(side, side)


def tower_bringup(checkpoint=None, *, tower_arch: str = "gemma3-vision", variant: str = "float32",
                  image=None, prompt: str = "<start_of_image> describe", attention_layer: Optional[int] = None,
                  results_path=None, record: bool = True, zoo_root=None) -> TowerBringup:
    """Hold `checkpoint`'s tower (default: the zoo's `tower_arch` in `variant`, a dtype name or
    dtype-q4 / q8 / mixed) to mlx-vlm on `image` (default: matplotlib's sample photograph)."""
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
    pil = load_image(image)
    model, processor = load(str(path))
    ref = prepare_inputs(processor, images=[pil], prompts=[prompt], add_special_tokens=True)
    ours = vlm.prepare(prompt, [pil])
    dtype = vlm.text_model.embed_tokens(ours.ids[:1][None]).dtype
    mine = vlm.vision.blocks(ours.pixel_values, dtype)
    x = ref["pixel_values"].transpose(0, 2, 3, 1).astype(dtype)
    sv = model.vision_tower.vision_model
    h = sv.embeddings(x)
    theirs = [h]
    for layer in sv.encoder.layers:
        h = layer(h)
        theirs.append(h)
    theirs.append(sv.post_layernorm(h))
    theirs.append(model.multi_modal_projector(theirs[-1]))
    stages = [name for name, _ in mine]
    grids = {name: _grid(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))) for (name, a), b in zip(mine, theirs)}
    merged = model.get_input_embeddings(ref["input_ids"], ref["pixel_values"], mask=ref["attention_mask"])
    spec = vlm.vision.processor
    resized = np.array(pil.resize((spec.width, spec.height), resample=spec.resample, reducing_gap=None))
    n_layers = len(vlm.vision.tower.encoder.layers)
    layer = n_layers - 1 if attention_layer is None else attention_layer
    attn = vlm.vision.tower.attention_maps(ours.pixel_values.transpose(0, 2, 3, 1).astype(dtype), layer)
    out = TowerBringup(
        path=path, stages=stages, grids=grids, stage_max={s: float(g.max()) for s, g in grids.items()},
        pixels_equal=bool(mx.array_equal(ours.pixel_values, ref["pixel_values"])),
        ids_equal=ours.ids.tolist() == ref["input_ids"][0].tolist(),
        embeddings_equal=bool(mx.array_equal(ours.embeddings, merged.inputs_embeds)),
        image=resized, patch_size=vlm.vision.tower.config.patch_size,
        soft_tokens=np.array(ours.features[0].astype(mx.float32)), prompt_ids=ours.ids.tolist(),
        image_token_id=vlm.vision.image_token_id, attention=np.array(attn[0]), attention_layer=layer)
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

