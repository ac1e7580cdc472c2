"""Plot primitives, the parity plots the notebooks share, per-layer plots (a layers x experts
load heatmap, per-layer lines: moe_routing's), plus interactive extras.

The primitives (`figure`, `cmap`, `show`, `token_label`, `interactive`) are what every
experiment's own plots (in `mlxbun.experiments.*`) are built from. Every plot function returns a `matplotlib.figure.Figure` built without pyplot (no global
state, no GUI backend: it renders with Agg anywhere) and `show(fig)` displays it as a PNG in a
notebook (or does nothing outside one). The widgets (`trajectory_explorer`, `layer_explorer`)
are ipywidgets when a live frontend can render them and degrade to static output otherwise
(papermill runs, `mlxbun lab run`, plain Python): see `interactive()`.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any

import numpy as np

__all__ = [
    "FRONTEND_ENV", "HEADLESS_ENV", "INTERACTIVE_ENV", "cmap", "delta_p_hist", "display", "expert_load_heatmap",
    "figure", "heatmap_plot", "interactive", "kld_per_position_plot", "layer_explorer", "layer_lines_plot",
    "running_mean", "show", "token_label", "topk_plot", "trajectory_explorer", "trajectory_plot",
]

HEADLESS_ENV = "MLXBUN_HEADLESS"  # set (not "" / "0") to force static output
INTERACTIVE_ENV = "MLXBUN_INTERACTIVE"  # set (not "" / "0") to force widgets in a kernel
# Set in the kernel's environment by frontends that render widgets: jupyter_server (JupyterLab,
# Notebook 7) for every notebook session's kernel, VS Code for the processes it starts.
FRONTEND_ENV = ("JPY_SESSION_NAME", "VSCODE_PID")


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def figure(w: float = 7.0, h: float = 4.0):
    """A matplotlib Figure of w x h inches, no pyplot (Agg renders it anywhere)."""
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), layout="constrained")


def _ipython():
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def interactive() -> bool:
    """True only in a Jupyter kernel, with ipywidgets, that a widget-rendering frontend started.

    A kernel cannot ask whether anyone will render a widget, and papermill / nbclient kernels
    look like any other. So the answer is static unless a known frontend marked the kernel's
    environment (FRONTEND_ENV) or $MLXBUN_INTERACTIVE is set; $MLXBUN_HEADLESS (which
    `mlxbun lab run` sets) always wins.
    """
    if _flag(HEADLESS_ENV):
        return False
    ip = _ipython()
    if ip is None or not hasattr(ip, "kernel"):
        return False
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    return _flag(INTERACTIVE_ENV) or any(os.environ.get(k) for k in FRONTEND_ENV)


def display(obj: Any) -> None:
    """Display any object in a notebook (a table, a widget); nothing outside one."""
    if _ipython() is None:
        return
    from IPython.display import display as ipython_display

    ipython_display(obj)


def show(fig) -> None:
    """Display a figure as a PNG in a notebook (nothing outside one)."""
    if _ipython() is None:
        return
    from IPython.display import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    display(Image(data=buf.getvalue(), format="png"))


# ---------------------------------------------------------------- parity


def heatmap_plot(df, title: str = "max |diff| per unit and sub-step", highlight: str | None = None):
    """A units x sub-steps heatmap of max |diff| (log10 colour scale; exact zeros annotated "0",
    cells with no module left blank); `highlight` outlines one unit's row."""
    fig = figure(1.6 + 1.2 * max(1, df.shape[1]), 1.2 + 0.45 * max(1, df.shape[0]))
    ax = fig.subplots()
    vals = df.to_numpy(dtype=float)
    finite = vals[np.isfinite(vals) & (vals > 0)]
    floor = finite.min() / 10 if finite.size else 1e-8
    shown = np.where(np.isnan(vals), np.nan, np.log10(np.maximum(vals, floor)))
    colors = cmap("viridis").with_extremes(bad="#eeeeee")
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=colors, aspect="auto",
                   vmin=math.log10(floor), vmax=math.log10(max(finite.max(), floor * 10)) if finite.size else 0)
    ax.set_xticks(range(df.shape[1]), [str(c) for c in df.columns])
    ax.set_yticks(range(df.shape[0]), [str(r) for r in df.index])
    for (i, j), v in np.ndenumerate(vals):
        if not np.isnan(v):
            ax.text(j, i, "0" if v == 0 else f"{v:.1e}", ha="center", va="center", fontsize=8,
                    color="white" if v == 0 or (finite.size and v < np.median(finite)) else "black")
    if highlight is not None and highlight in df.index:
        from matplotlib.patches import Rectangle

        row = list(df.index).index(highlight)
        ax.add_patch(Rectangle((-0.5, row - 0.5), df.shape[1], 1, fill=False, edgecolor="red", lw=2))
    fig.colorbar(im, ax=ax, label="log10 max |diff|")
    ax.set_title(title + (" - all bit-exact" if finite.size == 0 and np.isfinite(vals).any() else ""))
    return fig


