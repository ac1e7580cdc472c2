"""Images into the wrapped VLMs: a checkpoint's text graph plus its tower (mlxbun.towers), the
prompt spliced and tokenized as mlx-vlm's processor, the soft tokens merged into the text
embeddings as mlx-vlm's model, then mlxbun's own token loop (generate.py) over a RuntimeModel
that feeds the merged rows at the prompt's positions. Every bad input is refused by name before
any tower or text work (mlxbun.towers.errors).

    vlm = open_vlm("path/to/checkpoint")
    prompt = vlm.prepare("<start_of_image> what is this?", ["photo.png"])
    for r in stream_generate(vlm, prompt, max_tokens=32): ...

A Qwen-VL row takes a video instead (its frames: towers/video.py):
`vlm.prepare("what happens?", videos=["frames/"])`.

Here: the ViT-tower rows (`VisionLanguageModel`), the openers and refusals, the token loop over a
prompt; `prompt.py`: the prompt and the RuntimeModel that feeds its merged rows; `spliced.py`:
the gemma-style paths (audio, gemma4 / gemma3n images) whose soft tokens replace media tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from mlxbun.errors import GenerationError, UnsupportedModelError
from mlxbun.towers.errors import ImageCountError, NoTowerError, TooManyFrames, TooManyImages
from mlxbun.towers.images import Pixels, load_image, preprocess_any
from mlxbun.towers.knobs import TextPositions, VideoKind
from mlxbun.towers.loader import VisionStack, open_vision
from mlxbun.towers.mrope import MRopeText, rope_index
from mlxbun.towers.splice import count_placeholders, expand_prompt, merge_embeddings
from mlxbun.towers.table import tower_for
from mlxbun.towers.video import (VideoSpec, check_videos, count_videos, expand_videos, load_video, preprocess_videos,
                                 read_video_spec, rope_grids, video_timestamps)
from mlxbun.multimodal.prompt import MAX_IMAGES, EmbeddedPrompt, MediaPrompt, check_image_count
from mlxbun.multimodal.spliced import (AudioLanguageModel, AudioPrompt, Gemma3nImageModel, Gemma4ImageModel,
                                      load_clip)

__all__ = ["MAX_IMAGES", "AudioLanguageModel", "AudioPrompt", "EmbeddedPrompt", "Gemma3nImageModel",
           "Gemma4ImageModel", "MediaPrompt", "VisionLanguageModel", "load_clip", "open_alm", "open_vlm",
           "refuse_audio", "refuse_images", "refuse_video", "stream_generate"]


class VisionLanguageModel:
    """A checkpoint's text RuntimeModel, tokenizer and vision stack."""

    def __init__(self, text_model, tokenizer, vision: VisionStack, path: Path):
        self.text_model, self.tokenizer, self.vision, self.path = text_model, tokenizer, vision, path

    def _token(self, token_id: Optional[int], what: str) -> str:
        t = None if token_id is None else self.tokenizer.id_to_token(int(token_id))
        if t is None:
            raise GenerationError(f"{self.path}: the tokenizer has no {what} token (id {token_id})")
        return t

    def check_images(self, images: Sequence) -> None:
        check_image_count(images)

    def _marks(self) -> dict[str, str]:
        """The media tokens' texts: placeholder (what the prompt holds per image), boi, image, eoi,
        and pixtral's break / end."""
        v, d = self.vision, self.vision.descriptor
        image = self._token(v.image_token_id, "image")
        marks = {"image": image, "break": d.break_token or "", "end": d.end_token or "",
                 "start": d.start_token or "", "end_image": d.image_end_token or "",
                 "thumbnail": d.thumbnail_token or ""}
        if d.boi_key is not None:
            marks["boi"] = self._token(v.boi_token_id, "begin-of-image")
        if d.eoi_key is not None:
            marks["eoi"] = self._token(v.eoi_token_id, "end-of-image")
        marks["placeholder"] = image if d.placeholder_key == d.image_token_key else marks["boi"]
        video = None if v.video_token_id is None else self.tokenizer.id_to_token(int(v.video_token_id))
        if d.video is not VideoKind.NONE and video is not None:
            marks["video"] = video
        return marks

    def placeholders(self, prompt: str, n_images: int) -> str:
        """`prompt` with its image placeholders counted (ImageCountError where they and the
        images disagree); a prompt without any gets the row's lead per image in front."""
        marks = self._marks()
        lead = self.vision.descriptor.lead.format(**marks)
        text, found = count_placeholders(prompt, marks["placeholder"], n_images, lead)
        if found != n_images:
            raise ImageCountError(f"the prompt holds {found} image placeholder(s) ({marks['placeholder']!r}) but "
                                  f"{n_images} image(s) were given")
        return text

    def expand(self, prompt: str, pixels: Pixels) -> str:
        """The prompt text with each image placeholder expanded to its soft tokens (`pixels`: the
        processor's output for the images), as the processor writes it."""
        marks = self._marks()
        texts = self.vision.image_texts(marks, pixels)
        return expand_prompt(self.placeholders(prompt, len(texts)), marks["placeholder"], texts)

    def prepare(self, prompt: str, images: Sequence = (), *, videos: Sequence = (), fps: Optional[float] = None,
                add_special_tokens: bool = True) -> MediaPrompt:
        """Read, preprocess and splice `images` (or `videos`: each a frame directory, .npy file,
        frame list or array; `fps` their frame rate, default the processor's) into `prompt`, run
        the tower, merge: every input checked (count, files, context) before the tower runs."""
        if videos:
            return self._prepare_videos(prompt, videos, images, fps, add_special_tokens)
        self.check_images(images)
        self.placeholders(prompt, len(images))  # ImageCountError before any file is read
        count_videos(prompt, self._marks(), self.vision.descriptor, 0, self.path)  # VideoCountError
        pil = [load_image(i) for i in images]  # ImageUnreadable / ImageTruncated
        pixels = preprocess_any(pil, self.vision.processor)
        text = self.expand(prompt, pixels)
        ids = self._encode(text, add_special_tokens, TooManyImages, f"{len(images)} image(s)")
        return self.merge(text, ids, pixels, len(images))

    def _encode(self, text: str, add_special_tokens: bool, error, what: str) -> mx.array:
        """The expanded prompt's ids [L]; `error` past the model's context."""
        ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens and self.vision.descriptor.special_tokens)
        limit = getattr(getattr(self.text_model, "args", None), "fields", {}).get("max_position_embeddings")
        if limit and len(ids) > limit:
            raise error(f"{what} make the prompt {len(ids)} tokens, past the model's {limit}-token context")
        return mx.array(ids, dtype=mx.int32)

    def _prepare_videos(self, prompt: str, videos: Sequence, images: Sequence, fps: Optional[float],
                        add_special_tokens: bool) -> MediaPrompt:
        """mlx-vlm's video path: the frames through the video processor, each placeholder
        expanded (Qwen3-VL: timestamped per temporal patch), the tower over the frames, the merge
        at the video tokens, mRoPE over the video grids."""
        d, marks = self.vision.descriptor, self._marks()
        check_videos(d, len(videos), len(images), str(self.path))  # NoVideoTower / VideoCountError / TooManyFrames
        text = count_videos(prompt, marks, d, len(videos), self.path)  # VideoCountError before any frame is read
        self.placeholders(text, 0)  # image placeholders without images: ImageCountError
        spec = read_video_spec(self.path, d.model_type)
        frames = [load_video(x, spec.max_frames) for x in videos]  # VideoUnreadable / Format / TooManyFrames
        values, grid = preprocess_videos(frames, spec)
        stamps = [video_timestamps(len(f), spec.temporal_patch_size, spec.fps if fps is None else fps) for f in frames]
        text = expand_videos(d.video, text, marks, grid, stamps, spec.merge_size)
        ids = self._encode(text, add_special_tokens, TooManyFrames, f"{len(videos)} video(s)")
        return self.merge(text, ids, Pixels(values, grid), 0, token_id=self.vision.video_token_id,
                          rope_grid=rope_grids(d.video, grid), n_videos=len(videos))

    def merge(self, text: str, ids: mx.array, pixels: Pixels, n_images: int, *, token_id: Optional[int] = None,
              rope_grid=None, n_videos: int = 0) -> MediaPrompt:
        """Tower, projector and merge over ready ids [L] and the processor's output (a video's:
        `token_id` the video token, `rope_grid` the grids mRoPE walks)."""
        v = self.vision
        token_id = v.image_token_id if token_id is None else token_id
        values = mx.array(pixels.values)
        grid = None if pixels.grid is None else mx.array(pixels.grid)
        tower_grid = grid if pixels.mask is None else (pixels.grid, pixels.mask)
        embeds = self.text_model.embed_tokens(ids[None])
        features, deepstack = v.features_and_deepstack(values, embeds.dtype, tower_grid)
        merged = merge_embeddings(v.descriptor.merge, ids[None], embeds, features,
                                  image_token_id=token_id, pad_token_id=v.pad_token_id,
                                  hidden_size=v.merge_hidden)
        out = MediaPrompt(text, ids, values, grid, features, merged, n_images, v.soft_token_count(pixels),
                          deepstack=tuple(deepstack), image_token_id=token_id, mask=pixels.mask, n_videos=n_videos)
        if v.descriptor.text_positions is not TextPositions.PLAIN:
            rope_grid = np.asarray(grid).tolist() if rope_grid is None else rope_grid
            positions, out.position_delta = rope_index(ids.tolist(), rope_grid, image_token_id=token_id,
                                                       vision_start_token_id=v.boi_token_id,
                                                       merge=v.tower.config.spatial_merge_size)
            out.positions = mx.array(positions)[:, None, :]
        return out

    def mrope(self) -> Optional[MRopeText]:
        """The text model run with mRoPE positions (Qwen2-VL's rows), else None."""
        kind = self.vision.descriptor.text_positions
        if kind is TextPositions.PLAIN:
            return None
        if not hasattr(self.text_model, "backbone"):
            raise UnsupportedModelError(f"{self.path}: mRoPE positions need mlxbun's universal text graph")
        return MRopeText(self.text_model, interleaved=kind is TextPositions.MROPE_INTERLEAVED,
                         section=self._mrope_section())

    def _mrope_section(self) -> Optional[list]:
        """The config's mrope_section (text_config's, else the top level's; rope_scaling or
        rope_parameters), as mlx-vlm's text model reads it."""
        from mlxbun.towers.loader import _read_config

        cfg = _read_config(self.path)
        for c in (cfg.get("text_config") or {}, cfg):
            for key in ("rope_scaling", "rope_parameters"):
                block = c.get(key) or {}
                if isinstance(block, dict) and block.get("mrope_section"):
                    return list(block["mrope_section"])
        return None

    def check_generation(self) -> None:
        """Refuse generation where the text model would need positions mlxbun does not build."""
        self.mrope()

    def logits(self, prompt: MediaPrompt, cache: Optional[list] = None) -> mx.array:
        """The text model's logits [1, L, V] over the merged prompt in one call."""
        m, rope = self.text_model, self.mrope()
        if rope is not None:
            return rope.logits(prompt.ids[None], cache, prompt.positions, prompt.embeddings, prompt.deepstack,
                               prompt.visual_rows(0, prompt.ids.shape[0]))
        return m.logits_from_hidden(m.forward_hidden(prompt.ids[None], cache, input_embeddings=prompt.embeddings))


