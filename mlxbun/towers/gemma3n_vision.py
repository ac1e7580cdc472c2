"""Gemma3n's vision side, as mlx-vlm 0.7.10 runs it: the image processor (transformers' SigLIP,
which mlx-vlm's Gemma3nProcessor loads use_fast=False: a fixed-size PIL resize, rescale, the
normalization the file asks for), the MobileNetV5 tower (towers/mobilenet5), get_image_features
(the MSFA's map read into vision_soft_tokens_per_image rows of hidden_size, times
sqrt(hidden_size)), embed_vision (usm.MultimodalEmbedder, the class embed_audio is) and the
merge (usm.hard_rows: the ids' unscaled rows, both media vocabularies' hard tokens; then the
images' soft tokens over the image tokens and the clips' over the audio tokens). The prompt's
image token becomes "\\n\\n" <start_of_image> + the image token x soft tokens + <end_of_image> "\\n\\n"
(the processor's full_image_sequence).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlxbun.errors import ConfigError, UnsupportedModelError
from mlxbun.towers.audio import load_modules, read_json
from mlxbun.towers.errors import AudioCountError, ImageCountError, NoTowerError
from mlxbun.towers.images import ImageProcessorSpec, fixed_size_spec, preprocess, read_preprocessor_config
from mlxbun.towers.mobilenet5 import FULL_LAYOUT, MobileNetLayout, MobileNetV5
from mlxbun.towers.usm import MultimodalEmbedder, embedders, hard_rows, scatter_soft

__all__ = ["ARCHITECTURE", "Gemma3nVision", "check_vision_tower", "open_gemma3n_vision", "read_image_spec",
           "read_layout"]

# the timm architecture mlx-vlm's VisionTower builds (whatever vision_config.architecture says)
ARCHITECTURE = "mobilenetv5_300m_enc"
# the image processors mlx-vlm's Gemma3nProcessor takes (use_fast=False: the PIL path for each)
_SIGLIP = ("SiglipImageProcessor", "SiglipImageProcessorFast", "SiglipImageProcessorPil")
_VISION_TYPES = ("gemma3n_vision", "gemma3", "gemma3_vision")  # mlx-vlm's VisionModel accepts these


@dataclasses.dataclass
class Gemma3nVision:
    """A gemma3n checkpoint's vision tower, its media embedders and the numbers the processor,
    splice and merge read."""

    tower: MobileNetV5
    embed_vision: MultimodalEmbedder
    embed_audio: MultimodalEmbedder
    spec: ImageProcessorSpec
    tokens_per_image: int  # vision_soft_tokens_per_image = the processor's image_seq_length
    hidden: int  # vision_config.hidden_size: the MSFA's width
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    # every text call with media runs mlx-vlm 0.7.10's gemma3n composition (usm.AudioStack.hidden_kw)
    hidden_kw: dict = dataclasses.field(default_factory=lambda: {"shared_offset_after": True})

    def image_text(self, boi: str, image: str, eoi: str) -> str:
        """The processor's expansion of one image placeholder (full_image_sequence)."""
        return f"\n\n{boi}{image * self.tokens_per_image}{eoi}\n\n"

    def preprocess(self, images: Sequence) -> np.ndarray:
        """pixel_values [N, 3, H, W] float32 of RGB PIL images."""
        return preprocess(images, self.spec)

    def image_rows(self, msfa: mx.array) -> mx.array:
        """get_image_features up to its embed_vision: the MSFA's map [images, W', H', hidden] read
        into [images, tokens_per_image, hidden] (column by column), times sqrt(hidden)."""
        out = msfa.transpose(0, 3, 1, 2)
        out = out.reshape(out.shape[0], self.hidden, self.tokens_per_image).transpose(0, 2, 1)
        return out * self.hidden**0.5

    def soft_tokens(self, pixels: mx.array, taps: Optional[list] = None) -> mx.array:
        """[images, tokens_per_image, text hidden]: mlx-vlm's get_image_features (the processor's
        pixels as they come, in float32)."""
        return self.embed_vision.soft(self.image_rows(self.tower(pixels, taps)))

    def merge(self, embed_tokens, ids: mx.array, images: Optional[mx.array],
              audio: Optional[tuple[int, mx.array]] = None) -> mx.array:
        """mlx-vlm's get_input_embeddings over ids [1, L]: the images' soft tokens (`images`) over the
        image tokens, `audio` (the audio token id, the clips' soft tokens) over the audio tokens."""
        embeds = hard_rows(embed_tokens, ids, self.embed_vision, self.embed_audio)
        if images is not None:
            embeds = scatter_soft(embeds, ids, self.image_token_id, images, ImageCountError, "image", "images")
        if audio is not None:
            embeds = scatter_soft(embeds, ids, audio[0], audio[1], AudioCountError, "audio", "clips")
        return embeds