def cmap(name: str):
    """A matplotlib colormap by name."""
    import matplotlib

    return matplotlib.colormaps[name].copy()


def trajectory_plot(td, title: str = "greedy trajectory: per-step logits diff"):
    """Per decode step: max |logit diff| and KL(a || b); the first divergence marked."""
    fig = figure(7, 3.2)
    ax = fig.subplots()
    steps = [s.step for s in td.steps]
    diff = [np.nan if s.max_abs_diff is None else s.max_abs_diff for s in td.steps]
    kld = [np.nan if s.kld is None else s.kld for s in td.steps]
    ax.plot(steps, diff, "o-", label="max |logit diff|")
    ax.plot(steps, kld, "s--", label="KL(a || b)")
    if td.first_divergence is not None:
        ax.axvline(td.first_divergence, color="red", lw=1, label=f"ids part (step {td.first_divergence})")
    ax.set_xlabel("step (0 = prefill)")
    ax.set_ylabel("nats / logit units")
    ax.set_title(title + (" - identical" if td.identical and not np.nansum(diff) else ""))
    ax.legend(loc="best", fontsize=8)
    return fig


def token_label(i: int, tokenizer) -> str:
    """A token id with its text when a tokenizer is given (plot labels); ascii(): a tick label
    must not carry control or right-to-left characters."""
    if tokenizer is None:
        return str(i)
    try:
        return f"{i} {ascii(tokenizer.decode([i]))}"
    except Exception:  # noqa: BLE001 - a label must not fail the plot
        return str(i)


def topk_plot(step, labels: tuple[str, str] = ("a", "b"), tokenizer=None):
    """Both sides' top-k (id, its text with a tokenizer, and probability) at one `StepDiff`,
    side by side; each side's chosen id in red."""
    fig = figure(8, 2.8)
    axes = fig.subplots(1, 2, sharex=True)
    for ax, top, chosen, name in zip(axes, (step.top_a, step.top_b), (step.id_a, step.id_b), labels):
        top = top or []
        names = [token_label(i, tokenizer) for i, _ in top][::-1]
        probs = [p for _, p in top][::-1]
        colors = ["tab:red" if i == chosen else "tab:blue" for i, _ in top][::-1]
        ax.barh(names, probs, color=colors)
        ax.set_title(f"{name}: chose {chosen}", fontsize=9)
        ax.set_xlabel("probability")
    fig.suptitle(f"step {step.step}" + ("" if step.same else " - the sides part here"))
    return fig


# ---------------------------------------------------------------- logit diff


def running_mean(values, window: int) -> np.ndarray:
    """The centred running mean of `values` over `window` points, one per value: the window
    shrinks at both ends, so each point is the mean of the values its window covers (a
    zero-padded `np.convolve(..., mode="same")` divides the ends' partial sums by the full window
    and dips there). Position i's window is values[i - window // 2 : i - window // 2 + window]."""
    x = np.asarray(values, dtype=float)
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"running mean: window must be a positive integer, got {window!r}")
    if x.ndim != 1:
        raise ValueError(f"running mean: values must be one-dimensional, got shape {x.shape}")
    n, box = len(x), np.ones(int(window))
    if n == 0:
        return x
    start = (len(box) - 1) // 2  # np.convolve's "same" slice of the full convolution
    sums = np.convolve(x, box)[start:start + n]
    counts = np.convolve(np.ones(n), box)[start:start + n]
    return sums / counts


