"""The projectors from a tower's patches to the text model's soft tokens, one per
`ProjectorKind`, op for op as mlx-vlm's, under the checkpoint's names."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxbun.towers.knobs import ProjectorKind

__all__ = ["Gemma3Projector", "KimiProjector", "LlavaProjector", "Lfm2Projector", "Mistral3Projector", "PatchMerger",
           "Qwen3Merger", "make_projector"]


class Gemma3Projector(nn.Module):
    """mlx-vlm's Gemma3MultiModalProjector: the patch grid average-pooled to
    `tokens_per_image` tokens, gemma-RMS-normed, projected by mm_input_projection_weight."""

    def __init__(self, vision_hidden: int, text_hidden: int, grid: int, tokens_per_image: int, eps: float):
        super().__init__()
        side = int(tokens_per_image ** 0.5)
        if side * side != tokens_per_image or side == 0 or grid % side:
            raise ValueError(f"mm_tokens_per_image {tokens_per_image} is not a square whose side divides "
                             f"the {grid}x{grid} patch grid")
        self.mm_input_projection_weight = mx.zeros((vision_hidden, text_hidden))
        self.mm_soft_emb_norm = _GemmaRMSNorm(vision_hidden, eps)
        self.grid, self.kernel = grid, grid // side
        self.avg_pool = nn.AvgPool2d(kernel_size=self.kernel, stride=self.kernel)

    def __call__(self, x: mx.array) -> mx.array:
        b, _, d = x.shape
        h = x.transpose(0, 2, 1).reshape(b, d, self.grid, self.grid).transpose(0, 2, 3, 1)
        h = self.avg_pool(h).transpose(0, 3, 1, 2).flatten(2).transpose(0, 2, 1)
        h = self.mm_soft_emb_norm(h)
        return mx.einsum("btm,md->btd", h, self.mm_input_projection_weight).astype(x.dtype)


class _GemmaRMSNorm(nn.Module):
    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class PatchMerger(nn.Module):
    """mlx-vlm's Qwen2-VL PatchMerger: LayerNorm (Qwen2.5-VL: RMSNorm) over each patch, each merge window's patches
    (consecutive in the tower's order) concatenated, Linear -> erf GELU -> Linear."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, rms: bool = False):
        super().__init__()
        self.hidden_size = vision_hidden * merge ** 2
        self.ln_q = nn.RMSNorm(vision_hidden, eps=1e-6) if rms else nn.LayerNorm(vision_hidden, eps=1e-6)
        self.mlp = [nn.Linear(self.hidden_size, self.hidden_size), nn.GELU(),
                    nn.Linear(self.hidden_size, text_hidden)]

    def __call__(self, x: mx.array) -> mx.array:
        x = self.ln_q(x).reshape(-1, self.hidden_size)
        for layer in self.mlp:
            x = layer(x)
        return x


class LlavaProjector(nn.Module):
    """mlx-vlm's LlavaMultiModalProjector (pixtral): linear_1 -> erf GELU -> linear_2, biased."""

    def __init__(self, vision_hidden: int, text_hidden: int):
        super().__init__()
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=True)
        self.gelu = nn.GELU()
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        return self.linear_2(self.gelu(self.linear_1(x)))


