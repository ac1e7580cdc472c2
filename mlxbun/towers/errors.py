"""The named errors of tower inputs: each refused before any tower or text work runs."""

from __future__ import annotations

from mlxbun.errors import MlxbunError, UnsupportedModelError

__all__ = ["ImageCountError", "ImageTruncated", "ImageUnreadable", "MediaError", "NoTowerError",
           "TooManyImages"]


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


class NoTowerError(UnsupportedModelError):
    """A tower input (an image, audio) given to a checkpoint that has no such tower, or whose
    tower mlxbun does not build."""
