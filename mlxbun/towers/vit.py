"""The generic ViT-style tower: one module for the towers that share the pre-norm ViT shape
(patches -> N x (norm -> attention -> +, norm -> MLP -> +) -> optional norm), its branch points
the row's `VitKnobs`; op for op as mlx-vlm's (SigLIP: vision.py, attention.py, mlp.py; Qwen2-VL:
qwen2_vl/vision.py), under the checkpoint's own module names (`VitLayout`) so tensors load by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.towers.knobs import PatchEmbed, Positions, VitAct, VitKnobs, VitLayout, VitMlp, VitNorm
from mlxbun.towers.projectors import Qwen3Merger
from mlxbun.towers.resize import resize_bilinear_nhwc

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
    temporal_patch_size: int = 1
    spatial_merge_size: int = 1
    rope_theta: float = 10000.0
    window_size: int = 0  # Qwen2.5-VL: pixels a side of an attention window
    fullatt_block_indexes: tuple[int, ...] = ()  # Qwen2.5-VL: the blocks attending over the whole image
    head_dim: int = 0  # Pixtral: its rotary table's width (0: hidden / heads)
    num_position_embeddings: int = 0  # Qwen3-VL: the learned position table's rows (a square grid)
    deepstack_visual_indexes: tuple[int, ...] = ()  # Qwen3-VL: the blocks whose outputs feed a deepstack merger
    out_hidden_size: int = 0  # Qwen3-VL: the mergers' output width

    @property
    def grid(self) -> int:
        """Patches per side (a fixed-size tower)."""
        return self.image_size // self.patch_size


def _act(kind: VitAct, x: mx.array) -> mx.array:
    if kind is VitAct.GELU_TANH:
        return nn.gelu_approx(x)
    if kind is VitAct.GELU:
        return nn.gelu(x)
    return nn.gelu_fast_approx(x)


def _rotate_half(x: mx.array) -> mx.array:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return mx.concatenate([-x2, x1], axis=-1)


def _rope_vision(t: mx.array, freqs: mx.array) -> mx.array:
    """Qwen2-VL's apply_rotary_pos_emb_vision: cos / sin of `freqs` [L, d/2] tiled to d."""
    cos = mx.expand_dims(mx.tile(mx.expand_dims(mx.cos(freqs), axis=1), (1, 1, 2)), axis=0)
    sin = mx.expand_dims(mx.tile(mx.expand_dims(mx.sin(freqs), axis=1), (1, 1, 2)), axis=0)
    return ((t * cos) + (_rotate_half(t) * sin)).astype(t.dtype)


class Embeddings(nn.Module):
    """SigLIP's: conv patches + learned positions; LFM2-VL's Siglip2: linear patches + the
    position table resized to each view."""

    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        if knobs.patch is PatchEmbed.LINEAR:
            self.patch_embedding = nn.Linear(c.num_channels * c.patch_size ** 2, c.hidden_size)
            self.num_positions = c.num_position_embeddings
        else:
            self.patch_embedding = nn.Conv2d(c.num_channels, c.hidden_size, kernel_size=c.patch_size,
                                             stride=c.patch_size)
            self.num_positions = c.grid ** 2
        self.position_embedding = nn.Embedding(self.num_positions, c.hidden_size)
        self.knobs = knobs

    def __call__(self, x: mx.array, shapes=None) -> mx.array:
        if self.knobs.positions is Positions.LEARNED_RESIZED:
            return self.patch_embedding(x.astype(self.patch_embedding.weight.dtype)) + self.resized(shapes, x.shape[1])
        h = mx.flatten(self.patch_embedding(x), start_axis=1, end_axis=2)
        return h + self.position_embedding(mx.array(np.arange(self.num_positions)[None, :]))

    def resized(self, shapes, length: int) -> mx.array:
        """[views, length, D]: the table resized to each view's (rows, cols), its padding rows the
        first position's (Siglip2's resize_positional_embeddings)."""
        table = self.position_embedding.weight
        side, dim, dtype = int(self.num_positions ** 0.5), table.shape[-1], table.dtype
        source = table.reshape(side, side, -1)[None].astype(mx.float32)
        out = mx.zeros((len(shapes), length, dim), dtype=dtype)
        for i, (h, w) in enumerate(np.asarray(shapes).tolist()):
            rows = resize_bilinear_nhwc(source, (h, w), antialias=True).reshape(h * w, dim).astype(dtype)
            out[i, : h * w] = rows
            out[i, h * w:] = rows[0]
        return out


