"""Gemma3n's audio tower (USM): a subsampling convolution stack, conformer blocks with chunked
local attention over relative positions, and the multimodal embedder that carries its soft
tokens (and the audio vocabulary's hard tokens) into the text model's width. Module names are
the checkpoint's (`audio_tower.*`, `embed_audio.*`); the arithmetic is mlx-vlm 0.7.10's
(`models/gemma3n/audio.py`, `gemma3n.py`) op for op, including its array-valued constants (the
clip bound, the softcap, the residual weight and the query scale are float32 arrays, so a
half-precision checkpoint's tower computes in float32 from its first clip on).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.errors import ConfigError
from mlxbun.towers.audio import MelConfig, load_modules, log_mel, read_json
from mlxbun.towers.errors import AudioCountError, AudioTooLong, NoTowerError

__all__ = ["AUDIO_TOWERS", "MAX_CLIPS", "AudioStack", "AudioTower", "MultimodalEmbedder", "RMSNorm32",
           "check_audio_tower", "embedders", "hard_rows", "open_audio", "read_mel_config", "sampling_rate",
           "scatter_soft"]


class RMSNorm32(nn.Module):
    """Gemma3n's RMSNorm: computed in float32, scaled by the weight (or not), cast back."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps, self.with_scale = eps, with_scale
        if with_scale:
            self.weight = mx.ones(dim)

    def __call__(self, x: mx.array) -> mx.array:
        y = x.astype(mx.float32)
        out = y * mx.rsqrt(y.square().mean(axis=-1, keepdims=True) + self.eps)
        if self.with_scale:
            out = out * (self.weight + 0.0)
        return out.astype(x.dtype)


def _pad_time(x: mx.array, before: int, after: int) -> mx.array:
    widths = [(0, 0)] * x.ndim
    widths[1] = (before, after)
    return mx.pad(x, widths)


class CumulativeGroupNorm(nn.Module):
    """Group norm over (frequency, channels) with statistics accumulated along time (no mask:
    the subsampling stack runs every frame)."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = mx.ones(channels)

    def __call__(self, x: mx.array) -> mx.array:
        dtype, xc = x.dtype, x.astype(mx.float32)
        axes = (2, 3)
        ones = mx.ones_like(xc).astype(mx.float32)
        cum_sum = mx.cumsum(mx.sum(xc * ones, axis=axes, keepdims=True), axis=1)
        count = mx.clip(mx.cumsum(mx.sum(ones, axis=axes, keepdims=True), axis=1), 1, None)
        mean = cum_sum / count
        cum_sq = mx.cumsum(mx.sum((xc - mean) ** 2 * ones, axis=axes, keepdims=True), axis=1)
        out = (xc - mean) * mx.rsqrt(cum_sq / count + self.eps)
        out = out * self.weight.astype(mx.float32).reshape(1, 1, 1, -1)
        return (out * ones).astype(dtype)


class SubsampleBlock(nn.Module):
    """Conv2d over (time, frequency): time padded (0, k-1), frequency (1, 1); norm; ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel, stride, f_out: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(c_in, c_out, kernel_size=tuple(kernel), stride=tuple(stride), padding=(0, 0),
                              bias=False)
        self.norm = CumulativeGroupNorm(c_out, eps)
        self._pad_t = kernel[0] - 1

    def __call__(self, x: mx.array) -> mx.array:  # [B, C, T, F] -> [B, C', T', F']
        x = mx.pad(x, [(0, 0), (0, 0), (0, self._pad_t), (1, 1)])
        x = self.norm(self.conv(x.transpose(0, 2, 3, 1)))
        return nn.relu(x.transpose(0, 3, 1, 2))


