"""Speculative decoding by task: the task prompt set lab/prompt_lookup and lab/self_draft share,
rendered through the target's chat template, and the per-task readings of a `spec_sweep`
(the best drafter x k per task, measured speedup against the acceptance-length bound, adaptive k
against the best fixed k).

    prompts, fmt = task_prompts("real:smollm2", "lab/prompt_lookup/prompts")
    sweep = spec_sweep("real:smollm2", ["ngram:1", "ngram:3"], [1, 4, 8], prompts=prompts, ...)
    best_per_task(sweep)         # per task: the (drafter, k) of the highest decode speedup
    bound_plot(sweep)            # measured decode speedup against the bound, per task

A task file holds the instruction, a line `---`, then the source text (optional). The user
message is the instruction, a blank line and the source. A tokenizer without a chat template
(a base model such as Gemma-3-270M) gets the same message as plain text followed by a blank
line; `task_prompts` says which format it used.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pandas as pd

from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.experiments.spec_acceptance import ROW_COLUMNS, SpecSweep, draft_length
from mlxbun.lab.plots import figure

__all__ = ["PROMPT_SET", "adaptive_vs_fixed", "best_per_task", "bound_plot", "grid_plot", "length_distribution",
           "read_tasks", "render_task", "save_outputs", "table_from_rows", "task_prompts"]

PROMPT_SET = "spec-tasks-v1"
SEPARATOR = "---"


def read_tasks(directory, tasks: Sequence[str] | None = None) -> dict[str, tuple[str, str]]:
    """task name (the file's stem) -> (instruction, source) for every *.txt in `directory` (or the
    named `tasks`, in that order)."""
    root = Path(directory)
    if not root.is_dir():
        raise MlxbunError(f"prompts_dir: {root} is not a directory")
    files = {p.stem: p for p in sorted(root.glob("*.txt"))}
    if not files:
        raise MlxbunError(f"prompts_dir: no task files (*.txt) in {root}")
    if tasks is not None:
        missing = [t for t in tasks if t not in files]
        if missing:
            raise MlxbunError(f"tasks: no file for {missing} in {root} (there are: {', '.join(files)})")
        files = {t: files[t] for t in tasks}
    out = {}
    for name, path in files.items():
        lines = path.read_text().rstrip("\n").split("\n")
        cut = lines.index(SEPARATOR) if SEPARATOR in lines else len(lines)
        instruction, source = "\n".join(lines[:cut]).strip(), "\n".join(lines[cut + 1:]).strip()
        if not instruction:
            raise MlxbunError(f"{path}: no instruction before '{SEPARATOR}'")
        out[name] = (instruction, source)
    return out


def render_task(tokenizer, instruction: str, source: str = "") -> tuple[str, str]:
    """(prompt text, format): the user message through the tokenizer's chat template with the
    generation prompt ("chat_template"), or as plain text when it has none ("plain")."""
    message = f"{instruction}\n\n{source}" if source else instruction
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        return text, "chat_template"
    except (MlxbunError, ValueError, AttributeError):
        return message + "\n\n", "plain"


def task_prompts(model, directory, tasks: Sequence[str] | None = None, *,
                 variant: str = "float32") -> tuple[dict[str, str], str]:
    """(task -> rendered prompt, format) for `model`'s tokenizer."""
    tok = optional_tokenizer(model_path(model, variant=variant))
    if tok is None:
        raise MlxbunError(f"model {model}: no tokenizer to render the task prompts")
    rendered = {name: render_task(tok, *task) for name, task in read_tasks(directory, tasks).items()}
    formats = {fmt for _, fmt in rendered.values()}
    return {name: text for name, (text, _) in rendered.items()}, "/".join(sorted(formats))


# ---------------------------------------------------------------- readings


