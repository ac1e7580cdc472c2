"""Plots and interactive extras for the lab notebooks.

Every plot function returns a `matplotlib.figure.Figure` built without pyplot (no global
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
    "FRONTEND_ENV", "HEADLESS_ENV", "INTERACTIVE_ENV", "bandwidth_plot", "bench_bars", "delta_p_hist",
    "heatmap_plot", "interactive", "kld_per_position_plot", "kv_metric_plot", "layer_explorer", "pareto_plot", "show", "topk_plot",
    "trajectory_explorer", "trajectory_plot",
]

HEADLESS_ENV = "MLXBUN_HEADLESS"  # set (not "" / "0") to force static output
INTERACTIVE_ENV = "MLXBUN_INTERACTIVE"  # set (not "" / "0") to force widgets in a kernel
# Set in the kernel's environment by frontends that render widgets: jupyter_server (JupyterLab,
# Notebook 7) for every notebook session's kernel, VS Code for the processes it starts.
FRONTEND_ENV = ("JPY_SESSION_NAME", "VSCODE_PID")


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


def _figure(w: float = 7.0, h: float = 4.0):
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


def _display(obj: Any) -> None:
    if _ipython() is None:
        return
    from IPython.display import display

    display(obj)


def show(fig) -> None:
    """Display a figure as a PNG in a notebook (nothing outside one)."""
    if _ipython() is None:
        return
    from IPython.display import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    _display(Image(data=buf.getvalue(), format="png"))


# ---------------------------------------------------------------- parity


def heatmap_plot(df, title: str = "max |diff| per unit and sub-step", highlight: str | None = None):
    """A units x sub-steps heatmap of max |diff| (log10 colour scale; exact zeros annotated "0",
    cells with no module left blank); `highlight` outlines one unit's row."""
    fig = _figure(1.6 + 1.2 * max(1, df.shape[1]), 1.2 + 0.45 * max(1, df.shape[0]))
    ax = fig.subplots()
    vals = df.to_numpy(dtype=float)
    finite = vals[np.isfinite(vals) & (vals > 0)]
    floor = finite.min() / 10 if finite.size else 1e-8
    shown = np.where(np.isnan(vals), np.nan, np.log10(np.maximum(vals, floor)))
    cmap = _cmap("viridis").with_extremes(bad="#eeeeee")
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap, aspect="auto",
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


def _cmap(name: str):
    import matplotlib

    return matplotlib.colormaps[name].copy()


def trajectory_plot(td, title: str = "greedy trajectory: per-step logits diff"):
    """Per decode step: max |logit diff| and KL(a || b); the first divergence marked."""
    fig = _figure(7, 3.2)
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


def _token_label(i: int, tokenizer) -> str:
    if tokenizer is None:
        return str(i)
    try:
        return f"{i} {tokenizer.decode([i])!r}"
    except Exception:  # noqa: BLE001 - a label must not fail the plot
        return str(i)


def topk_plot(step, labels: tuple[str, str] = ("a", "b"), tokenizer=None):
    """Both sides' top-k (id, its text with a tokenizer, and probability) at one `StepDiff`,
    side by side; each side's chosen id in red."""
    fig = _figure(8, 2.8)
    axes = fig.subplots(1, 2, sharex=True)
    for ax, top, chosen, name in zip(axes, (step.top_a, step.top_b), (step.id_a, step.id_b), labels):
        top = top or []
        names = [_token_label(i, tokenizer) for i, _ in top][::-1]
        probs = [p for _, p in top][::-1]
        colors = ["tab:red" if i == chosen else "tab:blue" for i, _ in top][::-1]
        ax.barh(names, probs, color=colors)
        ax.set_title(f"{name}: chose {chosen}", fontsize=9)
        ax.set_xlabel("probability")
    fig.suptitle(f"step {step.step}" + ("" if step.same else " - the sides part here"))
    return fig


# ---------------------------------------------------------------- logit diff


