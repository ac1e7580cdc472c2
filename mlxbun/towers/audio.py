"""Audio in: WAV files read as mlx-vlm reads them, and the Gemma3n / USM log-mel features its
processor computes (transformers' Gemma3nAudioFeatureExtractor, numpy, the same ops in the same
order), every bad input refused by name before any tower work (towers.errors).

mlx-vlm 0.7.10 reads an audio file through mlx_audio (soundfile: PCM scaled to [-1, 1) in
float32, channels averaged, resampled to the processor's rate). mlxbun reads RIFF/WAVE 16-bit
PCM with the standard library's `wave` (x / 32768 in float32, which is soundfile's scaling) and
averages the channels in float32 as mlx-vlm does; a clip at another sample rate or sample width
is refused (AudioFormatError) rather than resampled or rescaled differently.
"""

from __future__ import annotations

import dataclasses
import json
import math
import wave
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlxbun.errors import ConfigError
from mlxbun.towers.errors import AudioFormatError, AudioTooLong, AudioTruncated, AudioUnreadable

__all__ = ["AudioFeatures", "MelConfig", "conv_weight", "load_modules", "log_mel", "preemphasized_frames", "read_json",
           "read_wav"]


def read_wav(path) -> tuple[np.ndarray, int]:
    """(samples [n] float32 mono, sample rate) of a 16-bit PCM WAV file."""
    p = Path(path)
    if not p.is_file():
        raise AudioUnreadable(f"{path}: no such audio file" if not p.exists() else f"{path}: not a file")
    head = p.read_bytes()[:12]
    if len(head) < 12 or head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        if head[:4] == b"RIFF" and len(head) < 12:
            raise AudioTruncated(f"{path}: the WAV header ends early ({len(head)} bytes)")
        raise AudioUnreadable(f"{path}: not a RIFF/WAVE file")
    try:
        with wave.open(str(p), "rb") as w:
            channels, width, rate, frames = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            if width != 2:
                raise AudioFormatError(f"{path}: {8 * width}-bit samples; mlxbun reads 16-bit PCM WAV only")
            data = w.readframes(frames)
    except (EOFError, wave.Error) as e:
        if "unknown format" in str(e):
            raise AudioFormatError(f"{path}: {e} (mlxbun reads 16-bit PCM WAV only)") from None
        raise AudioTruncated(f"{path}: the WAV data ends early ({e})") from None
    if len(data) < frames * channels * width:
        raise AudioTruncated(f"{path}: the header declares {frames} frames but the data holds "
                             f"{len(data) // (channels * width)}")
    if frames == 0:
        raise AudioUnreadable(f"{path}: no audio frames")
    audio = (np.frombuffer(data, dtype="<i2").astype(np.float32) / np.float32(32768.0)).reshape(frames, channels)
    audio = audio.mean(axis=1) if channels > 1 else audio[:, 0]  # mlx-vlm's load_audio downmix
    return np.asarray(audio, dtype=np.float32), rate


@dataclasses.dataclass(frozen=True)
class MelConfig:
    """Gemma3nAudioFeatureExtractor's settings (preprocessor_config.json)."""

    feature_size: int = 128
    sampling_rate: int = 16_000
    padding_value: float = 0.0
    frame_length_ms: float = 32.0
    hop_length_ms: float = 10.0
    min_frequency: float = 125.0
    max_frequency: float = 7600.0
    preemphasis: float = 0.97
    preemphasis_htk_flavor: bool = True
    fft_overdrive: bool = True
    dither: float = 0.0
    input_scale_factor: float = 1.0
    mel_floor: float = 1e-5
    per_bin_mean: Optional[tuple] = None
    per_bin_stddev: Optional[tuple] = None
    max_length: int = 480_000  # the processor call's defaults
    pad_to_multiple_of: int = 128

    @classmethod
    def from_config(cls, cfg: dict) -> "MelConfig":
        if cfg.get("dither", 0.0):
            raise AudioFormatError("a dithering feature extractor (random noise per call) is not reproducible")
        if cfg.get("padding_side", "right") != "right":
            raise AudioFormatError(f"feature extractor padding_side {cfg['padding_side']!r} (mlxbun pads right)")
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in fields}
        return cls(**kw)

    @property
    def frame_length(self) -> int:
        return int(round(self.sampling_rate * self.frame_length_ms / 1000.0))

    @property
    def hop_length(self) -> int:
        return int(round(self.sampling_rate * self.hop_length_ms / 1000.0))

    @property
    def fft_length(self) -> int:
        n = 2 ** math.ceil(math.log2(self.frame_length))
        return n * 2 if self.fft_overdrive else n