class Mistral3Projector(nn.Module):
    """mlx-vlm's Mistral3MultiModalProjector: RMSNorm (the text eps) per patch, each image's
    merge x merge windows concatenated (Mistral3PatchMerger's unfold: features channel-major,
    then the window's row and column) and merged by a bias-free linear, linear_1 -> erf GELU ->
    linear_2. Called with each image's size (pixels)."""

    takes_grid = True

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, patch: int, eps: float, bias: bool):
        super().__init__()
        self.norm = nn.RMSNorm(vision_hidden, eps=eps)
        self.patch_merger = _Mistral3Merger(vision_hidden, merge)
        self.linear_1 = nn.Linear(vision_hidden, text_hidden, bias=bias)
        self.gelu = nn.GELU()
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)
        self.merge, self.patch = merge, patch

    def __call__(self, x: mx.array, sizes) -> mx.array:
        if x.ndim == 3 and x.shape[0] == 1:
            x = x[0]
        x = self.norm(x)
        m, d = self.merge, x.shape[-1]
        shapes = [(int(h) // self.patch, int(w) // self.patch) for h, w in np.asarray(sizes).tolist()]
        splits = np.cumsum([h * w for h, w in shapes])[:-1].tolist()
        merged = []
        for tokens, (h, w) in zip(mx.split(x, splits, axis=0), shapes):
            # [d * m * m, windows] laid out as unfold's, then transposed (a strided view, as
            # mlx-vlm's: a single image's reaches the merging linear uncopied)
            grid = tokens.reshape(h // m, m, w // m, m, d).transpose(4, 1, 3, 0, 2)
            merged.append(grid.reshape(d * m * m, (h // m) * (w // m)).T)
        x = self.patch_merger.merging_layer(mx.concatenate(merged, axis=0))
        return self.linear_2(self.gelu(self.linear_1(x)))


class _Mistral3Merger(nn.Module):
    def __init__(self, hidden: int, merge: int):
        super().__init__()
        self.merging_layer = nn.Linear(hidden * merge ** 2, hidden, bias=False)


class Qwen3Merger(nn.Module):
    """mlx-vlm's Qwen3-VL PatchMerger: LayerNorm (over each patch, or with `postshuffle` over the
    concatenated window: the deepstack mergers), merge x merge windows concatenated,
    linear_fc1 -> erf GELU -> linear_fc2."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int, postshuffle: bool = False,
                 tanh: bool = False):
        super().__init__()
        self.hidden_size = vision_hidden * merge ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden_size if postshuffle else vision_hidden, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden_size, self.hidden_size)
        self.act_fn = nn.GELU(approx="tanh" if tanh else "none")
        self.linear_fc2 = nn.Linear(self.hidden_size, text_hidden)

    def __call__(self, x: mx.array) -> mx.array:
        x = self.norm(x.reshape(-1, self.hidden_size) if self.postshuffle else x).reshape(-1, self.hidden_size)
        return self.linear_fc2(self.act_fn(self.linear_fc1(x)))


class Lfm2Projector(nn.Module):
    """mlx-vlm's LFM2-VL encode_images + Lfm2VlMultiModalProjector: each view's real patches as
    its grid, pixel-unshuffled by `factor` (odd sides zero-padded), LayerNorm, linear_1 -> erf
    GELU -> linear_2; the views' tokens concatenated. Called with (each view's grid, its mask)."""

    takes_grid = True

    def __init__(self, vision_hidden: int, text_hidden: int, factor: int, hidden: int, bias: bool):
        super().__init__()
        channels = vision_hidden * factor ** 2
        self.layer_norm = nn.LayerNorm(channels)
        self.linear_1 = nn.Linear(channels, hidden, bias=bias)
        self.linear_2 = nn.Linear(hidden, text_hidden, bias=bias)
        self.factor = factor

    def unshuffle(self, x: mx.array) -> mx.array:
        f = self.factor
        n, w, h, c = x.shape
        if w % f:
            x = mx.concatenate([x, mx.zeros((n, f - w % f, h, c), dtype=x.dtype)], axis=1)
            n, w, h, c = x.shape
        if h % f:
            x = mx.concatenate([x, mx.zeros((n, w, f - h % f, c), dtype=x.dtype)], axis=2)
            n, w, h, c = x.shape
        x = x.reshape(n, w, h // f, c * f).transpose(0, 2, 1, 3)
        return x.reshape(n, h // f, w // f, c * f * f).transpose(0, 2, 1, 3)

    def __call__(self, x: mx.array, grid) -> mx.array:
        shapes, keep = grid
        lengths = np.asarray(keep).sum(axis=1).tolist()
        out = []
        for i, (h, w) in enumerate(np.asarray(shapes).tolist()):
            feature = x[i][: lengths[i], :][None, ...].reshape(1, int(h), int(w), -1)
            y = self.linear_1(self.layer_norm(self.unshuffle(feature)))
            y = self.linear_2(nn.gelu(y))
            out.append(y.reshape(-1, y.shape[-1]))
        return mx.concatenate(out, axis=0)


class KimiProjector(nn.Module):
    """mlx-vlm's KimiVLMultiModalProjector over the tower's [windows, merge**2, D]."""

    def __init__(self, vision_hidden: int, text_hidden: int, merge: int):
        super().__init__()
        self.hidden_size = vision_hidden * merge ** 2
        self.pre_norm = nn.LayerNorm(vision_hidden, eps=1e-5)
        self.linear_1 = nn.Linear(self.hidden_size, self.hidden_size, bias=True)
        self.linear_2 = nn.Linear(self.hidden_size, text_hidden, bias=True)

    def __call__(self, x: mx.array) -> mx.array:
        h = self.pre_norm(x).reshape(-1, self.hidden_size)
        return self.linear_2(nn.gelu(self.linear_1(h)))


def make_projector(kind: ProjectorKind, *, vision_hidden: int, text_hidden: int, grid: int = 0,
                   tokens_per_image: int = 0, eps: float = 1e-6, merge: int = 1, patch: int = 0,
                   bias: bool = True, tanh: bool = False, hidden: int = 0) -> nn.Module:
    if kind is ProjectorKind.GEMMA3_AVGPOOL:
        return Gemma3Projector(vision_hidden, text_hidden, grid, tokens_per_image, eps)
    if kind in (ProjectorKind.PATCH_MERGER, ProjectorKind.PATCH_MERGER_RMS):
        return PatchMerger(vision_hidden, text_hidden, merge, rms=kind is ProjectorKind.PATCH_MERGER_RMS)
    if kind is ProjectorKind.LLAVA:
        return LlavaProjector(vision_hidden, text_hidden)
    if kind is ProjectorKind.LFM2:
        return Lfm2Projector(vision_hidden, text_hidden, merge, hidden, bias)
    if kind is ProjectorKind.QWEN3_MERGER:
        return Qwen3Merger(vision_hidden, text_hidden, merge, tanh=tanh)
    if kind is ProjectorKind.MISTRAL3:
        return Mistral3Projector(vision_hidden, text_hidden, merge, patch, eps, bias)
    if kind is ProjectorKind.KIMI_VL:
        return KimiProjector(vision_hidden, text_hidden, merge)
    raise ValueError(f"no projector for {kind!r}")
