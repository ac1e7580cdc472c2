"""Images into the wrapped VLMs: a checkpoint's text graph plus its tower (mlxbun.towers), the
prompt spliced and tokenized as mlx-vlm's processor, the soft tokens merged into the text
embeddings as mlx-vlm's model, then mlxbun's own token loop (generate.py) over a RuntimeModel
that feeds the merged rows at the prompt's positions. Every bad input is refused by name before
any tower or text work (mlxbun.towers.errors).

    vlm = open_vlm("path/to/checkpoint")
    prompt = vlm.prepare("<start_of_image> what is this?", ["photo.png"])
    for r in stream_generate(vlm, prompt, max_tokens=32): ...
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Optional, Sequence

import mlx.core as mx

from mlxbun.errors import GenerationError
from mlxbun.towers.errors import NoTowerError, TooManyImages
from mlxbun.towers.images import load_image, preprocess
from mlxbun.towers.loader import VisionStack, open_vision
from mlxbun.towers.splice import expand_prompt, image_sequence, merge_embeddings

__all__ = ["MAX_IMAGES", "EmbeddedPrompt", "MediaPrompt", "VisionLanguageModel", "open_vlm",
           "refuse_images", "stream_generate"]

# a bound on the images of one prompt (each is a tower pass and its soft tokens in the context)
MAX_IMAGES = 16


@dataclasses.dataclass
class MediaPrompt:
    """A prompt with its images, ready for the text model."""

    text: str  # the expanded prompt text (the processor's)
    ids: mx.array  # [L] token ids, image placeholders spliced in
    pixel_values: mx.array  # [N, 3, H, W] float32, the processor's
    features: mx.array  # [N, T, D] soft tokens
    embeddings: mx.array  # [1, L, D] the merged input rows
    n_images: int
    soft_tokens: int  # N * T


class VisionLanguageModel:
    """A checkpoint's text RuntimeModel, tokenizer and vision stack."""

    def __init__(self, text_model, tokenizer, vision: VisionStack, path: Path):
        self.text_model, self.tokenizer, self.vision, self.path = text_model, tokenizer, vision, path

    def _token(self, token_id: int, what: str) -> str:
        t = self.tokenizer.id_to_token(token_id)
        if t is None:
            raise GenerationError(f"{self.path}: the tokenizer has no {what} token (id {token_id})")
        return t

    def check_images(self, images: Sequence) -> None:
        """TooManyImages past MAX_IMAGES (before any image is read)."""
        if len(images) > MAX_IMAGES:
            raise TooManyImages(f"{len(images)} images given; mlxbun takes at most {MAX_IMAGES} per prompt")

    def expand(self, prompt: str, n_images: int) -> str:
        """The prompt text with each image placeholder expanded (the processor's text)."""
        v = self.vision
        if v.boi_token_id is None:
            raise GenerationError(f"{self.path}: the config names no begin-of-image token")
        boi = self._token(int(v.boi_token_id), "begin-of-image")
        eoi_id = self._eoi_id()
        seq = image_sequence(v.descriptor.merge, boi, self._token(v.image_token_id, "image"),
                             self._token(eoi_id, "end-of-image"), v.tokens_per_image)
        return expand_prompt(prompt, boi, seq, n_images)

    def _eoi_id(self) -> int:
        from mlxbun.towers.loader import _read_config

        cfg = _read_config(self.path)
        if "eoi_token_index" not in cfg:
            raise GenerationError(f"{self.path}: the config names no end-of-image token (eoi_token_index)")
        return int(cfg["eoi_token_index"])

    def prepare(self, prompt: str, images: Sequence, *, add_special_tokens: bool = True) -> MediaPrompt:
        """Read, preprocess and splice `images` into `prompt`, run the tower, merge: every input
        checked (count, files, context) before the tower runs."""
        self.check_images(images)
        text = self.expand(prompt, len(images))  # ImageCountError before any file is read
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        limit = getattr(getattr(self.text_model, "args", None), "fields", {}).get("max_position_embeddings")
        if limit and len(ids) > limit:
            raise TooManyImages(f"{len(images)} image(s) make the prompt {len(ids)} tokens, past the model's "
                                f"{limit}-token context")
        pil = [load_image(i) for i in images]  # ImageUnreadable / ImageTruncated
        pixels = mx.array(preprocess(pil, self.vision.processor))
        return self.merge(text, mx.array(ids, dtype=mx.int32), pixels)

    def merge(self, text: str, ids: mx.array, pixel_values: mx.array) -> MediaPrompt:
        """Tower, projector and merge over ready ids [L] and pixel_values [N, 3, H, W]."""
        v = self.vision
        embeds = self.text_model.embed_tokens(ids[None])
        features = v.features(pixel_values, embeds.dtype)
        merged = merge_embeddings(v.descriptor.merge, ids[None], embeds, features,
                                  image_token_id=v.image_token_id, pad_token_id=v.pad_token_id,
                                  hidden_size=v.merge_hidden)
        n = int(pixel_values.shape[0])
        return MediaPrompt(text, ids, pixel_values, features, merged, n, n * v.tokens_per_image)

    def logits(self, prompt: MediaPrompt, cache: Optional[list] = None) -> mx.array:
        """The text model's logits [1, L, V] over the merged prompt in one call."""
        m = self.text_model
        return m.logits_from_hidden(m.forward_hidden(prompt.ids[None], cache, input_embeddings=prompt.embeddings))


