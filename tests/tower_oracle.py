"""What the tower tests share: a checkpoint's mlxbun side and mlx-vlm's, loaded once, and the
Qwen-VL rows' text side with media (the merged rows, Qwen3-VL's deepstack rows, the mRoPE
positions and the prompt's logits) held bit-exact to mlx-vlm's own get_input_embeddings and
language model."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from mlxbun.experiments.tower_bringup import oracle_stages
from mlxbun.multimodal import open_vlm
from mlxbun.towers.knobs import VitLayout

__all__ = ["load_both", "qwen_text_side_equal", "qwen_tower_equal"]

_LOADED: dict = {}


def load_both(path: Path):
    """(mlxbun's VisionLanguageModel, mlx-vlm's model, processor), loaded once per checkpoint."""
    if path not in _LOADED:
        from mlx_vlm.utils import load

        model, processor = load(str(path))
        _LOADED[path] = (open_vlm(path), model, processor)
    return _LOADED[path]


def qwen_tower_equal(vlm, model, ours, pixel_values, grid, windows: bool) -> None:
    """A Qwen-VL tower block by block, then its merger, on the processor's `pixel_values` and
    `grid` (images' or a video's) against mlx-vlm's (a mismatch names its first stage)."""
    theirs = oracle_stages(model, VitLayout.QWEN_VL, pixel_values, grid, None, windows)
    mine = vlm.vision.blocks(ours.pixel_values, None, ours.grid)
    assert len(mine) == len(theirs) and mine[-1][0] == "projector"
    for (name, a), b in zip(mine, theirs):
        assert a.dtype == b.dtype and mx.array_equal(a, b), f"first mismatch at {name}"


def qwen_text_side_equal(vlm, model, ours, ref, pixel_values, deepstack: bool, **media) -> None:
    """mlxbun's prepared prompt `ours` against mlx-vlm's model on its processor's inputs `ref`
    (`pixel_values` and `media`: what get_input_embeddings takes, e.g. image_grid_thw= or
    pixel_values_videos= / video_grid_thw=): merged rows, deepstack rows (`deepstack`: the row
    has them), positions, the position delta and the prompt's logits, all bit-equal."""
    merged = model.get_input_embeddings(ref["input_ids"], pixel_values, mask=ref["attention_mask"], **media)
    assert mx.array_equal(ours.embeddings, merged.inputs_embeds)
    rows = getattr(merged, "deepstack_visual_embeds", None)
    assert len(ours.deepstack) == (0 if rows is None else len(rows)) == deepstack
    for a, b in zip(ours.deepstack, [] if rows is None else rows):
        assert mx.array_equal(a, b)
    assert mx.array_equal(ours.positions, merged.position_ids)
    assert ours.position_delta == int(merged.rope_deltas.item())
    extra = {k: getattr(merged, k, None) for k in ("visual_pos_masks", "deepstack_visual_embeds")}
    logits = model.language_model(ref["input_ids"], inputs_embeds=merged.inputs_embeds,
                                  position_ids=merged.position_ids, rope_deltas=merged.rope_deltas,
                                  **{k: v for k, v in extra.items() if v is not None}).logits
    assert mx.array_equal(vlm.logits(ours), logits)
