"""The gemma-style media paths: a checkpoint's text RuntimeModel plus a media stack whose soft tokens
are spliced over the media tokens (`_SplicedModel`): audio clips (gemma3n's USM, gemma4's conformer:
`AudioLanguageModel`), gemma4's images (`Gemma4ImageModel`) and gemma3n's images beside its audio
(`Gemma3nImageModel`). Every input is checked before a tower runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from mlxbun.errors import GenerationError
from mlxbun.towers.errors import AudioCountError, ImageCountError, TooManyClips, TooManyImages
from mlxbun.towers.images import load_image
from mlxbun.towers.splice import count_placeholders, expand_prompt
from mlxbun.towers.video import check_videos
from mlxbun.multimodal.prompt import MediaPrompt, check_image_count

__all__ = ["AudioLanguageModel", "AudioPrompt", "Gemma3nImageModel", "Gemma4ImageModel", "load_clip"]


@dataclasses.dataclass
class AudioPrompt:
    """A prompt with its audio clips, ready for the text model."""

    text: str  # the expanded prompt text (the processor's)
    ids: mx.array  # [L] token ids, each clip's audio tokens spliced in
    features: mx.array  # [clips, frames, mel bins] the processor's log-mel frames (padded to the longest)
    mask: mx.array  # [clips, frames] True where a frame holds audio
    soft: mx.array  # [clips, soft tokens a clip, D] what lands at the audio tokens
    embeddings: mx.array  # [1, L, D] the merged input rows
    n_clips: int
    soft_tokens: int  # audio tokens in all
    positions: Optional[mx.array] = None  # (no mRoPE)
    position_delta: int = 0


def load_clip(clip, rate: int) -> np.ndarray:
    """A clip as the processor takes it: a WAV file read (towers.audio.read_wav; AudioFormatError
    at another sample rate: mlx-vlm resamples through mlx_audio), or samples (float32; a 2-D array's
    channels averaged, as mlx-vlm's load_audio does) taken to be at `rate`."""
    from mlxbun.towers.audio import read_wav
    from mlxbun.towers.errors import AudioFormatError

    if isinstance(clip, np.ndarray):
        a = clip.astype(np.float32, copy=False)
        return a.mean(axis=1) if a.ndim > 1 else a
    samples, got = read_wav(clip)
    if got != rate:
        raise AudioFormatError(f"{clip}: {got} Hz; the feature extractor takes {rate} Hz (mlxbun does not resample)")
    return samples


class _SplicedModel:
    """What the audio and gemma4 image paths share: a checkpoint's text RuntimeModel, tokenizer and
    media stack (whose `hidden_kw` every text call with the media passes), the media tokens' texts,
    the placeholder count, the tokenized prompt checked against the context, the prompt's logits."""

    def __init__(self, text_model, tokenizer, stack, path: Path):
        self.text_model, self.tokenizer, self.path = text_model, tokenizer, path
        self.hidden_kw = dict(stack.hidden_kw)

    def _token(self, token_id: int, what: str) -> str:
        t = self.tokenizer.id_to_token(int(token_id))
        if t is None:
            raise GenerationError(f"{self.path}: the tokenizer has no {what} token (id {token_id})")
        return t

    def _placeholders(self, prompt: str, token: str, n: int, error, what: str) -> str:
        """`prompt` with its placeholders (`token`) counted (`error` where they and the `n` items
        disagree); a prompt without any gets one per item in front."""
        text, found = count_placeholders(prompt, token, n, token)
        if found != n:
            raise error(f"the prompt holds {found} {what} placeholder(s) ({token!r}) but {n} {what}(s) were given")
        return text

    def _ids(self, text: str, add_special_tokens: bool, n: int, error, what: str) -> mx.array:
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        args = getattr(self.text_model, "args", None)
        limit = getattr(args, "max_position_embeddings", None) or getattr(args, "fields", {}).get("max_position_embeddings")
        if limit and len(ids) > limit:
            raise error(f"{n} {what}(s) make the prompt {len(ids)} tokens, past the model's {limit}-token context")
        return mx.array(ids, dtype=mx.int32)

    def mrope(self) -> None:
        return None

    def check_generation(self) -> None:
        return None

    def logits(self, prompt, cache: Optional[list] = None) -> mx.array:
        """The text model's logits [1, L, V] over the merged prompt in one call."""
        m = self.text_model
        kw = {k: v for k, v in getattr(prompt, "prompt_kw", {}).items() if k != "keep_last"}  # every row
        return m.logits_from_hidden(m.forward_hidden(prompt.ids[None], cache, input_embeddings=prompt.embeddings,
                                                     **self.hidden_kw, **kw))


class AudioLanguageModel(_SplicedModel):
    """A checkpoint's text RuntimeModel, tokenizer and audio stack (gemma3n's towers.usm.AudioStack,
    gemma4's towers.usm4.Gemma4Audio). Every text call with audio passes the stack's `hidden_kw`
    (gemma3n: mlx-vlm's KV-shared offsets; gemma4: the media ids' per-layer inputs at id 0)."""

    def __init__(self, text_model, tokenizer, audio, path: Path):
        super().__init__(text_model, tokenizer, audio, path)
        self.audio = audio

    def check_clips(self, clips: Sequence) -> None:
        """TooManyClips past MAX_CLIPS (before any file is read)."""
        from mlxbun.towers.usm import MAX_CLIPS

        if len(clips) > MAX_CLIPS:
            raise TooManyClips(f"{len(clips)} audio clips given; mlxbun takes at most {MAX_CLIPS} per prompt")
        if not clips:
            raise AudioCountError("no audio clips given")

    def _marks(self) -> dict:
        a = self.audio
        return {"audio": self._token(a.audio_token_id, "audio"), "boa": self._token(a.boa_token_id, "begin-of-audio"),
                "eoa": self._token(a.eoa_token_id, "end-of-audio")}

    def placeholders(self, prompt: str, n_clips: int) -> str:
        """`prompt` with its audio placeholders (the audio token) counted (AudioCountError where they
        and the clips disagree); a prompt without any gets one per clip in front."""
        return self._placeholders(prompt, self._marks()["audio"], n_clips, AudioCountError, "audio clip")

    def expand(self, text: str, counts: Sequence[int]) -> str:
        """Each placeholder in turn as the processor writes its clip (`counts`: each clip's tokens)."""
        marks = self._marks()
        return expand_prompt(text, marks["audio"], [self.audio.clip_text(marks, n) for n in counts])

    def prepare(self, prompt: str, clips: Sequence, *, add_special_tokens: bool = True) -> AudioPrompt:
        """Read the clips, compute their log-mel frames, splice their audio tokens into `prompt`, run
        the tower and merge: every input checked (count, files, length, context) before the tower."""
        a = self.audio
        self.check_clips(clips)
        text = self.placeholders(prompt, len(clips))  # AudioCountError before any file is read
        text, features, mask = self.read_clips(text, clips)
        ids = self._ids(text, add_special_tokens, len(clips), TooManyClips, "clip")
        soft = a.soft_tokens(features, mask)
        embeddings = a.merge(self.text_model.embed_tokens, ids[None], soft)
        return AudioPrompt(text, ids, features, mask, soft, embeddings, len(clips),
                           int((np.array(ids) == a.audio_token_id).sum()))

    def read_clips(self, text: str, clips: Sequence) -> tuple[str, mx.array, mx.array]:
        """(`text` with its placeholders expanded, the clips' log-mel frames, their mask): the files
        read (AudioUnreadable / Truncated / Format), the lengths checked (AudioTooLong)."""
        a = self.audio
        samples = [load_clip(c, a.mel.sampling_rate) for c in clips]
        counts = [a.clip_tokens(s) for s in samples]
        features, mask = a.features(samples)
        a.check_frames(features.shape[1], counts)  # AudioTooLong / AudioCountError
        return self.expand(text, counts), mx.array(features), mx.array(mask)


class Gemma4ImageModel(_SplicedModel):
    """gemma4's text RuntimeModel, tokenizer and vision side (towers.gemma4_vision): each image
    placeholder (the image token) as <boi> + its soft tokens + <eoi>, the images' soft tokens over
    the image tokens, the media ids' per-layer inputs at id 0 on every call with them."""

    def __init__(self, text_model, tokenizer, vision, path: Path):
        super().__init__(text_model, tokenizer, vision, path)
        self.vision = vision

    def check_images(self, images: Sequence) -> None:
        check_image_count(images)

    def prepare(self, prompt: str, images: Sequence = (), *, videos: Sequence = (), fps: Optional[float] = None,
                add_special_tokens: bool = True) -> MediaPrompt:
        """Read, preprocess and splice `images` into `prompt`, run the tower, merge: every input
        checked (count, files, context) before the tower runs. No video (NoVideoTower)."""
        if videos:
            check_videos(None, len(videos), len(images), f"{self.path}: gemma4")
        v = self.vision
        self.check_images(images)
        image = self._token(v.image_token_id, "image")
        text = self._placeholders(prompt, image, len(images), ImageCountError, "image")
        pixels, counts = v.spec.preprocess([load_image(i) for i in images])  # ImageUnreadable / ImageTruncated
        boi, eoi = self._token(v.boi_token_id, "begin-of-image"), self._token(v.eoi_token_id, "end-of-image")
        text = expand_prompt(text, image, [f"{boi}{image * n}{eoi}" for n in counts])
        ids = self._ids(text, add_special_tokens, len(images), TooManyImages, "image")
        dtype = self.text_model.embed_tokens(ids[:1]).dtype
        features = v.features(pixels, dtype)
        embeddings = v.merge(self.text_model.embed_tokens, ids[None], features)
        # bidirectional image attention: the whole prompt in one call (mlx-vlm's unchunked prefill)
        kw = {"vision_blocks": v.vision_blocks(np.array(ids)), "keep_last": True} if v.bidirectional and counts else {}
        return MediaPrompt(text, ids, [mx.array(p) for p in pixels], None, features, embeddings, len(images),
                           sum(counts), image_token_id=v.image_token_id, prompt_kw=kw)


class Gemma3nImageModel(Gemma4ImageModel):
    """gemma3n's text RuntimeModel, tokenizer and vision side (towers.gemma3n_vision: MobileNetV5):
    each image placeholder (the image token) as the processor writes it, and audio clips beside
    the images through the checkpoint's audio tower (opened on first use), merged as mlx-vlm's
    get_input_embeddings; mlx-vlm's KV-shared composition on every call with them."""

    _alm: Optional[AudioLanguageModel] = None

    def audio_model(self) -> AudioLanguageModel:
        """The checkpoint's audio side over the same text model (NoTowerError where it has none)."""
        from mlxbun.towers.usm import open_audio

        if self._alm is None:
            self._alm = AudioLanguageModel(self.text_model, self.tokenizer, open_audio(self.path), self.path)
        return self._alm

    def prepare(self, prompt: str, images: Sequence = (), *, clips: Sequence = (), videos: Sequence = (),
                fps: Optional[float] = None, add_special_tokens: bool = True) -> MediaPrompt:
        """Read, preprocess and splice `images` and `clips` into `prompt`, run the towers, merge:
        every input checked (counts, files, lengths, context) before a tower runs."""
        if videos:
            check_videos(None, len(videos), len(images), f"{self.path}: gemma3n")
        v = self.vision
        self.check_images(images)
        alm = self.audio_model() if clips else None
        if alm is not None:
            alm.check_clips(clips)
        image = self._token(v.image_token_id, "image")
        text = self._placeholders(prompt, image, len(images), ImageCountError, "image")
        text = text if alm is None else alm.placeholders(text, len(clips))  # before any file is read
        pil = [load_image(i) for i in images]  # ImageUnreadable / ImageTruncated
        if alm is not None:
            text, mel, mel_mask = alm.read_clips(text, clips)
        boi, eoi = self._token(v.boi_token_id, "begin-of-image"), self._token(v.eoi_token_id, "end-of-image")
        text = expand_prompt(text, image, [v.image_text(boi, image, eoi)] * len(images))
        ids = self._ids(text, add_special_tokens, len(images) or len(clips), TooManyImages if images else TooManyClips,
                        "image" if images else "clip")
        pixels = mx.array(v.preprocess(pil)) if pil else None
        features = None if pixels is None else v.soft_tokens(pixels)
        audio = None if alm is None else (alm.audio.audio_token_id, alm.audio.soft_tokens(mel, mel_mask))
        embeddings = v.merge(self.text_model.embed_tokens, ids[None], features, audio)
        soft = len(images) * v.tokens_per_image + (0 if alm is None else int(audio[1].shape[0] * audio[1].shape[1]))
        return MediaPrompt(text, ids, pixels, None, features, embeddings, len(images), soft,
                           image_token_id=v.image_token_id, n_clips=len(clips))