def table_from_rows(rows: pd.DataFrame) -> pd.DataFrame:
    """`SpecSweep.table()` rebuilt from a sweep's results rows (`store.load(experiment=...,
    expand_params=True)`): every column is a recorded metric (a metric NaN for a run, such as a
    bound with nothing drafted, stays NaN). For a run stopped before its notebook wrote its CSV."""
    keys = ["params.drafter", "params.k", "params.prompt"]
    if rows.empty or not set(keys) <= set(rows.columns):
        raise MlxbunError("results rows: no speculative runs (drafter, k, prompt) among them")
    per_run = rows[rows["params.drafter"].notna()]
    for extra in ("params.position", "params.acceptance_length"):
        if extra in per_run.columns:
            per_run = per_run[per_run[extra].isna()]
    wide = per_run.pivot_table(index=keys, columns="metric", values="value", sort=False).reset_index()
    wide = wide.rename(columns={"params.drafter": "drafter", "params.k": "k", "params.prompt": "prompt"})
    wide = wide.reindex(columns=ROW_COLUMNS)
    wide.columns.name = None
    wide["k"] = [int(k) if isinstance(k, float) and k.is_integer() else k for k in wide.k]  # a NaN-padded column
    wide["same_as_plain"] = wide.same_as_plain.map({1.0: True, 0.0: False})
    return wide


def _table(sweep) -> tuple[pd.DataFrame, list]:
    """(the per drafter x k x task table, the drafters in order) of a sweep or of its table."""
    if isinstance(sweep, SpecSweep):
        return sweep.table(), list(sweep.drafters)
    return sweep, list(dict.fromkeys(sweep.drafter))


def best_per_task(sweep: SpecSweep | pd.DataFrame, by: str = "decode_speedup") -> pd.DataFrame:
    """Per task (prompt): the drafter x k with the highest `by`, its acceptance, its bound and
    the drafter x k whose bound is highest (fixed k only). `sweep` may also be its `table()`
    (e.g. read back from the CSV `save_outputs` wrote)."""
    df, _ = _table(sweep)
    df = df[[not draft_length(k)[1] for k in df.k]]
    rows = []
    for task, g in df.groupby("prompt", sort=False):
        best = g.loc[g[by].idxmax()] if g[by].notna().any() else g.iloc[0]
        top = g.loc[g.speedup_bound.idxmax()]
        rows.append({"task": task, "drafter": best.drafter, "k": best.k,
                     "draft_acceptance_rate": best.draft_acceptance_rate,
                     "mean_acceptance_length": best.mean_acceptance_length, by: best[by],
                     "speedup_bound": best.speedup_bound, "cost_aware_bound": best.cost_aware_bound,
                     "verify_cost": best.verify_cost, "measured_over_bound": best[by] / best.speedup_bound,
                     "top_bound_drafter": top.drafter, "top_bound_k": top.k, "top_bound": top.speedup_bound})
    return pd.DataFrame(rows)


def adaptive_vs_fixed(sweep: SpecSweep, by: str = "decode_speedup") -> pd.DataFrame:
    """Per drafter and task: the best fixed k's `by`, each adaptive run's, and whether adaptive
    beat the best fixed k (plus the best fixed k over the whole set, chosen once)."""
    df = sweep.table()
    adaptive = np.array([draft_length(k)[1] for k in df.k])
    fixed, adap = df[~adaptive], df[adaptive]
    if adap.empty:
        raise MlxbunError("ks: no adaptive k ('aK') in this sweep to compare against the fixed ones")
    overall = sweep.summary()
    overall = overall[[not draft_length(k)[1] for k in overall.k]]
    rows = []
    for (d, task), g in fixed.groupby(["drafter", "prompt"], sort=False):
        best = g.loc[g[by].idxmax()]
        o = overall[overall.drafter == d]
        set_k = o.loc[o[by].idxmax()].k  # one k for every task: what a user without the controller picks
        at_set_k = g[g.k == set_k][by].iloc[0]
        for _, a in adap[(adap.drafter == d) & (adap.prompt == task)].iterrows():
            rows.append({"drafter": d, "task": task, "best_fixed_k": best.k, "best_fixed": best[by],
                         "set_best_k": set_k, "at_set_best_k": at_set_k, "adaptive": a.k, "adaptive_value": a[by],
                         "adaptive_over_best_fixed": a[by] / best[by], "adaptive_over_set_best": a[by] / at_set_k})
    return pd.DataFrame(rows)


