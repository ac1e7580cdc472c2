"""kv_quant.ipynb: KV schemes x bits x group sizes x context lengths against plain KV on the
same model and text: KLD, top-1 agreement, KV bytes, peak memory, decode speed, the Pareto front
(experiment "kv_quant")."""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from mlxbun.cache.turboquant_codec import resolve_kv_bits
from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.generation_caches import kv_layers, load_kv_plan, make_generation_cache
from mlxbun.lab.plots import cmap, figure
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.names import KVSettings
from mlxbun.parity.forced import eval_ids, teacher_forced
from mlxbun.parity.metrics import compare_logits

__all__ = ["KV_COLUMNS", "kv_grid", "kv_metric_plot", "kv_sweep", "pareto_front", "pareto_plot"]


def kv_grid(uniform_bits: Iterable[int] = (4, 8), group_sizes: Iterable[int] = (32, 64),
            turboquant_bits: Iterable = (3.5,)) -> list[KVSettings]:
    """The quantized KV configurations to sweep: uniform bits x group sizes, then TurboQuant: each
    entry a width (mlx-vlm's split of it, e.g. 3.5) or a [key_bits, value_bits] split (e.g. [4, 3],
    as `--kv turboquant:keys=4,values=3` and `turboquant_study` name it)."""
    specs = [KVSettings("uniform", int(b), int(g)) for b in uniform_bits for g in group_sizes]
    return specs + [_turboquant(b) for b in turboquant_bits]


def _turboquant(width) -> KVSettings:
    if isinstance(width, (list, tuple)):
        if len(width) != 2:
            raise MlxbunError(f"a TurboQuant split is [key_bits, value_bits], got {list(width)}")
        return KVSettings.of("turboquant", key_bits=width[0], value_bits=width[1])
    return KVSettings("turboquant", float(width))


KV_COLUMNS = ["scheme", "bits", "group_size", "key_bits", "value_bits", "label", "layers", "context", "kld_mean",
              "kld_p99", "kld_p999", "kld_max", "top1_agreement", "ppl_ratio", "kv_bytes", "kv_bytes_ratio",
              "kv_bytes_allocated", "peak_memory", "decode_tps", "error"]


def kv_sweep(model: str = "zoo:llama", specs: Sequence[KVSettings] | None = None, *, context_lengths=(64, 192),
             n_eval: int = 32, variant: str = "float32", head_dim: int | None = 64, engine: str = "mlxbun",
             text: str | None = None, plans: Mapping[str, Any] | None = None, results_path=None,
             record: bool = True, experiment: str = "kv_quant"):
    """Every KV spec at every context length against plain KV on the same model and text.

    Per (spec, context): the prompt is `context` tokens, then `n_eval` teacher-forced decode
    steps through the cache; KLD / top-1 agreement are over those steps' distributions. A
    configuration the model cannot take (e.g. a group size that does not divide head_dim)
    gets a failure row in the results table and its message in the `error` column.
    `head_dim` widens a zoo model's heads (`zoo:ARCH,head_dim=N`); other models keep their own.
    `text` is the evaluation text (None: the zoo corpus). `layers` says which cache layers a
    configuration quantizes ("2/18": TurboQuant leaves sliding-window layers and the last alone).
    `plans` adds per-layer KV plans (name -> a KVPlan or an optiq kv_config: entries or a file),
    each a row of scheme "mixed".
    Rows are recorded as `experiment` (another driver reusing the sweep names its own).
    Returns a pandas DataFrame (KV_COLUMNS; plain rows included, ratio 1).
    """
    import pandas as pd

    specs = list(kv_grid() if specs is None else specs)
    if not str(model).startswith("zoo:"):
        head_dim = None  # a real checkpoint keeps its own heads (and records None)
    path = model_path(model, variant=variant, head_dim=head_dim)
    m = open_runtime(path, engine)
    tok = optional_tokenizer(path)
    if tok is None:
        raise MlxbunError(f"{path}: no tokenizer to encode the evaluation text")
    n_layers = len(make_generation_cache(m))
    configs = [(spec, spec.label, None) for spec in specs]
    configs += [(KVSettings(), name, load_kv_plan(plan, n_layers)) for name, plan in (plans or {}).items()]
    coverage = {label: kv_layers(m, kv_bits=spec.bits, kv_scheme=spec.scheme, plan=plan)
                for spec, label, plan in configs}
    rows = []
    params = {"model": str(model), "variant": variant, "head_dim": head_dim, "engine": engine, "n_eval": n_eval}
    with recording(experiment, model=path, params=params, results_path=results_path, record=record) as run:
        for ctx in context_lengths:
            ids = eval_ids(tok, int(ctx) + n_eval, text)
            base = teacher_forced(m, ids, prefill=int(ctx), kv=KVSettings())
            rows.append(_kv_row(KVSettings(), "plain", ctx, base, None, base.kv_bytes, kv_layers(m)))
            if run is not None:
                _record_kv(run, rows[-1])
            for spec, label, plan in configs:
                try:
                    r = teacher_forced(m, ids, prefill=int(ctx), kv=spec, plan=plan)
                except MlxbunError as e:
                    rows.append({**_kv_row(spec, label, ctx, None, None, base.kv_bytes, coverage[label], plan),
                                 "error": str(e)})
                    if run is not None:
                        run.record_failure(str(e), **_kv_params(rows[-1]))
                    continue
                stats = compare_logits(base.logits, r.logits, r.next_tokens)
                rows.append(_kv_row(spec, label, ctx, r, stats, base.kv_bytes, coverage[label], plan))
                if run is not None:
                    _record_kv(run, rows[-1])
    return pd.DataFrame(rows, columns=KV_COLUMNS)


