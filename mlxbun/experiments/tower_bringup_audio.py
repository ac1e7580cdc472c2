"""tower_bringup.ipynb's audio side: a checkpoint's audio tower (gemma3n's USM, gemma4's
conformer: mlxbun.towers.usm / usm4) held to mlx-vlm over the audio frames.

One clip goes through the feature extractor (mlxbun's log-mel frames and mask, checked equal to
mlx-vlm's processor), then through mlxbun's tower and mlx-vlm's, stage by stage: the subsampling
stack, every conformer block, the tower's output (gemma3n: reduced and masked; gemma4: its output
projection), the embedder's soft tokens. Per stage, the largest |mlxbun - mlx-vlm| of each frame
(over the features): 0 everywhere is bit-exact. Beside it: the log-mel frames and the soft tokens
merged into the prompt's audio-token rows.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.experiments.tower_bringup_result import TowerBringup, row_diffs
from mlxbun.multimodal import AudioLanguageModel, load_clip
from mlxbun.towers.usm4 import Gemma4Audio

__all__ = ["audio_bringup", "default_clip", "oracle_audio_stages"]


def default_clip(rate: int, seconds: float = 0.6) -> np.ndarray:
    """A rising chirp (300 Hz to 3 kHz, amplitude 0.3) drawn here, float32 at `rate`: no file. 0.6 s
    gives gemma4 15 audio tokens, as many as its tower's encodings."""
    t = np.arange(int(rate * seconds)) / rate
    f0, f1 = 300.0, 3000.0
    return (0.3 * np.sin(2 * np.pi * (f0 * t + (f1 - f0) / (2 * seconds) * t**2))).astype(np.float32)


def oracle_audio_stages(model, features: mx.array, padded: mx.array, subsampled_mask=None) -> list[mx.array]:
    """mlx-vlm's audio tower stage by stage with its own modules and methods (its __call__ returns
    only the end): the subsampling stack, each conformer block, the tower's output, the embedder's
    soft tokens. `padded`: True where a frame is padding. gemma3n's __call__ subsamples the mask
    inline: `subsampled_mask(padded, frames)` gives it (mlxbun's; the output stage, mlx-vlm's own
    __call__, holds it)."""
    tower = model.audio_tower
    if hasattr(tower, "conformer"):  # gemma3n
        x = tower.subsample_conv_projection(features)
        mask = subsampled_mask(padded, x.shape[1])
        out = [x]
        for block in tower.conformer:
            out.append(x := block(x, mask))
        enc, _ = tower(features, padded)
        return out + [enc, model.embed_audio(inputs_embeds=enc)]
    x, mask = tower.subsample_conv_projection(features, padded)
    local = tower._build_causal_valid_mask()
    out = [x]
    for block in tower.layers:
        out.append(x := block(x, mask, local))
    enc, _ = tower(features, padded)
    return out + [enc, model.embed_audio(enc)]


def _our_stages(alm: AudioLanguageModel, features: mx.array, mask: mx.array) -> list[tuple[str, mx.array]]:
    """mlxbun's stages, named as the checkpoint's modules (gemma3n: conformer.i; gemma4: layers.i)."""
    a = alm.audio
    taps: list = []
    enc, _ = a.tower(features, ~mask, taps=taps)
    gemma4 = isinstance(a, Gemma4Audio)
    embedded = a.embed_audio(enc) if gemma4 else a.embed_audio.soft(enc)
    blocks = "layers" if gemma4 else "conformer"
    names = ["subsample"] + [f"{blocks}.{i}" for i in range(len(taps) - 1)] + ["output", "embedder"]
    return list(zip(names, taps + [enc, embedded]))


def audio_bringup(alm: AudioLanguageModel, oracle, clip=None, prompt: Optional[str] = None) -> TowerBringup:
    """Hold `alm`'s audio tower to mlx-vlm's (`oracle`: its model and processor) on `clip` (a WAV
    file or samples at the processor's rate; None: `default_clip`); `prompt` None: the clip's
    placeholder, then "transcribe"."""
    from mlx_vlm.utils import prepare_inputs

    model, processor = oracle
    a = alm.audio
    samples = load_clip(default_clip(a.mel.sampling_rate) if clip is None else clip, a.mel.sampling_rate)
    text = alm.placeholders("transcribe" if prompt is None else prompt, 1)
    ref = prepare_inputs(processor, audio=[samples], prompts=[text], add_special_tokens=True)
    ours = alm.prepare(text, [samples])
    mine = _our_stages(alm, ours.features, ours.mask)
    theirs = oracle_audio_stages(model, ref["input_features"], ~ref["input_features_mask"],
                                 getattr(a.tower, "subsampled_mask", None))
    grids = {name: row_diffs(x, y)[:1] for (name, x), y in zip(mine, theirs)}  # the clip's frames
    merged = model.get_input_embeddings(ref["input_ids"], None, input_features=ref["input_features"],
                                        input_features_mask=ref["input_features_mask"])
    return TowerBringup(
        path=alm.path, media="audio", stages=[n for n, _ in mine], grids=grids,
        inputs_equal=bool(mx.array_equal(ours.features, ref["input_features"])
                          and mx.array_equal(ours.mask, ref["input_features_mask"])),
        ids_equal=ours.ids.tolist() == ref["input_ids"][0].tolist(),
        embeddings_equal=bool(mx.array_equal(ours.embeddings, merged.inputs_embeds)),
        soft_tokens=np.array(ours.soft[0].astype(mx.float32)), prompt_ids=ours.ids.tolist(),
        token_id=a.audio_token_id, mel=np.array(ours.features[0]), mel_mask=np.array(ours.mask[0]))