def length_distribution(sweep: SpecSweep) -> pd.DataFrame:
    """Long table: drafter, k, task, acceptance length, rounds and their share of the drafting
    rounds (per drafter x k x task)."""
    rows = []
    for (d, k, task), s in sweep.runs.items():
        total = sum(s.acceptance_length_histogram.values())
        for a, n in sorted(s.acceptance_length_histogram.items()):
            rows.append((d, k, task, a, n, n / total))
    return pd.DataFrame(rows, columns=["drafter", "k", "task", "acceptance_length", "rounds", "share"])


def save_outputs(sweep: SpecSweep | pd.DataFrame, directory, figures: dict, name: str) -> list[Path]:
    """Write `name`.csv (the per drafter x k x task table; `sweep` may be that table) and each
    figure as `key`.png into `directory` (the committed outputs of a lab run)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{name}.csv"]
    _table(sweep)[0].to_csv(paths[0], index=False, float_format="%.4g")
    for key, fig in figures.items():
        paths.append(out / f"{key}.png")
        fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    return paths


# ---------------------------------------------------------------- plots


def bound_plot(sweep: SpecSweep | pd.DataFrame, by: str = "decode_speedup",
               title: str = "measured speedup vs the acceptance-length bound"):
    """One point per drafter x k x task: the bound (x) against the measured `by` (y), colored by
    task; the diagonal is "as fast as the bound". `sweep` may be its table."""
    df, _ = _table(sweep)
    df = df[[not draft_length(k)[1] for k in df.k]]
    fig = figure(6, 4.2)
    ax = fig.subplots()
    for task, g in df.groupby("prompt", sort=False):
        ax.scatter(g.speedup_bound, g[by], s=14, label=task)
    hi = max(1.0, float(np.nanmax(df.speedup_bound.to_numpy(dtype=float))))
    ax.plot([1, hi], [1, hi], color="grey", lw=0.8, ls="--")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xlabel("bound: tokens per verify round")
    ax.set_ylabel(f"measured {by.replace('_', ' ')} (x)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    return fig


def grid_plot(sweep: SpecSweep | pd.DataFrame, value: str = "mean_acceptance_length", title: str | None = None):
    """One panel per task: a drafters x fixed-k heatmap of `value` (annotated). `sweep` may be
    its table."""
    df, drafters = _table(sweep)
    df = df[[not draft_length(k)[1] for k in df.k]]
    tasks = list(dict.fromkeys(df.prompt))
    fig = figure(2.6 * len(tasks), 0.5 * len(drafters) + 1.6)
    axes = fig.subplots(1, len(tasks), sharey=True, squeeze=False)[0]
    vals = df[value].to_numpy(dtype=float)
    lo, hi = float(np.nanmin(vals)), float(np.nanmax(vals))
    for ax, task in zip(axes, tasks):
        grid = df[df.prompt == task].pivot_table(index="drafter", columns="k", values=value, sort=False)
        grid = grid.reindex(index=drafters)
        ax.imshow(grid.to_numpy(dtype=float), vmin=lo, vmax=hi, cmap="viridis", aspect="auto")
        for (i, j), v in np.ndenumerate(grid.to_numpy(dtype=float)):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", fontsize=6, color="w" if v < (lo + hi) / 2 else "k")
        ax.set_xticks(range(grid.shape[1]), [str(k) for k in grid.columns], fontsize=7)
        ax.set_yticks(range(grid.shape[0]), list(grid.index), fontsize=7)
        ax.set_xlabel("k")
        ax.set_title(task, fontsize=9)
    fig.suptitle(title or value.replace("_", " "))
    return fig