def _mel_filters(n_freqs: int, f_min: float, f_max: float, n_mels: int, sample_rate: int,
                 fft_length: int) -> np.ndarray:
    """transformers' create_fb_matrix (norm None), op for op."""
    all_freqs = np.arange(n_freqs, dtype=np.float32) * (sample_rate / fft_length)
    m_min = 2595.0 * math.log10(1.0 + (f_min / 700.0))
    m_max = 2595.0 * math.log10(1.0 + (f_max / 700.0))
    m_pts = np.linspace(m_min, m_max, n_mels + 2)
    f_pts = 700.0 * (10 ** (m_pts / 2595.0) - 1.0)
    f_diff = f_pts[1:] - f_pts[:-1]
    slopes = np.expand_dims(f_pts, 0) - np.expand_dims(all_freqs, 1)
    zero = np.zeros(1, dtype=np.float32)
    down_slopes = (-1.0 * slopes[:, :-2]) / f_diff[:-1]
    up_slopes = slopes[:, 2:] / f_diff[1:]
    return np.maximum(zero, np.minimum(down_slopes, up_slopes))


def preemphasized_frames(waveform: np.ndarray, cfg: MelConfig, samples: int) -> np.ndarray:
    """[1, frames, frame_length]: the extractors' unfold of frame_length + 1 samples every hop,
    then their preemphasis (HTK's: the first sample scaled by 1 - p) or the extra sample dropped."""
    size = cfg.frame_length + 1
    n = (waveform.shape[1] - size) // cfg.hop_length + 1
    if n <= 0:
        raise AudioTooLong(f"a clip of {samples} samples is shorter than one {size}-sample frame")
    strides = (waveform.strides[0], waveform.strides[1] * cfg.hop_length, waveform.strides[1])
    frames = np.lib.stride_tricks.as_strided(waveform, shape=(1, n, size), strides=strides)
    p = cfg.preemphasis
    if p <= 0.0:
        return frames[..., :-1]
    if cfg.preemphasis_htk_flavor:
        return np.concatenate([frames[..., :1] * (1.0 - p), frames[..., 1:-1] - p * frames[..., :-2]], axis=-1)
    return frames[..., 1:] - p * frames[..., :-1]


def load_modules(path: Path, config: Mapping, index, modules: Mapping[str, Any],
                 prepare: Optional[Callable[[dict], dict]] = None) -> None:
    """Each module's tensors (its checkpoint prefix -> module), first through `prepare` (a tower's
    own sanitize) where given, PyTorch-layout conv weights moved (conv_weight), quantized as the
    config says, loaded strictly (towers.loader._load)."""
    from mlxbun.quant import resolve_quantization
    from mlxbun.towers.loader import _load

    names = [n for n in index.names() if n.startswith(tuple(p + "." for p in modules))]
    loaded = index.load(names)
    tensors = {n: conv_weight(n, w) for n, w in (loaded if prepare is None else prepare(loaded)).items()}
    quantization = resolve_quantization(config)
    for prefix, module in modules.items():
        _load(module, prefix, tensors, quantization, path)
    mx.eval([m.parameters() for m in modules.values()])