class SubsampleConvProjection(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        f = c["input_feat_size"]
        dims = []
        for i in range(2):
            f = (f + 2 - c["sscp_conv_kernel_size"][i][1]) // c["sscp_conv_stride_size"][i][1] + 1
            dims.append(f)
        ch, eps = c["sscp_conv_channel_size"], c.get("sscp_conv_eps", 1e-3)  # mlx-vlm reads sscp_conv_eps
        self.conv_0 = SubsampleBlock(1, ch[0], c["sscp_conv_kernel_size"][0], c["sscp_conv_stride_size"][0],
                                     dims[0], eps)
        self.conv_1 = SubsampleBlock(ch[0], ch[1], c["sscp_conv_kernel_size"][1], c["sscp_conv_stride_size"][1],
                                     dims[1], eps)
        self.input_proj_linear = nn.Linear(ch[1] * dims[1], c["hidden_size"], bias=False)

    def __call__(self, mel: mx.array) -> mx.array:
        x = self.conv_1(self.conv_0(mx.expand_dims(mel, 1)))
        b, ch, t, f = x.shape
        return self.input_proj_linear(x.transpose(0, 2, 3, 1).reshape(b, t, f * ch))


class RelativePositionEmbedding(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self.heads, self.channels = c["conf_num_attention_heads"], c["hidden_size"]
        self.head_dim = self.channels // self.heads
        left = c["conf_attention_context_left"]
        self.max_backward, self.max_forward = (left - 1 if left > 0 else 0), c["conf_attention_context_right"]
        self.pos_proj = nn.Linear(self.channels, self.heads * self.head_dim, bias=False)
        n = self.channels // 2
        step = math.log(1.0e4 / 1.0) / max(n - 1, 1)
        self._inv_timescales = mx.array(1.0 * mx.exp(mx.arange(n) * -step))[None, None, ...]

    def __call__(self, q: mx.array, k: mx.array) -> mx.array:
        b, u, w, heads, hd = q.shape
        ctx = k.shape[2]
        pos = mx.expand_dims(mx.arange(self.max_backward, -self.max_forward - 1, -1), axis=0)
        span = pos.shape[1]
        t = mx.expand_dims(pos.astype(mx.float32), axis=-1) * self._inv_timescales
        signal = mx.concatenate([mx.sin(t), mx.cos(t)], axis=-1).astype(q.dtype)
        sin_emb = self.pos_proj(signal).reshape(1, span, heads, hd).squeeze(0)
        qp = q.transpose(0, 3, 1, 2, 4)
        term_ac = mx.matmul(qp, k.transpose(0, 3, 1, 4, 2))
        bd = mx.matmul(qp.reshape(b, heads, u * w, hd), sin_emb.transpose(1, 2, 0)).reshape(b, heads, u, w, span)
        # the relative shift: pad the span to ctx + 1, fold, cut, unfold
        bd = mx.pad(bd, [(0, 0)] * 4 + [(0, ctx + 1 - span)]).reshape(b, heads, u, w * (ctx + 1))
        bd = bd[:, :, :, : w * ctx].reshape(b, heads, u, w, ctx)
        return term_ac + bd


class ChunkedAttention(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self.heads, hidden = c["conf_num_attention_heads"], c["hidden_size"]
        self.head_dim = hidden // self.heads
        self.chunk = c["conf_attention_chunk_size"]
        self.future = c["conf_attention_context_right"]
        self.past = max(0, c["conf_attention_context_left"] - 1)
        self.invalid = c.get("conf_attention_invalid_logits_value", -1e9)
        self.context = self.chunk + self.past + self.future
        self.relative_position_embedding = RelativePositionEmbedding(c)
        self.per_dim_scale = mx.zeros((self.head_dim,))
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self._q_scale = self.head_dim**-0.5 * (1.0 / mx.log(2.0))
        lower = mx.tril(mx.ones((self.context, self.chunk), dtype=mx.bool_), k=0).T
        upper = mx.tril(mx.ones((self.chunk, self.context), dtype=mx.bool_), k=self.past + self.future)
        self._local = mx.ones((self.chunk, self.context), dtype=mx.bool_) * lower * upper
        self._softcap = mx.array(c["conf_attention_logit_cap"], dtype=mx.float32)

    def _blocks(self, x: mx.array) -> mx.array:
        b, t = x.shape[:2]
        n = (t + self.chunk - 1) // self.chunk
        if n * self.chunk - t > 0:
            x = _pad_time(x, 0, n * self.chunk - t)
        return x.reshape((b, n, self.chunk) + x.shape[2:])

    def _context(self, x: mx.array) -> mx.array:
        x = _pad_time(x, self.past, self.future + self.chunk - 1)
        n = (x.shape[1] - self.context) // self.chunk + 1
        out = mx.stack([x[:, i * self.chunk:i * self.chunk + self.context] for i in range(n)], axis=2)
        return out.transpose(0, 2, 1, 3, 4) if x.ndim > 2 else out

    def __call__(self, x: mx.array, padded: mx.array) -> mx.array:
        shape = (*x.shape[:-1], self.heads, self.head_dim)
        q, k, v = self.q_proj(x).reshape(shape), self.k_proj(x).reshape(shape), self.v_proj(x).reshape(shape)
        q = q * self._q_scale * mx.logaddexp(self.per_dim_scale, 0.0).reshape(1, 1, 1, self.head_dim)
        b, t = q.shape[:2]
        qb, kb, vb = self._blocks(q), self._context(k), self._context(v)
        u = qb.shape[1]
        valid = self._context(~padded).transpose(0, 2, 1)
        if valid.shape != (b, u, self.context):
            raise ValueError(f"audio attention mask blocks {valid.shape} != {(b, u, self.context)}")
        allowed = mx.logical_and(mx.expand_dims(mx.expand_dims(valid, axis=1), axis=-2),
                                 self._local[None, None, None, ...])
        logits = self.relative_position_embedding(qb, kb)
        logits = nn.tanh(logits / self._softcap) * self._softcap
        logits = mx.where(allowed, logits, self.invalid)
        p = mx.softmax(logits.astype(mx.float32), axis=-1).astype(vb.dtype)
        _, heads, _, w, ctx = p.shape
        out = mx.matmul(p.transpose(0, 2, 1, 3, 4).reshape(-1, w, ctx),
                        vb.transpose(0, 1, 3, 2, 4).reshape(-1, ctx, vb.shape[-1]))
        out = out.reshape(b, u, heads, w, vb.shape[-1]).transpose(0, 1, 3, 2, 4)
        return out.reshape((b, u * self.chunk, self.heads, self.head_dim))[:, :t]


class ConformerAttention(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self._clip = mx.array(c["gradient_clipping"])
        self.pre_attn_norm = RMSNorm32(c["hidden_size"])
        self.attn = ChunkedAttention(c)
        self.post = nn.Linear(c["hidden_size"], c["hidden_size"], bias=False)
        self.post_norm = RMSNorm32(c["hidden_size"])

    def __call__(self, x: mx.array, padded: mx.array) -> mx.array:
        out = self.attn(self.pre_attn_norm(mx.clip(x, -self._clip, self._clip)), padded)
        b, t, heads, hd = out.shape
        out = mx.clip(self.post(out.reshape(b, t, heads * hd)), -self._clip, self._clip)
        return x + self.post_norm(out)


class ConformerFeedForward(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d = c["hidden_size"]
        self._clip = mx.array(c["gradient_clipping"])
        self.pre_layer_norm = RMSNorm32(d)
        self.ffw_layer_1 = nn.Linear(d, d * 4, bias=False)
        self.ffw_layer_2 = nn.Linear(d * 4, d, bias=False)
        self.post_layer_norm = RMSNorm32(d)
        self._scale = mx.array(c["conf_residual_weight"])

    def __call__(self, x: mx.array) -> mx.array:
        h = self.pre_layer_norm(mx.clip(x, -self._clip, self._clip))
        h = mx.clip(self.ffw_layer_2(nn.silu(self.ffw_layer_1(h))), -self._clip, self._clip)
        return x + (self.post_layer_norm(h) * self._scale)


class LightConv1d(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d, eps, k = c["hidden_size"], c["rms_norm_eps"], c["conf_conv_kernel_size"]
        self.pre_layer_norm = RMSNorm32(d, eps=eps)
        self.linear_start = nn.Linear(d, d * 2, bias=False)
        self.depthwise_conv1d = nn.Conv1d(d, d, kernel_size=k, stride=1, padding=0, groups=d, bias=False)
        self._clip = mx.array(c["gradient_clipping"])
        self.conv_norm = RMSNorm32(d, eps=eps)
        self.linear_end = nn.Linear(d, d, bias=False)
        self._causal = k - 1

    def __call__(self, x: mx.array) -> mx.array:
        h = nn.glu(self.linear_start(self.pre_layer_norm(x)), axis=-1).transpose(0, 2, 1)
        h = mx.pad(h, [(0, 0), (0, 0), (self._causal, 0)])
        h = mx.clip(self.depthwise_conv1d(h.transpose(0, 2, 1)), -self._clip, self._clip)
        return self.linear_end(nn.silu(self.conv_norm(h))) + x


class ConformerBlock(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self.ffw_layer_start = ConformerFeedForward(c)
        self.attention = ConformerAttention(c)
        self.lconv1d = LightConv1d(c)
        self.ffw_layer_end = ConformerFeedForward(c)
        self._clip = mx.array(c["gradient_clipping"])
        self.norm = RMSNorm32(c["hidden_size"])

    def __call__(self, x: mx.array, padded: mx.array) -> mx.array:
        x = self.attention(self.ffw_layer_start(x), padded)
        x = self.lconv1d(x * mx.expand_dims(~padded, -1).astype(x.dtype))
        return self.norm(mx.clip(self.ffw_layer_end(x), -self._clip, self._clip))


class AudioTower(nn.Module):
    """`audio_tower`: log-mel frames [B, T, F] and their padding mask (True: padded) -> the
    conformer's encodings [B, T', D] (zero where padded) and the reduced padding mask."""

    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self.config = dict(c)
        self.subsample_conv_projection = SubsampleConvProjection(c)
        self.conformer = [ConformerBlock(c) for _ in range(c["conf_num_hidden_layers"])]

    def subsampled_mask(self, padded: mx.array, t_sub: int) -> mx.array:
        stride = 1
        for s in self.config["sscp_conv_stride_size"]:
            stride *= s[0]
        idx = mx.clip(mx.arange(t_sub) * stride, None, padded.shape[1] - 1)
        return mx.take_along_axis(padded, mx.broadcast_to(idx[None, :], (padded.shape[0], t_sub)), axis=1)

    def __call__(self, mel: mx.array, padded: mx.array, taps: Optional[list] = None):
        x = self.subsample_conv_projection(mel)
        mask = self.subsampled_mask(padded, x.shape[1])
        if taps is not None:
            taps.append(x)
        for block in self.conformer:
            x = block(x, mask)
            if taps is not None:
                taps.append(x)
        r = self.config["conf_reduction_factor"]
        if r > 1:
            x, mask = x[:, ::r], mask[:, ::r]
        return mx.where(mask[..., None], 0.0, x), mask

    def soft_token_count(self, frames: int) -> int:
        """The encodings one clip of `frames` mel frames yields."""
        t = frames
        for k, s in zip(self.config["sscp_conv_kernel_size"], self.config["sscp_conv_stride_size"]):
            t = (t + k[0] - 1 - k[0]) // s[0] + 1
        r = self.config["conf_reduction_factor"]
        return (t + r - 1) // r if r > 1 else t


class MultimodalEmbedder(nn.Module):
    """`embed_audio` / `embed_vision`: hard tokens (ids past `vocab_offset`) or soft tokens into the
    text width: RMSNorm, a bias-free projection, an unscaled RMSNorm."""

    def __init__(self, c: Mapping[str, Any], text_hidden: int):
        super().__init__()
        d, eps = c["hidden_size"], c.get("rms_norm_eps", 1e-6)
        self.vocab_offset, self.vocab_size = c["vocab_offset"], c.get("vocab_size", 128)
        self.embedding = nn.Embedding(self.vocab_size, d)
        self.hard_embedding_norm = RMSNorm32(d, eps=eps)
        self.soft_embedding_norm = RMSNorm32(d, eps=eps)
        self.embedding_projection = nn.Linear(d, text_hidden, bias=False)
        self.embedding_post_projection_norm = RMSNorm32(text_hidden, eps=eps, with_scale=False)

    def hard(self, ids: mx.array) -> mx.array:
        return self._out(self.hard_embedding_norm(self.embedding(ids - self.vocab_offset)))

    def soft(self, x: mx.array) -> mx.array:
        return self._out(self.soft_embedding_norm(x))

    def _out(self, h: mx.array) -> mx.array:
        return self.embedding_post_projection_norm(self.embedding_projection(h))


def hard_rows(embed_tokens, ids: mx.array, embed_vision: MultimodalEmbedder,
              embed_audio: MultimodalEmbedder) -> mx.array:
    """The start of mlx-vlm's Gemma3n get_input_embeddings over ids [1, L]: the ids' unscaled rows,
    the vision and audio vocabularies' hard tokens through their embedders."""
    embeds = embed_tokens(ids)
    a_off, v_off = embed_audio.vocab_offset, embed_vision.vocab_offset
    vision = mx.logical_and(ids >= v_off, ids < a_off)
    rows = embed_vision.hard(mx.where(vision, ids, v_off + embed_vision.vocab_size - 1))
    embeds = mx.where(vision[..., None], rows, embeds)
    audio = ids >= a_off
    rows = embed_audio.hard(mx.where(audio, ids, a_off + embed_audio.vocab_size - 1))
    return mx.where(audio[..., None], rows, embeds)


def scatter_soft(embeds: mx.array, ids: mx.array, token_id: int, soft: mx.array, error, what: str,
                 items: str) -> mx.array:
    """`embeds` [1, L, D] with the rows of `token_id` the soft tokens [n, T, D] in order, cast to its
    dtype (mlx-vlm's masked_scatter); `error` where the counts differ."""
    at = np.nonzero(np.array(ids[0]) == token_id)[0]
    if len(at) != soft.shape[0] * soft.shape[1]:
        raise error(f"the prompt holds {len(at)} {what} tokens; the {items} give {soft.shape[0] * soft.shape[1]}")
    embeds[0, mx.array(at.astype(np.uint32))] = soft.reshape(-1, soft.shape[-1]).astype(embeds.dtype)
    return embeds


# a bound on the clips of one prompt (each is its own soft-token block in the context)
MAX_CLIPS = 8
# the wrappers whose audio tower this module builds (model_type -> audio_config.model_type)
AUDIO_TOWERS = {"gemma3n": "gemma3n_audio", "gemma4": "gemma4_audio"}


@dataclasses.dataclass
class AudioStack:
    """A checkpoint's audio tower, its embedders (audio's, and vision's for the hard vision ids
    the merge embeds) and the numbers the processor, splice and merge read."""

    tower: AudioTower
    embed_audio: MultimodalEmbedder
    embed_vision: MultimodalEmbedder
    mel: MelConfig
    soft_tokens_per_clip: int  # audio_soft_tokens_per_image (the model's) = the processor's audio_seq_length
    audio_token_id: int
    boa_token_id: int
    eoa_token_id: int
    text_vocab_size: int
    # every text call with audio runs mlx-vlm 0.7.10's gemma3n composition: its KV-shared layers rope
    # their queries at the owner cache's offset after this forward's write
    hidden_kw: dict = dataclasses.field(default_factory=lambda: {"shared_offset_after": True})

    def clip_tokens(self, samples) -> int:
        """The audio tokens a clip takes in the prompt: the model's fixed count."""
        return self.soft_tokens_per_clip

    def clip_text(self, marks: dict, n: int) -> str:
        """The processor's expansion of one audio placeholder."""
        return f"\n\n{marks['boa']}{marks['audio'] * n}{marks['eoa']}\n\n"

    def features(self, clips) -> tuple[np.ndarray, np.ndarray]:
        f = log_mel(clips, self.mel)
        return f.features, f.mask

    def check_frames(self, frames: int, counts=()) -> int:
        """The encodings a clip padded to `frames` mel frames yields (AudioTooLong past the soft
        tokens a clip holds)."""
        n = self.tower.soft_token_count(frames)
        if n > self.soft_tokens_per_clip:
            raise AudioTooLong(f"the clip(s) make {frames} mel frames, {n} audio encodings; the model holds "
                               f"{self.soft_tokens_per_clip} a clip")
        return n

    def merge(self, embed_tokens, ids: mx.array, soft: mx.array) -> mx.array:
        """mlx-vlm's Gemma3n get_input_embeddings over ids [1, L] and the clips' soft tokens
        (`soft_tokens`): the ids' rows with the media vocabularies' hard tokens (hard_rows), the
        soft tokens at the audio tokens."""
        embeds = hard_rows(embed_tokens, ids, self.embed_vision, self.embed_audio)
        return scatter_soft(embeds, ids, self.audio_token_id, soft, AudioCountError, "audio", "clips")

    def soft_tokens(self, features: mx.array, mask: mx.array) -> mx.array:
        """[clips, soft_tokens_per_clip, text hidden] from the mel frames [clips, T, F] and their mask
        (True: audio): the tower's encodings embedded, padded frames and the clip's tail the padding
        id's row (the text vocabulary's last id through embed_audio)."""
        enc, padded = self.tower(features, ~mask)
        soft = self.embed_audio.soft(enc)
        pad = self.embed_audio.hard(mx.array([[self.text_vocab_size - 1]]))
        soft = mx.where(padded[..., None], pad, soft)
        b, n, d = soft.shape
        return mx.concatenate((soft, mx.broadcast_to(pad, (b, self.soft_tokens_per_clip - n, d))), axis=1)


def check_audio_tower(path: Path, config: Mapping) -> tuple[str, Any]:
    """(tensor prefix, weight index) of the checkpoint's audio tower, or NoTowerError saying why not."""
    from mlxbun.weights import read_index

    model_type = config.get("model_type")
    audio = config.get("audio_config")
    if model_type not in AUDIO_TOWERS:
        what = "a model without an audio tower mlxbun builds" if not audio else "a model whose audio tower mlxbun does not build"
        raise NoTowerError(f"{path}: {model_type} is {what}; audio goes to the towers of {', '.join(AUDIO_TOWERS)}")
    if not isinstance(audio, Mapping) or audio.get("model_type", AUDIO_TOWERS[model_type]) != AUDIO_TOWERS[model_type]:
        raise NoTowerError(f"{path}: {model_type} checkpoint has no {AUDIO_TOWERS[model_type]} audio_config")
    index = read_index(path)
    names = set(index.names())
    prefix = next((p for p in ("model.audio_tower", "audio_tower") if any(n.startswith(p + ".") for n in names)), None)
    if prefix is None:
        raise NoTowerError(f"{path}: {model_type} checkpoint holds no audio_tower.* tensors (a build without the "
                           "audio tower): it takes no audio")
    return prefix, index


def open_audio(path, config: Optional[Mapping] = None):
    """The checkpoint's audio stack (gemma3n's AudioStack, gemma4's usm4.Gemma4Audio), loaded;
    NoTowerError where it has none."""
    from mlxbun.towers.loader import _read_config

    path = Path(path)
    config = _read_config(path) if config is None else config
    prefix, index = check_audio_tower(path, config)
    root = prefix[: -len("audio_tower")]
    if config.get("model_type") == "gemma4":
        from mlxbun.towers.usm4 import open_gemma4_audio

        return open_gemma4_audio(path, config, index, root)
    text = config["text_config"]
    audio = {**_AUDIO_DEFAULTS, **config["audio_config"]}
    tower = AudioTower(audio)
    embed_vision, embed_audio = embedders(config)
    load_modules(path, config, index, {root + "audio_tower": tower, root + "embed_audio": embed_audio,
                                       root + "embed_vision": embed_vision})
    mel = read_mel_config(path)
    if mel.feature_size != audio["input_feat_size"]:
        raise ConfigError(f"{path}: the feature extractor's {mel.feature_size} mel bins != the tower's "
                          f"input_feat_size {audio['input_feat_size']}")
    per_clip = int(config.get("audio_soft_tokens_per_image", 188))
    seq = int(read_json(path / "processor_config.json", missing_ok=True).get("audio_seq_length", 188))
    if seq != per_clip:
        raise ConfigError(f"{path}: the processor's audio_seq_length {seq} != the model's audio_soft_tokens_per_image "
                          f"{per_clip} (mlx-vlm's merge would refuse the prompt)")
    return AudioStack(tower, embed_audio, embed_vision, mel, per_clip, int(config.get("audio_token_id", 262273)),
                      int(config.get("boa_token_id", 256000)), int(config.get("eoa_token_id", 262272)),
                      int(text.get("vocab_size", 262400)))


def embedders(config: Mapping) -> tuple[MultimodalEmbedder, MultimodalEmbedder]:
    """gemma3n's (embed_vision, embed_audio), unloaded: each media vocabulary's embedder into the
    text width, at mlx-vlm's VisionConfig / AudioConfig defaults where config.json is silent."""
    width = int(config["text_config"]["hidden_size"])
    vision = {"vocab_offset": 262_144, "vocab_size": 128, "hidden_size": 2048, **(config.get("vision_config") or {})}
    audio = {**_AUDIO_DEFAULTS, **(config.get("audio_config") or {})}
    return MultimodalEmbedder(vision, width), MultimodalEmbedder(audio, width)


# mlx-vlm's AudioConfig defaults for keys a config.json may leave out
_AUDIO_DEFAULTS = {"input_feat_size": 80, "hidden_size": 1536, "conf_attention_chunk_size": 12,
                   "conf_attention_context_left": 13, "conf_attention_context_right": 0,
                   "conf_attention_invalid_logits_value": -1e9, "conf_attention_logit_cap": 50.0,
                   "conf_num_attention_heads": 8, "conf_num_hidden_layers": 12, "conf_conv_kernel_size": 5,
                   "conf_reduction_factor": 4, "conf_residual_weight": 0.5, "sscp_conv_channel_size": (128, 32),
                   "sscp_conv_kernel_size": ((3, 3), (3, 3)), "sscp_conv_stride_size": ((2, 2), (2, 2)),
                   "vocab_size": 128, "sscp_conv_eps": 1e-3, "rms_norm_eps": 1e-6, "gradient_clipping": 1e10,
                   "vocab_offset": 262_144 + 128}


def read_mel_config(path) -> MelConfig:
    """The checkpoint's audio feature extractor settings (preprocessor_config.json)."""
    return MelConfig.from_config(read_json(Path(path) / "preprocessor_config.json"))


def sampling_rate(path) -> int:
    """The sample rate the checkpoint's audio feature extractor takes (read before any weight)."""
    from mlxbun.towers.loader import _read_config

    path = Path(path)
    if _read_config(path).get("model_type") == "gemma4":
        from mlxbun.towers.usm4 import Gemma4Mel

        proc = read_json(path / "processor_config.json", missing_ok=True)
        return Gemma4Mel.from_config(proc.get("feature_extractor") or {}).sampling_rate
    return read_mel_config(path).sampling_rate
