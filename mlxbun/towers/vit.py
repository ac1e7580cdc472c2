"""The generic ViT-style tower: one module for the towers that share the pre-norm ViT shape,
its branch points the row's `VitKnobs`; op for op as mlx-vlm's (SigLIP: vision.py, attention.py,
mlp.py), under the checkpoint's own module names so the tensors load by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.towers.knobs import PatchEmbed, Positions, VitAct, VitKnobs

__all__ = ["VitConfig", "VitTower"]


@dataclass(frozen=True)
class VitConfig:
    """The numbers a tower reads from vision_config (mlx-vlm's VisionConfig defaults filled in)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    patch_size: int
    image_size: int
    num_channels: int
    layer_norm_eps: float

    @property
    def grid(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size


class Embeddings(nn.Module):
    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        if knobs.patch is PatchEmbed.CONV2D:
            self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, kernel_size=c.patch_size,
                                             stride=c.patch_size)
        self.num_positions = c.grid ** 2
        if knobs.positions is Positions.LEARNED:
            self.position_embedding = nn.Embedding(self.num_positions, c.hidden_size)
        self.knobs = knobs

    def __call__(self, x: mx.array) -> mx.array:
        h = mx.flatten(self.patch_embedding(x), start_axis=1, end_axis=2)
        if self.knobs.positions is Positions.LEARNED:
            h = h + self.position_embedding(mx.array(np.arange(self.num_positions)[None, :]))
        return h


class Attention(nn.Module):
    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        dims, bias = c.hidden_size, knobs.qkv_bias
        if dims % c.num_attention_heads:
            raise ValueError(f"vision hidden_size {dims} is not a multiple of num_attention_heads "
                             f"{c.num_attention_heads}")
        self.num_heads = c.num_attention_heads
        self.scale = (dims // self.num_heads) ** (-0.5)
        self.q_proj = nn.Linear(dims, dims, bias=bias)
        self.k_proj = nn.Linear(dims, dims, bias=bias)
        self.v_proj = nn.Linear(dims, dims, bias=bias)
        self.out_proj = nn.Linear(dims, dims, bias=bias)

    def heads(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B, L, _ = x.shape
        q, k, v = (p(x).reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        return q, k, v

    def __call__(self, x: mx.array) -> mx.array:
        B, L, _ = x.shape
        q, k, v = self.heads(x)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=None)
        return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def probabilities(self, x: mx.array) -> mx.array:
        """The attention weights [B, heads, L, L] (softmax(q k^T * scale) in float32): for the
        maps the bring-up notebook draws; the forward itself runs the fused SDPA."""
        q, k, _ = self.heads(x)
        scores = (q.astype(mx.float32) * self.scale) @ k.astype(mx.float32).transpose(0, 1, 3, 2)
        return mx.softmax(scores, axis=-1)


class MLP(nn.Module):
    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=True)
        self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=True)
        self.act = knobs.act

    def __call__(self, x: mx.array) -> mx.array:
        h = self.fc1(x)
        h = nn.gelu(h) if self.act is VitAct.GELU else nn.gelu_approx(h)
        return self.fc2(h)


class EncoderLayer(nn.Module):
    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        self.self_attn = Attention(c, knobs)
        self.layer_norm1 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.mlp = MLP(c, knobs)
        self.layer_norm2 = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def __call__(self, x: mx.array) -> mx.array:
        h = x + self.self_attn(self.layer_norm1(x))
        return h + self.mlp(self.layer_norm2(h))


class Encoder(nn.Module):
    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        self.layers = [EncoderLayer(c, knobs) for _ in range(c.num_hidden_layers)]


class VitTower(nn.Module):
    """embeddings -> encoder.layers -> post_layernorm, as the checkpoint names them."""

    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        self.config, self.knobs = c, knobs
        self.embeddings = Embeddings(c, knobs)
        self.encoder = Encoder(c, knobs)
        if knobs.post_norm:
            eps = c.layer_norm_eps if knobs.post_norm_eps is None else knobs.post_norm_eps
            self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=eps)

    def blocks(self, pixels: mx.array) -> list[tuple[str, mx.array]]:
        """Every stage's output, named: embeddings, layers.i, post_layernorm (the last is the
        tower's output). `pixels`: [B, H, W, C] in the tower's dtype."""
        h = self.embeddings(pixels)
        out = [("embeddings", h)]
        for i, layer in enumerate(self.encoder.layers):
            h = layer(h)
            out.append((f"layers.{i}", h))
        if self.knobs.post_norm:
            out.append(("post_layernorm", self.post_layernorm(h)))
        return out

    def __call__(self, pixels: mx.array) -> mx.array:
        h = self.embeddings(pixels)
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h) if self.knobs.post_norm else h

    def attention_maps(self, pixels: mx.array, layer: Optional[int] = None) -> mx.array:
        """Attention weights [B, heads, patches, patches] of block `layer` (default: the last)."""
        layers = self.encoder.layers
        layer = len(layers) - 1 if layer is None else layer
        if not 0 <= layer < len(layers):
            raise IndexError(f"layer {layer} outside the tower's {len(layers)} blocks")
        h = self.embeddings(pixels)
        for blk in layers[:layer]:
            h = blk(h)
        return layers[layer].self_attn.probabilities(layers[layer].layer_norm1(h))
