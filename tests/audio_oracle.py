"""What the audio tests share: WAV files written with the standard library's wave module, the
samples mlx-vlm's load_audio makes of them, and the prompt's logits held bit-exact to mlx-vlm's text
model on its merged rows (gemma3n's audio and images)."""

from __future__ import annotations

import wave
from pathlib import Path

import mlx.core as mx
import numpy as np

__all__ = ["RATE", "prompt_logits_equal", "samples_of", "write_wav"]

RATE = 16_000


def write_wav(path: Path, samples: np.ndarray, rate: int = RATE, width: int = 2) -> Path:
    """Samples in [-1, 1) ([n] or [n, channels]) as PCM of `width` bytes."""
    x = samples if samples.ndim == 2 else samples[:, None]
    if width == 2:
        data = np.clip(np.round(x * 32768), -32768, 32767).astype("<i2").tobytes()
    else:
        data = np.clip(np.round(x * 128 + 128), 0, 255).astype(np.uint8).tobytes()
    with wave.open(str(path), "wb") as w:
        w.setnchannels(x.shape[1])
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(data)
    return path


def samples_of(path: Path) -> np.ndarray:
    """What mlx-vlm's load_audio makes of the file (soundfile's float32 PCM scaling, channels averaged)."""
    with wave.open(str(path), "rb") as w:
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32).reshape(-1, w.getnchannels())
    x = x / np.float32(32768.0)
    return x.mean(axis=1) if x.shape[1] > 1 else x[:, 0]


def prompt_logits_equal(alm, model, ref, emb, ours):
    """The prompt's logits over caches, mlx-vlm's text model on its merged rows and per-layer
    inputs vs mlxbun's, in one call and as generate prefills (all but the last, then it)."""
    lm, m, n = model.language_model, alm.text_model, ours.ids.shape[0]
    for splits in ([n], [n - 1, 1]):
        c1, c2, s = lm.make_cache(), m.make_cache(), 0
        for k in splits:
            want = lm(ref["input_ids"][:, s:s + k], inputs_embeds=emb.inputs_embeds[:, s:s + k], cache=c1,
                      per_layer_inputs=emb.per_layer_inputs).logits
            got = m.logits_from_hidden(m.forward_hidden(ours.ids[None, s:s + k], c2,
                                                        input_embeddings=ours.embeddings[:, s:s + k],
                                                        **alm.hidden_kw))
            assert mx.array_equal(got, want), f"prompt logits differ ({splits}, from {s})"
            s += k
