"""A checkpoint's vision side: its tower row, config numbers, tensors and image processor, built
into a `VisionStack` (tower + projector) whose tensors load by their checkpoint names. A
checkpoint without a tower mlxbun builds is refused by name (`NoTowerError`)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.errors import ConfigError, LoadError
from mlxbun.towers.errors import NoTowerError
from mlxbun.towers.images import ImageProcessorSpec, read_processor_spec
from mlxbun.towers.knobs import PatchEmbed, ProjectorKind, SpliceKind, TowerDescriptor, VisionKeys, VitAct, VitLayout
from mlxbun.towers.moonvit import MoonVit, moonvit_names
from mlxbun.towers.splice import image_sequence, tiles_sequence
from mlxbun.towers.projectors import make_projector
from mlxbun.towers.table import TOWERS, tower_for
from mlxbun.towers.vit import VitConfig, VitTower

__all__ = ["VisionStack", "has_tower", "open_vision"]

# mlx-vlm's ModelConfig defaults the merge reads where config.json has no such key
_MLX_VLM_TOP_DEFAULTS = {"hidden_size": 2048, "pad_token_id": 0, "image_token_index": 262144}


@dataclasses.dataclass
class VisionStack:
    """A checkpoint's tower and projector with the numbers the splice and merge need."""

    descriptor: TowerDescriptor
    tower: VitTower | MoonVit
    projector: nn.Module
    processor: ImageProcessorSpec
    tokens_per_image: int  # soft tokens per image (a fixed-size tower; 0: per image, from its grid)
    image_token_id: int
    boi_token_id: int | None
    eoi_token_id: int | None
    merge_hidden: int  # the wrapper's hidden_size the merge divides by (mlx-vlm's config)
    pad_token_id: int | None
    feature_layer: int = -1  # the stage the projector reads (vision_feature_layer: -1 the last)
    video_token_id: int | None = None  # the video token (a row that takes video: towers/video.py)

    @property
    def dynamic(self) -> bool:
        """Qwen2-VL's layout: patches [sum, C*T*P*P] with a grid per image."""
        return self.descriptor.vit.layout is VitLayout.QWEN_VL

    def image_texts(self, marks: dict, pixels) -> list[str]:
        """Each image's expansion in the prompt text (`pixels`: the processor's Pixels)."""
        d = self.descriptor
        if d.splice is SpliceKind.TILES:
            spec, f = self.processor, self.processor.merge_size
            tile_side = spec.tiling[0] // spec.patch_size
            per_tile = _unshuffled(tile_side, tile_side, f)
            return [tiles_sequence(marks, rows, cols, per_tile,
                                   _unshuffled(h // spec.patch_size, w // spec.patch_size, f), spec.tiling[6])
                    for rows, cols, (h, w) in pixels.layouts]
        grid = pixels.grid if pixels.grid is not None else [None] * len(pixels.values)
        return [image_sequence(d.splice, marks, r, c) for r, c in self.token_shapes(grid)]

    def soft_token_count(self, pixels) -> int:
        """Soft tokens the tower gives for `pixels` (all images)."""
        if self.descriptor.splice is SpliceKind.TILES:
            f = self.processor.merge_size
            return sum(_unshuffled(int(h), int(w), f) for h, w in np.asarray(pixels.grid).tolist())
        grid = pixels.grid if pixels.grid is not None else [None] * len(pixels.values)
        return sum(r * c for r, c in self.token_shapes(grid))

    def token_shapes(self, grid) -> list[tuple[int, int]]:
        """Each image's soft tokens as rows x columns (a fixed-size tower: one row of
        tokens_per_image; Qwen2-VL: its grid over the merge window; Pixtral: its size in patches;
        Kimi-VL: its (rows, columns) of patches over the merge window)."""
        layout = self.descriptor.vit.layout
        if layout is VitLayout.SIGLIP:
            return [(1, self.tokens_per_image)] * len(grid)
        if layout is VitLayout.MOONVIT:
            m = self.tower.config.spatial_merge_size
            return [(int(h) // m, int(w) // m) for h, w in np.asarray(grid).tolist()]
        if layout is VitLayout.PIXTRAL:  # the processor's patch: the tower's x the projector's merge
            p = self.processor.patch_size
            return [(int(h) // p, int(w) // p) for h, w in np.asarray(grid).tolist()]
        m = self.tower.config.spatial_merge_size
        return [(int(t) * int(h) // m, int(w) // m) for t, h, w in np.asarray(grid).tolist()]

    def soft_tokens(self, grid) -> list[int]:
        """Soft tokens per image."""
        return [r * c for r, c in self.token_shapes(grid)]

    def pixels(self, pixel_values, dtype: mx.Dtype) -> mx.array:
        """The processor's pixel values as the tower takes them."""
        return self._pixels(pixel_values, dtype)

    def _pixels(self, pixel_values, dtype: mx.Dtype) -> mx.array:
        pixels = mx.array(np.asarray(pixel_values)) if not isinstance(pixel_values, mx.array) else pixel_values
        layout = self.descriptor.vit.layout
        if layout is VitLayout.QWEN_VL:  # mlx-vlm casts to the patch embedding's dtype
            return pixels.astype(self.tower.patch_embed.proj.weight.dtype)
        if layout is VitLayout.MOONVIT:  # channels last, not cast: mlx-vlm hands the conv its float32 patches
            return pixels.transpose(0, 2, 3, 1)
        if layout is VitLayout.PIXTRAL:  # channels last, then the patch conv's dtype
            return pixels.transpose(0, 2, 3, 1).astype(self.tower.patch_conv.weight.dtype)
        if self.descriptor.vit.patch is PatchEmbed.LINEAR:  # packed patch rows, as the processor gives them
            return pixels
        return pixels.transpose(0, 2, 3, 1).astype(dtype)  # mlx-vlm casts to the text embeddings'

    def _project(self, x: mx.array, grid) -> mx.array:
        if getattr(self.projector, "takes_grid", False):
            return self.projector(x, grid)
        return self.tower.unwindow(self.projector(x), grid)

    def _selected(self, pixels: mx.array, grid) -> mx.array:
        if self.feature_layer == -1:
            return self.tower(pixels, grid)
        return self.tower.blocks_out(pixels, grid)[self.feature_layer][1]

    def features_and_deepstack(self, pixel_values, dtype: mx.Dtype, grid=None) -> tuple[mx.array, list]:
        """The soft tokens and (Qwen3-VL) the deepstack mergers' tokens, in one pass."""
        if not self.tower.config.deepstack_visual_indexes:
            return self.features(pixel_values, dtype, grid), []
        stages = self.tower.blocks_out(self._pixels(pixel_values, dtype), grid)
        return self._project(stages[-1][1], grid), self.tower.deepstack(stages)

    def features(self, pixel_values, dtype: mx.Dtype, grid=None) -> mx.array:
        """Soft tokens of `pixel_values` (the processor's): [N, T, text hidden] (a fixed-size tower,
        run in `dtype`, the text embeddings' dtype), [tokens, text hidden] (Qwen2-VL, `grid` its
        image_grid_thw) or [1, tokens, text hidden] (Pixtral, `grid` its image sizes)."""
        return self._project(self._selected(self._pixels(pixel_values, dtype), grid), grid)

    def blocks(self, pixel_values, dtype: mx.Dtype, grid=None) -> list[tuple[str, mx.array]]:
        """The tower's stages (tower.blocks_out) and the projector's output, named."""
        stages = self.tower.blocks_out(self._pixels(pixel_values, dtype), grid)
        selected = stages[-1][1] if self.feature_layer == -1 else stages[self.feature_layer][1]
        return stages + [("projector", self._project(selected, grid))]


def _unshuffled(rows: int, cols: int, factor: int) -> int:
    """Tokens of a rows x cols patch grid after a pixel unshuffle by `factor` (odd sides padded)."""
    return ((rows + (-rows % factor)) // factor) * ((cols + (-cols % factor)) // factor)


def _read_config(path: Path) -> dict:
    f = path / "config.json"
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{f}: missing") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{f}: unreadable ({e})") from None


def has_tower(path) -> bool:
    """Whether `path` declares a vision tower mlxbun builds and holds its tensors."""
    try:
        _check_tower(Path(path), _read_config(Path(path)))
    except NoTowerError:
        return False
    return True


def _check_tower(path: Path, config: Mapping) -> tuple[TowerDescriptor, Any]:
    """(row, weight index) of the checkpoint's vision tower, or NoTowerError saying why not."""
    from mlxbun.weights import read_index

    model_type = config.get("model_type")
    d = tower_for(model_type)
    vision = config.get("vision_config")
    if d is None:
        what = "a text model" if not vision else "a VLM whose tower mlxbun does not build"
        raise NoTowerError(f"{path}: {model_type} is {what}; images go to the towers of "
                           f"{', '.join(sorted(TOWERS))}")
    if not isinstance(vision, Mapping):
        raise NoTowerError(f"{path}: {model_type} checkpoint has no vision_config (no vision tower)")
    vt = vision.get("model_type", d.vision_types[0])
    if vt not in d.vision_types:
        raise NoTowerError(f"{path}: vision_config.model_type {vt!r}; the {model_type} tower is one of "
                           f"{', '.join(d.vision_types)}")
    index = read_index(path)
    if not any(n.startswith(d.tower_prefix + ".") for n in index.names()):
        raise NoTowerError(f"{path}: {model_type} checkpoint holds no {d.tower_prefix}.* tensors "
                           "(a text-only build of the VLM): it takes token ids only")
    return d, index


def _vit_config(d: TowerDescriptor, vision: Mapping) -> tuple[VitConfig, int | None]:
    """The tower's numbers and the projector's output width (None: the text model's)."""
    v = {**d.vision_defaults, **vision}
    try:
        if d.vision_keys is VisionKeys.SIGLIP:
            return VitConfig(**{f.name: v[f.name] for f in dataclasses.fields(VitConfig) if f.name in v or
                                f.default is dataclasses.MISSING}), None
        if d.vision_keys is VisionKeys.SIGLIP2:
            return VitConfig(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                             num_hidden_layers=v["num_hidden_layers"], num_attention_heads=v["num_attention_heads"],
                             patch_size=v["patch_size"], image_size=v["image_size"], num_channels=v["num_channels"],
                             layer_norm_eps=v["layer_norm_eps"], num_position_embeddings=v["num_patches"]), None
        if d.vision_keys is VisionKeys.PIXTRAL:
            return VitConfig(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                             num_hidden_layers=v["num_hidden_layers"], num_attention_heads=v["num_attention_heads"],
                             patch_size=v["patch_size"], image_size=v["image_size"], num_channels=v["num_channels"],
                             layer_norm_eps=v["rms_norm_eps"], rope_theta=v["rope_theta"], head_dim=v["head_dim"]), None
        if d.vision_keys is VisionKeys.MOONVIT:
            return _moonvit_config(v), None
        if d.vision_keys is VisionKeys.QWEN3_VL:  # LayerNorm eps 1e-6 in its blocks
            return VitConfig(hidden_size=v["hidden_size"], intermediate_size=v["intermediate_size"],
                             num_hidden_layers=v["depth"], num_attention_heads=v["num_heads"],
                             patch_size=v["patch_size"], image_size=v["image_size"], num_channels=v["in_channels"],
                             layer_norm_eps=1e-6, temporal_patch_size=v["temporal_patch_size"],
                             spatial_merge_size=v["spatial_merge_size"],
                             num_position_embeddings=v["num_position_embeddings"],
                             deepstack_visual_indexes=tuple(v.get("deepstack_visual_indexes") or ()),
                             out_hidden_size=v["out_hidden_size"]), int(v["out_hidden_size"])
        qwen2 = d.vision_keys is VisionKeys.QWEN2_VL  # LayerNorm / RMSNorm eps 1e-6 in their blocks
        width = v["embed_dim"] if qwen2 else v["hidden_size"]
        c = VitConfig(hidden_size=width,
                      intermediate_size=int(width * v["mlp_ratio"]) if qwen2 else v["intermediate_size"],
                      num_hidden_layers=v["depth"], num_attention_heads=v["num_heads"],
                      patch_size=v["patch_size"], image_size=v["image_size"], num_channels=v["in_channels"],
                      layer_norm_eps=1e-6, temporal_patch_size=v["temporal_patch_size"],
                      spatial_merge_size=v["spatial_merge_size"],
                      window_size=0 if qwen2 else v["window_size"],
                      fullatt_block_indexes=() if qwen2 else tuple(v["fullatt_block_indexes"]))
        return c, int(v["hidden_size"] if qwen2 else v["out_hidden_size"])
    except KeyError as e:
        raise ConfigError(f"vision_config lacks {e.args[0]!r}") from None


def _moonvit_config(v: Mapping) -> VitConfig:
    """MoonViT's numbers under mlx-vlm's VisionConfig keys; HF's num_hidden_layers /
    num_attention_heads (which mlx-vlm does not read) must agree with them."""
    for hf, key in (("num_hidden_layers", "depth"), ("num_attention_heads", "num_heads")):
        if hf in v and v[hf] != v[key]:
            raise ConfigError(f"vision_config {hf} {v[hf]} but {key} {v[key]}: mlx-vlm's MoonViT reads {key}")
    kernel = list(v.get("merge_kernel_size") or [v["spatial_merge_size"]] * 2)
    if len(kernel) != 2 or kernel[0] != kernel[1] or v["embed_dim"] != v["hidden_size"]:
        raise ConfigError(f"vision_config merge_kernel_size {kernel}, embed_dim {v['embed_dim']}, hidden_size "
                          f"{v['hidden_size']}: mlxbun builds MoonViT with square merge windows and one width")
    return VitConfig(hidden_size=v["embed_dim"], intermediate_size=v["intermediate_size"], num_hidden_layers=v["depth"],
                     num_attention_heads=v["num_heads"], patch_size=v["patch_size"], image_size=v["image_size"],
                     num_channels=v["num_channels"], layer_norm_eps=1e-6, spatial_merge_size=int(kernel[0]),
                     num_position_embeddings=int(v["init_pos_emb_height"]))


def _load(module: nn.Module, prefix: str, tensors: dict[str, mx.array], quantization, where: Path,
          exclude: str | None = None) -> None:
    from mlxbun.quant import quantize_model

    own = {k[len(prefix) + 1:]: v for k, v in tensors.items()
           if k.startswith(prefix + ".") and not (exclude and k.startswith(exclude + "."))}
    if quantization:
        q = {k: v for k, v in quantization.items() if k in ("group_size", "bits", "mode")}
        q.update({k[len(prefix) + 1:]: v for k, v in quantization.items() if k.startswith(prefix + ".")})
        quantize_model(module, q, own)
    expected = {k for k, _ in _flat(module)}
    missing, extra = sorted(expected - set(own)), sorted(set(own) - expected)
    if missing or extra:
        raise LoadError(f"{where}: {prefix}: " + "; ".join(
            s for s in (f"missing {', '.join(missing[:8])}" if missing else "",
                        f"unconsumed {', '.join(extra[:8])}" if extra else "") if s))
    try:
        module.load_weights(list(own.items()), strict=True)
    except ValueError as e:
        raise LoadError(f"{where}: {prefix}: {e}") from None


def _flat(module: nn.Module):
    from mlx.utils import tree_flatten

    return tree_flatten(module.parameters())


def _conv_to_mlx(w: mx.array) -> mx.array:
    """mlx-vlm's check_array_shape: an mlx-layout conv weight ([out, kH, kW, in]; Conv3d:
    [out, kT, kH, kW, in], its last axis 3) stays, else it is PyTorch's and is transposed."""
    if w.ndim == 2:  # a linear patch embedding (Siglip2): nothing to move
        return w
    if w.ndim == 5:
        return w if w.shape[-1] == 3 else w.transpose(0, 2, 3, 4, 1)
    out, kh, kw, _ = w.shape
    return w if (out >= kh and out >= kw and kh == kw) else w.transpose(0, 2, 3, 1)


def open_vision(path, config: Mapping | None = None) -> VisionStack:
    """The checkpoint's tower and projector, loaded; NoTowerError where it has none mlxbun builds."""
    from mlxbun.quant import resolve_quantization

    path = Path(path)
    config = _read_config(path) if config is None else config
    d, index = _check_tower(path, config)
    vision = config["vision_config"]
    text = config.get("text_config") or config  # qwen2_vl's hub configs: the text keys at the top
    vc, out_width = _vit_config(d, vision)
    moonvit = d.vit.layout is VitLayout.MOONVIT
    tower = MoonVit(vc) if moonvit else VitTower(vc, d.vit)
    top = {**_MLX_VLM_TOP_DEFAULTS, **d.top_defaults, **config}
    tokens = 0 if d.vit.layout in (VitLayout.QWEN_VL, VitLayout.MOONVIT) else int(text.get("mm_tokens_per_image", 256))
    mistral3 = d.projector is ProjectorKind.MISTRAL3  # its own eps (text's), merge and bias
    if d.projector is ProjectorKind.LFM2:
        if not top.get("projector_use_layernorm", True) or top.get("vision_feature_layer", -1) != -1:
            raise ConfigError(f"{path}: projector_use_layernorm false or a vision_feature_layer other than -1: "
                              "mlxbun builds lfm2-vl's tower with its last layer and the projector's LayerNorm")
        mistral3 = False
    projector = make_projector(d.projector, vision_hidden=vc.hidden_size,
                               text_hidden=out_width or int(text["hidden_size"]),
                               grid=vc.grid, tokens_per_image=tokens,
                               eps=float(text.get("rms_norm_eps", 1e-6)) if mistral3 else vc.layer_norm_eps,
                               merge=(int(top.get("spatial_merge_size", 2)) if mistral3 else
                                      int(top.get("downsample_factor", 2)) if d.projector is ProjectorKind.LFM2
                                      else vc.spatial_merge_size),
                               patch=vc.patch_size,
                               bias=bool(top.get("projector_bias", True)) if d.projector is ProjectorKind.LFM2
                               else bool(top.get("multimodal_projector_bias", False)),
                               tanh=d.vit.merger_act is VitAct.GELU_TANH,
                               hidden=int(top.get("projector_hidden_size", 2560)))
    names = [n for n in index.names() if n.startswith((d.tower_prefix + ".", d.projector_prefix + "."))]
    tensors = index.load(names)
    if moonvit:  # HF's vision_tower.encoder.* and bare wqkv / wo, as mlx-vlm's sanitize moves them
        tensors = {moonvit_names(k): w for k, w in tensors.items()}
    for conv in (f"{d.tower_prefix}.embeddings.patch_embedding.weight", f"{d.tower_prefix}.patch_embed.proj.weight",
                 f"{d.tower_prefix}.patch_conv.weight"):
        if conv in tensors:
            tensors[conv] = _conv_to_mlx(tensors[conv])
    quantization = resolve_quantization(config)
    nested = d.projector_prefix.startswith(d.tower_prefix + ".")
    _load(tower, d.tower_prefix, tensors, quantization, path, exclude=d.projector_prefix if nested else None)
    _load(projector, d.projector_prefix, tensors, quantization, path)
    mx.eval(tower.parameters(), projector.parameters())

    def token(key):
        return None if key is None or top.get(key) is None else int(top[key])

    return VisionStack(d, tower, projector, read_processor_spec(path), tokens, int(top[d.image_token_key]),
                       token(d.boi_key), token(d.eoi_key), int(top["hidden_size"]), top.get("pad_token_id"),
                       int(top.get("vision_feature_layer", -1)) if d.vit.layout is VitLayout.PIXTRAL else -1,
                       token(d.video_token_key))