class PatchEmbed3d(nn.Module):
    """Qwen2-VL's patch_embed: a Conv3d (biased in Qwen3-VL) over the processor's flattened patches."""

    def __init__(self, c: VitConfig, bias: bool = False):
        super().__init__()
        self.c = c
        k = [c.temporal_patch_size, c.patch_size, c.patch_size]
        self.proj = nn.Conv3d(c.num_channels, c.hidden_size, kernel_size=k, stride=k, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        c = self.c
        x = x.reshape(-1, c.num_channels, c.temporal_patch_size, c.patch_size, c.patch_size).moveaxis(1, 4)
        return self.proj(x).reshape(-1, c.hidden_size)


def _sdpa(q, k, v, scale: float, mask=None, pad: bool = False) -> mx.array:
    """mx.fast SDPA; `pad`: mlx-vlm's ensure_fused_sdpa (heads zero-padded to 64 / 80 / 128, cut back)."""
    d = q.shape[-1]
    target = next((t for t in (64, 80, 128) if d <= t), d) if pad else d
    if target != d:
        widths = [(0, 0)] * (q.ndim - 1) + [(0, target - d)]
        q, k, v = mx.pad(q, widths), mx.pad(k, widths), mx.pad(v, widths)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)[..., :d]
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


class Attention(nn.Module):
    """SigLIP's (separate q / k / v / out_proj) or Qwen2-VL's (fused qkv, proj, 2-D rotary, each
    image's patches attending within themselves)."""

    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        dims = c.hidden_size
        if dims % c.num_attention_heads:
            raise ValueError(f"vision hidden size {dims} is not a multiple of its {c.num_attention_heads} heads")
        self.num_heads, self.layout, self.sdpa_pad = c.num_attention_heads, knobs.layout, knobs.sdpa_pad
        self.scale = (dims // self.num_heads) ** (-0.5)
        if knobs.layout is VitLayout.SIGLIP:
            bias = knobs.qkv_bias
            self.q_proj = nn.Linear(dims, dims, bias=bias)
            self.k_proj = nn.Linear(dims, dims, bias=bias)
            self.v_proj = nn.Linear(dims, dims, bias=bias)
            self.out_proj = nn.Linear(dims, dims, bias=bias)
        elif knobs.layout is VitLayout.PIXTRAL:
            self.q_proj = nn.Linear(dims, dims, bias=False)
            self.k_proj = nn.Linear(dims, dims, bias=False)
            self.v_proj = nn.Linear(dims, dims, bias=False)
            self.o_proj = nn.Linear(dims, dims, bias=False)
        else:
            self.qkv = nn.Linear(dims, dims * 3, bias=True)
            self.proj = nn.Linear(dims, dims)

    def heads(self, x: mx.array, rope: Optional[mx.array] = None) -> tuple[mx.array, mx.array, mx.array]:
        """q, k, v as [B, heads, L, head_dim] (Qwen2-VL: B = 1, rotated by `rope`; Pixtral: by
        its (cos, sin))."""
        if self.layout is VitLayout.SIGLIP:
            B, L, _ = x.shape
            return tuple(p(x).reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)
                         for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.layout is VitLayout.PIXTRAL:
            B, L, _ = x.shape
            q, k, v = (p(x).reshape(B, L, self.num_heads, -1).transpose(0, 2, 1, 3)
                       for p in (self.q_proj, self.k_proj, self.v_proj))
            cos, sin = (mx.expand_dims(t, axis=0) for t in rope)
            return (q * cos) + (_rotate_half(q) * sin), (k * cos) + (_rotate_half(k) * sin), v
        L = x.shape[0]
        qkv = self.qkv(x).reshape(L, 3, self.num_heads, -1).transpose(1, 0, 2, 3)
        q, k, v = mx.split(qkv, 3)
        q = _rope_vision(mx.expand_dims(q, 0), rope)[0]
        k = _rope_vision(mx.expand_dims(k, 0), rope)[0]
        return q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, rope=None, cu_seqlens: Optional[list] = None, mask=None):
        if self.layout is VitLayout.SIGLIP:
            B, L, _ = x.shape
            q, k, v = self.heads(x)
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            return self.out_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        if self.layout is VitLayout.PIXTRAL:
            B, L, _ = x.shape
            q, k, v = self.heads(x, rope)
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
            return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))
        L = x.shape[0]
        q, k, v = self.heads(x, rope)
        parts = [mx.split(t, cu_seqlens[1:-1], axis=2) for t in (q, k, v)]
        out = mx.concatenate([_sdpa(a, b, c, self.scale, pad=self.sdpa_pad) for a, b, c in zip(*parts)], axis=2)
        return self.proj(out.transpose(0, 2, 1, 3).reshape(L, -1))

    def probabilities(self, x: mx.array, rope: Optional[mx.array] = None) -> mx.array:
        """The attention weights [B, heads, L, L] (softmax(q k^T * scale) in float32, over the whole
        sequence): for the maps the bring-up notebook draws; the forward runs the fused SDPA."""
        q, k, _ = self.heads(x, rope)
        scores = (q.astype(mx.float32) * self.scale) @ k.astype(mx.float32).transpose(0, 1, 3, 2)
        return mx.softmax(scores, axis=-1)


