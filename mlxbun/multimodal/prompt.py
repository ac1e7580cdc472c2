"""A media prompt as the text model takes it, and the RuntimeModel that feeds it: `MediaPrompt` (the
expanded text, its ids, the tower's inputs and soft tokens, the merged rows, mRoPE positions) and
`EmbeddedPrompt` (the merged rows at the prompt's positions, then the model as usual)."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from mlxbun.errors import GenerationError
from mlxbun.towers.errors import TooManyImages
from mlxbun.towers.mrope import MRopeText


__all__ = ["MAX_IMAGES", "EmbeddedPrompt", "MediaPrompt", "check_image_count"]

# a bound on the images of one prompt (each is a tower pass and its soft tokens in the context)
MAX_IMAGES = 16


def check_image_count(images) -> None:
    """TooManyImages past MAX_IMAGES (before any image is read)."""
    if len(images) > MAX_IMAGES:
        raise TooManyImages(f"{len(images)} images given; mlxbun takes at most {MAX_IMAGES} per prompt")


@dataclasses.dataclass
class MediaPrompt:
    """A prompt with its images, ready for the text model."""

    text: str  # the expanded prompt text (the processor's)
    ids: mx.array  # [L] token ids, image placeholders spliced in
    pixel_values: mx.array  # the processor's: [N, 3, H, W] (fixed size; Pixtral: padded) or [patches, C*T*P*P] (Qwen2-VL)
    grid: Optional[mx.array]  # [N, 3] image_grid_thw (Qwen2-VL), [N, 2] image sizes (Pixtral), else None
    features: mx.array  # soft tokens: [N, T, D] or [tokens, D]
    embeddings: mx.array  # [1, L, D] the merged input rows
    n_images: int
    soft_tokens: int  # soft tokens in all
    positions: Optional[mx.array] = None  # [3, 1, L] mRoPE position ids (Qwen2-VL), else None
    position_delta: int = 0  # decoding continues at the cache offset + this (mRoPE)
    deepstack: tuple = ()  # Qwen3-VL: per early text layer, [soft tokens, D] added at the image rows
    image_token_id: int = -1  # the soft tokens' token id (a video prompt's: the video token)
    mask: Optional[np.ndarray] = None  # LFM2-VL: each view's real patches
    prompt_kw: dict = dataclasses.field(default_factory=dict)  # forward_hidden's options for the prompt's call
    n_videos: int = 0  # a video prompt's videos (pixel_values / grid: pixel_values_videos / video_grid_thw)
    n_clips: int = 0  # gemma3n: audio clips beside the images (their tokens counted in soft_tokens)

    @property
    def tower_grid(self):
        """What the tower takes beside the pixels: the grid, or (LFM2-VL) (view grids, masks)."""
        return self.grid if self.mask is None else (np.asarray(self.grid), self.mask)

    def visual_rows(self, start: int, stop: int) -> mx.array:
        """The image tokens' positions within [start, stop), relative to start."""
        ids = np.array(self.ids)[start:stop]
        return mx.array(np.nonzero(ids == self.image_token_id)[0].astype(np.uint32))

    def deepstack_rows(self, start: int, stop: int) -> tuple:
        """Each deepstack array's rows for the image tokens within [start, stop)."""
        if not self.deepstack:
            return ()
        ids = np.array(self.ids)
        before = int((ids[:start] == self.image_token_id).sum())
        count = int((ids[start:stop] == self.image_token_id).sum())
        return tuple(d[before:before + count] for d in self.deepstack)



class EmbeddedPrompt:
    """A RuntimeModel over `model` whose calls at the prompt's positions (counted from the first
    cached call) run the merged rows instead of the ids' embeddings; later calls run as usual.
    With `mrope` (Qwen2-VL), every cached call runs through it: the prompt's mRoPE positions, then
    the cache offset plus `delta` on all three axes."""

    def __init__(self, model, embeddings: mx.array, mrope: Optional[MRopeText] = None,
                 positions: Optional[mx.array] = None, delta: int = 0, prompt: Optional[MediaPrompt] = None,
                 hidden_kw: Optional[dict] = None):
        self._model, self._embeddings, self._pos = model, embeddings, 0
        self._mrope, self._positions, self._delta, self._prompt = mrope, positions, delta, prompt
        self._kw = dict(hidden_kw or {})  # forward_hidden's options on every cached call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, ids: mx.array, cache: Optional[list] = None, **kw) -> mx.array:
        total = self._embeddings.shape[1]
        if cache is None or (self._pos >= total and self._mrope is None):
            if self._kw and cache is not None:
                return self._model.logits_from_hidden(self._model.forward_hidden(ids, cache, **self._kw))
            return self._model(ids, cache=cache, **kw)
        n = ids.shape[1]
        if self._pos < total < self._pos + n:
            raise GenerationError(f"a call over positions {self._pos}..{self._pos + n} crosses the end of the "
                                  f"{total}-token image prompt")
        if self._pos >= total:  # decoding with mRoPE: the cache offset + the prompt's delta
            start = cache[0].offset + self._delta
            positions = mx.broadcast_to(mx.arange(start, start + n)[None, None, :], (3, 1, n))
            return self._mrope.logits(ids, cache, positions)
        rows = self._embeddings[:, self._pos:self._pos + n]
        span = slice(self._pos, self._pos + n)
        self._pos += n
        if self._mrope is not None:
            p = self._prompt
            extra = () if p is None else (p.deepstack_rows(span.start, span.stop), p.visual_rows(span.start, span.stop))
            return self._mrope.logits(ids, cache, self._positions[..., span], rows, *extra)
        extra = {} if self._prompt is None else getattr(self._prompt, "prompt_kw", {})
        if extra and (span.start, span.stop) != (0, total):
            raise GenerationError("a prompt whose image tokens attend both ways runs in one call")
        return self._model.logits_from_hidden(self._model.forward_hidden(ids, cache, input_embeddings=rows,
                                                                         **self._kw, **extra))