def refuse_video(path, what: str = "a video") -> VideoSpec:
    """The video processor's settings of `path`; NoTowerError where it has no tower mlxbun
    builds, NoVideoTower where its tower takes no video (checked before any work)."""
    from mlxbun.towers.loader import _read_config

    refuse_images(path, what)
    model_type = _read_config(Path(path)).get("model_type")
    check_videos(tower_for(model_type), 1, 0, f"{what} given, but {path}: {model_type}")
    return read_video_spec(Path(path), model_type)


def open_alm(path) -> AudioLanguageModel:
    """A checkpoint's text graph, tokenizer and audio tower (NoTowerError where it has none); `path`
    a directory or any model name (mlxbun.locate: `zoo:gemma3n-audio`, ORG/REPO, ...)."""
    from mlxbun.factory import open_model
    from mlxbun.locate import locate
    from mlxbun.tokenizer import load_tokenizer
    from mlxbun.towers.usm import open_audio

    path = locate(path)
    audio = open_audio(path)
    return AudioLanguageModel(open_model(path), load_tokenizer(path), audio, path)


def refuse_audio(path, what: str = "audio") -> None:
    """NoTowerError unless `path` holds an audio tower mlxbun builds (checked before any work)."""
    from mlxbun.towers.usm import check_audio_tower

    _refuse(check_audio_tower, path, what)


