"""Qwen2-VL's text side with images, as mlx-vlm's text model runs it: the prompt's 3-D (t, h, w)
position ids (get_rope_index: text runs count on, each image's soft tokens at its grid's
coordinates), rotated by MRoPE in mlx-vlm's arithmetic (the chunked section layout: each
frequency takes the t, h or w position its mrope_section says; cos / sin of the doubled
frequencies in the embeddings' dtype; q * cos + rotate_half(q) * sin). The weights and every
other op are mlxbun's qwen2 row (UniversalDense's modules, called in the same order); decoding
continues at the cache offset plus the prompt's position delta.

mlx-lm's qwen2_vl (which the text row holds) runs plain RoPE on text positions; this is the
other composition, the one mlx-vlm's generate runs once images are in the prompt."""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from mlxbun.errors import GenerationError
from mlxbun.models.base import create_attention_mask

__all__ = ["MRopeText", "rope_index"]


def rope_index(ids: Sequence[int], grids: Sequence[Sequence[int]], *, image_token_id: int,
               vision_start_token_id: int, merge: int) -> tuple[np.ndarray, int]:
    """(positions [3, L], delta) of one prompt row (mlx-vlm's get_rope_index, no padding, images
    only): images are the image tokens that follow a vision-start token, in order of `grids`."""
    tokens = [int(t) for t in ids]
    starts = [tokens[i + 1] for i, t in enumerate(tokens[:-1]) if t == vision_start_token_id]
    n_images = sum(t == image_token_id for t in starts)
    parts: list[np.ndarray] = []
    st = 0
    for i in range(n_images):
        ed = tokens.index(image_token_id, st)
        t, h, w = (int(x) for x in grids[i])
        gt, gh, gw = t, h // merge, w // merge
        text_len = ed - st
        st_idx = int(parts[-1].max()) + 1 if parts else 0
        parts.append(np.broadcast_to(np.arange(text_len), (3, text_len)) + st_idx)
        grid = np.stack([np.repeat(np.arange(gt), gh * gw), np.tile(np.repeat(np.arange(gh), gw), gt),
                         np.tile(np.arange(gw), gt * gh)])
        parts.append(grid + text_len + st_idx)
        st = ed + gt * gh * gw
    if st < len(tokens):
        st_idx = int(parts[-1].max()) + 1 if parts else 0
        parts.append(np.broadcast_to(np.arange(len(tokens) - st), (3, len(tokens) - st)) + st_idx)
    positions = np.concatenate(parts, axis=1).reshape(3, -1)
    return positions, int(positions.max()) + 1 - len(tokens)


def _interleaved_selector(section: Sequence[int], freq_dim: int) -> mx.array:
    """mlx-vlm's interleaved layout (Qwen3-VL): h and w take every third frequency from 1 and 2."""
    selector = [0] * freq_dim
    for axis, offset in enumerate((1, 2), start=1):
        for i in range(offset, min(section[axis] * 3, freq_dim), 3):
            selector[i] = axis
    return mx.array(selector, dtype=mx.int32)


def _chunked_selector(section: Sequence[int], freq_dim: int) -> mx.array:
    """Which position axis (0 t, 1 h, 2 w) each frequency reads (mlx-vlm's chunked layout)."""
    selector = [0] * freq_dim
    offset = section[0]
    for axis, length in enumerate(section[1:], start=1):
        for i in range(offset, min(offset + length, freq_dim)):
            selector[i] = axis
        offset += length
    return mx.array(selector, dtype=mx.int32)


def _rotate_half(x: mx.array) -> mx.array:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return mx.concatenate([-x2, x1], axis=-1)