class EmbeddedPrompt:
    """A RuntimeModel over `model` whose calls at the prompt's positions (counted from the first
    cached call) run the merged rows instead of the ids' embeddings; later calls run as usual."""

    def __init__(self, model, embeddings: mx.array):
        self._model, self._embeddings, self._pos = model, embeddings, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, ids: mx.array, cache: Optional[list] = None, **kw) -> mx.array:
        total = self._embeddings.shape[1]
        if cache is None or self._pos >= total:
            return self._model(ids, cache=cache, **kw)
        n = ids.shape[1]
        if self._pos + n > total:
            raise GenerationError(f"a call over positions {self._pos}..{self._pos + n} crosses the end of the "
                                  f"{total}-token image prompt")
        rows = self._embeddings[:, self._pos:self._pos + n]
        self._pos += n
        return self._model.logits_from_hidden(self._model.forward_hidden(ids, cache, input_embeddings=rows))


def open_vlm(path) -> VisionLanguageModel:
    """A checkpoint's text graph, tokenizer and tower (NoTowerError where it has none)."""
    from mlxbun.factory import open_model
    from mlxbun.tokenizer import load_tokenizer

    path = Path(path)
    vision = open_vision(path)
    model = open_model(path)
    if not hasattr(model, "embed_tokens"):
        raise NoTowerError(f"{path}: its text graph ({type(model).__name__}) takes no input embeddings")
    return VisionLanguageModel(model, load_tokenizer(path), vision, path)


def refuse_images(path, what: str = "images") -> None:
    """NoTowerError unless `path` holds a tower mlxbun builds (checked before any work)."""
    from mlxbun.towers.loader import _check_tower, _read_config

    p = Path(path)
    try:
        _check_tower(p, _read_config(p))
    except NoTowerError as e:
        raise NoTowerError(f"{what} given, but {e}") from None


def stream_generate(vlm: VisionLanguageModel, prompt: MediaPrompt, **kwargs):
    """mlxbun.generate.stream_generate over the merged prompt (same options; `fast` refused:
    the compiled step knows no input embeddings)."""
    from mlxbun.generate import stream_generate as text_stream

    if kwargs.get("fast"):
        raise GenerationError("--fast does not take images (the compiled step runs token ids only)")
    if kwargs.get("prompt_cache") is not None:
        raise GenerationError("a prompt cache cannot be combined with images (its rows are the ids' embeddings)")
    model = EmbeddedPrompt(vlm.text_model, prompt.embeddings)
    return text_stream(model, vlm.tokenizer, prompt.ids, **kwargs)
