"""Images in: reading a file (each failure a named error, before any work) and the processor's
preprocessing, equal to what mlx-vlm's processor hands its model (transformers' PIL-backend
image processor: RGB, PIL resize, rescale in float64 then float32, normalize in float32,
channels first)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from mlxbun.towers.errors import ImageTruncated, ImageUnreadable

__all__ = ["ImageProcessorSpec", "Pixels", "fixed_size_spec", "load_image", "preprocess", "preprocess_any",
           "preprocess_kimi", "preprocess_lfm2", "preprocess_pixtral", "preprocess_qwen", "qwen_normalized",
           "qwen_patches", "read_preprocessor_config", "read_processor_spec", "smart_resize"]

ImageSource = Union[str, Path, "PIL.Image.Image"]  # noqa: F821

# the image processors whose preprocessing `preprocess` reproduces: fixed-size (transformers' PIL
# backend, as mlx-vlm's gemma3 processor loads it) and Qwen2-VL's dynamic resolution (mlx-vlm's own
# numpy port, Qwen3VLImageProcessor, which its qwen2_vl processor uses whatever the file says)
_PROCESSOR_TYPES = ("Gemma3ImageProcessor", "Gemma3ImageProcessorPil", "SiglipImageProcessor")
QWEN_TYPES = ("Qwen2VLImageProcessor", "Qwen2VLImageProcessorFast", "Qwen2VLImageProcessorPil")
PIXTRAL_TYPES = ("PixtralImageProcessor", "PixtralImageProcessorFast")
LFM2_TYPES = ("Lfm2VlImageProcessor", "Lfm2VlImageProcessorFast", "Siglip2ImageProcessor",
              "Siglip2ImageProcessorFast")
KIMI_TYPES = ("KimiVLImageProcessor",)
# OpenAI CLIP's mean and deviation (the Pixtral and Kimi-VL processors' defaults)
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# mlx-vlm applies the official LFM2-VL tiling whatever the checkpoint's files say
_LFM2_SPLITTING = {"do_image_splitting": True, "min_tiles": 2, "max_tiles": 10, "use_thumbnail": True}


@dataclass(frozen=True)
class ImageProcessorSpec:
    """A checkpoint's preprocessor_config.json, as the image processor reads it."""

    processor_type: str
    height: int
    width: int
    resample: int  # PIL's resampling filter id (2: bilinear, 3: bicubic)
    rescale_factor: float
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_convert_rgb: bool = True
    # Qwen2-VL's dynamic resolution (kind "qwen_vl"): smart_resize to multiples of patch * merge
    kind: str = "fixed"
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 14 * 14 * 4 * 1280
    # LFM2-VL (kind "lfm2"): smart resize to min..max image tokens, tiling past the tolerance
    tiling: tuple = ()  # (tile_size, min_image_tokens, max_image_tokens, max_pixels_tolerance, min_tiles,
    #                      max_tiles, use_thumbnail, do_image_splitting)
    max_num_patches: int = 0
    in_token_limit: int = 0  # Kimi-VL (kind "kimi_vl"): patches past which an image is scaled down


@dataclass(frozen=True)
class Pixels:
    """The processor's output: pixel values and what the tower, splice and merge need with them."""

    values: np.ndarray
    grid: np.ndarray | None = None  # Qwen2-VL: image_grid_thw; Pixtral: image sizes; LFM2-VL: each view's patch grid
    mask: np.ndarray | None = None  # LFM2-VL: each view's real patches (pixel_attention_mask)
    layouts: tuple = ()  # LFM2-VL: per image (tile rows, tile columns, (resized height, width))