@dataclasses.dataclass
class AudioFeatures:
    """The processor's output for a prompt's clips."""

    features: np.ndarray  # [clips, frames, mel bins] float32 (padded to the longest clip)
    mask: np.ndarray  # [clips, frames] bool, True where a frame holds audio
    samples: tuple  # each clip's sample count


def log_mel(clips: Sequence[np.ndarray], cfg: MelConfig) -> AudioFeatures:
    """Gemma3nAudioFeatureExtractor.__call__ (padding "longest" to a multiple of 128 samples,
    attention mask, per-clip log-mel spectrogram, per-bin normalization)."""
    for i, c in enumerate(clips):
        if len(c) > cfg.max_length:
            raise AudioTooLong(f"clip {i + 1}: {len(c)} samples, past the processor's {cfg.max_length} "
                               f"({cfg.max_length / cfg.sampling_rate:g} s; mlx-vlm would cut it)")
    target = max(len(c) for c in clips)
    if target % cfg.pad_to_multiple_of:
        target = (target // cfg.pad_to_multiple_of + 1) * cfg.pad_to_multiple_of
    window = (0.5 * (1 - np.cos(2 * np.pi * np.arange(cfg.frame_length, dtype=np.float32) / cfg.frame_length)))
    window = window.astype(np.float32)
    filters = _mel_filters(cfg.fft_length // 2 + 1, cfg.min_frequency, cfg.max_frequency, cfg.feature_size,
                           cfg.sampling_rate, cfg.fft_length)
    mean = None if cfg.per_bin_mean is None else np.array(cfg.per_bin_mean).reshape(1, 1, cfg.feature_size)
    std = None if cfg.per_bin_stddev is None else np.array(cfg.per_bin_stddev).reshape(1, 1, cfg.feature_size)
    floor = np.array(cfg.mel_floor, dtype=np.float64)
    features, masks = [], []
    for clip in clips:
        speech = np.asarray([clip]).T  # [n, 1] as the extractor holds it
        attention = np.ones(len(speech), dtype=np.int32)
        pad = target - len(speech)
        if pad:
            attention = np.pad(attention, (0, pad))
            speech = np.pad(speech, (0, pad), "constant", constant_values=cfg.padding_value)
        if speech.dtype == np.float64:
            speech = speech.astype(np.float32)
        waveform = speech.T
        if cfg.input_scale_factor != 1.0:
            waveform = waveform * cfg.input_scale_factor
        frames = preemphasized_frames(waveform, cfg, len(clip)) * window
        magnitude = np.abs(np.fft.rfft(frames, n=cfg.fft_length, axis=-1))
        spec = np.log(np.maximum(np.matmul(magnitude, filters), floor))
        if mean is not None:
            spec = spec - mean
        if std is not None:
            spec = spec / std
        spec = spec.squeeze(0)
        features.append(spec.astype(np.float32))
        masks.append(attention[:: cfg.hop_length].astype(bool)[: spec.shape[0]])
    return AudioFeatures(np.stack(features), np.stack(masks), tuple(len(c) for c in clips))


def conv_weight(name: str, w: mx.array) -> mx.array:
    """mlx-vlm's audio sanitize: a PyTorch-layout conv weight transposed to mlx's (check_array_shape)."""
    if name.endswith("conv1d.weight") and w.ndim == 3:
        return w if w.shape[1] >= w.shape[2] else w.transpose(0, 2, 1)
    if name.endswith("conv.weight") and w.ndim == 4:
        out, kh, kw, _ = w.shape
        return w if (out >= kh and out >= kw and kh == kw) else w.transpose(0, 2, 3, 1)
    return w


def read_json(f: Path, missing_ok: bool = False) -> dict:
    try:
        return json.loads(f.read_text(encoding="utf-8"))
    except FileNotFoundError:
        if missing_ok:
            return {}
        raise ConfigError(f"{f}: missing (the audio feature extractor's settings)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(f"{f}: unreadable ({e})") from None
