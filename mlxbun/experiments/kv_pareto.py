"""lab/kv_pareto: KV bytes per cached token against KLD for uniform affine KV (bits x groups),
TurboQuant widths and simple mixed per-layer plans, on one or more models; the Pareto frontier per
model (experiment "kv_pareto"). The sweep itself is `kv_quant.kv_sweep`; this module adds what the
Pareto question needs: the configurations each model can take, simple per-layer plans, bytes per
token, the frontier table and its plot; and `turboquant_seed_spread`, TurboQuant's drift under other
rotation seeds (the sweep runs seed 0, as generation does), which says how far apart two TurboQuant
widths must be before one sample tells them apart."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from mlxbun.errors import MlxbunError
from mlxbun.cache.turboquant import TurboQuantKVCache
from mlxbun.cache.turboquant_codec import resolve_kv_bits
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.experiments.kv_quant import kv_sweep, pareto_front
from mlxbun.generation_caches import kv_layers, make_generation_cache, turboquant_layers
from mlxbun.lab.plots import cmap, figure
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.names import KVSettings
from mlxbun.parity.forced import eval_ids, teacher_forced
from mlxbun.parity.metrics import compare_logits

__all__ = ["FRONTIER_COLUMNS", "SEED_COLUMNS", "edge_plan", "frontier_plot", "frontier_table", "model_configs",
           "pareto_sweep", "seed_spread_plot", "seed_summary", "tq_vs_uniform", "turboquant_seed_spread", "uniform_plan",
           "write_outputs", "write_seed_outputs"]


def uniform_plan(layers: Sequence[int], bits: int, group_size: int = 64) -> list[dict]:
    """A per-layer plan (optiq kv_config entries) with `layers` at `bits`, the others full precision."""
    return [{"layer_idx": int(i), "bits": int(bits), "group_size": int(group_size)} for i in layers]


def edge_plan(layers: Sequence[int], edge_bits: int = 8, rest_bits: int = 4, edge: int = 1,
              group_size: int = 64) -> list[dict]:
    """The first and last `edge` of `layers` at `edge_bits`, the rest at `rest_bits` (entries)."""
    layers = sorted(int(i) for i in layers)
    if edge < 0 or not layers:
        raise MlxbunError(f"edge_plan: edge must be >= 0 and layers non-empty (edge={edge}, layers={layers})")
    ends = set(layers[:edge]) | set(layers[len(layers) - edge:] if edge else [])
    return [{"layer_idx": i, "bits": int(edge_bits if i in ends else rest_bits), "group_size": int(group_size)}
            for i in layers]


def model_configs(model, uniform_bits: Iterable[int], group_sizes: Iterable[int], turboquant_bits: Iterable[float],
                  edge_plans: Iterable[Sequence[int]] = ((8, 4, 2),), plan_group_size: int = 64):
    """(specs, plans, skipped) for one opened model.

    Uniform affine KV needs every cache layer quantizable (mlx-lm refuses sliding windows): on a
    model with window layers (Gemma-3) the uniform widths become per-layer plans of its full-attention
    layers ("q4 g64 global layers"), and a group size that does not divide the head dim is skipped
    (named in `skipped`, not run). `edge_plans`: (edge_bits, rest_bits, edge) triples -> plans with
    the first/last `edge` quantizable layers at edge_bits and the rest at rest_bits."""
    n_layers = len(make_generation_cache(model))
    quantizable = list(kv_layers(model, kv_bits=4).layers)
    head_dim = getattr(getattr(model, "config", None), "head_dim", None)
    specs, plans, skipped = [], {}, []
    windows = len(quantizable) < n_layers
    for b in uniform_bits:
        for g in group_sizes:
            if head_dim is not None and int(head_dim) % int(g):
                skipped.append(f"uniform {b}-bit g{g}: group {g} does not divide head_dim {head_dim}")
            elif windows:
                plans[f"q{b} g{g} on the {len(quantizable)} full-attention layers"] = uniform_plan(quantizable, b, g)
            else:
                specs.append(KVSettings("uniform", int(b), int(g)))
    specs += [KVSettings("turboquant", float(b)) for b in turboquant_bits]
    for edge_bits, rest_bits, edge in edge_plans:
        if 2 * int(edge) >= len(quantizable):
            skipped.append(f"edge plan q{edge_bits} ends / q{rest_bits}: {len(quantizable)} layers, no middle")
            continue
        plans[f"q{edge_bits} first/last {edge}, q{rest_bits} rest"] = edge_plan(
            quantizable, edge_bits, rest_bits, int(edge), plan_group_size)
    return specs, plans, skipped


def pareto_sweep(models: Sequence[str] = ("zoo:llama",), *, uniform_bits=(2, 3, 4, 8), group_sizes=(32, 64, 128),
                 turboquant_bits=(2, 2.5, 3, 3.5, 4), edge_plans=((8, 4, 2),), context: int = 64, n_eval: int = 16,
                 text: str | None = None, variant: str = "float32", head_dim: int | None = 64, results_path=None,
                 record: bool = True):
    """`kv_sweep` of every configuration each model takes, at one context length; one table with a
    `model` column and `bytes_per_token` (KV bytes / cached tokens: context + n_eval - 1). Skipped
    configurations (see `model_configs`) are rows with their reason in `error`."""
    import pandas as pd

    if not models:
        raise MlxbunError("models: give at least one model")
    if int(context) < 2 or int(n_eval) < 1:
        raise MlxbunError(f"context must be >= 2 and n_eval >= 1 (got context={context}, n_eval={n_eval})")
    tables = []
    for name in models:
        hd = head_dim if str(name).startswith("zoo:") else None
        m = open_runtime(model_path(name, variant=variant, head_dim=hd), "mlxbun")
        specs, plans, skipped = model_configs(m, uniform_bits, group_sizes, turboquant_bits, edge_plans)
        del m
        df = kv_sweep(name, specs, context_lengths=(int(context),), n_eval=int(n_eval), variant=variant,
                      head_dim=hd, text=text, plans=plans, results_path=results_path, record=record,
                      experiment="kv_pareto")
        if skipped:
            df = pd.concat([df, pd.DataFrame({"label": [s.split(":")[0] for s in skipped], "error": skipped,
                                              "context": int(context)})], ignore_index=True)
        df.insert(0, "model", str(name))
        tables.append(df)
    out = pd.concat(tables, ignore_index=True)
    out["bytes_per_token"] = out["kv_bytes"] / (int(context) + int(n_eval) - 1)
    return out


FRONTIER_COLUMNS = ["model", "label", "layers", "bytes_per_token", "kv_bytes_ratio", "kld_mean", "kld_p99",
                    "top1_agreement", "pareto"]


def frontier_table(df, x: str = "bytes_per_token", y: str = "kld_mean"):
    """Every measured configuration with a `pareto` column (on its model's frontier of `x` vs `y`,
    lower both better), sorted by model then bytes; failed or skipped rows left out."""
    import pandas as pd

    ok = df[df[x].notna() & df[y].notna()].copy()
    ok["pareto"] = False
    for _, g in ok.groupby("model"):
        ok.loc[g.index, "pareto"] = pareto_front(g, x, y)
    ok = ok.sort_values(["model", x, y], kind="stable")
    return pd.DataFrame(ok[FRONTIER_COLUMNS]).reset_index(drop=True)


def _scheme_of(label: str) -> str:
    return label.split(" ")[0] if label.split(" ")[0] in ("plain", "uniform", "turboquant") else "mixed plan"


def frontier_plot(table, x: str = "bytes_per_token", y: str = "kld_mean", title: str = "KV bytes/token vs KLD"):
    """One panel per model (log-log): every configuration coloured by scheme, the frontier joined
    and labelled. The plain cache (KLD 0) cannot sit on a log axis: a dashed vertical line at its x."""
    models = list(dict.fromkeys(table["model"]))
    fig = figure(6.5 * len(models), 4.6)
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    colors = {s: cmap("tab10")(k) for k, s in enumerate(("uniform", "turboquant", "mixed plan"))}
    for ax, model in zip(axes, models):
        g = table[table["model"] == model]
        for xv in g.loc[g[y] <= 0, x]:
            ax.axvline(xv, color="grey", ls="--", lw=1, label="plain (KLD 0)")
        pos = g[g[y] > 0]
        for scheme, s in pos.groupby(pos["label"].map(_scheme_of)):
            ax.scatter(s[x], s[y], color=colors.get(scheme, "k"), s=28, alpha=0.8, label=scheme)
        front = pos[pos["pareto"]].sort_values(x)
        ax.plot(front[x], front[y], color="k", lw=1.5, marker="o", mfc="none", ms=10, label="Pareto frontier")
        for _, r in front.iterrows():
            ax.annotate(r["label"], (r[x], r[y]), fontsize=6.5, xytext=(4, 3), textcoords="offset points")
        ax.set_xscale("log")
        if len(pos):
            ax.set_yscale("log")
        ax.set_xlabel(f"{x} (log)")
        ax.set_ylabel(f"{y}, nats (log)")
        ax.set_title(f"{model}: {title}", fontsize=9)
        ax.legend(fontsize=7)
    return fig


def tq_vs_uniform(table, bits: float = 3.5, slack: float = 1.1):
    """Per model: TurboQuant at `bits` beside the lowest-KLD uniform/mixed row costing at most `slack`
    x its bytes per token (what the "quality-neutral" claim is checked against; NaN when none)."""
    import pandas as pd

    rows = []
    for model, g in table.groupby("model", sort=False):
        tq = g[g["label"] == f"turboquant {bits:g}-bit"]
        if tq.empty:
            continue
        t = tq.iloc[0]
        rivals = g[(g["label"].map(_scheme_of) != "turboquant") & (g["kld_mean"] > 0)
                   & (g["bytes_per_token"] <= t["bytes_per_token"] * slack)]
        best = rivals.sort_values("kld_mean").iloc[0] if len(rivals) else None
        rows.append({"model": model, "tq_bytes_per_token": t["bytes_per_token"], "tq_kld_mean": t["kld_mean"],
                     "tq_top1": t["top1_agreement"],
                     "best_rival": None if best is None else best["label"],
                     "rival_bytes_per_token": math.nan if best is None else best["bytes_per_token"],
                     "rival_kld_mean": math.nan if best is None else best["kld_mean"],
                     "rival_top1": math.nan if best is None else best["top1_agreement"]})
    return pd.DataFrame(rows)


def _stem(table, prefix: str = "kv_pareto", suffix: str = "") -> str:
    """prefix_<model>suffix for a table of one model (real:smollm2 -> kv_pareto_smollm2), else prefix + suffix."""
    import re

    models = list(dict.fromkeys(table["model"]))
    one = "_" + re.sub(r"\W+", "_", models[0].split(":")[-1]) if len(models) == 1 else ""
    return prefix + one + suffix


def write_seed_outputs(spread, fig, out_dir, stem: str | None = None) -> list:
    """<stem>.csv (every seed's row), <stem>_summary.md (`seed_summary`) and <stem>.png in `out_dir`;
    `stem` None: "kv_pareto_<model>_turboquant_seeds" for one model, else "kv_pareto_turboquant_seeds"."""
    from pathlib import Path

    from mlxbun.results.export import to_markdown

    stem = stem or _stem(spread, suffix="_turboquant_seeds")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.csv", out / f"{stem}_summary.md", out / f"{stem}.png"]
    spread.to_csv(paths[0], index=False, float_format="%.6g")
    paths[1].write_text(to_markdown(seed_summary(spread), float_fmt=".4g") + "\n", encoding="utf-8")
    fig.savefig(paths[2], dpi=110, bbox_inches="tight")
    return paths


def write_outputs(table, frontier, fig, out_dir, stem: str | None = None) -> list:
    """The full-size run's committed outputs in `out_dir`: <stem>.csv (every row, failures included),
    <stem>_frontier.md (the frontier table, markdown) and <stem>.png (the plot). Returns the paths.
    `stem` None: "kv_pareto_<model>" for a table of one model (real:smollm2 -> kv_pareto_smollm2),
    else "kv_pareto"."""
    from pathlib import Path

    from mlxbun.results.export import to_markdown

    stem = stem or _stem(table)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.csv", out / f"{stem}_frontier.md", out / f"{stem}.png"]
    table.to_csv(paths[0], index=False, float_format="%.6g")
    paths[1].write_text(to_markdown(frontier, float_fmt=".4g") + "\n", encoding="utf-8")
    fig.savefig(paths[2], dpi=110, bbox_inches="tight")
    return paths


SEED_COLUMNS = ["model", "bits", "key_bits", "value_bits", "seed", "context", "kld_mean", "kld_mean_unc",
                "kld_median", "kld_p99", "kld_max", "positions_over_1", "top1_agreement"]


def _turboquant_hook(bits: float, seed: int):
    """Generation's TurboQuant conversion (`maybe_turboquant_kv_cache`: the same layers, converted
    once filled) with rotation seed `seed` (generation's is 0)."""
    def convert(cache: list) -> None:
        for i in turboquant_layers(cache):
            cache[i] = TurboQuantKVCache.from_cache(cache[i], bits=bits, seed=seed)

    return convert


def turboquant_seed_spread(models: Sequence[str] = ("zoo:llama",), widths=(3, 3.5, 4), seeds=(0, 1, 2, 3), *,
                           context: int = 64, n_eval: int = 16, text: str | None = None, variant: str = "float32",
                           head_dim: int | None = 64, results_path=None, record: bool = True):
    """Per model, TurboQuant width and rotation seed: the drift over `n_eval` teacher-forced steps after
    `context` tokens (as `pareto_sweep` measures it; seed 0 is its row): mean KLD and its uncertainty,
    median, p99 and max, the positions over 1 nat, top-1 agreement. One row each (SEED_COLUMNS), recorded
    as experiment "kv_pareto" with part "turboquant_seeds"."""
    import pandas as pd

    if not models or not widths or not seeds:
        raise MlxbunError("turboquant_seed_spread: give at least one model, width and seed")
    if int(context) < 2 or int(n_eval) < 1:
        raise MlxbunError(f"context must be >= 2 and n_eval >= 1 (got context={context}, n_eval={n_eval})")
    rows = []
    for name in models:
        hd = head_dim if str(name).startswith("zoo:") else None
        path = model_path(name, variant=variant, head_dim=hd)
        m, tok = open_runtime(path, "mlxbun"), optional_tokenizer(path)
        if tok is None:
            raise MlxbunError(f"{path}: no tokenizer to encode the evaluation text")
        ids = eval_ids(tok, int(context) + int(n_eval), text)
        base = teacher_forced(m, ids, prefill=int(context))
        params = {"model": str(name), "variant": variant, "head_dim": hd, "n_eval": int(n_eval),
                  "context": int(context), "part": "turboquant_seeds"}
        with recording("kv_pareto", model=path, params=params, results_path=results_path, record=record) as run:
            for bits in widths:
                for seed in seeds:
                    _, key_bits, value_bits = resolve_kv_bits(float(bits))
                    r = teacher_forced(m, ids, prefill=int(context), quantize=_turboquant_hook(float(bits), int(seed)))
                    st = compare_logits(base.logits, r.logits)
                    rows.append({"model": str(name), "bits": float(bits), "key_bits": key_bits,
                                 "value_bits": value_bits, "seed": int(seed), "context": int(context),
                                 "kld_mean": st.kld_mean, "kld_mean_unc": st.kld_mean_unc, "kld_median": st.kld_median,
                                 "kld_p99": st.kld_percentiles["99"], "kld_max": st.kld_max,
                                 "positions_over_1": int((st.kld_values > 1.0).sum()), "top1_agreement": st.same_top_p})
                    if run is not None:
                        extra = {"kv": f"turboquant {float(bits):g}-bit", "kv_bits": float(bits), "seed": int(seed)}
                        run.record_many((k, rows[-1][k], "nats" if k.startswith("kld") else None, extra)
                                        for k in ("kld_mean", "kld_median", "kld_max", "positions_over_1",
                                                  "top1_agreement"))
        del m
    return pd.DataFrame(rows, columns=SEED_COLUMNS)


def seed_summary(spread):
    """Per model and width, over the seeds: mean, min and max of the mean KLD, the mean median, and
    the seeds' spread of the mean KLD next to a single run's own uncertainty (mean of kld_mean_unc)."""
    g = spread.groupby(["model", "bits"], sort=False)
    out = g["kld_mean"].agg(["mean", "min", "max", "std"]).rename(columns=lambda c: f"kld_mean_{c}")
    out["kld_median_mean"] = g["kld_median"].mean()
    out["one_run_unc"] = g["kld_mean_unc"].mean()
    out["seeds"] = g["seed"].count()
    return out.reset_index()


def seed_spread_plot(spread, title: str = "TurboQuant mean KLD by rotation seed"):
    """One panel per model: each width's mean KLD per seed (points) and the seeds' mean (a bar)."""
    models = list(dict.fromkeys(spread["model"]))
    fig = figure(5.0 * len(models), 3.8)
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        g = spread[spread["model"] == model]
        widths = list(dict.fromkeys(g["bits"]))
        for k, w in enumerate(widths):
            vals = g[g["bits"] == w]["kld_mean"]
            ax.bar(k, vals.mean(), color=cmap("tab10")(1), alpha=0.35)
            ax.scatter([k] * len(vals), vals, color="k", s=16, zorder=3)
        ax.set_xticks(range(len(widths)), [f"{w:g} bits" for w in widths])
        ax.set_ylabel("mean KLD, nats")
        ax.set_title(f"{model}: {title}", fontsize=9)
    return fig