def read_layout(vision: Mapping[str, Any]) -> MobileNetLayout:
    """The tower's layout: vision_config's mobilenet_layout (the zoo's tiny checkpoints), else
    mlx-vlm's hard-coded one for the architecture it builds."""
    if "mobilenet_layout" in vision:
        return MobileNetLayout.from_config(vision["mobilenet_layout"])
    arch = vision.get("architecture", ARCHITECTURE)
    if arch != ARCHITECTURE:
        raise UnsupportedModelError(f"vision_config.architecture {arch!r}: mlx-vlm (and mlxbun) build "
                                    f"{ARCHITECTURE}'s layout only")
    return FULL_LAYOUT


def read_image_spec(path: Path) -> ImageProcessorSpec:
    """mlx-vlm's Gemma3nProcessor.from_pretrained's image processor: preprocessor_config.json's
    SigLIP settings, processor_config.json's image_processor size over them."""
    f, cfg = read_preprocessor_config(path)
    kind = cfg.get("image_processor_type", "")
    if kind not in _SIGLIP:
        raise ConfigError(f"{f}: image_processor_type {kind!r}; gemma3n's processor is one of {', '.join(_SIGLIP)}")
    size = (read_json(path / "processor_config.json", missing_ok=True).get("image_processor") or {}).get("size") \
        or cfg.get("size") or {"height": 224, "width": 224}
    if "height" not in size or "width" not in size:
        raise ConfigError(f"{f}: size must give height and width, got {size!r}")
    # SiglipImageProcessorPil's defaults where the file is silent (bicubic, 224 x 224, mean / std 0.5)
    return fixed_size_spec("SiglipImageProcessor", cfg, size, resample=3)


def check_vision_tower(path: Path, config: Mapping) -> tuple[str, Any]:
    """(the tensors' root, "" or "model.", weight index) of a gemma3n checkpoint's vision tower, or
    NoTowerError saying why it has none."""
    from mlxbun.weights import read_index

    vision = config.get("vision_config")
    if not isinstance(vision, Mapping) or vision.get("model_type", _VISION_TYPES[0]) not in _VISION_TYPES:
        raise NoTowerError(f"{path}: gemma3n checkpoint has no gemma3n_vision vision_config")
    index = read_index(path)
    names = index.names()
    root = next((r for r in ("model.", "") if any(n.startswith(r + "vision_tower.timm_model.") for n in names)), None)
    if root is None:
        raise NoTowerError(f"{path}: gemma3n checkpoint holds no vision_tower.* tensors (a text-only build): "
                           "it takes token ids only")
    return root, index


def _vision_sanitize(tensors: dict) -> dict:
    """mlx-vlm's VisionModel.sanitize: every 4-D conv / projection weight moved from PyTorch's layout
    to mlx's, unless the first block's conv_exp is already mlx's (its in channels past its height)."""
    key = next((n for n in tensors if n.endswith("vision_tower.timm_model.blocks.0.0.conv_exp.weight")), None)
    if key is None:
        raise ConfigError("gemma3n vision tower: no blocks.0.0.conv_exp weight (mlx-vlm reads the layout from it: "
                          "the first block must be an EdgeResidual)")
    _, h, _, c = tensors[key].shape
    if c > h:
        return tensors
    return {k: v.transpose(0, 2, 3, 1) if v.ndim == 4 and (("conv" in k and "weight" in k) or "proj.weight" in k)
            else v for k, v in tensors.items()}


def open_gemma3n_vision(path: Path, config: Mapping) -> Gemma3nVision:
    """A gemma3n checkpoint's vision side, loaded (NoTowerError where it holds no vision tower);
    every number the processor, tower and merge must agree on checked first (ConfigError)."""
    root, index = check_vision_tower(path, config)
    vision = config["vision_config"]
    layout = read_layout(vision)
    hidden = int(vision.get("hidden_size", 2048))
    tokens = int(config.get("vision_soft_tokens_per_image", 256))
    seq = int(read_json(path / "processor_config.json", missing_ok=True).get("image_seq_length", 256))
    if layout.msfa_out != hidden:
        raise ConfigError(f"{path}: the tower's MSFA gives {layout.msfa_out} channels; vision_config.hidden_size "
                          f"is {hidden}")
    if not layout.tokens == tokens == seq:
        raise ConfigError(f"{path}: the tower pools to {layout.tokens} tokens, vision_soft_tokens_per_image is "
                          f"{tokens} and the processor's image_seq_length {seq}: mlx-vlm's merge needs them equal")
    spec = read_image_spec(path)
    layout.check_image(spec.height, spec.width)
    tower = MobileNetV5(layout)
    embed_vision, embed_audio = embedders(config)
    load_modules(path, config, index, {root + "vision_tower.timm_model": tower, root + "embed_vision": embed_vision,
                                       root + "embed_audio": embed_audio}, prepare=_vision_sanitize)
    return Gemma3nVision(tower, embed_vision, embed_audio, spec, tokens, hidden,
                         int(config.get("image_token_id", 262145)), int(config.get("boi_token_id", 255999)),
                         int(config.get("eoi_token_id", 262144)))