def _kv_row(spec: KVSettings, label: str, ctx: int, r, stats, plain_bytes: int, coverage, plan=None) -> dict:
    """One table row; `r` None: the configuration failed; `stats` None: the plain baseline itself."""
    row = dict.fromkeys(KV_COLUMNS, math.nan)
    row.update(scheme="mixed" if plan is not None else spec.scheme, label=label, context=int(ctx), error=None,
               layers=f"{len(coverage.layers)}/{coverage.total}",
               bits=spec.bits if spec.bits is not None else math.nan,
               group_size=(spec.group_size or 64) if spec.scheme == "uniform" else math.nan)
    if spec.scheme == "turboquant":  # the widths its caches run at (mlx-vlm's split where none is chosen)
        _, row["key_bits"], row["value_bits"] = resolve_kv_bits(spec.bits, spec.key_bits, spec.value_bits)
    if r is None:
        return row
    row.update(kv_bytes=r.kv_bytes, kv_bytes_ratio=r.kv_bytes / plain_bytes if plain_bytes else math.nan,
               kv_bytes_allocated=r.kv_bytes_allocated, peak_memory=r.peak_memory, decode_tps=r.decode_tps)
    if stats is None:
        row.update(kld_mean=0.0, kld_p99=0.0, kld_p999=0.0, kld_max=0.0, top1_agreement=1.0, ppl_ratio=1.0)
    else:
        row.update(kld_mean=stats.kld_mean, kld_p99=stats.kld_percentiles["99"],
                   kld_p999=stats.kld_percentiles["99.9"], kld_max=stats.kld_max, top1_agreement=stats.same_top_p,
                   ppl_ratio=stats.ppl_ratio if stats.ppl_ratio is not None else math.nan)
    return row


def _kv_params(row: dict) -> dict:
    return {"kv": row["label"], "scheme": row["scheme"], "kv_bits": None if math.isnan(row["bits"]) else row["bits"],
            "kv_group_size": None if math.isnan(row["group_size"]) else int(row["group_size"]),
            **({"key_bits": int(row["key_bits"]), "value_bits": int(row["value_bits"])}
               if not math.isnan(row["key_bits"]) else {}),
            "context": row["context"], "layers": row["layers"]}


_KV_METRICS = (("kld_mean", "nats"), ("kld_p99", "nats"), ("kld_p999", "nats"), ("kld_max", "nats"),
               ("top1_agreement", None), ("ppl_ratio", None),
               ("kv_bytes", "bytes"), ("kv_bytes_allocated", "bytes"), ("peak_memory", "bytes"),
               ("decode_tps", "tok/s"))


def _record_kv(run, row: dict) -> None:
    extra = _kv_params(row)
    run.record_many((m, row[m], unit, extra) for m, unit in _KV_METRICS)


def pareto_front(df, x: str = "kv_bytes", y: str = "kld_mean"):
    """A boolean Series: the rows no other row beats on both `x` and `y` (lower is better for
    both; NaN rows are never on the front). Ties: equal points are all on the front."""
    import pandas as pd

    xs, ys = df[x].to_numpy(dtype=float), df[y].to_numpy(dtype=float)
    ok = ~(np.isnan(xs) | np.isnan(ys))
    front = np.zeros(len(df), dtype=bool)
    for i in np.flatnonzero(ok):
        dominated = ok & (xs <= xs[i]) & (ys <= ys[i]) & ((xs < xs[i]) | (ys < ys[i]))
        front[i] = not dominated.any()
    return pd.Series(front, index=df.index, name="pareto")



# ---------------------------------------------------------------- plots


def pareto_plot(df, x: str = "kv_bytes", y: str = "kld_mean", title: str = "KV bytes vs KLD"):
    """Scatter of the quantized configurations (one colour per context length, log-log), each
    context's Pareto front joined and labelled; configurations with y = 0 (plain KV, the
    reference) cannot sit on a log axis and are dashed vertical lines at their x instead."""
    fig = figure(7, 4.2)
    ax = fig.subplots()
    ok = df[df[x].notna() & df[y].notna()]
    colors = cmap("tab10")
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
    fig = figure(8, 3.4)
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