def read_preprocessor_config(path) -> tuple[Path, dict]:
    """(the file, its settings) of the checkpoint's preprocessor_config.json; ConfigError naming it
    where it is missing or unreadable."""
    from mlxbun.errors import ConfigError

    f = Path(path) / "preprocessor_config.json"
    try:
        return f, json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{f}: missing (the image processor's settings)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{f}: unreadable ({e})") from None


def read_processor_spec(path: Path) -> ImageProcessorSpec:
    """The checkpoint's image preprocessing; ImageUnreadable-free: a missing or unsupported
    processor is a ConfigError naming the file."""
    from mlxbun.errors import ConfigError

    f, cfg = read_preprocessor_config(path)
    kind = cfg.get("image_processor_type", "")
    if kind in QWEN_TYPES:
        return _qwen_spec(path, cfg)
    if kind in PIXTRAL_TYPES:
        return _pixtral_spec(path, cfg)
    if kind in LFM2_TYPES:
        return _lfm2_spec(path)
    if kind in KIMI_TYPES:
        return _kimi_spec(path)
    if kind not in _PROCESSOR_TYPES:
        raise ConfigError(f"{f}: image_processor_type {kind!r}; mlxbun reproduces "
                          f"{', '.join(_PROCESSOR_TYPES + QWEN_TYPES)}")
    if cfg.get("do_pan_and_scan"):
        raise ConfigError(f"{f}: do_pan_and_scan is on; mlxbun does not reproduce pan-and-scan crops")
    size = cfg.get("size") or {}
    if "height" not in size or "width" not in size:
        raise ConfigError(f"{f}: size must give height and width, got {size!r}")
    return fixed_size_spec(kind, cfg, size, resample=2)


def fixed_size_spec(kind: str, cfg: dict, size: dict, resample: int) -> ImageProcessorSpec:
    """A fixed-size processor's settings: preprocessor_config.json's `cfg` over its defaults (the
    `resample` filter, 1/255, mean and std 0.5, every flag on), at `size` (height and width)."""

    def flag(key):
        v = cfg.get(key)
        return True if v is None else bool(v)

    return ImageProcessorSpec(kind, int(size["height"]), int(size["width"]), int(cfg.get("resample", resample)),
                              float(cfg.get("rescale_factor", 1 / 255)),
                              tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))),
                              tuple(cfg.get("image_std", (0.5, 0.5, 0.5))),
                              flag("do_resize"), flag("do_rescale"), flag("do_normalize"), flag("do_convert_rgb"))


def _qwen_spec(path: Path, raw: dict) -> ImageProcessorSpec:
    """mlx-vlm's _qwen_vl_image_kwargs (patch 14 by default for qwen2_vl): preprocessor_config.json
    with processor_config.json's image_processor over it."""
    proc = Path(path) / "processor_config.json"
    if proc.is_file():
        raw = {**raw, **(json.loads(proc.read_text(encoding="utf-8")).get("image_processor") or {})}
    size = raw.get("size") or {}
    min_px = raw.get("min_pixels", size.get("shortest_edge", 56 * 56))
    max_px = raw.get("max_pixels", size.get("longest_edge", 14 * 14 * 4 * 1280))
    return ImageProcessorSpec(
        raw.get("image_processor_type", ""), 0, 0, 3, float(raw.get("rescale_factor", 1 / 255.0)),
        tuple(raw.get("image_mean") or (0.5, 0.5, 0.5)), tuple(raw.get("image_std") or (0.5, 0.5, 0.5)),
        True, bool(raw.get("do_rescale", True)), bool(raw.get("do_normalize", True)),
        bool(raw.get("do_convert_rgb", True)), kind="qwen_vl", patch_size=int(raw.get("patch_size", 14)),
        temporal_patch_size=int(raw.get("temporal_patch_size", 2)), merge_size=int(raw.get("merge_size", 2)),
        min_pixels=int(min_px), max_pixels=int(max_px))


