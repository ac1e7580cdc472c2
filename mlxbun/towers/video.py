"""Video in, for the Qwen-VL rows: reading frames (each failure a named error, before any work),
the video processor's preprocessing, the prompt splice and the grids mRoPE counts, equal to
mlx-vlm 0.7.10 (its numpy Qwen3VLVideoProcessor, which the qwen2_vl / qwen2_5_vl / qwen3_vl
processors all use, and the processors' text expansion).

mlx-vlm decodes a video file through OpenCV, sampling `fps` frames a second; OpenCV is not a
dependency here, so mlxbun takes frames already decoded: a directory of image files (in name
order), a list of image files or PIL images, a .npy array [T, H, W, C] / [T, C, H, W] of uint8,
or such an array. mlx-vlm takes decoded frames as they are (nothing sampled, at the processor's
fps), and so does mlxbun."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from mlxbun.towers.audio import read_json
from mlxbun.towers.errors import NoVideoTower, TooManyFrames, VideoCountError, VideoFormatError, VideoUnreadable
from mlxbun.towers.images import qwen_normalized, qwen_patches
from mlxbun.towers.knobs import TowerDescriptor, VideoKind
from mlxbun.towers.splice import count_placeholders
from mlxbun.towers.table import TOWERS

__all__ = ["MAX_VIDEOS", "VideoSpec", "check_videos", "count_videos", "expand_videos", "load_video",
           "preprocess_videos", "read_video_spec", "rope_grids", "video_timestamps"]

# a bound on the videos of one prompt (each is a tower pass over all its frames)
MAX_VIDEOS = 4
# containers mlx-vlm opens through OpenCV (not installed with mlxbun): named in the refusal
_CONTAINERS = (".mp4", ".mov", ".avi", ".mkv", ".webm", ".m4v", ".gif", ".mpg", ".mpeg", ".wmv", ".flv")
# the frame files a directory is read for (what Pillow decodes)
_FRAME_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


@dataclass(frozen=True)
class VideoSpec:
    """mlx-vlm's Qwen3VLVideoProcessor settings (_qwen_vl_video_kwargs over its defaults)."""

    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    min_pixels: int = 128 * 32 * 32
    max_pixels: int = 32 * 32 * 768
    do_rescale: bool = True
    rescale_factor: float = 1 / 255.0
    do_normalize: bool = True
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    do_convert_rgb: bool = True
    fps: float = 2.0
    max_frames: int = 768


def read_video_spec(path: Path, model_type: str) -> VideoSpec:
    """video_preprocessor_config.json, else preprocessor_config.json (older checkpoints keep the
    video settings beside the image ones), as mlx-vlm's _qwen_vl_video_kwargs reads them; the
    default patch 14 for qwen2_vl / qwen2_5_vl, 16 for qwen3_vl."""
    files = [Path(path) / name for name in ("video_preprocessor_config.json", "preprocessor_config.json")]
    raw = next((read_json(f) for f in files if f.is_file()), {})
    kw = {"patch_size": 14 if model_type in ("qwen2_vl", "qwen2_5_vl") else 16}
    for k in ("patch_size", "temporal_patch_size", "merge_size", "fps", "max_frames", "image_mean", "image_std",
              "rescale_factor", "do_rescale", "do_normalize", "do_convert_rgb"):
        if raw.get(k) is not None:
            kw[k] = tuple(raw[k]) if k in ("image_mean", "image_std") else raw[k]
    size = raw.get("size") or {}
    for key, field in (("shortest_edge", "min_pixels"), ("longest_edge", "max_pixels")):
        if size.get(key) is not None:
            kw[field] = size[key]
    for field in ("min_pixels", "max_pixels"):
        if raw.get(field) is not None:
            kw[field] = raw[field]
    return VideoSpec(**kw)


# ------------------------------------------------------------------ reading frames


