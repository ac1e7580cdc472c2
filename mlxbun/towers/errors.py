"""The named errors of tower inputs: each refused before any tower or text work runs."""

from __future__ import annotations

from mlxbun.errors import MlxbunError, UnsupportedModelError

__all__ = ["AudioCountError", "AudioFormatError", "AudioTooLong", "AudioTruncated", "AudioUnreadable",
           "ImageCountError", "ImageTruncated", "ImageUnreadable", "MediaError", "NoTowerError", "NoVideoTower",
           "TooManyClips", "TooManyFrames", "TooManyImages", "VideoCountError", "VideoFormatError", "VideoUnreadable"]


class MediaError(MlxbunError, ValueError):
    """An image / audio input mlxbun cannot take (the subclass says which way)."""


class ImageUnreadable(MediaError):
    """The file is missing, not a file, or not an image any installed Pillow decoder reads."""


class ImageTruncated(MediaError):
    """The file starts as an image but its data ends early (a cut download, a partial write)."""


class ImageCountError(MediaError):
    """The prompt's image placeholders and the images given disagree."""


class TooManyImages(MediaError):
    """More images than the model's limit, or than its context holds once spliced."""


class AudioUnreadable(MediaError):
    """The file is missing, not a file, not a RIFF/WAVE file, or holds no frames."""


class AudioTruncated(MediaError):
    """The WAV header or its data ends before what the header declares."""


class AudioFormatError(MediaError):
    """A WAV mlxbun does not read as mlx-vlm would: not 16-bit PCM, or not at the processor's
    sample rate (mlx-vlm resamples through mlx_audio)."""


class AudioTooLong(MediaError):
    """A clip past the processor's length, or longer than the model's audio soft tokens hold (or
    shorter than one frame)."""


class AudioCountError(MediaError):
    """The prompt's audio placeholders and the clips given disagree."""


class TooManyClips(MediaError):
    """More audio clips than mlxbun takes in one prompt, or than the context holds once spliced."""


class VideoUnreadable(MediaError):
    """The video is missing, a container mlxbun does not decode (.mp4, ...: mlx-vlm reads those
    through OpenCV), a directory without frames, or a frame / .npy file that cannot be read."""


class VideoFormatError(MediaError):
    """Frames mlxbun does not take as mlx-vlm's video processor would: not uint8, not RGB /
    grayscale / RGBA, of different sizes, or smaller than the processor's resize factor."""


class VideoCountError(MediaError):
    """The prompt's video placeholders and the videos given disagree (or images and videos were
    given together)."""


class TooManyFrames(MediaError):
    """More frames than the video processor takes (its max_frames), more videos than mlxbun takes
    in one prompt, or a prompt past the model's context once the video tokens are spliced."""


class NoTowerError(UnsupportedModelError):
    """A tower input (an image, audio) given to a checkpoint that has no such tower, or whose
    tower mlxbun does not build."""


class NoVideoTower(NoTowerError):
    """A video given to a checkpoint whose tower mlxbun builds takes no video (mlxbun's video path
    is the Qwen-VL rows')."""
