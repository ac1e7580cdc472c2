"""The tower bring-up's figures (experiments/tower_bringup.py): the image with its patch grid,
per-stage diffs over the patch grid, the soft tokens and where they sit in the prompt, attention
maps; for an audio tower, the clip's log-mel frames and per-stage diffs over the frames. Each
returns a matplotlib Figure (lab.plots.show displays it)."""

from __future__ import annotations

import numpy as np

from mlxbun.lab.plots import cmap, figure

__all__ = ["attention_plot", "frame_diff_plot", "mel_plot", "patch_grid_plot", "soft_tokens_plot",
           "stage_diff_grids"]


def patch_grid_plot(image: np.ndarray, patch, title: str = "the image as the tower sees it",
                    numbers: np.ndarray | None = None):
    """The resized image with its patch boundaries (`patch`: pixels a side, or (rows, columns)) and
    each patch's number: `numbers` [rows, cols] (its soft token's index), default row-major."""
    ph, pw = (patch, patch) if np.isscalar(patch) else patch
    fig = figure(4.5, 4.5)
    ax = fig.subplots()
    ax.imshow(image)
    h, w = image.shape[:2]
    for x in range(0, w + 1, pw):
        ax.axvline(x - 0.5, color="white", lw=0.8)
    for y in range(0, h + 1, ph):
        ax.axhline(y - 0.5, color="white", lw=0.8)
    rows, cols = h // ph, w // pw
    if rows <= 16 and cols <= 16:
        numbers = np.arange(rows * cols).reshape(rows, cols) if numbers is None else numbers
        for r in range(rows):
            for c in range(cols):
                ax.text(c * pw + pw / 2, r * ph + ph / 2, str(numbers[r, c]), ha="center", va="center",
                        color="yellow", fontsize=7)
    ax.set_title(title)
    ax.set_axis_off()
    return fig


def stage_diff_grids(grids: dict, title: str = "max |mlxbun - mlx-vlm| per patch, stage by stage"):
    """One small heatmap per stage over the patch grid (the projector's over its soft tokens);
    an all-zero stage is annotated 'bit-exact'."""
    names = list(grids)
    cols = min(4, len(names))
    rows = -(-len(names) // cols)
    fig = figure(2.4 * cols + 0.6, 2.4 * rows + 0.6)
    axes = np.atleast_1d(fig.subplots(rows, cols)).ravel()
    vmax = max(float(g.max()) for g in grids.values()) or 1.0
    for ax, name in zip(axes, names):
        g = grids[name]
        im = ax.imshow(g, cmap=cmap("magma"), vmin=0, vmax=vmax)
        ax.set_title(f"{name}\n{'bit-exact' if g.max() == 0 else f'max {g.max():.3g}'}", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
    for ax in axes[len(names):]:
        ax.set_axis_off()
    fig.colorbar(im, ax=list(axes[:len(names)]), shrink=0.8, label="max |diff|")
    fig.suptitle(title, fontsize=10)
    return fig


def soft_tokens_plot(soft_tokens: np.ndarray, prompt_ids: list[int], image_token_id: int,
                     title: str = "the image's soft tokens and where they enter the prompt"):
    """Left: the soft tokens [T, D] (values); right: the prompt's positions, the image-token rows
    (the merged soft tokens) marked."""
    fig = figure(9, 3.2)
    a, b = fig.subplots(1, 2, width_ratios=[2, 3])
    im = a.imshow(soft_tokens, aspect="auto", cmap=cmap("coolwarm"))
    a.set_xlabel("feature")
    a.set_ylabel("soft token")
    if soft_tokens.shape[0] <= 32:
        a.set_yticks(range(soft_tokens.shape[0]))
    fig.colorbar(im, ax=a)
    ids = np.array(prompt_ids)
    mask = (ids == image_token_id).astype(float)[None, :]
    b.imshow(mask, aspect="auto", cmap=cmap("Greens"), vmin=0, vmax=1)
    b.set_yticks([])
    b.set_xlabel("prompt position (green: a soft token's row)")
    if len(ids) <= 40:
        b.set_xticks(range(len(ids)), [str(i) for i in ids], rotation=90, fontsize=6)
    fig.suptitle(title, fontsize=10)
    return fig


def attention_plot(attention: np.ndarray, query: int | None = None, title: str = "attention",
                   shape: tuple[int, int] | None = None):
    """Per head: the attention each patch receives (mean over queries) on the patch grid (`shape`
    rows x columns, default square), and the map of one query patch (default: the centre one)."""
    heads, n, _ = attention.shape
    rows, cols = shape if shape and shape[0] * shape[1] == n else (int(round(n ** 0.5)),) * 2
    query = (rows // 2) * cols + cols // 2 if query is None else query
    fig = figure(2.4 * heads + 0.6, 5.0)
    axes = np.array(fig.subplots(2, heads)).reshape(2, heads)
    for h in range(heads):
        axes[0, h].imshow(attention[h].mean(axis=0).reshape(rows, cols), cmap=cmap("viridis"))
        axes[0, h].set_title(f"head {h}: received", fontsize=8)
        axes[1, h].imshow(attention[h, query].reshape(rows, cols), cmap=cmap("viridis"))
        axes[1, h].set_title(f"head {h}: query patch {query}", fontsize=8)
        for ax in axes[:, h]:
            ax.set_xticks([])
            ax.set_yticks([])
    fig.suptitle(title, fontsize=10)
    return fig


def mel_plot(mel: np.ndarray, mask: np.ndarray | None = None, title: str = "the clip's log-mel frames"):
    """The log-mel features [frames, bins] (time across, mel bins up), padded frames hatched."""
    fig = figure(8, 3.2)
    ax = fig.subplots()
    im = ax.imshow(mel.T, aspect="auto", origin="lower", cmap=cmap("magma"), interpolation="nearest")
    if mask is not None and not mask.all():
        first = int(np.argmin(mask)) if mask[0] else 0
        ax.axvspan(first - 0.5, len(mask) - 0.5, color="white", alpha=0.35, hatch="//", label="padding")
        ax.legend(loc="upper right", fontsize=7)
    ax.set_xlabel("frame")
    ax.set_ylabel("mel bin")
    fig.colorbar(im, ax=ax, label="log-mel")
    ax.set_title(title)
    return fig


def frame_diff_plot(grids: dict, title: str = "max |mlxbun - mlx-vlm| per frame, stage by stage"):
    """One strip per stage over its frames ([1, T] each: the subsampled frames, the tower's output,
    the embedder's soft tokens); an all-zero stage is annotated 'bit-exact'."""
    names = list(grids)
    fig = figure(8, 0.75 * len(names) + 1.2)
    axes = np.atleast_1d(fig.subplots(len(names), 1))
    vmax = max(float(g.max()) for g in grids.values()) or 1.0
    for ax, name in zip(axes, names):
        g = np.atleast_2d(grids[name])
        im = ax.imshow(g, aspect="auto", cmap=cmap("magma"), vmin=0, vmax=vmax, interpolation="nearest")
        ax.set_yticks([])
        ax.set_ylabel(name, rotation=0, ha="right", va="center", fontsize=8)
        ax.text(1.01, 0.5, "bit-exact" if g.max() == 0 else f"max {g.max():.3g}", transform=ax.transAxes,
                fontsize=7, va="center")
    axes[-1].set_xlabel("frame (each stage's own rate)")
    fig.colorbar(im, ax=list(axes), shrink=0.8, label="max |diff|", pad=0.12)
    fig.suptitle(title, fontsize=10)
    return fig