class MRopeText:
    """A qwen2 / qwen3 UniversalDense (the qwen2_vl / qwen3_vl rows) run with mRoPE positions
    (`interleaved`: Qwen3-VL's frequency layout) and, for Qwen3-VL, deepstack rows added to the
    first layers' outputs at the image positions."""

    def __init__(self, model, interleaved: bool = False, section: Optional[Sequence[int]] = None):
        """`section`: the mrope_section (default: the row's rope scaling's; a row whose mlx-lm
        file ignores rope_scaling, qwen3_vl_moe's, is handed the config's)."""
        self.model = model
        d = model.descriptor
        self._n = d.names
        self._qk = d.qk_norm.names if d.qk_norm is not None and d.qk_norm.enabled else None
        spec = model.args.layers[0].rope
        section = section or (spec.scaling or {}).get("mrope_section")
        if not section:
            raise GenerationError(f"{model.model_type}: the config's rope_scaling has no mrope_section "
                                  "(the image positions' layout)")
        attn = model.backbone[d.names.layers][0][d.names.attn]
        hd = attn._hd
        self.inv_freq = 1.0 / (spec.base ** (mx.arange(0, hd, 2).astype(mx.float32) / hd))
        layout = _interleaved_selector if interleaved else _chunked_selector
        self.selector = layout(list(section), self.inv_freq.shape[0])

    def cos_sin(self, positions: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """cos / sin [B, L, head_dim] of `positions` [3, B, L]."""
        freqs = mx.take(positions, self.selector, axis=0).transpose(1, 2, 0).astype(mx.float32) * self.inv_freq
        emb = mx.concatenate([freqs, freqs], axis=-1)
        return (mx.cos(emb) * 1.0).astype(dtype), (mx.sin(emb) * 1.0).astype(dtype)

    def _attention(self, attn, x: mx.array, mask, cache, cos: mx.array, sin: mx.array) -> mx.array:
        n = self._n
        B, L, _ = x.shape
        q = attn[n.q](x).reshape(B, L, attn._h, attn._hd)
        k = attn[n.k](x).reshape(B, L, attn._kv, attn._hd)
        if self._qk is not None:  # Qwen3: per-head RMSNorm before the heads move forward
            q, k = attn[self._qk[0]](q), attn[self._qk[1]](k)
        q, k = q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3)
        v = attn[n.v](x).reshape(B, L, attn._kv, attn._hd).transpose(0, 2, 1, 3)
        c, s = mx.expand_dims(cos, axis=1), mx.expand_dims(sin, axis=1)
        q = ((q * c) + (_rotate_half(q) * s)).astype(q.dtype)
        k = ((k * c) + (_rotate_half(k) * s)).astype(k.dtype)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=attn._scale, mask=mask)
        return attn[n.o](out.transpose(0, 2, 1, 3).reshape(B, L, -1))

    def forward_hidden(self, ids: mx.array, cache: Optional[list], positions: mx.array,
                       input_embeddings: Optional[mx.array] = None, deepstack: Sequence[mx.array] = (),
                       visual_rows: Optional[mx.array] = None) -> mx.array:
        """`deepstack[i]` [rows, D] is added after layer i at `visual_rows` (this call's image rows)."""
        m, n = self.model, self._n
        h = m.embed_tokens(ids) if input_embeddings is None else input_embeddings
        blocks = m.backbone[n.layers]
        if cache is None:
            cache = [None] * len(blocks)
        for c in cache:
            if c is not None and type(c).__name__ != "KVCache":
                raise GenerationError(f"images through mRoPE run on plain KV caches only, not {type(c).__name__}")
        mask = create_attention_mask(h, cache[0])
        cos, sin = self.cos_sin(positions, h.dtype)
        for i, (block, c) in enumerate(zip(blocks, cache)):
            r = self._attention(block[n.attn], block[n.norms.pre_attn](h), mask, c, cos, sin)
            h = h + r
            h = h + block[n.mlp](block[n.norms.pre_mlp](h))
            if i < len(deepstack) and visual_rows is not None and visual_rows.size:
                h = mx.stack([mx.array(h[0]).at[visual_rows].add(deepstack[i])], axis=0)
        return m.backbone[n.final_norm](h)

    def logits(self, ids: mx.array, cache: Optional[list], positions: mx.array,
               input_embeddings: Optional[mx.array] = None, deepstack: Sequence[mx.array] = (),
               visual_rows: Optional[mx.array] = None) -> mx.array:
        return self.model.logits_from_hidden(self.forward_hidden(ids, cache, positions, input_embeddings,
                                                                 deepstack, visual_rows))