def _pixtral_spec(path: Path, raw: dict) -> ImageProcessorSpec:
    """mlx-vlm's PixtralImageProcessor.from_pretrained: processor_config.json's image_processor,
    else preprocessor_config.json; the patch the processor resizes to is patch x spatial merge."""
    from mlxbun.errors import ConfigError

    proc_file = Path(path) / "processor_config.json"
    proc = json.loads(proc_file.read_text(encoding="utf-8")) if proc_file.is_file() else {}
    cfg = dict(proc.get("image_processor") or raw)
    for key in ("size", "patch_size"):
        if key not in cfg and key in proc:
            cfg[key] = proc[key]
    size = cfg.get("size") or {"longest_edge": 1024}
    edge = size.get("longest_edge") if isinstance(size, dict) else size
    if edge is None:
        if not (isinstance(size, dict) and "height" in size and "width" in size):
            raise ConfigError(f"{path}: the Pixtral processor's size {size!r} names no longest_edge")
        height, width = int(size["height"]), int(size["width"])
    else:
        height = width = int(edge)
    patch = cfg.get("patch_size") or {"height": 16, "width": 16}
    patch = int(patch["height"]) if isinstance(patch, dict) else int(patch)
    patch = int(proc.get("patch_size", patch))
    merge = int(proc.get("spatial_merge_size", 1))
    model_file = Path(path) / "config.json"  # mistral3's processor: the model config's numbers first
    if model_file.is_file():
        model_cfg = json.loads(model_file.read_text(encoding="utf-8"))
        patch = int((model_cfg.get("vision_config") or {}).get("patch_size", patch))
        merge = int(model_cfg.get("spatial_merge_size", merge))
    return ImageProcessorSpec(
        cfg.get("image_processor_type", "PixtralImageProcessor"), height, width, int(cfg.get("resample", 3)),
        float(cfg.get("rescale_factor", 1 / 255)),
        tuple(cfg.get("image_mean") or _CLIP_MEAN), tuple(cfg.get("image_std") or _CLIP_STD),
        bool(cfg.get("do_resize", True)), bool(cfg.get("do_rescale", True)), bool(cfg.get("do_normalize", True)),
        bool(cfg.get("do_convert_rgb", True)), kind="pixtral", patch_size=patch * merge, merge_size=merge)


def _pixtral_size(height: int, width: int, spec: ImageProcessorSpec) -> tuple[int, int]:
    """Pixtral's get_resize_output_image_size: shrunk into the size, then up to whole patches."""
    ratio = max(height / spec.height, width / spec.width)
    if ratio > 1:
        height, width = int(math.floor(height / ratio)), int(math.floor(width / ratio))
    p = spec.patch_size
    return ((height - 1) // p + 1) * p, ((width - 1) // p + 1) * p


def preprocess_pixtral(images: Sequence, spec: ImageProcessorSpec) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [N, 3, H, W] float32, zero-padded to the largest, image_sizes [N, 2]) as
    mlx-vlm's PixtralImageProcessor."""
    from PIL import Image

    arrays, sizes = [], []
    for image in images:
        pil = image.convert("RGB")
        size = (pil.height, pil.width)
        if spec.do_resize:
            size = _pixtral_size(pil.height, pil.width, spec)
            pil = pil.resize((size[1], size[0]), resample=Image.Resampling(spec.resample))
        x = np.array(pil).astype(np.float32)
        if spec.do_rescale:
            x *= spec.rescale_factor
        if spec.do_normalize:
            x = (x - np.array(spec.image_mean, dtype=np.float32)) / np.array(spec.image_std, dtype=np.float32)
        arrays.append(x.transpose(2, 0, 1))
        sizes.append(size)
    h, w = max(a.shape[1] for a in arrays), max(a.shape[2] for a in arrays)
    padded = [np.pad(a, ((0, 0), (0, h - a.shape[1]), (0, w - a.shape[2]))) for a in arrays]
    return np.stack(padded).astype(np.float32), np.array(sizes, dtype=np.int64)