def _frame(source) -> np.ndarray:
    """One frame as mlx-vlm's video processor takes a PIL frame: convert("RGB") (no EXIF turn:
    a decoded video frame has none), [H, W, 3] uint8."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        return np.asarray(source.convert("RGB"))
    p = Path(source)
    if not p.is_file():
        raise VideoUnreadable(f"{p}: no such frame file" if not p.exists() else f"{p}: not a file")
    try:
        with Image.open(p) as image:
            image.load()
            return np.asarray(image.convert("RGB"))
    except UnidentifiedImageError:
        raise VideoUnreadable(f"{p}: not an image Pillow can read (a video frame)") from None
    except (OSError, SyntaxError, ValueError) as e:
        raise VideoUnreadable(f"{p}: the frame cannot be read ({e})") from None


def _frames_array(a: np.ndarray, where: str) -> np.ndarray:
    """[T, H, W, 3] uint8 of an array as mlx-vlm's _prepare_video lays it out: channels last
    when the last axis is 1 / 3 / 4 (RGBA's alpha dropped), else [T, C, H, W]; one channel
    repeated to three."""
    if a.dtype != np.uint8:
        raise VideoFormatError(f"{where}: frames of {a.dtype}; mlxbun takes uint8 frames (0..255)")
    if a.ndim != 4:
        raise VideoFormatError(f"{where}: an array of shape {a.shape}; a video is [T, H, W, C] or [T, C, H, W]")
    if a.shape[-1] in (1, 3, 4):
        a = a[..., :3] if a.shape[-1] == 4 else a
    elif a.shape[1] in (1, 3):
        a = a.transpose(0, 2, 3, 1)
    else:
        raise VideoFormatError(f"{where}: an array of shape {a.shape}: no axis of 1, 3 or 4 channels where "
                               "mlx-vlm's video processor looks ([T, H, W, C] or [T, C, H, W])")
    if a.shape[-1] == 1:
        a = np.repeat(a, 3, axis=-1)
    return np.ascontiguousarray(a)


def _count_check(n: int, max_frames: int, where: str) -> None:
    if n == 0:
        raise VideoUnreadable(f"{where}: no frames")
    if n > max_frames:
        raise TooManyFrames(f"{where}: {n} frames; the video processor takes at most {max_frames} "
                            "(mlx-vlm samples no more from a file)")


def load_video(source, max_frames: int = VideoSpec.max_frames) -> np.ndarray:
    """A video's frames [T, H, W, 3] uint8: `source` a directory of frame images (name order), a
    .npy file, a list of frame files / PIL images, or an array. The frame count is checked
    (TooManyFrames) before any frame is decoded; every failure is a named error."""
    if isinstance(source, np.ndarray):
        _count_check(source.shape[0] if source.ndim else 0, max_frames, "the video array")
        return _frames_array(source, "the video array")
    if isinstance(source, (list, tuple)):
        _count_check(len(source), max_frames, "the video's frame list")
        return _stack([_frame(f) for f in source], "the video's frame list")
    p = Path(source)
    if p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix.lower() in _FRAME_SUFFIXES and f.is_file())
        _count_check(len(files), max_frames, f"{p} (a directory of frame images)")
        return _stack([_frame(f) for f in files], str(p))
    if not p.exists():
        raise VideoUnreadable(f"{p}: no such video file or frame directory")
    if p.suffix.lower() in _CONTAINERS:
        raise VideoUnreadable(f"{p}: mlxbun decodes no video containers (mlx-vlm reads them through OpenCV, not "
                              "installed); give the frames as a directory of images or a .npy array")
    if p.suffix.lower() != ".npy":
        raise VideoUnreadable(f"{p}: not a video mlxbun reads (a directory of frame images or a .npy array)")
    try:
        a = np.load(p, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as e:
        raise VideoUnreadable(f"{p}: not a readable .npy array ({e})") from None
    _count_check(a.shape[0] if a.ndim else 0, max_frames, str(p))
    try:
        data = np.array(a)
    except (OSError, ValueError) as e:  # a cut file: the header promises more than the data holds
        raise VideoUnreadable(f"{p}: the array data cannot be read ({e})") from None
    return _frames_array(data, str(p))


def _stack(frames: list, where: str) -> np.ndarray:
    sizes = sorted({f.shape[:2] for f in frames})
    if len(sizes) > 1:
        raise VideoFormatError(f"{where}: frames of different sizes ({', '.join(f'{w}x{h}' for h, w in sizes)})")
    return np.stack(frames)


# ------------------------------------------------------------------ the video processor


def _smart_resize(num_frames: int, height: int, width: int, spec: VideoSpec) -> tuple[int, int]:
    """mlx-vlm's _smart_resize_video: sides multiples of patch x merge, the frames' pixels (the
    temporal patches rounded up) within the bounds."""
    factor, tf = spec.patch_size * spec.merge_size, spec.temporal_patch_size
    if height < factor or width < factor:
        raise VideoFormatError(f"frames of {width}x{height}: smaller than the video processor's {factor}-pixel "
                               "resize factor")
    if max(height, width) / min(height, width) > 200:
        raise VideoFormatError(f"frames of {width}x{height}: aspect ratio past 200, which the resize refuses")
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = math.ceil(num_frames / tf) * tf
    if t_bar * h_bar * w_bar > spec.max_pixels:
        beta = math.sqrt((num_frames * height * width) / spec.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < spec.min_pixels:
        beta = math.sqrt(spec.min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _process_one(frames: np.ndarray, spec: VideoSpec) -> tuple[np.ndarray, list[int]]:
    """Qwen3VLVideoProcessor._process_one on [T, H, W, 3] uint8: bicubic PIL resize per frame,
    float32 rescale and normalize, the last frame repeated to whole temporal patches, flattened
    merge window by merge window."""
    from PIL import Image

    video = frames.transpose(0, 3, 1, 2)  # [T, C, H, W], as mlx-vlm's
    T, C, H, W = video.shape
    rh, rw = _smart_resize(T, H, W, spec)
    if (rh, rw) != (H, W):
        out = np.empty((T, C, rh, rw), dtype=video.dtype)
        for i, frame in enumerate(video):
            pil = Image.fromarray(np.transpose(frame, (1, 2, 0))).resize((rw, rh), resample=Image.BICUBIC)
            out[i] = np.transpose(np.array(pil), (2, 0, 1))
        video = out
    x = qwen_normalized(video, spec)
    pad = (-x.shape[0]) % spec.temporal_patch_size
    if pad:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)], axis=0)
    return qwen_patches(x, spec.patch_size, spec.temporal_patch_size, spec.merge_size)


def preprocess_videos(videos: Sequence[np.ndarray], spec: VideoSpec) -> tuple[np.ndarray, np.ndarray]:
    """(pixel_values_videos [patches, C*T*P*P] float32, video_grid_thw [N, 3] int64)."""
    done = [_process_one(v, spec) for v in videos]
    return np.concatenate([p for p, _ in done], axis=0), np.array([g for _, g in done], dtype=np.int64)


# ------------------------------------------------------------------ the prompt


def check_videos(row: Optional[TowerDescriptor], n_videos: int, n_images: int, where: str) -> None:
    """Refusals before any frame is read: a row without video (NoVideoTower), images beside the
    videos (mlx-vlm's qwen2_vl / qwen2_5_vl run the images alone when both come), too many videos."""
    if row is None or row.video is VideoKind.NONE:
        rows = ", ".join(sorted(m for m, d in TOWERS.items() if d.video is not VideoKind.NONE))
        raise NoVideoTower(f"{where}: its tower takes no video in mlxbun (video goes to the {rows} rows)")
    if n_images and n_videos:
        raise VideoCountError("images and videos in one prompt: mlxbun takes one or the other")
    if n_videos > MAX_VIDEOS:
        raise TooManyFrames(f"{n_videos} videos given; mlxbun takes at most {MAX_VIDEOS} per prompt")


def count_videos(prompt: str, marks: dict, row: TowerDescriptor, n_videos: int, where) -> str:
    """`prompt` with its video placeholders (the video token) counted (VideoCountError where they
    and the videos disagree); a prompt without any gets the row's lead per video in front."""
    if "video" not in marks:  # a row without video, or a tokenizer without the video token
        if n_videos:
            raise NoVideoTower(f"{where}: the tokenizer has no video token")
        return prompt
    text, found = count_placeholders(prompt, marks["video"], n_videos,
                                     row.lead.format(**{**marks, "placeholder": marks["video"]}))
    if found != n_videos:
        raise VideoCountError(f"the prompt holds {found} video placeholder(s) ({marks['video']!r}) but "
                              f"{n_videos} video(s) were given")
    return text


def video_timestamps(frames: int, temporal_patch_size: int, fps: float) -> list[float]:
    """Qwen3-VL's seconds per temporal patch: the mean of its first and last frame's time, frame i
    at i / fps (mlx-vlm's metadata for decoded frames), the last frame repeated to fill a patch."""
    if not (fps > 0 and math.isfinite(fps)):
        raise VideoFormatError(f"fps {fps!r}: a video's frame rate must be positive and finite")
    indices = list(range(frames))
    indices += indices[-1:] * (-len(indices) % temporal_patch_size)
    times = [i / fps for i in indices]
    return [(times[i] + times[i + temporal_patch_size - 1]) / 2 for i in range(0, len(times), temporal_patch_size)]


def expand_videos(kind: VideoKind, text: str, marks: dict, grids, timestamps: list[list[float]], merge: int) -> str:
    """The prompt text with each video placeholder expanded as the processor writes it (its
    while-loop, replacing the first occurrence each time; Qwen3-VL: the first placeholder wrapped
    in vision start / end, wherever it is, before a bare one)."""
    video, placeholder = marks["video"], "<|placeholder|>"
    wrapped = f"{marks.get('boi', '')}{video}{marks.get('eoi', '')}"
    index = 0
    while video in text:
        if index >= len(grids):
            raise VideoCountError(f"the prompt holds more video placeholders ({video!r}) than the "
                                  f"{len(grids)} video(s) given")
        t, h, w = (int(x) for x in grids[index])
        per_frame = h * w // merge ** 2
        if kind is VideoKind.TIMESTAMPS and wrapped in text:
            groups = "".join(f"<{s:.1f} seconds>" + marks["boi"] + placeholder * per_frame + marks["eoi"]
                             for s in timestamps[index])
            text = text.replace(wrapped, groups, 1)
        else:
            text = text.replace(video, placeholder * (t * per_frame), 1)
        index += 1
    return text.replace(placeholder, video)


def rope_grids(kind: VideoKind, grids) -> list[list[int]]:
    """The grids mlx-vlm's get_rope_index walks: Qwen3-VL splits each video into its temporal
    patches, one (1, h, w) grid each (one vision block per patch in the prompt)."""
    rows = [[int(x) for x in g] for g in np.asarray(grids).tolist()]
    if kind is VideoKind.TIMESTAMPS:
        return [[1, h, w] for t, h, w in rows for _ in range(t)]
    return rows