def _refuse(check, path, what: str) -> None:
    """`check(path, config)`'s NoTowerError, said as what was given."""
    from mlxbun.towers.loader import _read_config

    p = Path(path)
    try:
        check(p, _read_config(p))
    except NoTowerError as e:
        raise NoTowerError(f"{what} given, but {e}") from None


def open_vlm(path):
    """A checkpoint's text graph, tokenizer and tower (NoTowerError where it has none): a
    VisionLanguageModel, or for gemma4 / gemma3n a Gemma4ImageModel / Gemma3nImageModel; `path` a
    directory or any model name (mlxbun.locate: `zoo:gemma3-vision@q8`, ORG/REPO, ...)."""
    from mlxbun.factory import open_model
    from mlxbun.locate import locate
    from mlxbun.tokenizer import load_tokenizer

    path = locate(path)
    if _gemma4(path):
        from mlxbun.towers.gemma4_vision import open_gemma4_vision
        from mlxbun.towers.loader import _read_config

        vision = open_gemma4_vision(path, _read_config(path), _gemma4_vision_index(path))
        return Gemma4ImageModel(open_model(path), load_tokenizer(path), vision, path)
    if _gemma3n(path):
        from mlxbun.towers.gemma3n_vision import open_gemma3n_vision
        from mlxbun.towers.loader import _read_config

        vision = open_gemma3n_vision(path, _read_config(path))
        return Gemma3nImageModel(open_model(path), load_tokenizer(path), vision, path)
    vision = open_vision(path)
    if vision.descriptor.model_type == "kimi_vl":  # mlx-vlm's own text model beside its tower
        from mlxbun.towers.kimi_vl_text import open_kimi_vl_text

        model = open_kimi_vl_text(path)
    else:
        model = open_model(path)
    if not hasattr(model, "embed_tokens"):
        raise NoTowerError(f"{path}: its text graph ({type(model).__name__}) takes no input embeddings")
    return VisionLanguageModel(model, load_tokenizer(path), vision, path)