def kld_per_position_plot(stats, title: str = "KLD per position"):
    """KL(base || new) at every scored position (log scale), top-1 disagreements marked."""
    fig = figure(8, 3.2)
    ax = fig.subplots()
    kld = np.asarray(stats.kld_values, dtype=float)
    pos = np.arange(len(kld))
    ax.plot(pos, kld, lw=1, label="KLD")
    if len(kld) >= 8:
        w = max(4, len(kld) // 16)
        ax.plot(pos, running_mean(kld, w), lw=2, label=f"running mean ({w})")
    miss = np.flatnonzero(np.asarray(stats.top_base) != np.asarray(stats.top_new))
    ax.scatter(miss, kld[miss], color="red", s=14, zorder=3, label=f"top-1 differs ({len(miss)})")
    if (kld > 0).any():
        ax.set_yscale("log")
    ax.set_xlabel("position (scored)")
    ax.set_ylabel("KLD (nats)")
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    return fig


def delta_p_hist(stats, bins: int = 40, title: str = "delta-p: p_new(token) - p_base(token)"):
    """Histogram of delta-p (in %) of the actual next tokens."""
    if stats.dp_values is None:
        from mlxbun.errors import MlxbunError

        raise MlxbunError("no delta-p: the statistics were computed without next tokens")
    fig = figure(6, 3.2)
    ax = fig.subplots()
    dp = 100 * np.asarray(stats.dp_values, dtype=float)
    ax.hist(dp, bins=bins, color="tab:purple")
    ax.axvline(0, color="black", lw=0.8)
    ax.axvline(dp.mean(), color="red", lw=1, ls="--", label=f"mean {dp.mean():.3g} %")
    ax.set_xlabel("delta-p (%)")
    ax.set_ylabel("positions")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- per layer


def expert_load_heatmap(load, title: str = "expert load"):
    """A layers x experts heatmap of token counts (`moe_routing`'s `RoutingStats.load()`), each
    layer's row as its share of the layer's routed slots (the uniform share is 1/E); cells
    annotated when there are few."""
    vals = load.to_numpy(dtype=float)
    share = vals / np.nansum(vals, axis=1, keepdims=True)
    fig = figure(min(14.0, 3.0 + 0.5 * max(1, vals.shape[1])), min(12.0, 1.6 + 0.4 * max(1, vals.shape[0])))
    ax = fig.subplots()
    im = ax.imshow(np.ma.masked_invalid(share), cmap=cmap("magma").with_extremes(bad="#eeeeee"), aspect="auto",
                   vmin=0)
    if vals.size <= 256:
        ax.set_xticks(range(vals.shape[1]), [str(c) for c in load.columns])
        for (i, j), v in np.ndenumerate(vals):
            if not np.isnan(v):
                ax.text(j, i, f"{int(v)}", ha="center", va="center", fontsize=7,
                        color="white" if share[i, j] < np.nanmax(share) / 2 else "black")
    ax.set_yticks(range(vals.shape[0]), [str(r) for r in load.index])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    fig.colorbar(im, ax=ax, label="share of routed slots")
    ax.set_title(title)
    return fig


def layer_lines_plot(df, title: str = "per layer", ylabel: str = "", reference: float | None = None,
                     reference_label: str = "reference"):
    """One line per column of `df` over its index (the layers), e.g. a statistic of two
    configurations side by side; `reference` draws a dashed horizontal line (e.g. ln E)."""
    fig = figure(7, 3.2)
    ax = fig.subplots()
    for column in df.columns:
        ax.plot(df.index, df[column].to_numpy(dtype=float), "o-", label=str(column))
    if reference is not None:
        ax.axhline(reference, color="gray", ls="--", lw=1, label=f"{reference_label} ({reference:.3g})")
    ax.set_xticks(list(df.index))
    ax.set_xlabel(str(df.index.name or "layer"))
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(loc="best", fontsize=8)
    return fig


# ---------------------------------------------------------------- interactive extras


def trajectory_explorer(td, labels: tuple[str, str] = ("a", "b"), tokenizer=None):
    """A step slider over a trajectory diff showing both sides' top-k; static headless: the
    top-k plot at the divergence step (or the last step) and the per-step table."""
    if not td.steps:
        return None
    start = td.first_divergence if td.first_divergence is not None else len(td.steps) - 1
    if not interactive():
        show(topk_plot(td.steps[start], labels, tokenizer))
        display(td.as_table())
        return None
    import ipywidgets as w

    slider = w.IntSlider(value=start, min=0, max=len(td.steps) - 1, description="step")
    out = w.Output()

    def render(change=None):
        out.clear_output(wait=True)
        with out:
            show(topk_plot(td.steps[slider.value], labels, tokenizer))

    slider.observe(render, names="value")
    render()
    box = w.VBox([slider, out])
    display(box)
    return box


def layer_explorer(layer_diff, columns=("path", "substep", "call", "shape_a", "mean_a", "mean_b", "max_abs_diff",
                                        "equal")):
    """A layer (unit) picker on a LayerDiff's heatmap: the heatmap with the unit outlined and
    that unit's module outputs (both sides' statistics, max |diff|); static headless: the rows
    of the first differing unit (or of every unit when all agree)."""
    table = layer_diff.table
    heat = layer_diff.heatmap().dropna(how="all")
    units = list(heat.index)

    def rows_of(unit):
        if unit == "logits":
            sel = table["path"] == "logits"
        else:
            sel = (table["path"] == unit) | table["path"].str.startswith(unit + ".")
        return table.loc[sel, [c for c in columns if c in table.columns]]

    if not interactive():
        # the first output both sides have and that differs (a module one side lacks is no divergence)
        first = next((r for r in layer_diff.records if r["a"] is not None and r["b"] is not None
                      and not r["equal"]), None)
        if first is None:
            display(table[[c for c in columns if c in table.columns]])
        else:
            unit = next((u for u in units if first["path"] == u or first["path"].startswith(u + ".")), None)
            display(rows_of(unit) if unit else table)
        return None
    import ipywidgets as w

    picker = w.Dropdown(options=units, description="unit")
    out = w.Output()

    def render(change=None):
        out.clear_output(wait=True)
        with out:
            show(heatmap_plot(heat, highlight=picker.value))
            display(rows_of(picker.value))

    picker.observe(render, names="value")
    render()
    box = w.VBox([picker, out])
    display(box)
    return box
