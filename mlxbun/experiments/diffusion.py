"""diffusion.ipynb: what a block-diffusion sampler's knobs buy and cost.

    table = diffusion_sweep("zoo:diffusion_gemma", ["Once upon a time"], steps=(4, 8, 16))
    order = reveal_order(stats)          # canvas position x step, for a heatmap

`diffusion_sweep` runs every (sampler, steps, bound, seed) over the prompts and reports the
decoder forwards (NFE), tokens per forward, tokens/s and the agreement with the sampler's
reference run (the most steps and the strictest bound: the highest confidence threshold, the
lowest entropy bound) at the same seed. Rows go to the results table as experiment
"diffusion", tied to the `mlxbun lab run` that executed the notebook (`lab.recording`).
The plots here follow `mlxbun.lab.plots`: pyplot-free figures, shown with `plots.show`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from mlxbun.diffusion.engine import collect, diffusion_generate
from mlxbun.diffusion.schedule import SAMPLERS
from mlxbun.diffusion.stats import DiffusionStats
from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.generate import prepare_prompt, vocab_size_of
from mlxbun.lab import plots
from mlxbun.lab.plots import cmap, figure, token_label
from mlxbun.lab.recording import recording
from mlxbun.models.diffusion_gemma.loader import load_diffusion_gemma

__all__ = [
    "EXPERIMENT", "SWEEP_COLUMNS", "ZOO_SPEC", "DiffusionCheckpoint", "agreement", "agreement_plot",
    "diffusion_run", "diffusion_sweep", "load_diffusion", "reference_bound", "reveal_explorer", "reveal_order",
    "reveal_plot", "sweep_plot",
]

EXPERIMENT = "diffusion"
ZOO_SPEC = "zoo:diffusion_gemma"
SWEEP_COLUMNS = ["sampler", "steps", "bound", "seed", "reference", "nfe", "generation_tokens", "tokens_per_forward",
                 "tokens_per_s", "agreement", "blocks", "early_stops"]
# the knob each sampler takes, and which end of it is strict (fewer positions kept per step)
_BOUND_NAME = {"confidence-threshold": "threshold", "entropy-bound": "entropy_bound"}
_STRICTEST = {"confidence-threshold": max, "entropy-bound": min}


# ---------------------------------------------------------------- model


@dataclass
class DiffusionCheckpoint:
    """A loaded diffusion model, its tokenizer (None: id prompts only) and where it came from."""

    model: Any
    tokenizer: Any = None
    path: Optional[Path] = None

    @property
    def identity(self):
        """What the results rows name as the model: the checkpoint path, else the model."""
        return self.path if self.path is not None else self.model


def load_diffusion(model=ZOO_SPEC, tokenizer=None) -> DiffusionCheckpoint:
    """`zoo:diffusion_gemma` (the tiny zoo checkpoint, built once in the zoo cache), a checkpoint
    directory or a repo id in the local hub cache, a `DiffusionCheckpoint`, or a loaded model
    (then `tokenizer` is used as given)."""
    if isinstance(model, DiffusionCheckpoint):
        return model
    if not isinstance(model, (str, os.PathLike)):
        if not hasattr(model, "diffusion_decoder_logits"):
            raise MlxbunError(f"{type(model).__name__} is not a diffusion model (no diffusion_decoder_logits)")
        return DiffusionCheckpoint(model, tokenizer)
    spec = str(model)
    if spec.startswith("zoo:") and spec.partition("@")[0].partition(",")[0] != ZOO_SPEC:
        raise MlxbunError(f"'{spec}': the zoo's diffusion model is {ZOO_SPEC}")
    path = model_path(spec)
    return DiffusionCheckpoint(load_diffusion_gemma(path),
                               tokenizer if tokenizer is not None else optional_tokenizer(path), Path(path))


# ---------------------------------------------------------------- one run, agreement


def diffusion_run(ckpt: DiffusionCheckpoint, prompt, *, sampler: str, steps: int, bound: float, seed: int,
                  max_tokens: int, **generate_kwargs) -> tuple[list[int], DiffusionStats]:
    """One seeded generation with `bound` as the sampler's knob (confidence threshold or
    entropy bound): (emitted ids, stats)."""
    if sampler not in _BOUND_NAME:
        raise MlxbunError(f"unknown diffusion sampler {sampler!r}; choose one of: {', '.join(SAMPLERS)}")
    knob = {_BOUND_NAME[sampler]: float(bound)}
    return collect(diffusion_generate(ckpt.model, ckpt.tokenizer, prompt, max_tokens=max_tokens, seed=seed,
                                      steps=steps, sampler=sampler, **knob, **generate_kwargs))


def agreement(ids: Sequence[int], reference: Sequence[int]) -> tuple[int, int]:
    """(positions equal to the reference, positions compared): position by position over the
    longer of the two, so a missing or extra token counts as a disagreement."""
    n = max(len(ids), len(reference))
    return sum(int(a == b) for a, b in zip(ids, reference)), n


def reference_bound(sampler: str, bounds: Iterable[float]) -> float:
    """The strictest bound: the highest confidence threshold, the lowest entropy bound."""
    return _STRICTEST[sampler](bounds)


# ---------------------------------------------------------------- the sweep


def _grid(name: str, values, cast) -> list:
    try:
        out = list(dict.fromkeys(cast(v) for v in values))
    except (TypeError, ValueError):
        raise MlxbunError(f"{name} must be a list of numbers, got {values!r}") from None
    if not out:
        raise MlxbunError(f"{name} is empty: the sweep needs at least one value")
    return out


def _prompts(prompts, ckpt: DiffusionCheckpoint) -> list:
    if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts and all(
            isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in prompts)):
        prompts = [prompts]  # one text or one id list
    prompts = list(prompts)
    if not prompts:
        raise MlxbunError("prompts is empty: the sweep needs at least one prompt")
    vocab = vocab_size_of(ckpt.model)
    for n, prompt in enumerate(prompts):  # every prompt, before any run
        try:
            prepare_prompt(ckpt.tokenizer, prompt, vocab)
        except MlxbunError as e:
            raise MlxbunError(f"prompts[{n}]: {e}") from None
    return prompts


def diffusion_sweep(model_path_or_model, prompts, *, samplers: Sequence[str] = SAMPLERS,
                    steps: Sequence[int] = (4, 8, 16), thresholds: Sequence[float] = (0.5, 0.9, 0.99),
                    entropy_bounds: Sequence[float] = (0.5, 0.1, 0.02), seeds: Sequence[int] = (0,),
                    max_tokens: int = 32, tokenizer=None, warmup: bool = True, results=None, record: bool = True,
                    **generate_kwargs):
    """Every sampler x steps x bound x seed over `prompts` (texts or id lists); `thresholds`
    are the confidence-threshold sampler's bounds, `entropy_bounds` the entropy-bound
    sampler's. Other keywords (t_min, t_max, temperature, stability_stop, ...) go to every
    `diffusion_generate` call; None keeps the checkpoint's generation_config.

    One row per configuration (SWEEP_COLUMNS), totals over the prompts:
    - nfe: decoder forwards; tokens_per_forward: generation tokens (a stopping EOS included,
      as the engine counts) / nfe; tokens_per_s: generation tokens / generation time;
    - agreement: emitted positions equal to the reference run's for the same prompt, over the
      positions compared (see `agreement`); the reference (`reference` True, agreement 1) is
      the sampler's run with the most steps and the strictest bound at the same seed;
    - blocks and early_stops: canvases denoised, and those that stopped before `steps`.
    `warmup` runs the first configuration once untimed, so tokens/s leaves out first-call costs.
    Rows are recorded (experiment "diffusion") to `results` (a results path; None: the default
    store) unless record=False; the DataFrame's attrs["run_id"] names them.
    """
    import pandas as pd

    ckpt = load_diffusion(model_path_or_model, tokenizer)
    prompts = _prompts(prompts, ckpt)
    samplers = [samplers] if isinstance(samplers, str) else list(dict.fromkeys(samplers))
    bad = [s for s in samplers if s not in _BOUND_NAME]
    if bad:
        raise MlxbunError(f"unknown diffusion sampler(s) {bad!r}; choose from: {', '.join(SAMPLERS)}")
    if not samplers:
        raise MlxbunError("samplers is empty: the sweep needs at least one sampler")
    steps = _grid("steps", steps, int)
    seeds = _grid("seeds", seeds, int)
    bounds = {"confidence-threshold": _grid("thresholds", thresholds, float),
              "entropy-bound": _grid("entropy_bounds", entropy_bounds, float)}

    if warmup:
        s0 = samplers[0]
        diffusion_run(ckpt, prompts[0], sampler=s0, steps=steps[0], bound=bounds[s0][0], seed=seeds[0],
                      max_tokens=max_tokens, **generate_kwargs)
    rows = []
    for sampler in samplers:
        ref_steps, ref_bound = max(steps), reference_bound(sampler, bounds[sampler])
        for seed in seeds:
            runs = {(st, b): [diffusion_run(ckpt, p, sampler=sampler, steps=st, bound=b, seed=seed,
                                            max_tokens=max_tokens, **generate_kwargs) for p in prompts]
                    for st in steps for b in bounds[sampler]}
            reference = [ids for ids, _ in runs[(ref_steps, ref_bound)]]
            for (st, b), results_ in runs.items():
                stats = [s for _, s in results_]
                same = [agreement(ids, ref) for (ids, _), ref in zip(results_, reference)]
                matched, compared = sum(m for m, _ in same), sum(n for _, n in same)
                nfe = sum(s.nfe for s in stats)
                tokens = sum(s.generation_tokens for s in stats)
                seconds = sum(s.generation_time for s in stats)
                rows.append({
                    "sampler": sampler, "steps": st, "bound": b, "seed": seed,
                    "reference": (st, b) == (ref_steps, ref_bound), "nfe": nfe, "generation_tokens": tokens,
                    "tokens_per_forward": tokens / nfe if nfe else math.nan,
                    "tokens_per_s": tokens / seconds if seconds > 0 else math.nan,
                    "agreement": matched / compared if compared else 1.0,
                    "blocks": sum(len(s.blocks) for s in stats),
                    "early_stops": sum(b_.stopped_early is not None for s in stats for b_ in s.blocks),
                })
    table = pd.DataFrame(rows, columns=SWEEP_COLUMNS)

    params = {"prompts": len(prompts), "max_tokens": max_tokens, "samplers": samplers, "steps_grid": steps,
              "thresholds": bounds["confidence-threshold"], "entropy_bounds": bounds["entropy-bound"],
              "seeds": seeds, **{k: v for k, v in generate_kwargs.items() if v is not None}}
    with recording(EXPERIMENT, model=ckpt.identity, params=params, results_path=results, record=record) as run:
        if run is not None:
            table.attrs["run_id"] = run.run_id
            run.record_many(row for r in table.itertuples(index=False) for row in _rows(r._asdict()))
    return table


_METRICS = (("nfe", "forwards"), ("generation_tokens", "tokens"), ("tokens_per_forward", "tok/forward"),
            ("tokens_per_s", "tok/s"), ("agreement", None))


def _rows(r: dict):
    extra = {"sampler": r["sampler"], "steps": int(r["steps"]), _BOUND_NAME[r["sampler"]]: float(r["bound"]),
             "seed": int(r["seed"]), "reference": bool(r["reference"])}
    for metric, unit in _METRICS:
        yield metric, float(r[metric]), unit, extra


# ---------------------------------------------------------------- reveal order


def reveal_order(stats: DiffusionStats, *, cumulative: bool = True):
    """Canvas position x step: 1 where the position is revealed (from its reveal step on when
    `cumulative`, else at that step only), 0 before, NaN past its block's last step. Rows are
    the positions of every block's canvas in order (index "position", from 0); columns the
    1-based denoising steps within a block, up to the longest block."""
    import pandas as pd

    width = max((b.steps for b in stats.blocks), default=0)
    rows = []
    for b in stats.blocks:
        steps = np.arange(1, width + 1)
        for r in b.reveal_step:
            row = (steps >= r) if cumulative else (steps == r)
            rows.append(np.where(steps <= b.steps, row.astype(float), np.nan))
    data = np.vstack(rows) if rows else np.zeros((0, width))
    return pd.DataFrame(data, index=pd.RangeIndex(len(rows), name="position"),
                        columns=pd.Index(range(1, width + 1), name="step"))


# ---------------------------------------------------------------- plots


def _bound_label(sampler: str) -> str:
    return "confidence threshold" if sampler == "confidence-threshold" else "entropy bound"


def sweep_plot(df, metrics: Sequence[str] = ("nfe", "tokens_per_forward"), x: str = "steps"):
    """A grid of panels, one row per metric and one column per sampler: the metric (mean over
    seeds) against `x` ("steps" or "bound"), one line per value of the other knob."""
    if x not in ("steps", "bound"):
        raise MlxbunError(f"x must be 'steps' or 'bound', got {x!r}")
    other = "bound" if x == "steps" else "steps"
    samplers = list(dict.fromkeys(df["sampler"]))
    fig = figure(4.0 * max(1, len(samplers)), 2.8 * max(1, len(metrics)))
    axes = np.atleast_2d(fig.subplots(len(metrics), len(samplers), squeeze=False))
    colors = cmap("viridis")
    for j, sampler in enumerate(samplers):
        g = df[df["sampler"] == sampler].groupby([other, x], sort=True)[list(metrics)].mean().reset_index()
        levels = sorted(g[other].unique())
        for i, metric in enumerate(metrics):
            ax = axes[i, j]
            for k, level in enumerate(levels):
                line = g[g[other] == level].sort_values(x)
                name = f"{level:g}" if other == "bound" else f"{level} steps"
                ax.plot(line[x], line[metric], "o-", color=colors(k / max(1, len(levels) - 1)), label=name)
            ax.set_xlabel(_bound_label(sampler) if x == "bound" else "max denoising steps")
            ax.set_ylabel(metric)
            if i == 0:
                ax.set_title(sampler, fontsize=10)
            ax.legend(fontsize=7, title=_bound_label(sampler) if other == "bound" else None, title_fontsize=7)
    return fig


def agreement_plot(df, title: str = "agreement with the reference run vs NFE"):
    """Agreement against decoder forwards, one colour per sampler, each point labelled with its
    steps / bound; the references (agreement 1 by definition) are stars."""
    fig = figure(7, 4.2)
    ax = fig.subplots()
    for k, (sampler, g) in enumerate(df.groupby("sampler", sort=False)):
        color = f"C{k}"
        rest, ref = g[~g["reference"]], g[g["reference"]]
        ax.scatter(rest["nfe"], rest["agreement"], color=color, s=30, label=sampler)
        ax.scatter(ref["nfe"], ref["agreement"], color=color, marker="*", s=160, edgecolor="black",
                   label=f"{sampler} reference")
        for _, r in g.iterrows():
            ax.annotate(f"{r['steps']}/{r['bound']:g}", (r["nfe"], r["agreement"]), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
    ax.set_xlabel("NFE (decoder forwards, all prompts)")
    ax.set_ylabel("agreement (fraction of positions)")
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(title + " (labels: steps/bound)")
    ax.legend(fontsize=7)
    return fig


def reveal_plot(stats: DiffusionStats, tokenizer=None, title: str = "reveal order"):
    """`reveal_order` as a heatmap (canvas position x step): each row lights up at its reveal
    step; grey cells are past the block's last step; lines separate the blocks and a dashed
    line marks where emission stopped. Rows are labelled with the emitted tokens."""
    order = reveal_order(stats)
    n, width = order.shape
    fig = figure(2.5 + 0.35 * max(1, width), 1.4 + 0.2 * max(1, n))
    ax = fig.subplots()
    colors = cmap("Blues").with_extremes(bad="#dddddd")
    ax.imshow(np.ma.masked_invalid(order.to_numpy()), cmap=colors, vmin=0, vmax=1.3, aspect="auto",
              interpolation="nearest")
    # the step each position was revealed at, written in the cell
    start = 0
    for b in stats.blocks:
        for p, r in enumerate(b.reveal_step):
            ax.text(r - 1, start + p, str(r), ha="center", va="center", fontsize=6, color="white")
        start += b.canvas_length
        if start < n:
            ax.axhline(start - 0.5, color="black", lw=1.2)
    emitted = len(stats.tokens)
    if emitted < n:
        ax.axhline(emitted - 0.5, color="red", lw=1, ls="--")
    labels = [f"{i}: {token_label(t, tokenizer)}" if i < emitted else str(i)
              for i, t in zip(range(n), list(stats.tokens) + [None] * n)]
    ax.set_yticks(range(n), labels, fontsize=6)
    ax.set_xticks(range(width), [str(c) for c in order.columns], fontsize=7)
    ax.set_xlabel("denoising step")
    ax.set_ylabel("canvas position")
    ax.set_title(title, fontsize=9)
    return fig


def reveal_explorer(ckpt: DiffusionCheckpoint, prompt, df, *, max_tokens: int, **generate_kwargs):
    """A picker over the sweep's configurations that re-runs one (same prompt and seed) and
    shows its reveal heatmap; static headless (`plots.interactive()`): the first sampler's
    reference run. Returns the stats shown (static) or the widget box."""
    configs = [(r.sampler, int(r.steps), float(r.bound), int(r.seed)) for r in df.itertuples()]
    if not configs:
        return None

    def figure(config):
        sampler, steps, bound, seed = config
        _, stats = diffusion_run(ckpt, prompt, sampler=sampler, steps=steps, bound=bound, seed=seed,
                                 max_tokens=max_tokens, **generate_kwargs)
        title = f"{sampler}, {steps} steps, {_bound_label(sampler)} {bound:g}, seed {seed}: NFE {stats.nfe}"
        return plots.show(reveal_plot(stats, ckpt.tokenizer, title)), stats

    start = next((c for c, ref in zip(configs, df["reference"]) if ref), configs[0])
    if not plots.interactive():
        return figure(start)[1]
    import ipywidgets as w

    picker = w.Dropdown(options=[(f"{s} steps={st} bound={b:g} seed={sd}", (s, st, b, sd))
                                 for s, st, b, sd in configs], value=start, description="run")
    out = w.Output()

    def render(change=None):
        out.clear_output(wait=True)
        with out:
            figure(picker.value)

    picker.observe(render, names="value")
    render()
    box = w.VBox([picker, out])
    plots.display(box)
    return box
