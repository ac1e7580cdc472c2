"""Gemma4's audio side: its log-mel features (mlx-vlm 0.7.10's Gemma4AudioFeatureExtractor, numpy,
the same ops in the same order; the mel filters are transformers' mel_filter_bank, which it calls),
its USM conformer (`audio_tower.*`: a masked LayerNorm subsampling stack, clippable linears, chunked
local attention with a key scale, an output projection), the `embed_audio` embedder and the merge
of mlx-vlm's get_input_embeddings (the ids' scaled rows, each clip's encodings at its audio tokens,
the per-layer inputs of media ids read at id 0). The prompt gets ceil(clip ms / audio_ms_per_token)
audio tokens a clip (at most audio_seq_length), as mlx-vlm's Gemma4Processor writes them.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.errors import ConfigError
from mlxbun.towers.audio import MelConfig, preemphasized_frames
from mlxbun.towers.errors import AudioCountError, AudioTooLong

__all__ = ["Gemma4Audio", "Gemma4AudioEncoder", "Gemma4Mel", "open_gemma4_audio"]


@dataclasses.dataclass(frozen=True)
class Gemma4Mel(MelConfig):
    """Gemma4AudioFeatureExtractor's settings (processor_config.json's feature_extractor): the
    gemma3n extractor's fields at gemma4's defaults."""

    frame_length_ms: float = 20.0
    min_frequency: float = 0.0
    max_frequency: float = 8000.0
    preemphasis: float = 0.0
    fft_overdrive: bool = False
    mel_floor: float = 1e-3

    def features(self, clips: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """([clips, frames, bins] float32, [clips, frames] bool: True where a frame holds audio)."""
        from transformers.audio_utils import mel_filter_bank

        for i, c in enumerate(clips):
            if len(c) > self.max_length:
                raise AudioTooLong(f"clip {i + 1}: {len(c)} samples, past the processor's {self.max_length} "
                                   f"({self.max_length / self.sampling_rate:g} s; mlx-vlm would cut it)")
        fft = self.fft_length
        window = 0.5 - 0.5 * np.cos(2.0 * np.pi * np.arange(self.frame_length, dtype=np.float32) / self.frame_length)
        with warnings.catch_warnings():  # its all-zero lowest filters at 128 bins (mlx-vlm's warn too)
            warnings.simplefilter("ignore", UserWarning)
            filters = mel_filter_bank(num_frequency_bins=fft // 2 + 1, num_mel_filters=self.feature_size,
                                      min_frequency=self.min_frequency, max_frequency=self.max_frequency,
                                      sampling_rate=self.sampling_rate, norm=None, mel_scale="htk")
        n = self.feature_size
        mean = None if self.per_bin_mean is None else np.array(self.per_bin_mean).reshape(1, 1, n)
        std = None if self.per_bin_stddev is None else np.array(self.per_bin_stddev).reshape(1, 1, n)
        floor = np.array(self.mel_floor, dtype=np.float64)
        target = min(max(len(c) for c in clips), self.max_length)
        if target % self.pad_to_multiple_of:
            target = (target // self.pad_to_multiple_of + 1) * self.pad_to_multiple_of
        out, masks = [], []
        for clip in clips:
            w = np.asarray(clip, dtype=np.float32).flatten()
            attention = np.ones(target, dtype=np.int32)
            if len(w) < target:
                attention[len(w):] = 0
                w = np.pad(w, (0, target - len(w)), constant_values=self.padding_value)
            wave = np.array([w]).reshape(1, -1)
            if self.input_scale_factor != 1.0:
                wave = wave * self.input_scale_factor
            left = self.frame_length // 2
            wave = np.pad(wave, ((0, 0), (left, 0)), mode="constant")
            attention = np.pad(attention, (left, 0), mode="constant", constant_values=0)
            frames = preemphasized_frames(wave, self, len(clip))
            spec = np.log(np.matmul(np.abs(np.fft.rfft(frames * window, n=fft, axis=-1)), filters) + floor)
            if mean is not None:
                spec = spec - mean
            if std is not None:
                spec = spec / std
            spec = spec.squeeze(0)
            ends = np.arange(spec.shape[0]) * self.hop_length + self.frame_length
            m = attention[ends].astype(bool)
            out.append(spec.astype(np.float32) * m[..., None])
            masks.append(m)
        return np.stack(out), np.stack(masks)


class ClippableLinear(nn.Module):
    """A bias-free linear whose input and output are clipped to the checkpoint's bounds."""

    def __init__(self, d_in: int, d_out: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.clipped = clipped
        if clipped:
            self.input_min, self.input_max = mx.array(float("-inf")), mx.array(float("inf"))
            self.output_min, self.output_max = mx.array(float("-inf")), mx.array(float("inf"))

    def __call__(self, x: mx.array) -> mx.array:
        if self.clipped:
            x = mx.clip(x, self.input_min, self.input_max)
        x = self.linear(x)
        return mx.clip(x, self.output_min, self.output_max) if self.clipped else x


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = mx.ones((dim,)), eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


class SubsampleBlock(nn.Module):
    def __init__(self, c_in: int, c_out: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=(3, 3), stride=(2, 2), padding=0, bias=False)
        self.norm = nn.LayerNorm(c_out, eps=eps, bias=False)

    def __call__(self, x: mx.array, mask: mx.array):
        x = mx.where(mask[:, :, None, None], 0.0, x)
        x = self.conv(mx.pad(x, [(0, 0), (1, 1), (1, 1), (0, 0)]))
        return nn.relu(self.norm(x)), mask[:, ::2][:, :x.shape[1]]


class SubsampleConvProjection(nn.Module):
    FEATURES = 128  # mlx-vlm fixes the mel bins the projection reads

    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        ch, eps = c["subsampling_conv_channels"], c["rms_norm_eps"]
        self.layer0 = SubsampleBlock(1, ch[0], eps)
        self.layer1 = SubsampleBlock(ch[0], ch[1], eps)
        f = self.FEATURES
        for _ in range(2):
            f = (f + 2 - 3) // 2 + 1
        self.input_proj_linear = nn.Linear(f * ch[-1], c["hidden_size"], bias=False)

    def __call__(self, mel: mx.array, mask: mx.array):
        x, mask = self.layer0(mx.expand_dims(mel, -1), mask)
        x, mask = self.layer1(x, mask)
        b, t, f, ch = x.shape
        return self.input_proj_linear(x.reshape(b, t, f * ch)), mask


class FeedForward(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d, clip = c["hidden_size"], c["use_clipped_linears"]
        self.clip, self.residual_weight = c["gradient_clipping"], c["residual_weight"]
        self.pre_layer_norm = RMSNorm(d)
        self.ffw_layer_1 = ClippableLinear(d, d * 4, clip)
        self.ffw_layer_2 = ClippableLinear(d * 4, d, clip)
        self.post_layer_norm = RMSNorm(d)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.pre_layer_norm(mx.clip(x, -self.clip, self.clip))
        h = mx.clip(self.ffw_layer_2(nn.silu(self.ffw_layer_1(h))), -self.clip, self.clip)
        return x + self.post_layer_norm(h) * self.residual_weight


class Attention(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d, clip = c["hidden_size"], c["use_clipped_linears"]
        self.heads = c["num_attention_heads"]
        self.head_dim = d // self.heads
        self.chunk = c["attention_chunk_size"]
        self.future = c["attention_context_right"]
        self.past = max(0, c["attention_context_left"] - 1)
        self.context = self.chunk + self.past + self.future
        self.invalid, self.softcap = c["attention_invalid_logits_value"], c["attention_logit_cap"]
        self.relative_k_proj = nn.Linear(d, d, bias=False)
        self.per_dim_scale = mx.zeros((self.head_dim,))
        self.q_proj, self.k_proj = ClippableLinear(d, d, clip), ClippableLinear(d, d, clip)
        self.v_proj, self.post = ClippableLinear(d, d, clip), ClippableLinear(d, d, clip)
        self.q_scale = (self.head_dim**-0.5) / math.log(2)
        self.k_scale = math.log(1 + math.e) / math.log(2)
        n = d // 2
        self._inv_timescales = (1.0 * mx.exp(mx.arange(n) * -(math.log(10000.0) / max(n - 1, 1)))).reshape(1, 1, n)

    def _context(self, x: mx.array) -> mx.array:
        pads = [(0, 0)] * x.ndim
        pads[1] = (self.past, self.future + self.chunk - 1)
        x = mx.pad(x, pads)
        n = (x.shape[1] - self.context) // self.chunk + 1
        return x[:, (mx.arange(n) * self.chunk)[:, None] + mx.arange(self.context)[None, :]]

    def _relative_logits(self, q: mx.array, k: mx.array) -> mx.array:
        b, u, w, heads, hd = q.shape
        ctx = k.shape[2]
        pos = mx.arange(self.past, -self.future - 1, -1)[None]
        span = pos.shape[1]
        t = pos.astype(mx.float32)[..., None] * self._inv_timescales
        sin = mx.concatenate([mx.sin(t), mx.cos(t)], axis=-1).astype(q.dtype)
        sin = self.relative_k_proj(sin.astype(self.relative_k_proj.weight.dtype))
        sin = sin.reshape(span, heads, hd).astype(q.dtype)
        qp = q.transpose(0, 3, 1, 2, 4)
        ac = qp @ k.transpose(0, 3, 1, 4, 2)
        bd = (qp.reshape(b, heads, u * w, hd) @ sin.transpose(1, 2, 0)).reshape(b, heads, u, w, span)
        bd = mx.pad(bd, [(0, 0)] * 4 + [(0, ctx + 1 - span)]).reshape(b, heads, u, w * (ctx + 1))
        return ac + bd[:, :, :, : w * ctx].reshape(b, heads, u, w, ctx)

    def __call__(self, x: mx.array, mask: mx.array, local: mx.array) -> mx.array:
        b, t = x.shape[:2]
        shape = (b, t, self.heads, self.head_dim)
        q = self.q_proj(x).astype(mx.float32).reshape(shape)
        k = self.k_proj(x).astype(mx.float32).reshape(shape)
        v = self.v_proj(x).astype(mx.float32).reshape(shape)
        q = q * (self.q_scale * nn.softplus(self.per_dim_scale))
        k = k * self.k_scale
        u = (t + self.chunk - 1) // self.chunk
        if u * self.chunk - t > 0:
            q = mx.pad(q, [(0, 0), (0, u * self.chunk - t), (0, 0), (0, 0)])
        qb = q.reshape(b, u, self.chunk, self.heads, self.head_dim)
        kb, vb = self._context(k), self._context(v)
        allowed = self._context(~mask)[:, None, :, None, :] & local[None, None, None, :, :]
        logits = self._relative_logits(qb, kb)
        logits = mx.where(allowed, mx.tanh(logits / self.softcap) * self.softcap, self.invalid)
        out = mx.einsum("bnuwc,bucnh->buwnh", mx.softmax(logits, axis=-1), vb)
        out = out.reshape(b, u * self.chunk, self.heads, self.head_dim)[:, :t]
        return self.post(out.reshape(b, t, self.heads * self.head_dim))


class LightConv1d(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d, clip, k = c["hidden_size"], c["use_clipped_linears"], c["conv_kernel_size"]
        self.clip, self.causal = c["gradient_clipping"], k - 1
        self.pre_layer_norm = RMSNorm(d, c["rms_norm_eps"])
        self.linear_start = ClippableLinear(d, d * 2, clip)
        self.depthwise_conv1d = nn.Conv1d(d, d, kernel_size=k, stride=1, padding=0, bias=False)
        self.depthwise_conv1d.weight = mx.zeros((d, k, 1))
        self.conv_norm = RMSNorm(d, c["rms_norm_eps"])
        self.linear_end = ClippableLinear(d, d, clip)

    def __call__(self, x: mx.array) -> mx.array:
        a, g = mx.split(self.linear_start(self.pre_layer_norm(x)), 2, axis=-1)
        h = mx.pad(a * mx.sigmoid(g), [(0, 0), (self.causal, 0), (0, 0)])
        h = mx.conv_general(h, self.depthwise_conv1d.weight, stride=1, padding=0, groups=h.shape[-1])
        return self.linear_end(nn.silu(self.conv_norm(mx.clip(h, -self.clip, self.clip)))) + x


class Block(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d = c["hidden_size"]
        self.clip = c["gradient_clipping"]
        self.feed_forward1, self.self_attn = FeedForward(c), Attention(c)
        self.lconv1d, self.feed_forward2 = LightConv1d(c), FeedForward(c)
        self.norm_pre_attn, self.norm_post_attn, self.norm_out = RMSNorm(d), RMSNorm(d), RMSNorm(d)

    def __call__(self, x: mx.array, mask: mx.array, local: mx.array) -> mx.array:
        x = self.feed_forward1(x)
        h = self.self_attn(self.norm_pre_attn(mx.clip(x, -self.clip, self.clip)), mask, local)
        x = x + self.norm_post_attn(mx.clip(h, -self.clip, self.clip))
        x = self.feed_forward2(self.lconv1d(x * (~mask)[:, :, None].astype(x.dtype)))
        return self.norm_out(mx.clip(x, -self.clip, self.clip))


class Gemma4AudioEncoder(nn.Module):
    """`audio_tower`: mel frames [B, T, 128] and their padding mask (True: padded) -> encodings
    [B, T/4, output_proj_dims] (zero where padded) and the reduced mask."""

    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self.config = dict(c)
        self.subsample_conv_projection = SubsampleConvProjection(c)
        self.layers = [Block(c) for _ in range(c["num_hidden_layers"])]
        if c.get("output_proj_dims") is not None:
            self.output_proj = nn.Linear(c["hidden_size"], c["output_proj_dims"], bias=True)

    def local_mask(self) -> mx.array:
        c = self.config
        chunk, future, past = c["attention_chunk_size"], c["attention_context_right"], max(0, c["attention_context_left"] - 1)
        dist = mx.arange(chunk)[:, None] + past - mx.arange(chunk + past + future)[None, :]
        return (((dist >= 0) & (dist < past)) | ((dist < 0) & (-dist < future))).astype(mx.bool_)

    def __call__(self, mel: mx.array, padded: mx.array, taps: Optional[list] = None):
        x, mask = self.subsample_conv_projection(mel, padded)
        if taps is not None:
            taps.append(x)
        local = self.local_mask()
        for block in self.layers:
            x = block(x, mask, local)
            if taps is not None:
                taps.append(x)
        if "output_proj" in self:
            x = self.output_proj(x)
        mask = mask[:, :x.shape[1]]
        return mx.where(mask[:, :, None], 0.0, x), mask


class Embedder(nn.Module):
    """`embed_audio`: an unscaled RMSNorm, then a bias-free projection into the text width."""

    def __init__(self, d: int, text_hidden: int, eps: float):
        super().__init__()
        self.embedding_projection = nn.Linear(d, text_hidden, bias=False)
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return self.embedding_projection(mx.fast.rms_norm(x, None, self.eps))


@dataclasses.dataclass
class Gemma4Audio:
    """A gemma4 checkpoint's audio tower, embedder and the numbers the processor and merge read."""

    tower: Gemma4AudioEncoder
    embed_audio: Embedder
    mel: Gemma4Mel
    seq_length: int  # the processor's audio_seq_length: a clip's most tokens
    ms_per_token: int
    audio_token_id: int
    boa_token_id: int
    eoa_token_id: int
    media_ids: tuple  # the ids whose per-layer inputs read id 0 (image, audio, video)
    embed_scale: float  # the text model's sqrt(hidden_size): the merge scales the ids' rows
    hidden_kw: dict = dataclasses.field(default_factory=dict)

    def clip_tokens(self, samples: np.ndarray) -> int:
        """mlx-vlm's _compute_audio_num_tokens: ceil(ms / ms_per_token), at most seq_length."""
        ms = len(samples) / self.mel.sampling_rate * 1000.0
        return min(math.ceil(ms / self.ms_per_token), self.seq_length)

    def clip_text(self, marks: dict, n: int) -> str:
        """The processor's expansion of one audio placeholder."""
        return f"{marks['boa']}{marks['audio'] * n}{marks['eoa']}"

    def features(self, clips):
        return self.mel.features(clips)

    def check_frames(self, frames: int, counts: Sequence[int]) -> int:
        """The encodings a clip of `frames` mel frames yields, which must be each clip's token count
        (mlx-vlm's scatter lays the encodings over the tokens in order and wraps around)."""
        n = frames
        for _ in range(2):
            n = (n + 2 - 3) // 2 + 1
        if any(c != n for c in counts):
            why = (AudioTooLong, f"past the {self.seq_length} tokens a clip takes") if max(counts) == self.seq_length \
                else (AudioCountError, "mlx-vlm's merge would misalign them")
            raise why[0](f"the clip(s) take {list(counts)} audio tokens but the tower gives {n} encodings a clip "
                         f"(clips padded to the longest): {why[1]}")
        return n

    def soft_tokens(self, features: mx.array, mask: mx.array) -> mx.array:
        """[clips, frames / 4, text hidden]: each clip's encodings embedded."""
        enc, _ = self.tower(features, ~mask)
        return self.embed_audio(enc)

    def merge(self, embed_tokens, ids: mx.array, soft: mx.array) -> mx.array:
        """mlx-vlm's gemma4 get_input_embeddings over ids [1, L] and the clips' encodings
        (`soft_tokens`): the ids' scaled rows, the encodings laid in order over the audio tokens."""
        embeds = embed_tokens(ids) * self.embed_scale
        at = np.nonzero(np.array(ids[0]) == self.audio_token_id)[0]
        if len(at) != soft.shape[0] * soft.shape[1]:
            raise AudioCountError(f"the prompt holds {len(at)} audio tokens; the clips give {soft.shape[0] * soft.shape[1]}")
        embeds[0, mx.array(at.astype(np.uint32))] = soft.reshape(-1, soft.shape[-1]).astype(embeds.dtype)
        return embeds


def open_gemma4_audio(path: Path, config: Mapping, index, root: str) -> Gemma4Audio:
    from mlxbun.towers.audio import load_modules, read_json

    a = {"hidden_act": "silu", "use_clipped_linears": True, "gradient_clipping": 1e10, "residual_weight": 0.5,
         "attention_invalid_logits_value": -1e9, "attention_logit_cap": 50.0, "rms_norm_eps": 1e-6,
         "output_proj_dims": 1536, **config["audio_config"]}
    if a.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"{path}: audio_config.hidden_act {a['hidden_act']!r} (mlx-vlm's gemma4 tower runs silu)")
    text = config.get("text_config") or {}
    tower = Gemma4AudioEncoder(a)
    embed = Embedder(a["output_proj_dims"] or a["hidden_size"], int(text["hidden_size"]), a["rms_norm_eps"])
    load_modules(path, config, index, {root + "audio_tower": tower, root + "embed_audio": embed})
    proc = read_json(path / "processor_config.json", missing_ok=True)
    mel = Gemma4Mel.from_config(proc.get("feature_extractor") or {})
    if mel.feature_size != SubsampleConvProjection.FEATURES:
        raise ConfigError(f"{path}: {mel.feature_size} mel bins; mlx-vlm's gemma4 audio tower reads 128")
    ids = tuple(int(config[k]) for k in ("image_token_id", "audio_token_id", "video_token_id")
                if config.get(k) is not None)
    return Gemma4Audio(tower, embed, mel, int(proc.get("audio_seq_length", 750)),
                       int(proc.get("audio_ms_per_token", 40)), int(config.get("audio_token_id", 258881)),
                       int(config.get("boa_token_id", 256000)), int(config.get("eoa_token_id", 258883)), ids,
                       int(text["hidden_size"]) ** 0.5, {"media_ids": ids})