class MLP(nn.Module):
    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        self.kind, self.act = knobs.mlp, knobs.act
        if knobs.mlp is VitMlp.FC:
            self.fc1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=True)
            self.fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=True)
        elif knobs.mlp is VitMlp.LINEAR_FC:
            self.linear_fc1 = nn.Linear(c.hidden_size, c.intermediate_size, bias=True)
            self.linear_fc2 = nn.Linear(c.intermediate_size, c.hidden_size, bias=True)
        else:
            bias = knobs.mlp_bias
            self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=bias)
            self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=bias)
            self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        if self.kind is VitMlp.FC:
            return self.fc2(_act(self.act, self.fc1(x)))
        if self.kind is VitMlp.LINEAR_FC:
            return self.linear_fc2(_act(self.act, self.linear_fc1(x)))
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def _norm(kind: VitNorm, dims: int, eps: float) -> nn.Module:
    return nn.LayerNorm(dims, eps=eps) if kind is VitNorm.LAYERNORM else nn.RMSNorm(dims, eps=eps)


# each layout's block children: (attention norm, attention, MLP norm, MLP), as its checkpoints name them
_BLOCK_NAMES = {
    VitLayout.SIGLIP: ("layer_norm1", "self_attn", "layer_norm2", "mlp"),
    VitLayout.QWEN_VL: ("norm1", "attn", "norm2", "mlp"),
    VitLayout.PIXTRAL: ("attention_norm", "attention", "ffn_norm", "feed_forward"),
}