def refuse_images(path, what: str = "images") -> None:
    """NoTowerError unless `path` holds a tower mlxbun builds (checked before any work)."""
    from mlxbun.towers.gemma3n_vision import check_vision_tower
    from mlxbun.towers.loader import _check_tower

    check = (lambda p, config: _gemma4_vision_index(p)) if _gemma4(path) else \
        check_vision_tower if _gemma3n(path) else _check_tower
    _refuse(check, path, what)


def _gemma4(path) -> bool:
    from mlxbun.towers.loader import _read_config

    return _read_config(Path(path)).get("model_type") == "gemma4"


def _gemma3n(path) -> bool:
    from mlxbun.towers.loader import _read_config

    return _read_config(Path(path)).get("model_type") == "gemma3n"


def _gemma4_vision_index(path):
    """The weight index of a gemma4 checkpoint that holds its vision tower (NoTowerError if not)."""
    from mlxbun.weights import read_index

    index = read_index(Path(path))
    if not any(n.startswith(("vision_tower.", "model.vision_tower.")) for n in index.names()):
        raise NoTowerError(f"{path}: gemma4 checkpoint holds no vision_tower.* tensors (a text-only build): "
                           "it takes token ids only")
    return index


def stream_generate(vlm, prompt, **kwargs):
    """mlxbun.generate.stream_generate over the merged prompt of a VisionLanguageModel's
    MediaPrompt or an AudioLanguageModel's AudioPrompt (same options; `fast` refused: the
    compiled step knows no input embeddings)."""
    from mlxbun.generate import stream_generate as text_stream

    if kwargs.get("fast"):
        raise GenerationError("--fast does not take images or audio (the compiled step runs token ids only)")
    if kwargs.get("prompt_cache") is not None:
        raise GenerationError("a prompt cache cannot be combined with images or audio (its rows are the ids' "
                              "embeddings)")
    rope = vlm.mrope()
    if rope is not None and any(kwargs.get(k) is not None for k in ("kv_bits", "max_kv_size", "kv_key_bits",
                                                                     "kv_value_bits")):
        raise GenerationError("images through mRoPE run on plain KV caches only (no KV quantization, "
                              "no bounded cache)")
    model = EmbeddedPrompt(vlm.text_model, prompt.embeddings, rope, prompt.positions, prompt.position_delta, prompt,
                           getattr(vlm, "hidden_kw", None))
    if getattr(prompt, "prompt_kw", None):  # gemma4's bidirectional image attention: mlx-vlm's unchunked prefill
        kwargs["prefill_whole"] = True
    return text_stream(model, vlm.tokenizer, prompt.ids, **kwargs)
