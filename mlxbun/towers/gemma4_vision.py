"""Gemma4's vision side, as mlx-vlm 0.7.10 runs it: its image processor (aspect-preserving bicubic
resize into a patch budget of max_soft_tokens x pooling_kernel_size**2 patches, both sides a
multiple of pooling_kernel_size x patch_size; rescale; channels first), its tower (`vision_tower.*`:
linear patch embedding of 2 * (x - 0.5), a two-axis learned position table read by one-hot,
pre / post-normed blocks with q / k / v RMSNorms and two-axis rotary halves, gated-GELU MLPs,
clippable linears, then the average pooler over pooling_kernel_size**2 patches scaled by
sqrt(hidden)), `embed_vision` (an unscaled RMSNorm, a projection) and the merge (each image's soft
tokens over its image tokens, the ids' rows scaled). Where the text config asks for bidirectional
attention over image tokens (use_bidirectional_attention "vision"), the prompt runs in one call
whose masks let each image's tokens see each other (`vision_blocks`), as mlx-vlm's generate does
once it gets the processor's token types.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.errors import UnsupportedModelError
from mlxbun.towers.errors import ImageCountError
from mlxbun.towers.usm4 import ClippableLinear, Embedder, RMSNorm
from mlxbun.towers.vit import _rotate_half, _sdpa

__all__ = ["Gemma4ImageSpec", "Gemma4Vision", "Gemma4VisionTower", "open_gemma4_vision"]


@dataclasses.dataclass(frozen=True)
class Gemma4ImageSpec:
    """Gemma4ImageProcessor's settings (processor_config.json's image_processor)."""

    patch_size: int = 16
    max_soft_tokens: int = 280
    pooling_kernel_size: int = 3
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = False
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)

    @classmethod
    def from_config(cls, cfg: Mapping) -> "Gemma4ImageSpec":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in cfg.items() if k in fields})

    def target_size(self, height: int, width: int) -> tuple[int, int]:
        """mlx-vlm's get_aspect_ratio_preserving_size."""
        p, k = self.patch_size, self.pooling_kernel_size
        max_patches = self.max_soft_tokens * k**2
        factor = math.sqrt(max_patches * p**2 / (height * width))
        side = k * p
        th, tw = int(math.floor(factor * height / side)) * side, int(math.floor(factor * width / side)) * side
        if th == 0 and tw == 0:
            raise ValueError("Attempting to resize to a 0 x 0 image.")
        longest = (max_patches // k**2) * side
        if th == 0:
            th, tw = side, min(int(math.floor(width / height)) * side, longest)
        elif tw == 0:
            tw, th = side, min(int(math.floor(height / width)) * side, longest)
        return th, tw

    def preprocess(self, images: Sequence) -> tuple[list[np.ndarray], list[int]]:
        """(each image [3, H, W] float32, its soft tokens): Gemma4ImageProcessor.preprocess on RGB
        PIL images."""
        from PIL import Image

        out, tokens = [], []
        for image in images:
            a = np.array(image)
            if self.do_resize:
                th, tw = self.target_size(a.shape[0], a.shape[1])
                if (th, tw) != a.shape[:2]:
                    a = np.array(Image.fromarray(a).resize((tw, th), resample=Image.BICUBIC))
            if self.do_rescale:
                a = a.astype(np.float32) * self.rescale_factor
            if self.do_normalize:
                a = (a - np.array(self.image_mean, dtype=np.float32)) / np.array(self.image_std, dtype=np.float32)
            a = np.transpose(a, (2, 0, 1))
            out.append(a)
            h, w = a.shape[-2:]
            tokens.append((h // self.patch_size) * (w // self.patch_size) // self.pooling_kernel_size**2)
        return out, tokens


def _norm32(x: mx.array, eps: float, weight: Optional[mx.array] = None) -> mx.array:
    """Gemma4's vision RMSNorm: float32 throughout, the weight as is (or none)."""
    xf = x.astype(mx.float32)
    y = xf * mx.rsqrt(mx.mean(xf**2, axis=-1, keepdims=True) + eps)
    return (y if weight is None else y * weight.astype(mx.float32)).astype(x.dtype)


class HeadNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = mx.ones((dim,)), eps

    def __call__(self, x: mx.array) -> mx.array:
        return _norm32(x, self.eps, self.weight)


def _rope_2d(x: mx.array, positions: mx.array, base: float) -> mx.array:
    """mlx-vlm's apply_multidimensional_rope over (x, y) patch positions: the head split in two,
    each half rotated by its own axis."""
    ndim = positions.shape[-1]
    per = 2 * (x.shape[-1] // (2 * ndim))
    parts = []
    for d in range(ndim):
        xp = x[..., d * per:(d + 1) * per]
        t = positions[..., d:d + 1].astype(mx.float32) / mx.power(base, (2.0 / per) * mx.arange(0, per // 2).astype(mx.float32))
        cos = mx.expand_dims(mx.concatenate([mx.cos(t), mx.cos(t)], axis=-1).astype(x.dtype), 2)
        sin = mx.expand_dims(mx.concatenate([mx.sin(t), mx.sin(t)], axis=-1).astype(x.dtype), 2)
        parts.append(xp * cos + _rotate_half(xp) * sin)
    return mx.concatenate(parts, axis=-1)


class Attention(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d, clip = c["hidden_size"], c["use_clipped_linears"]
        self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.base = c["rope_parameters"]["rope_theta"]
        self.q_proj = ClippableLinear(d, self.heads * self.head_dim, clip)
        self.k_proj = ClippableLinear(d, self.kv_heads * self.head_dim, clip)
        self.v_proj = ClippableLinear(d, self.kv_heads * self.head_dim, clip)
        self.o_proj = ClippableLinear(self.heads * self.head_dim, d, clip)
        self.q_norm, self.k_norm = HeadNorm(self.head_dim), HeadNorm(self.head_dim)

    def queries_keys(self, x: mx.array, positions: mx.array) -> tuple[mx.array, mx.array]:
        """q [B, L, heads, D] and k [B, L, kv heads, D], normed and rotated."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(b, n, self.heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(b, n, self.kv_heads, self.head_dim))
        return _rope_2d(q, positions, self.base), _rope_2d(k, positions, self.base)

    def __call__(self, x: mx.array, positions: mx.array, mask: mx.array) -> mx.array:
        b, n, _ = x.shape
        q, k = self.queries_keys(x, positions)
        v = _norm32(self.v_proj(x).reshape(b, n, self.kv_heads, self.head_dim), 1e-6)
        out = _sdpa(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), 1.0, mask, pad=True)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    def probabilities(self, x: mx.array, positions: mx.array) -> mx.array:
        """softmax(q k^T) [B, heads, L, L] in float32 (scale 1.0, every patch seen: the tower's one-size
        images have no padding), for pictures; the forward runs the fused SDPA."""
        q, k = (a.astype(mx.float32).transpose(0, 2, 1, 3) for a in self.queries_keys(x, positions))
        k = mx.repeat(k, self.heads // self.kv_heads, axis=1)
        return mx.softmax(q @ k.transpose(0, 1, 3, 2), axis=-1)


class Mlp(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d, i, clip = c["hidden_size"], c["intermediate_size"], c["use_clipped_linears"]
        self.gate_proj, self.up_proj = ClippableLinear(d, i, clip), ClippableLinear(d, i, clip)
        self.down_proj = ClippableLinear(i, d, clip)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        d, eps = c["hidden_size"], c["rms_norm_eps"]
        self.self_attn, self.mlp = Attention(c), Mlp(c)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = RMSNorm(d, eps), RMSNorm(d, eps)

    def __call__(self, x: mx.array, positions: mx.array, mask: mx.array) -> mx.array:
        h = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), positions, mask))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class PatchEmbedder(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self.patch = c["patch_size"]
        self.input_proj = nn.Linear(3 * self.patch**2, c["hidden_size"], bias=False)
        self.position_embedding_table = mx.ones((2, c["position_embedding_size"], c["hidden_size"]))

    def __call__(self, pixels: mx.array, positions: mx.array) -> mx.array:
        b, ch, h, w = pixels.shape
        p = self.patch
        x = pixels.reshape(b, ch, h // p, p, w // p, p).transpose(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), ch * p * p)
        x = self.input_proj((2 * (x - 0.5)).astype(self.input_proj.weight.dtype))
        table = self.position_embedding_table
        oh = (mx.expand_dims(positions, -1) == mx.arange(table.shape[1])).astype(mx.float32)
        pos = (oh.transpose(0, 2, 1, 3).astype(table.dtype) @ table).sum(axis=1)
        return x + mx.where(mx.zeros(positions.shape[:2], dtype=mx.bool_)[..., None], 0.0, pos)


class Encoder(nn.Module):
    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self.layers = [Block(c) for _ in range(c["num_hidden_layers"])]


class Gemma4VisionTower(nn.Module):
    """`vision_tower`: one image [1, 3, H, W] -> its soft tokens [n, hidden] before embed_vision."""

    def __init__(self, c: Mapping[str, Any]):
        super().__init__()
        self.config = dict(c)
        self.patch_embedder = PatchEmbedder(c)
        self.encoder = Encoder(c)
        if c.get("standardize"):
            self.std_bias, self.std_scale = mx.zeros((c["hidden_size"],)), mx.ones((c["hidden_size"],))

    def _start(self, pixels: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """(the patch embeddings, the patches' (x, y) positions, the all-visible mask)."""
        b, _, h, w = pixels.shape
        p = self.config["patch_size"]
        gx, gy = np.meshgrid(np.arange(w // p), np.arange(h // p), indexing="xy")
        positions = mx.array(np.tile(np.stack([gx.flatten(), gy.flatten()], -1).astype(np.int32)[None], (b, 1, 1)))
        n = positions.shape[1]
        x = self.patch_embedder(pixels, positions)
        zero = mx.array(0.0, dtype=x.dtype)
        mask = mx.expand_dims(mx.where(mx.ones((b, n, n), dtype=mx.bool_), zero, mx.array(-1e4, dtype=x.dtype)), 1)
        return x, positions, mask

    def attention_maps(self, pixels: mx.array, layer: Optional[int] = None) -> mx.array:
        """Attention weights [B, heads, patches, patches] of block `layer` (default: the last)."""
        layers = self.encoder.layers
        layer = len(layers) - 1 if layer is None else layer
        if not 0 <= layer < len(layers):
            raise IndexError(f"layer {layer} outside the tower's {len(layers)} blocks")
        x, positions, mask = self._start(pixels)
        for block in layers[:layer]:
            x = block(x, positions, mask)
        return layers[layer].self_attn.probabilities(layers[layer].input_layernorm(x), positions)

    def __call__(self, pixels: mx.array, taps: Optional[list] = None) -> mx.array:
        c = self.config
        k = c["pooling_kernel_size"]
        x, positions, mask = self._start(pixels)
        n = positions.shape[1]
        if taps is not None:
            taps.append(x)
        for layer in self.encoder.layers:
            x = layer(x, positions, mask)
            if taps is not None:
                taps.append(x)
        length = n // k**2
        if n != length:  # the pooler: each k x k window of patches averaged
            kk = int((n // length) ** 0.5)
            clamped = mx.clip(positions, 0, None)
            max_x = mx.max(clamped[..., 0], axis=-1, keepdims=True) + 1
            idx = mx.floor(clamped.astype(mx.float32) / kk).astype(mx.int32)
            idx = idx[..., 0] + (max_x // kk) * idx[..., 1]
            weights = (mx.expand_dims(idx, -1) == mx.arange(length)).astype(mx.float32) / kk**2
            x = mx.einsum("bLl,bLd->bld", weights, x).astype(x.dtype)
        x = x * c["hidden_size"] ** 0.5
        if "std_bias" in self:
            x = (x - self.std_bias) * self.std_scale
        return x.reshape(-1, x.shape[-1])


@dataclasses.dataclass
class Gemma4Vision:
    """A gemma4 checkpoint's vision tower, embed_vision and the numbers the processor and merge read."""

    tower: Gemma4VisionTower
    embed_vision: Embedder
    spec: Gemma4ImageSpec
    image_token_id: int
    boi_token_id: int
    eoi_token_id: int
    embed_scale: float
    hidden_kw: dict
    bidirectional: bool  # use_bidirectional_attention "vision": an image's tokens see each other

    def vision_blocks(self, ids: np.ndarray) -> mx.array:
        """[1, L]: each position's image block (its run of image tokens, counted from 0), -1 elsewhere
        (mlx-vlm's _block_sequence_ids_for_mask over the processor's token types)."""
        vision = ids == self.image_token_id
        starts = vision & ~np.concatenate([[False], vision[:-1]])
        return mx.array(np.where(vision, np.cumsum(starts) - 1, -1).astype(np.int32))[None]

    def features(self, pixels: Sequence[np.ndarray], dtype: mx.Dtype) -> mx.array:
        """[soft tokens, text hidden]: images of one size through the tower as one batch (the
        processor stacks them; a batch rounds differently from one image at a time), differently
        sized ones one by one (mlx-vlm's per-image path), then embed_vision."""
        if len({p.shape for p in pixels}) == 1:
            out = [self.tower(mx.array(np.stack(pixels)))]
        else:
            out = [self.tower(mx.array(p)[None]) for p in pixels]
        return self.embed_vision(mx.concatenate(out, axis=0)[None])[0].astype(dtype)

    def merge(self, embed_tokens, ids: mx.array, soft: mx.array) -> mx.array:
        embeds = embed_tokens(ids) * self.embed_scale
        at = np.nonzero(np.array(ids[0]) == self.image_token_id)[0]
        if len(at) != soft.shape[0]:
            raise ImageCountError(f"the prompt holds {len(at)} image tokens; the images give {soft.shape[0]}")
        embeds[0, mx.array(at.astype(np.uint32))] = soft.astype(embeds.dtype)
        return embeds


def open_gemma4_vision(path: Path, config: Mapping, index) -> Gemma4Vision:
    from mlxbun.towers.audio import load_modules, read_json

    text = config.get("text_config") or {}
    bidirectional = text.get("use_bidirectional_attention")
    if bidirectional not in (None, "vision"):
        raise UnsupportedModelError(f"{path}: text_config.use_bidirectional_attention {bidirectional!r}: "
                                    "attention over every token both ways is not built")
    v = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 16, "num_attention_heads": 12,
         "num_key_value_heads": 12, "head_dim": 64, "rms_norm_eps": 1e-6, "patch_size": 16,
         "position_embedding_size": 10240, "pooling_kernel_size": 3, "use_clipped_linears": False,
         "standardize": False, "hidden_activation": "gelu_pytorch_tanh", **config["vision_config"]}
    if not v.get("rope_parameters"):
        v["rope_parameters"] = {"rope_theta": 100.0}
    if v["hidden_activation"] != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{path}: vision hidden_activation {v['hidden_activation']!r} (mlx-vlm runs "
                                    "the tanh GELU)")
    tower = Gemma4VisionTower(v)
    embed = Embedder(v["hidden_size"], int(text["hidden_size"]), v["rms_norm_eps"])
    root = "model." if any(n.startswith("model.vision_tower.") for n in index.names()) else ""
    load_modules(path, config, index, {root + "vision_tower": tower, root + "embed_vision": embed})
    proc = read_json(path / "processor_config.json", missing_ok=True)
    spec = Gemma4ImageSpec.from_config(proc.get("image_processor") or {})
    ids = tuple(int(config[k]) for k in ("image_token_id", "audio_token_id", "video_token_id")
                if config.get(k) is not None)
    return Gemma4Vision(tower, embed, spec, int(config.get("image_token_id", 258880)),
                        int(config.get("boi_token_id", 255999)), int(config.get("eoi_token_id", 258882)),
                        int(text["hidden_size"]) ** 0.5, {"media_ids": ids}, bidirectional == "vision")