def kld_per_position_plot(stats, title: str = "KLD per position"):
    """KL(base || new) at every scored position (log scale), top-1 disagreements marked."""
    fig = _figure(8, 3.2)
    ax = fig.subplots()
    kld = np.asarray(stats.kld_values, dtype=float)
    pos = np.arange(len(kld))
    ax.plot(pos, kld, lw=1, label="KLD")
    if len(kld) >= 8:
        w = max(4, len(kld) // 16)
        ax.plot(pos, np.convolve(kld, np.ones(w) / w, mode="same"), lw=2, label=f"running mean ({w})")
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
    fig = _figure(6, 3.2)
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


# ---------------------------------------------------------------- KV quantization


def pareto_plot(df, x: str = "kv_bytes", y: str = "kld_mean", title: str = "KV bytes vs KLD"):
    """Scatter of the quantized configurations (one colour per context length, log-log), each
    context's Pareto front joined and labelled; configurations with y = 0 (plain KV, the
    reference) cannot sit on a log axis and are dashed vertical lines at their x instead."""
    from mlxbun.lab.workflows import pareto_front

    fig = _figure(7, 4.2)
    ax = fig.subplots()
    ok = df[df[x].notna() & df[y].notna()]
    colors = _cmap("tab10")
    for k, (ctx, g) in enumerate(ok.groupby("context")):
        color = colors(k % 10)
        for xv in g.loc[g[y] <= 0, x]:
            ax.axvline(xv, color=color, ls="--", lw=1, label=f"{y} = 0 (context {ctx})")
        pos = g[g[y] > 0]
        ax.scatter(pos[x], pos[y], color=color, s=30, label=f"context {ctx}")
        front = pos[pareto_front(pos, x, y)].sort_values(x)
        ax.plot(front[x], front[y], color=color, lw=1, alpha=0.7)
        for _, r in front.iterrows():
            ax.annotate(r["label"], (r[x], r[y]), fontsize=7, xytext=(3, 3), textcoords="offset points")
    if (ok[y] > 0).any():
        ax.set_yscale("log")
    ax.set_xscale("log")
    ax.set_xlabel(f"{x} (log)")
    ax.set_ylabel(f"{y} (log)")
    ax.set_title(title + " (lines: Pareto fronts)")
    ax.legend(fontsize=7)
    return fig


def kv_metric_plot(df, metric: str = "decode_tps", title: str | None = None):
    """One bar per KV configuration, grouped by context length, for one column of `kv_sweep`'s table."""
    fig = _figure(8, 3.4)
    ax = fig.subplots()
    labels = list(dict.fromkeys(df["label"]))
    contexts = list(dict.fromkeys(df["context"]))
    width = 0.8 / max(1, len(contexts))
    for k, ctx in enumerate(contexts):
        g = df[df["context"] == ctx].set_index("label").reindex(labels)
        ax.bar(np.arange(len(labels)) + k * width, g[metric].to_numpy(dtype=float), width, label=f"context {ctx}")
    ax.set_xticks(np.arange(len(labels)) + width * (len(contexts) - 1) / 2, labels, rotation=30, ha="right",
                  fontsize=8)
    ax.set_ylabel(metric)
    ax.set_title(title or metric)
    ax.legend(fontsize=8)
    return fig


# ---------------------------------------------------------------- benchmark


def bench_bars(df, metrics=("prefill_tps", "decode_tps", "ttft_ms", "peak_memory_gb"), by: str = "engine"):
    """One panel per metric, one bar per engine (mlxbun vs mlx-lm); `df` has an `engine`
    column or index (e.g. `Benchmark.table()`)."""
    df = df.reset_index() if by not in df.columns else df
    present = [m for m in metrics if m in df.columns]
    fig = _figure(3.0 * max(1, len(present)), 3.4)
    axes = np.atleast_1d(fig.subplots(1, max(1, len(present))))
    for ax, m in zip(axes, present):
        g = df.groupby(by, sort=False)[m].mean()
        ax.bar([str(i) for i in g.index], g.to_numpy(), color=["tab:blue", "tab:orange", "tab:green"][: len(g)])
        ax.set_title(m, fontsize=9)
        for i, v in enumerate(g.to_numpy()):
            ax.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    return fig


def bandwidth_plot(weight_bytes: float, bandwidth_bytes_s: float, measured: dict[str, float],
                   title: str = "the bandwidth wall"):
    """Decode tok/s against the wall `bandwidth / weight bytes` (each token reads every weight
    once): one bar per engine, the wall a horizontal line, the attained fraction annotated."""
    fig = _figure(6, 3.4)
    ax = fig.subplots()
    wall = bandwidth_bytes_s / weight_bytes if weight_bytes else math.nan
    names = list(measured)
    vals = [measured[n] for n in names]
    ax.bar(names, vals, color="tab:blue")
    ax.axhline(wall, color="red", ls="--", label=f"wall {wall:,.0f} tok/s ({bandwidth_bytes_s / 1e9:.1f} GB/s "
                                                  f"/ {weight_bytes / 1e6:.2f} MB)")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:,.0f} tok/s\n{100 * v / wall:.2g} % of wall", ha="center", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("decode tok/s (log)")
    ax.set_title(title)
    ax.legend(fontsize=8)
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
        _display(td.as_table())
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
    _display(box)
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
            _display(table[[c for c in columns if c in table.columns]])
        else:
            unit = next((u for u in units if first["path"] == u or first["path"].startswith(u + ".")), None)
            _display(rows_of(unit) if unit else table)
        return None
    import ipywidgets as w

    picker = w.Dropdown(options=units, description="unit")
    out = w.Output()

    def render(change=None):
        out.clear_output(wait=True)
        with out:
            show(heatmap_plot(heat, highlight=picker.value))
            _display(rows_of(picker.value))

    picker.observe(render, names="value")
    render()
    box = w.VBox([picker, out])
    _display(box)
    return box
