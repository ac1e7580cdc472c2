"""Kimi-VL's vision tower (MoonViT) and its projector, op for op as mlx-vlm 0.7.10's kimi_vl
(vision.py, kimi_vl.py), under the checkpoint's names (`vision_tower.*`,
`multi_modal_projector.*`):

- patches: the processor cuts each image into patches [patches, C, P, P]; a biased Conv2d turns
  each into one row [patches, D];
- positions: a learned [side, side, D] table added as is where an image's patch grid is that
  size, else bicubically resized to it (mlx-vlm's off-Metal bicubic, towers/resize.py); and a
  2-D rotary on q / k in complex float32 (row and column frequencies interleaved, read from a
  512 x 512 table), each image attending within itself (a block-diagonal boolean mask);
- blocks: LayerNorm (1e-6) -> fused wqkv -> rotary -> SDPA -> wo, LayerNorm -> fc0 -> erf GELU
  -> fc1; a final LayerNorm; each image's 2x2 patch windows gathered ([windows, 4, D]);
- the projector (projectors.KimiProjector): LayerNorm (1e-5) per patch, a window's four patches
  concatenated, linear_1 -> erf GELU -> linear_2 to the text width.

The tower has VitTower's interface (towers/loader.py's VisionStack drives it): `config`,
`layers`, `__call__` / `blocks_out(pixels, grid)` with `grid` each image's (rows, columns) of
patches, `unwindow`, `deepstack`."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.towers.resize import resize_bicubic_nchw
from mlxbun.towers.vit import VitConfig

__all__ = ["MoonVit", "moonvit_names"]

ROPE_SIDE = 512  # mlx-vlm's Rope2DPosEmb(head_dim, 512, 512): the largest patch grid a side


def moonvit_names(name: str) -> str:
    """A checkpoint name as mlx-vlm's sanitize leaves it: HF's vision_tower.encoder.* moved up
    (Model.sanitize), a block's wqkv / wo under its attn (VisionModel.sanitize)."""
    if name.startswith("vision_tower."):
        name = name.replace("encoder.", "")
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "blocks" and parts[3] in ("wqkv", "wo"):
            name = ".".join(parts[:3] + ["attn"] + parts[3:])
    return name


