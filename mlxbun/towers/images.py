"""Images in: reading a file (each failure a named error, before any work) and the processor's
preprocessing, equal to what mlx-vlm's processor hands its model (transformers' PIL-backend
image processor: RGB, PIL resize, rescale in float64 then float32, normalize in float32,
channels first)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence, Union

import numpy as np

from mlxbun.towers.errors import ImageTruncated, ImageUnreadable

__all__ = ["ImageProcessorSpec", "load_image", "preprocess", "read_processor_spec"]

ImageSource = Union[str, Path, "PIL.Image.Image"]  # noqa: F821

# the image processors whose preprocessing `preprocess` reproduces
_PROCESSOR_TYPES = ("Gemma3ImageProcessor", "Gemma3ImageProcessorPil", "SiglipImageProcessor")


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


def read_processor_spec(path: Path) -> ImageProcessorSpec:
    """The checkpoint's image preprocessing; ImageUnreadable-free: a missing or unsupported
    processor is a ConfigError naming the file."""
    from mlxbun.errors import ConfigError

    f = Path(path) / "preprocessor_config.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{f}: missing (the image processor's settings)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{f}: unreadable ({e})") from None
    kind = cfg.get("image_processor_type", "")
    if kind not in _PROCESSOR_TYPES:
        raise ConfigError(f"{f}: image_processor_type {kind!r}; mlxbun reproduces {', '.join(_PROCESSOR_TYPES)}")
    if cfg.get("do_pan_and_scan"):
        raise ConfigError(f"{f}: do_pan_and_scan is on; mlxbun does not reproduce pan-and-scan crops")
    size = cfg.get("size") or {}
    if "height" not in size or "width" not in size:
        raise ConfigError(f"{f}: size must give height and width, got {size!r}")

    def flag(key):
        v = cfg.get(key)
        return True if v is None else bool(v)

    return ImageProcessorSpec(kind, int(size["height"]), int(size["width"]), int(cfg.get("resample", 2)),
                              float(cfg.get("rescale_factor", 1 / 255)),
                              tuple(cfg.get("image_mean", (0.5, 0.5, 0.5))),
                              tuple(cfg.get("image_std", (0.5, 0.5, 0.5))),
                              flag("do_resize"), flag("do_rescale"), flag("do_normalize"), flag("do_convert_rgb"))


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