class Block(nn.Module):
    """A pre-norm block: x + attention(norm(x)), then + MLP(norm(.)), its children named by layout."""

    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        self.layout = knobs.layout
        norm1, attn, norm2, mlp = _BLOCK_NAMES[knobs.layout]
        setattr(self, norm1, _norm(knobs.norm, c.hidden_size, c.layer_norm_eps))
        setattr(self, attn, Attention(c, knobs))
        setattr(self, norm2, _norm(knobs.norm, c.hidden_size, c.layer_norm_eps))
        setattr(self, mlp, MLP(c, knobs))

    @property
    def attention_module(self) -> Attention:
        return self[_BLOCK_NAMES[self.layout][1]]

    def attn_input(self, x: mx.array) -> mx.array:
        return self[_BLOCK_NAMES[self.layout][0]](x)

    def __call__(self, x: mx.array, rope=None, cu_seqlens=None, mask=None) -> mx.array:
        norm1, attn, norm2, mlp = _BLOCK_NAMES[self.layout]
        x = x + self[attn](self[norm1](x), rope=rope, cu_seqlens=cu_seqlens, mask=mask)
        return x + self[mlp](self[norm2](x))


class Encoder(nn.Module):
    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        self.layers = [Block(c, knobs) for _ in range(c.num_hidden_layers)]


