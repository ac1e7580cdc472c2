"""What every tower bring-up (experiments/tower_bringup.py) gives back, whatever the tower: the
stages held to mlx-vlm with the largest |diff| of each patch (image towers: over the patch grid)
or frame (audio towers: over the frames), whether the processor's inputs, the spliced ids and
the merged rows equal mlx-vlm's, the soft tokens and where they enter the prompt; the input as
the tower sees it (the resized image, or the log-mel frames) and an image tower's attention maps.
Also what the bring-ups share: mlx-vlm's model for a checkpoint, the per-row diffs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.errors import MlxbunError

__all__ = ["MEDIA", "TowerBringup", "load_oracle", "row_diffs", "seen_image"]

MEDIA = ("image", "audio")  # the inputs a bring-up feeds a tower


@dataclass
class TowerBringup:
    """The bring-up of one tower on one image or one audio clip against mlx-vlm."""

    path: Path
    media: str  # "image" | "audio"
    stages: list[str]  # image: embeddings, layers.i, .., projector; audio: subsample, blocks, output, embedder
    # stage -> max |diff| per patch [rows, cols] (per soft token: projector), per cell of a feature map
    # [rows, cols] (MobileNetV5) / per frame [1, T]
    grids: dict[str, np.ndarray]
    stage_max: dict[str, float] = field(init=False)  # stage -> the largest of its grid (set from `grids`)
    inputs_equal: bool  # mlxbun's preprocessing (pixels; log-mel frames and mask) == mlx-vlm's processor
    ids_equal: bool  # the spliced prompt ids == mlx-vlm's
    embeddings_equal: bool  # the merged rows == mlx-vlm's get_input_embeddings
    soft_tokens: np.ndarray  # [T, D] the image's / clip's soft tokens (float32)
    prompt_ids: list[int]
    token_id: int  # the media token whose rows the soft tokens take
    # image towers
    image: Optional[np.ndarray] = None  # the resized image the tower sees [H, W, 3] uint8
    patch_size: int | tuple[int, int] = 0  # (MobileNetV5: the pixels a soft token pools, rows x columns)
    patch_numbers: Optional[np.ndarray] = None  # [rows, cols] each patch's index in the tokens (None: row-major)
    attention: Optional[np.ndarray] = None  # [heads, P, P] of block `attention_layer`
    attention_layer: Optional[int] = None
    grid_shape: tuple[int, int] = (0, 0)  # patches (rows, columns) of the image
    # audio towers
    mel: Optional[np.ndarray] = None  # [frames, mel bins] the clip's log-mel features
    mel_mask: Optional[np.ndarray] = None  # [frames] True where a frame holds audio
    cell: Optional[str] = None  # what a grid's cell is (None: "patch" for an image, "frame" for audio)
    run_id: Optional[str] = None
    notes: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.stage_max = {s: float(g.max()) for s, g in self.grids.items()}

    @property
    def bit_exact(self) -> bool:
        return (all(v == 0.0 for v in self.stage_max.values()) and self.inputs_equal and self.ids_equal
                and self.embeddings_equal)

    def _inputs(self) -> str:
        return "pixels" if self.media == "image" else "log-mel frames"

    def _cell(self) -> str:
        return self.cell or ("patch" if self.media == "image" else "frame")

    def verdict(self) -> str:
        if self.bit_exact:
            return (f"PASS: {len(self.stages)} stages bit-exact vs mlx-vlm, {self._inputs()}, ids and merged rows "
                    "equal")
        first = next((s for s in self.stages if self.stage_max[s] != 0.0), None)
        return (f"FAIL: first stage that differs: {first}; {self._inputs()} equal: {self.inputs_equal}, ids equal: "
                f"{self.ids_equal}, merged rows equal: {self.embeddings_equal}")

    def require_pass(self) -> None:
        if not self.bit_exact:
            raise MlxbunError(self.verdict())

    def table(self):
        import pandas as pd

        unit = {"patch": "patches"}.get(self._cell(), self._cell() + "s") + "_differing"
        return pd.DataFrame({"stage": self.stages, "max_abs_diff": [self.stage_max[s] for s in self.stages],
                             unit: [int((self.grids[s] > 0).sum()) for s in self.stages]})

    # the notebook's figures (mlxbun.lab.tower_plots), one per section, whatever the tower

    def input_figure(self):
        """The image with its patches, or the clip's log-mel frames."""
        from mlxbun.lab import tower_plots

        if self.media == "audio":
            return tower_plots.mel_plot(self.mel, self.mel_mask)
        return tower_plots.patch_grid_plot(self.image, self.patch_size, numbers=self.patch_numbers)

    def diff_figure(self):
        """Per-stage max |diff| over the patch grid (the feature maps), or over the frames."""
        from mlxbun.lab import tower_plots

        if self.media == "audio":
            return tower_plots.frame_diff_plot(self.grids)
        return tower_plots.stage_diff_grids(self.grids, f"max |mlxbun - mlx-vlm| per {self._cell()}, stage by stage")

    def soft_tokens_figure(self):
        from mlxbun.lab import tower_plots

        what = "image" if self.media == "image" else "clip"
        return tower_plots.soft_tokens_plot(self.soft_tokens, self.prompt_ids, self.token_id,
                                            title=f"the {what}'s soft tokens and where they enter the prompt")

    def attention_figure(self):
        """A block's attention maps (image towers; an audio tower's are not drawn: MlxbunError)."""
        from mlxbun.lab import tower_plots

        if self.attention is None:
            raise MlxbunError(f"no attention maps: this {self.media} tower's bring-up draws none")
        return tower_plots.attention_plot(self.attention, title=f"block {self.attention_layer}'s attention",
                                          shape=self.grid_shape)


def row_diffs(a: mx.array, b: mx.array) -> np.ndarray:
    """max |a - b| over the last axis (in float32), the leading axes kept."""
    return np.array(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max(axis=-1))


def seen_image(pixels: np.ndarray, spec, normalized: bool = True) -> np.ndarray:
    """The image as a tower sees it, [H, W, 3] uint8: the processor's pixels [H, W, 3]
    (`normalized`: by spec's image_mean / std) taken back to 0..255."""
    if normalized:
        pixels = pixels * np.array(spec.image_std) + np.array(spec.image_mean)
    return np.clip(pixels / spec.rescale_factor, 0, 255).round().astype(np.uint8)


def load_oracle(path: Path):
    """(mlx-vlm's model, processor) of the checkpoint; a gemma3n checkpoint that carries no vision
    tower (the zoo's gemma3n-audio) is built without one, as its audio path never calls it, and one
    whose config gives its own MobileNetV5 layout (the zoo's gemma3n-towers) under that layout."""
    from mlx_vlm.utils import load

    from mlxbun.weights import read_index
    from mlxbun.zoo.mobilenet import mobilenet_patch
    from mlxbun.zoo.towers import without_vision_tower

    config = json.loads((Path(path) / "config.json").read_text())
    model_type = config.get("model_type")
    bare = model_type == "gemma3n" and not any("vision_tower." in n for n in read_index(Path(path)).names())
    with without_vision_tower(model_type) if bare else mobilenet_patch(config):
        return load(str(path))
