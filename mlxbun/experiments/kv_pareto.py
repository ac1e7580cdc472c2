"""lab/kv_pareto: KV bytes per cached token against KLD for uniform affine KV (bits x groups),
TurboQuant widths and simple mixed per-layer plans, on one or more models; the Pareto frontier per
model (experiment "kv_pareto"). The sweep itself is `kv_quant.kv_sweep`; this module adds what the
Pareto question needs: the configurations each model can take, simple per-layer plans, bytes per
token, the frontier table and its plot. TurboQuant under other rotation seeds (the sweep runs seed 0,
as generation does) is `turboquant_study`'s."""

from __future__ import annotations

import math
from typing import Iterable, Sequence

from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, output_stem, write_run_outputs
from mlxbun.experiments.kv_quant import kv_sweep, pareto_front
from mlxbun.generation_caches import kv_layers, make_generation_cache
from mlxbun.lab.plots import cmap, figure
from mlxbun.locate import open_runtime
from mlxbun.names import KVSettings

__all__ = ["FRONTIER_COLUMNS", "edge_plan", "frontier_plot", "frontier_table", "model_configs", "pareto_sweep",
           "tq_vs_uniform", "uniform_plan", "write_outputs"]


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


def write_outputs(table, frontier, fig, out_dir, stem: str | None = None) -> list:
    """The full-size run's committed outputs in `out_dir`: <stem>.csv (every row, failures included),
    <stem>_frontier.md (the frontier table, markdown) and <stem>.png (the plot). Returns the paths.
    `stem` None: "kv_pareto_<model>" for a table of one model (real:smollm2 -> kv_pareto_smollm2),
    else "kv_pareto"."""
    return write_run_outputs(out_dir, stem or output_stem(table, "kv_pareto"), table, frontier, "_frontier", fig)