def _lfm2_spec(path: Path) -> ImageProcessorSpec:
    """mlx-vlm's LFM2-VL processor: preprocessor_config.json (its image_processor block where
    nested) with processor_config.json over it; the official tiling always on."""
    def read(name):
        f = Path(path) / name
        if not f.is_file():
            return {}
        loaded = json.loads(f.read_text(encoding="utf-8"))
        return dict(loaded.get("image_processor", loaded))

    cfg = {**read("preprocessor_config.json"), **read("processor_config.json")}
    patch, factor = int(cfg.get("encoder_patch_size", cfg.get("patch_size", 16))), int(cfg.get("downsample_factor", 2))
    tile, max_tokens = int(cfg.get("tile_size", 512)), int(cfg.get("max_image_tokens", 256))
    split = dict(_LFM2_SPLITTING)
    return ImageProcessorSpec(
        "Lfm2VlImageProcessor", 0, 0, int(cfg.get("resample") or 3), float(cfg.get("rescale_factor", 1 / 255)),
        tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))), tuple(cfg.get("image_std", (0.5, 0.5, 0.5))),
        True, bool(cfg.get("do_rescale", True)), bool(cfg.get("do_normalize", True)), True, kind="lfm2",
        patch_size=patch, merge_size=factor,
        tiling=(tile, int(cfg.get("min_image_tokens", 64)), max_tokens, float(cfg.get("max_pixels_tolerance", 2.0)),
                split["min_tiles"], split["max_tiles"], split["use_thumbnail"], split["do_image_splitting"]),
        max_num_patches=max(max_tokens * factor ** 2, (tile // patch) ** 2 if split["do_image_splitting"] else 0))


def _lfm2_smart_resize(height: int, width: int, spec: ImageProcessorSpec) -> tuple[int, int]:
    """LFM2-VL's smart resize: (width, height), multiples of patch x factor within the token budget."""
    _, min_tokens, max_tokens = spec.tiling[:3]
    f = spec.patch_size * spec.merge_size
    per_token = spec.patch_size ** 2 * spec.merge_size ** 2
    h_bar, w_bar = _bounded(height, width, max(f, round(height / f) * f), max(f, round(width / f) * f), f,
                            min_tokens * per_token, max_tokens * per_token)
    return w_bar, h_bar


def _bounded(height: int, width: int, h_bar: int, w_bar: int, f: int, min_px: int, max_px: int) -> tuple[int, int]:
    """The smart resizes' area bound (Qwen2-VL's, LFM2-VL's): (h, w) multiples of `f`, shrunk
    past max_px or grown under min_px with the image's aspect ratio."""
    if h_bar * w_bar > max_px:
        beta = math.sqrt((height * width) / max_px)
        return max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
    if h_bar * w_bar < min_px:
        beta = math.sqrt(min_px / (height * width))
        return math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
    return h_bar, w_bar


def _lfm2_grid(height: int, width: int, spec: ImageProcessorSpec) -> tuple[int, int]:
    """The tile grid (columns, rows) whose aspect ratio is closest to the image's (ties: the
    later grid when the image covers half its area), 2..max tiles."""
    tile, _, _, _, min_tiles, max_tiles = spec.tiling[:6]
    ratios = sorted({(w, h) for n in range(min_tiles, max_tiles + 1) for w in range(1, n + 1)
                     for h in range(1, n + 1) if min_tiles <= w * h <= max_tiles}, key=lambda r: r[0] * r[1])
    aspect, best, best_diff = width / height, (1, 1), float("inf")
    for r in ratios:
        diff = abs(aspect - r[0] / r[1])
        if diff < best_diff:
            best_diff, best = diff, r
        elif diff == best_diff and width * height > 0.5 * tile * tile * r[0] * r[1]:
            best = r
    return best


def _lfm2_views(image, spec: ImageProcessorSpec):
    """(views, rows, cols, (resized height, width)) of one image: a tile grid plus a thumbnail
    when it is too large for one view, else the one smart-resized view."""
    from PIL import Image

    tile, _, max_tokens, tolerance, _, _, use_thumbnail, splitting = spec.tiling
    width, height = image.size
    rw, rh = _lfm2_smart_resize(height, width, spec)
    f = spec.patch_size * spec.merge_size
    h_bar, w_bar = max(spec.patch_size, round(height / f) * f), max(spec.patch_size, round(width / f) * f)
    large = h_bar * w_bar > max_tokens * spec.patch_size ** 2 * spec.merge_size ** 2 * tolerance
    resample = Image.Resampling(spec.resample)
    if splitting and large:
        cols, rows = _lfm2_grid(height, width, spec)
        resized = image.resize((tile * cols, tile * rows), resample)
        views = [resized.crop((c * tile, r * tile, (c + 1) * tile, (r + 1) * tile))
                 for r in range(rows) for c in range(cols)]
        if use_thumbnail and rows * cols > 1:
            views.append(image.resize((rw, rh), resample))
        return views, rows, cols, (rh, rw)
    return [image.resize((rw, rh), resample)], 1, 1, (rh, rw)


def preprocess_lfm2(images: Sequence, spec: ImageProcessorSpec) -> Pixels:
    """mlx-vlm's Lfm2VlNumpyImageProcessor: each view rescaled and normalized in float32, cut into
    patch rows (row-major), zero-padded to max_num_patches with its mask."""
    values, masks, shapes, layouts = [], [], [], []
    p = spec.patch_size
    for image in images:
        views, rows, cols, size = _lfm2_views(image.convert("RGB"), spec)
        for view in views:
            x = np.array(view, dtype=np.float32)
            if spec.do_rescale:
                x *= spec.rescale_factor
            if spec.do_normalize:
                x = (x - np.array(spec.image_mean, dtype=np.float32)) / np.array(spec.image_std, dtype=np.float32)
            h, w = x.shape[0] // p, x.shape[1] // p
            patches = x[: h * p, : w * p].reshape(h, p, w, p, 3).transpose(0, 2, 1, 3, 4).reshape(h * w, -1)
            mask = np.ones((spec.max_num_patches,), dtype=np.int32)
            if patches.shape[0] >= spec.max_num_patches:
                patches = patches[: spec.max_num_patches]
            else:
                mask[patches.shape[0]:] = 0
                pad = np.zeros((spec.max_num_patches - patches.shape[0], patches.shape[1]), dtype=patches.dtype)
                patches = np.concatenate([patches, pad], axis=0)
            values.append(patches)
            masks.append(mask)
            shapes.append((h, w))
        layouts.append((rows, cols, size))
    return Pixels(np.stack(values), np.array(shapes, dtype=np.int32), np.stack(masks), tuple(layouts))


def _kimi_spec(path: Path) -> ImageProcessorSpec:
    """mlx-vlm's KimiVLProcessor.from_pretrained: patch_size and merge_kernel_size from config.json's
    vision_config (mlx-vlm's defaults 14, [2, 2]), the rest its class defaults whatever
    preprocessor_config.json says (CLIP's mean and deviation, 4096 patches, no padding)."""
    from mlxbun.errors import ConfigError

    f = Path(path) / "config.json"
    vision = json.loads(f.read_text(encoding="utf-8")).get("vision_config") or {}
    kernel = list(vision.get("merge_kernel_size") or [vision.get("spatial_merge_size", 2)] * 2)
    if len(kernel) != 2 or kernel[0] != kernel[1]:
        raise ConfigError(f"{f}: merge_kernel_size {kernel}: mlxbun takes square merge windows")
    return ImageProcessorSpec("KimiVLImageProcessor", 0, 0, 3, 1 / 255, _CLIP_MEAN, _CLIP_STD,
                              kind="kimi_vl", patch_size=int(vision.get("patch_size", 14)),
                              merge_size=int(kernel[0]), in_token_limit=4096)


def _kimi_one(image, spec: ImageProcessorSpec) -> tuple[np.ndarray, tuple[int, int]]:
    """KimiVLImageProcessor._preprocess: bicubic shrink past the patch limit, centre crop to whole
    merge windows, /255 and normalize in float32, cut into [patches, 3, P, P] row-major."""
    from PIL import Image

    from mlxbun.towers.errors import MediaError

    p, side = spec.patch_size, spec.patch_size * spec.merge_size
    w, h = image.size
    if (w // p) * (h // p) > spec.in_token_limit:
        scale = math.sqrt(spec.in_token_limit / ((w // p) * (h // p)))
        image = image.resize((int(w * scale), int(h * scale)), Image.Resampling.BICUBIC)
    w, h = image.size
    cw, ch = w - w % side, h - h % side
    if cw == 0 or ch == 0:
        raise MediaError(f"an image of {w}x{h}: smaller than one {side}x{side} merge window, which Kimi-VL's "
                         "processor crops every image to")
    if cw // p >= 512 or ch // p >= 512:
        raise MediaError(f"an image of {w}x{h}: {cw // p}x{ch // p} patches, past the 512 a side of Kimi-VL's "
                         "rotary table")
    left, top = (w - cw) // 2, (h - ch) // 2
    x = np.asarray(image.crop((left, top, left + cw, top + ch)).convert("RGB"), dtype=np.float32) / np.float32(255.0)
    x = x.transpose(2, 0, 1)
    x = (x - np.array(spec.image_mean, dtype=np.float32).reshape(3, 1, 1)) / \
        np.array(spec.image_std, dtype=np.float32).reshape(3, 1, 1)
    patches = x.reshape(3, ch // p, p, cw // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
    return patches, (ch // p, cw // p)


def preprocess_kimi(images: Sequence, spec: ImageProcessorSpec) -> Pixels:
    """mlx-vlm's KimiVLImageProcessor: every image's patches [patches, 3, P, P] float32 in one
    array, image_grid_hws [N, 2] (rows, columns of patches)."""
    done = [_kimi_one(i, spec) for i in images]
    return Pixels(np.concatenate([p for p, _ in done], axis=0), np.array([g for _, g in done], dtype=np.int32))


def preprocess_any(images: Sequence, spec: ImageProcessorSpec) -> Pixels:
    """The processor's output for `images`, by its kind: fixed-size, Qwen2-VL (image_grid_thw),
    Pixtral (image sizes), LFM2-VL (views, masks, layouts) or Kimi-VL (patches, image_grid_hws)."""
    if spec.kind == "qwen_vl":
        return Pixels(*preprocess_qwen(images, spec))
    if spec.kind == "pixtral":
        return Pixels(*preprocess_pixtral(images, spec))
    if spec.kind == "lfm2":
        return preprocess_lfm2(images, spec)
    if spec.kind == "kimi_vl":
        return preprocess_kimi(images, spec)
    return Pixels(preprocess(images, spec))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's smart_resize: both sides multiples of `factor`, the area within the bounds."""
    from mlxbun.towers.errors import MediaError

    if max(height, width) / min(height, width) > 200:
        raise MediaError(f"an image of {width}x{height}: aspect ratio past 200, which Qwen2-VL's resize refuses")
    return _bounded(height, width, round(height / factor) * factor, round(width / factor) * factor, factor,
                    min_pixels, max_pixels)


def _qwen_one(image, spec: ImageProcessorSpec) -> tuple[np.ndarray, list[int]]:
    """mlx-vlm's Qwen3VLImageProcessor._process_one: bicubic PIL resize, float32 rescale and
    normalize, the frame repeated over the temporal patch, flattened merge window by window."""
    from PIL import Image

    arr = np.transpose(np.array(image.convert("RGB")), (2, 0, 1))
    C, H, W = arr.shape
    ps, tps, ms = spec.patch_size, spec.temporal_patch_size, spec.merge_size
    rh, rw = smart_resize(H, W, ps * ms, spec.min_pixels, spec.max_pixels)
    if (rh, rw) != (H, W):
        pil = Image.fromarray(np.transpose(arr, (1, 2, 0))).resize((rw, rh), resample=Image.BICUBIC)
        arr = np.transpose(np.array(pil), (2, 0, 1))
    return qwen_patches(np.repeat(qwen_normalized(arr, spec)[None], tps, axis=0), ps, tps, ms)


def qwen_normalized(x: np.ndarray, spec) -> np.ndarray:
    """The Qwen-VL processors' float32 rescale and normalize of [..., C, H, W] (images and video frames)."""
    x = x.astype(np.float32)
    if spec.do_rescale:
        x = x * spec.rescale_factor
    if spec.do_normalize:
        x = (x - np.array(spec.image_mean, dtype=np.float32).reshape(-1, 1, 1)) / \
            np.array(spec.image_std, dtype=np.float32).reshape(-1, 1, 1)
    return x


def qwen_patches(x: np.ndarray, ps: int, tps: int, ms: int) -> tuple[np.ndarray, list[int]]:
    """Frames [T, C, H, W] (T whole temporal patches) as the Qwen-VL processors flatten them, merge
    window by merge window: ([t * h * w patches, C * tps * ps * ps], the grid [t, h, w])."""
    T, C, H, W = x.shape
    gt, gh, gw = T // tps, H // ps, W // ps
    patches = x[None].reshape(1, gt, tps, C, gh // ms, ms, ps, gw // ms, ms, ps)
    patches = patches.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9)
    return patches.reshape(gt * gh * gw, C * tps * ps * ps), [gt, gh, gw]


def preprocess_qwen(images: Sequence, spec: ImageProcessorSpec) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values [patches, C*T*P*P] float32, image_grid_thw [N, 3] int64) as mlx-vlm's processor."""
    done = [_qwen_one(i, spec) for i in images]
    return np.concatenate([p for p, _ in done], axis=0), np.array([g for _, g in done], dtype=np.int64)


def load_image(source: ImageSource):
    """An RGB PIL image, fully decoded (EXIF orientation applied, as mlx-vlm's load_image): a
    missing / non-image file is ImageUnreadable, data that ends early ImageTruncated."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        p = Path(source)
        if not p.is_file():
            raise ImageUnreadable(f"{p}: no such image file" if not p.exists() else f"{p}: not a file")
        try:
            image = Image.open(p)
        except UnidentifiedImageError:
            raise ImageUnreadable(f"{p}: not an image Pillow can read") from None
        except OSError as e:
            raise ImageUnreadable(f"{p}: cannot be read ({e})") from None
        try:
            image.load()
        except OSError as e:  # "image file is truncated", "broken data stream", ...
            raise ImageTruncated(f"{p}: the image data ends early or is damaged ({e})") from None
        except (SyntaxError, ValueError) as e:
            raise ImageUnreadable(f"{p}: not a valid image ({e})") from None
    image = ImageOps.exif_transpose(image)
    return image.convert("RGB")


def preprocess(images: Sequence, spec: ImageProcessorSpec) -> np.ndarray:
    """pixel_values [N, 3, H, W] float32, as the PIL-backend processor computes them."""
    out = []
    for image in images:
        from PIL import Image

        img = image.convert("RGB") if spec.do_convert_rgb else image
        if spec.do_resize:
            img = img.resize((spec.width, spec.height), resample=Image.Resampling(spec.resample), reducing_gap=None)
        x = np.array(img)
        if spec.do_rescale:
            x = (x.astype(np.float64) * spec.rescale_factor).astype(np.float32)
        if spec.do_normalize:
            if not np.issubdtype(x.dtype, np.floating):
                x = x.astype(np.float32)
            x = (x - np.array(spec.image_mean, dtype=x.dtype)) / np.array(spec.image_std, dtype=x.dtype)
        out.append(np.moveaxis(x, -1, 0))
    return np.stack(out)