def _rope_table(head_dim: int, theta: float = 10000.0) -> mx.array:
    """Rope2DPosEmb._precompute_freqs_cis: [512, 512, head_dim / 2] complex64, the column (x)
    and row (y) frequencies interleaved."""
    n = ROPE_SIDE * ROPE_SIDE
    flat = mx.arange(0, n, dtype=mx.float32)
    x_pos, y_pos = flat % ROPE_SIDE, flat // ROPE_SIDE
    dim_range = mx.arange(0, head_dim, 4)[: (head_dim // 4)].astype(mx.float32)
    freqs = 1.0 / (theta ** (dim_range / head_dim))
    x_freqs, y_freqs = mx.outer(x_pos, freqs), mx.outer(y_pos, freqs)
    x_cis = mx.cos(x_freqs) + 1j * mx.sin(x_freqs)
    y_cis = mx.cos(y_freqs) + 1j * mx.sin(y_freqs)
    return mx.stack([x_cis, y_cis], axis=-1).reshape(ROPE_SIDE, ROPE_SIDE, -1)


def _complex(x: mx.array) -> mx.array:
    """[..., d] float32 as [..., d / 2] complex64, consecutive pairs (view_as_complex)."""
    x = x.reshape(*x.shape[:-1], -1, 2)
    return x[..., 0] + 1j * x[..., 1]


def _rotate(x: mx.array, freqs: mx.array) -> mx.array:
    """mlx-vlm's apply_rope on one of q / k [L, heads, d]: in complex float32, cast back."""
    out = _complex(x.astype(mx.float32)) * freqs
    return mx.stack([mx.real(out), mx.imag(out)], axis=-1).flatten(-2).astype(x.dtype)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.scale = self.head_dim ** -0.5
        self.wqkv = nn.Linear(dim, dim * 3, bias=True)
        self.wo = nn.Linear(dim, dim, bias=True)

    def heads(self, x: mx.array, freqs: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v [1, heads, L, d], q / k rotated."""
        L = x.shape[0]
        qkv = self.wqkv(x).reshape(L, 3, self.num_heads, self.head_dim).transpose(1, 0, 2, 3)
        q, k, v = (t.squeeze(0) for t in mx.split(qkv, 3))
        f = mx.expand_dims(freqs, axis=-2)
        q, k = _rotate(q, f), _rotate(k, f)
        return tuple(t.transpose(1, 0, 2)[None, ...] for t in (q, k, v))

    def __call__(self, x: mx.array, freqs: mx.array, mask: mx.array) -> mx.array:
        q, k, v = self.heads(x, freqs)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(x.shape[0], -1))

    def probabilities(self, x: mx.array, freqs: mx.array) -> mx.array:
        """softmax(q k^T * scale) [1, heads, L, L] in float32 over the whole sequence (for maps)."""
        q, k, _ = self.heads(x, freqs)
        scores = (q.astype(mx.float32) * self.scale) @ k.astype(mx.float32).transpose(0, 1, 3, 2)
        return mx.softmax(scores, axis=-1)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc0 = nn.Linear(dim, hidden)
        self.fc1 = nn.Linear(hidden, dim)

    def __call__(self, x: mx.array) -> mx.array:
        return self.fc1(nn.gelu(self.fc0(x)))


class Block(nn.Module):
    def __init__(self, c: VitConfig):
        super().__init__()
        self.norm0 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = Attention(c.hidden_size, c.num_attention_heads)
        self.mlp = MLP(c.hidden_size, c.intermediate_size)

    @property
    def attention_module(self) -> Attention:
        return self.attn

    def attn_input(self, x: mx.array) -> mx.array:
        return self.norm0(x)

    def __call__(self, x: mx.array, freqs: mx.array, mask: mx.array) -> mx.array:
        x = x + self.attn(self.norm0(x), freqs, mask)
        return x + self.mlp(self.norm1(x))


class PatchEmbed(nn.Module):
    """The patch conv and the learned position table (pos_emb.weight [side, side, D])."""

    def __init__(self, c: VitConfig):
        super().__init__()
        self.proj = nn.Conv2d(c.num_channels, c.hidden_size, kernel_size=c.patch_size, stride=c.patch_size,
                              bias=True)
        side = c.num_position_embeddings
        self.pos_emb = _PosEmb(side, c.hidden_size)

    def __call__(self, x: mx.array, shapes: list[tuple[int, int]]) -> mx.array:
        h = self.proj(x).swapaxes(1, 3)
        h = h.reshape(h.shape[0], -1)
        return h + mx.concatenate([self.pos_emb.at(s) for s in shapes], axis=0).astype(h.dtype)


class _PosEmb(nn.Module):
    def __init__(self, side: int, dim: int):
        super().__init__()
        self.weight = mx.ones((side, side, dim))

    def at(self, shape: tuple[int, int]) -> mx.array:
        """[h * w, D]: the table (its own size) or its bicubic resize (Learnable2DInterpPosEmb)."""
        if tuple(shape) == tuple(self.weight.shape[:-1]):
            return self.weight.flatten(end_axis=1)
        resized = resize_bicubic_nchw(mx.expand_dims(self.weight.transpose(2, 0, 1), axis=0), shape)
        return resized.squeeze(0).transpose(1, 2, 0).flatten(end_axis=1)


def _shapes(grid) -> list[tuple[int, int]]:
    return [(int(h), int(w)) for h, w in np.asarray(grid).tolist()]


class MoonVit(nn.Module):
    """mlx-vlm's kimi_vl VisionModel on the processor's [patches, P, P, C] (channels last) with
    `grid` each image's (rows, columns) of patches; out: [windows, merge**2, D]."""

    def __init__(self, c: VitConfig):
        super().__init__()
        if c.hidden_size % c.num_attention_heads or (c.hidden_size // c.num_attention_heads) % 4:
            raise ValueError(f"MoonViT's head width ({c.hidden_size} / {c.num_attention_heads} heads) must be a "
                             "multiple of 4 (its 2-D rotary)")
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = [Block(c) for _ in range(c.num_hidden_layers)]
        self.final_layernorm = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self._rope: Optional[mx.array] = None  # the rotary table, built on first use (not a parameter)

    @property
    def layers(self) -> list:
        return self.blocks

    def _start(self, pixels: mx.array, grid) -> tuple[mx.array, mx.array, mx.array]:
        """The embedded patches, their rotary frequencies and the block-diagonal mask."""
        shapes = _shapes(grid)
        h = self.patch_embed(pixels, shapes)
        if self._rope is None:
            self._rope = _rope_table(self.config.hidden_size // self.config.num_attention_heads)
        d = self._rope.shape[-1]
        freqs = mx.concatenate([self._rope[:r, :c].reshape(-1, d) for r, c in shapes], axis=0)
        block = np.repeat(np.arange(len(shapes)), [r * c for r, c in shapes])
        mask = mx.array(block[:, None] == block[None, :])
        return h, freqs, mask

    def merge(self, h: mx.array, grid) -> mx.array:
        """patch_merger: each image's merge x merge windows, row-major, as [windows, merge**2, D]."""
        m, d, out, start = self.config.spatial_merge_size, h.shape[-1], [], 0
        for r, c in _shapes(grid):
            seq = h[start:start + r * c].reshape(r // m, m, c // m, m, d).transpose(0, 2, 1, 3, 4)
            out.append(seq.reshape((r // m) * (c // m), m * m, -1))
            start += r * c
        return mx.concatenate(out, axis=0)

    def blocks_out(self, pixels: mx.array, grid=None) -> list[tuple[str, mx.array]]:
        """Every stage's output, named: embeddings, layers.i, post_layernorm, merged."""
        h, freqs, mask = self._start(pixels, grid)
        out = [("embeddings", h)]
        for i, blk in enumerate(self.blocks):
            h = blk(h, freqs, mask)
            out.append((f"layers.{i}", h))
        h = self.final_layernorm(h)
        return out + [("post_layernorm", h), ("merged", self.merge(h, grid))]

    def __call__(self, pixels: mx.array, grid=None) -> mx.array:
        h, freqs, mask = self._start(pixels, grid)
        for blk in self.blocks:
            h = blk(h, freqs, mask)
        return self.merge(self.final_layernorm(h), grid)

    def attention_maps(self, pixels: mx.array, layer: Optional[int] = None, grid=None) -> mx.array:
        """Attention weights [1, heads, patches, patches] of block `layer` (default: the last)."""
        layer = len(self.blocks) - 1 if layer is None else layer
        if not 0 <= layer < len(self.blocks):
            raise IndexError(f"layer {layer} outside the tower's {len(self.blocks)} blocks")
        h, freqs, mask = self._start(pixels, grid)
        for blk in self.blocks[:layer]:
            h = blk(h, freqs, mask)
        return self.blocks[layer].attn.probabilities(self.blocks[layer].norm0(h), freqs)

    def unwindow(self, tokens: mx.array, grid) -> mx.array:
        return tokens

    def deepstack(self, stages) -> list:
        return []