class PixtralRope:
    """Pixtral's 2-D rotary table (PixtralRotaryEmbedding): not a parameter."""

    def __init__(self, c: VitConfig):
        dim, side = c.head_dim, c.image_size // c.patch_size
        freqs = 1.0 / (c.rope_theta ** (mx.arange(0, dim, 2).astype(mx.float32) / dim))
        freqs_h = mx.outer(mx.arange(side), freqs[::2]).astype(mx.float32)
        freqs_w = mx.outer(mx.arange(side), freqs[1::2]).astype(mx.float32)
        table = mx.concatenate([mx.tile(freqs_h[:, None, :], (1, side, 1)),
                                mx.tile(freqs_w[None, :, :], (side, 1, 1))], axis=-1).reshape(-1, dim // 2)
        self.table, self.side = mx.concatenate((table, table), axis=-1), side

    def __call__(self, dtype, positions: mx.array) -> tuple[mx.array, mx.array]:
        freqs = self.table[positions]
        return mx.cos(freqs).astype(dtype), mx.sin(freqs).astype(dtype)


class VitTower(nn.Module):
    """SigLIP: embeddings -> encoder.layers -> post_layernorm on [N, H, W, C] pixels.
    Qwen2-VL: patch_embed -> blocks on the processor's [patches, C*T*P*P] with `grid` [N, 3]."""

    def __init__(self, c: VitConfig, knobs: VitKnobs):
        super().__init__()
        self.config, self.knobs = c, knobs
        if knobs.layout is VitLayout.SIGLIP:
            if knobs.patch not in (PatchEmbed.CONV2D, PatchEmbed.LINEAR):
                raise ValueError(f"the siglip layout takes conv2d or linear patches, not {knobs.patch.value}")
            self.embeddings = Embeddings(c, knobs)
            self.encoder = Encoder(c, knobs)
        elif knobs.layout is VitLayout.PIXTRAL:
            if knobs.patch is not PatchEmbed.CONV2D or knobs.positions is not Positions.ROPE_2D_PIXTRAL:
                raise ValueError("the pixtral layout takes conv2d patches and Pixtral's 2-D rotary")
            self.patch_conv = nn.Conv2d(c.num_channels, c.hidden_size, kernel_size=c.patch_size,
                                        stride=c.patch_size, bias=False)
            self.ln_pre = nn.RMSNorm(c.hidden_size)
            self.transformer = Encoder(c, knobs)
            self._rope = PixtralRope(c)
        else:
            if knobs.patch is not PatchEmbed.CONV3D or knobs.positions not in (Positions.ROPE_2D,
                                                                              Positions.ROPE_2D_INTERP):
                raise ValueError("the qwen_vl layout takes conv3d patches and 2-D rotary positions")
            self.patch_embed = PatchEmbed3d(c, bias=knobs.patch_bias)
            if knobs.positions is Positions.ROPE_2D_INTERP:
                self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
            self.blocks = [Block(c, knobs) for _ in range(c.num_hidden_layers)]
            if c.deepstack_visual_indexes:
                m = c.spatial_merge_size
                tanh = knobs.merger_act is VitAct.GELU_TANH
                self.deepstack_merger_list = [Qwen3Merger(c.hidden_size, c.out_hidden_size, m, postshuffle=True,
                                                          tanh=tanh) for _ in c.deepstack_visual_indexes]
        if knobs.post_norm:
            eps = c.layer_norm_eps if knobs.post_norm_eps is None else knobs.post_norm_eps
            self.post_layernorm = nn.LayerNorm(c.hidden_size, eps=eps)

    @property
    def layers(self) -> list:
        layout = self.knobs.layout
        if layout is VitLayout.SIGLIP:
            return self.encoder.layers
        return self.transformer.layers if layout is VitLayout.PIXTRAL else self.blocks

    # ------------------------------------------------------------ Qwen2-VL's positions

    def rope(self, grid: np.ndarray) -> mx.array:
        """rot_pos_emb: [patches, head_dim / 2] frequencies at each patch's (row, col)."""
        m = self.config.spatial_merge_size
        pos = []
        for t, h, w in np.asarray(grid).tolist():
            hpos = mx.repeat(mx.expand_dims(mx.arange(h), 1), w, axis=1)
            hpos = mx.transpose(hpos.reshape(h // m, m, w // m, m), (0, 2, 1, 3)).flatten()
            wpos = mx.repeat(mx.expand_dims(mx.arange(w), 0), h, axis=0)
            wpos = mx.transpose(wpos.reshape(h // m, m, w // m, m), (0, 2, 1, 3)).flatten()
            pos.append(mx.tile(mx.stack([hpos, wpos], axis=-1), (t, 1)))
        pos = mx.concatenate(pos, axis=0)
        dim = self.config.hidden_size // self.config.num_attention_heads // 2
        inv_freq = 1.0 / (self.config.rope_theta ** (mx.arange(0, dim, 2, dtype=mx.float32) / dim))
        seq = mx.arange(int(np.asarray(grid)[:, 1:].max()), dtype=inv_freq.dtype)
        return mx.outer(seq, inv_freq)[pos].reshape(pos.shape[0], -1)

    @staticmethod
    def cu_seqlens(grid: np.ndarray) -> list[int]:
        """Each image's (each frame's) patch span boundaries, from 0."""
        out = [0]
        for t, h, w in np.asarray(grid).tolist():
            for _ in range(t):
                out.append(out[-1] + h * w)
        return out

    def window_index(self, grid: np.ndarray) -> tuple[mx.array, list[int]]:
        """Qwen2.5-VL's get_window_index: the merge units' order window by window, and the
        windows' patch span boundaries in that order (empty windows' repeats dropped)."""
        m = self.config.spatial_merge_size
        win = self.config.window_size // m // self.config.patch_size
        order, bounds, base = [], [0], 0
        for t, h, w in np.asarray(grid).tolist():
            gh, gw = h // m, w // m
            index = np.arange(t * gh * gw).reshape(t, gh, gw)
            ph, pw = win - gh % win, win - gw % win
            nh, nw = (gh + ph) // win, (gw + pw) // win
            padded = np.pad(index, ((0, 0), (0, ph), (0, pw)), constant_values=-100)
            padded = padded.reshape(t, nh, win, nw, win).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, win, win)
            seqlens = (padded != -100).sum(axis=(2, 3)).reshape(-1)
            flat = padded.reshape(-1)
            order.append(flat[flat != -100] + base)
            bounds.extend((np.cumsum(seqlens) * m * m + bounds[-1]).tolist())
            base += t * gh * gw
        return mx.array(np.concatenate(order)), list(dict.fromkeys(bounds))

    def interpolated_positions(self, grid: np.ndarray) -> mx.array:
        """Qwen3-VL's fast_pos_embed_interpolate: the learned table bilinearly resampled to each
        image's grid (the four corners' rows weighted in the rows' dtype, summed in order), each
        image's rows in merge-window order."""
        side = int(self.config.num_position_embeddings ** 0.5)
        grids = np.asarray(grid).tolist()
        idx, wts = [[] for _ in range(4)], [[] for _ in range(4)]
        for t, h, w in grids:
            hi, wi = mx.linspace(0, side - 1, int(h)), mx.linspace(0, side - 1, int(w))
            hf, wf = hi.astype(mx.int32), wi.astype(mx.int32)
            hc, wc = mx.minimum(hf + 1, side - 1), mx.minimum(wf + 1, side - 1)
            dh, dw = hi - hf.astype(mx.float32), wi - wf.astype(mx.float32)
            bh, bhc = hf * side, hc * side
            corners = [(bh[:, None] + wf[None, :]).flatten(), (bh[:, None] + wc[None, :]).flatten(),
                       (bhc[:, None] + wf[None, :]).flatten(), (bhc[:, None] + wc[None, :]).flatten()]
            weights = [((1 - dh)[:, None] * (1 - dw)[None, :]).flatten(), ((1 - dh)[:, None] * dw[None, :]).flatten(),
                       (dh[:, None] * (1 - dw)[None, :]).flatten(), (dh[:, None] * dw[None, :]).flatten()]
            for i in range(4):
                idx[i].extend(corners[i].tolist())
                wts[i].extend(weights[i].tolist())
        rows = self.pos_embed(mx.array(idx, dtype=mx.int32))
        rows = rows * mx.array(wts, dtype=rows.dtype)[:, :, None]
        table = rows[0] + rows[1] + rows[2] + rows[3]
        sizes = [int(h * w) for _, h, w in grids]
        parts = mx.split(table, np.cumsum(sizes)[:-1].tolist(), axis=0) if len(sizes) > 1 else [table]
        m, out = self.config.spatial_merge_size, []
        for part, (t, h, w) in zip(parts, grids):
            t, h, w = int(t), int(h), int(w)
            d = part.shape[-1]
            part = mx.tile(part, (t, 1)).reshape(t, h, w, d)
            out.append(part.reshape(t, h // m, m, w // m, m, d).transpose(0, 1, 3, 2, 4, 5).reshape(-1, d))
        return mx.concatenate(out)

    def deepstack(self, stages: list[tuple[str, mx.array]]) -> list[mx.array]:
        """Qwen3-VL: the deepstack mergers' tokens of their blocks' outputs (`stages`: blocks_out's)."""
        return [merger(stages[i + 1][1])
                for merger, i in zip(self.deepstack_merger_list, self.config.deepstack_visual_indexes)]

    def unwindow(self, tokens: mx.array, grid) -> mx.array:
        """The merger's tokens back in image order (identity without windows)."""
        if not self.knobs.windows:
            return tokens
        return tokens[mx.argsort(self.window_index(grid)[0], axis=0), :]

    # ------------------------------------------------------------ forward

    def _start(self, pixels: mx.array, grid) -> tuple[mx.array, list[dict]]:
        """The embedded patches and each block's keyword arguments."""
        n = len(self.layers)
        if self.knobs.layout is VitLayout.SIGLIP and self.knobs.patch is PatchEmbed.LINEAR:
            shapes, keep = grid  # LFM2-VL: each view's patch grid and its real-patch mask
            h = self.embeddings(pixels, shapes)
            h = h.astype(self.embeddings.patch_embedding.weight.dtype)
            mask = mx.where(mx.array(keep)[:, None, None, :].astype(mx.bool_), mx.array(0.0),
                            mx.array(-mx.inf)).astype(h.dtype)
            return h, [{"mask": mask}] * n
        if self.knobs.layout is VitLayout.SIGLIP:
            return self.embeddings(pixels), [{}] * n
        if self.knobs.layout is VitLayout.PIXTRAL:
            return self._pixtral_start(pixels, grid)
        h, rope, full = self.patch_embed(pixels), self.rope(grid), self.cu_seqlens(grid)
        if self.knobs.positions is Positions.ROPE_2D_INTERP:
            h = h + self.interpolated_positions(grid)
        if not self.knobs.windows:
            return h, [{"rope": rope, "cu_seqlens": full}] * n
        index, windows = self.window_index(grid)
        unit = self.config.spatial_merge_size ** 2
        L = h.shape[0]
        h = h.reshape(L // unit, unit, -1)[index, :, :].reshape(L, -1)
        rope = rope.reshape(L // unit, unit, -1)[index, :, :].reshape(L, -1)
        return h, [{"rope": rope, "cu_seqlens": full if i in self.config.fullatt_block_indexes else windows}
                   for i in range(n)]

    def _pixtral_start(self, pixels: mx.array, sizes) -> tuple[mx.array, list[dict]]:
        """Each image's patch grid (its size, not the padding) concatenated into [1, patches, D],
        ln_pre, its row * side + col rotary, the block-diagonal additive mask (0 within an image,
        -1e9 across, in the activations' dtype)."""
        p = self.config.patch_size
        sizes = [(int(h), int(w)) for h, w in np.asarray(sizes).tolist()]
        conv = self.patch_conv(pixels)
        grids = [e[: h // p, : w // p] for e, (h, w) in zip(conv, sizes)]
        h = self.ln_pre(mx.concatenate([g.reshape(-1, g.shape[-1]) for g in grids], axis=0)[None, ...])
        ids = []
        for g in grids:
            rows, cols = mx.meshgrid(mx.arange(g.shape[0]), mx.arange(g.shape[1]), indexing="ij")
            ids.append((rows.reshape(-1, 1) * self._rope.side + cols.reshape(-1, 1)).flatten())
        rope = self._rope(h.dtype, mx.concatenate(ids))
        lengths = [g.shape[0] * g.shape[1] for g in grids]
        total = sum(lengths)
        mask = mx.full((total, total), vals=-1e9)
        start = 0
        for n in lengths:
            mask[start:start + n, start:start + n] = 0
            start += n
        mask = mx.broadcast_to(mask[None, None, :, :], (h.shape[0], 1, total, total)).astype(h.dtype)
        return h, [{"rope": rope, "mask": mask}] * len(self.layers)

    def blocks_out(self, pixels: mx.array, grid=None) -> list[tuple[str, mx.array]]:
        """Every stage's output, named: embeddings, layers.i, post_layernorm (where the tower has
        one). SigLIP: `pixels` [N, H, W, C]; Qwen2-VL: [patches, C*T*P*P] with `grid` [N, 3]
        (Qwen2.5-VL: the patches in window order, as its blocks see them)."""
        h, kws = self._start(pixels, grid)
        out = [("embeddings", h)]
        for i, (layer, kw) in enumerate(zip(self.layers, kws)):
            h = layer(h, **kw)
            out.append((f"layers.{i}", h))
        if self.knobs.post_norm:
            out.append(("post_layernorm", self.post_layernorm(h)))
        return out

    def __call__(self, pixels: mx.array, grid=None) -> mx.array:
        h, kws = self._start(pixels, grid)
        for layer, kw in zip(self.layers, kws):
            h = layer(h, **kw)
        return self.post_layernorm(h) if self.knobs.post_norm else h

    def attention_maps(self, pixels: mx.array, layer: Optional[int] = None, grid=None) -> mx.array:
        """Attention weights [B, heads, patches, patches] of block `layer` (default: the last)."""
        layers = self.layers
        layer = len(layers) - 1 if layer is None else layer
        if not 0 <= layer < len(layers):
            raise IndexError(f"layer {layer} outside the tower's {len(layers)} blocks")
        h, kws = self._start(pixels, grid)
        for blk, kw in zip(layers[:layer], kws):
            h = blk(h, **kw)
        return layers[layer].attention_module.probabilities(layers[layer].attn_input(h), kws[layer].get("rope"))
