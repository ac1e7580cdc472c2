"""lab/kv_plan: per-layer KV sensitivity, the greedy plan under KLD budgets, against uniform widths
and the first/last-layers heuristic at equal (or fewer) bytes (experiment "kv_plan").

The measurement and the search are `mlxbun.parity.kv_plan`'s (the `mlxbun kv-plan` command runs
the same); this driver runs them on one model and text, records every measurement as rows, and
draws the two plots the lab README shows.
"""

from __future__ import annotations

import math
from typing import Sequence

from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.lab.plots import cmap, figure
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.parity import kv_plan as kp
from mlxbun.parity.forced import eval_ids

__all__ = ["PLAN_COLUMNS", "parse_budget", "plan_study", "sensitivity_plot", "tradeoff_plot"]

PLAN_COLUMNS = ["kind", "label", "budget", "kld_mean", "kld_p99", "top1_agreement", "bytes_per_token",
                "bytes_ratio", "predicted_kld", "quantized", "plan"]


def parse_budget(budget) -> tuple[str, float | int]:
    """A budget: a KLD in nats (float >= 0), or "uniform:B": the measured KLD of every layer at B bits."""
    if isinstance(budget, str) and budget.startswith("uniform:"):
        try:
            return "uniform", int(budget.split(":", 1)[1])
        except ValueError:
            pass
    elif isinstance(budget, (int, float)) and not isinstance(budget, bool) and math.isfinite(budget) and budget >= 0:
        return "kld", float(budget)
    raise MlxbunError(f"budgets: each budget is a KLD >= 0 (nats) or 'uniform:BITS', got {budget!r}")


def _describe(layers: dict, candidates: Sequence[int]) -> str:
    """Bits per candidate layer, e.g. "8 8 4 4 - 2" (- : plain)."""
    return " ".join(str(layers[i][0]) if i in layers else "-" for i in candidates)


def plan_study(model: str = "zoo:llama", *, bits: Sequence[int] = (8, 4, 2), group_size: int = 64,
               budgets: Sequence = ("uniform:8", "uniform:4"), prefill: int = 48, n_eval: int = 16,
               text: str | None = None, variant: str = "float32", head_dim: int | None = 64,
               results_path=None, record: bool = True) -> dict:
    """Sensitivity of every candidate layer at every width, then per budget the searched plan and the
    edge heuristic matched to its bytes, plus plain and every uniform width. Returns
    {"sensitivity": DataFrame (kp.SENSITIVITY_COLUMNS), "plans": DataFrame (PLAN_COLUMNS),
    "candidates": the quantizable layers, "num_layers": the cache layers}."""
    import pandas as pd

    bits = kp.check_bits(bits, group_size)
    parsed = [parse_budget(b) for b in budgets]
    if not str(model).startswith("zoo:"):
        head_dim = None
    path = model_path(model, variant=variant, head_dim=head_dim)
    tok = optional_tokenizer(path)
    if tok is None:
        raise MlxbunError(f"{path}: no tokenizer to encode the evaluation text")
    probe = kp.KVProbe(open_runtime(path, "mlxbun"), eval_ids(tok, prefill + n_eval, text), prefill=prefill)
    if not probe.candidates:
        raise MlxbunError(f"{model}: no full-attention KV layer for a plan to quantize")
    params = {"model": str(model), "variant": variant, "head_dim": head_dim, "prefill": prefill, "n_eval": n_eval,
              "group_size": group_size, "bits": list(bits)}
    rows = []

    def add(kind, label, m: kp.Measured, budget=math.nan, predicted=math.nan):
        rows.append({"kind": kind, "label": label, "budget": budget, "kld_mean": m.kld_mean, "kld_p99": m.kld_p99,
                     "top1_agreement": m.top1_agreement, "bytes_per_token": m.bytes_per_token,
                     "bytes_ratio": m.kv_bytes / probe.plain_bytes, "predicted_kld": predicted,
                     "quantized": len(m.layers), "plan": _describe(m.layers, probe.candidates)})

    with recording("kv_plan", model=path, params=params, results_path=results_path, record=record) as run:
        table = kp.sensitivity(probe, bits, group_size)
        if run is not None:
            run.record_many((metric, r[metric], unit, {"part": "sensitivity", "layer": int(r["layer"]),
                                                       "kv_bits": int(r["bits"])})
                            for r in table.to_dict("records")
                            for metric, unit in (("kld_mean", "nats"), ("top1_agreement", None),
                                                 ("bytes_saved", "bytes")))
        add("plain", "plain", probe.plain, 0.0)
        uniform = {}
        for b in bits:
            uniform[b] = probe.measure(kp.uniform_plan(probe.candidates, b, group_size))
            add("uniform", f"uniform q{b}", uniform[b])
        for kind, value in parsed:
            if kind == "uniform" and value not in uniform:
                uniform[value] = probe.measure(kp.uniform_plan(probe.candidates, value, group_size))
            budget = uniform[value].kld_mean if kind == "uniform" else value
            name = f"KLD of uniform q{value}" if kind == "uniform" else f"{budget:.3g}"
            found = kp.search_plan(probe, table, budget)
            add("searched", f"plan <= {name}", found.measured, budget, found.predicted_kld)
            edge = kp.matched_edge_plan(table, probe.candidates, probe.plain_bytes, found.measured.kv_bytes,
                                        bits, group_size)
            if edge is not None:
                add("edge", f"edges at <= bytes of plan <= {name}", probe.measure(edge), budget)
        if run is not None:
            for r in rows:
                extra = {"part": "plan", "kind": r["kind"], "label": r["label"],
                         "budget": None if math.isnan(r["budget"]) else r["budget"],
                         "plan": r["plan"]}
                run.record_many((metric, r[metric], unit, extra) for metric, unit in
                                (("kld_mean", "nats"), ("kld_p99", "nats"), ("top1_agreement", None),
                                 ("bytes_per_token", "bytes"), ("bytes_ratio", None)))
    return {"sensitivity": table, "plans": pd.DataFrame(rows, columns=PLAN_COLUMNS),
            "candidates": list(probe.candidates), "num_layers": probe.num_layers,
            "measurements": probe.measurements}


# ---------------------------------------------------------------- plots


def sensitivity_plot(table, title: str = "per-layer KV sensitivity: one layer quantized alone"):
    """Mean KLD vs layer, one line per bit width (log y; a KLD of 0 cannot sit on it and is left out)."""
    fig = figure(7, 3.4)
    ax = fig.subplots()
    for b, g in table.groupby("bits"):
        g = g[g["kld_mean"] > 0].sort_values("layer")
        ax.plot(g["layer"], g["kld_mean"], "o-", ms=3, label=f"q{b}")
    ax.set_yscale("log")
    ax.set_xlabel("cache layer")
    ax.set_ylabel("mean KLD vs plain (nats, log)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def tradeoff_plot(plans, title: str = "KV bytes per token vs mean KLD"):
    """One marker per plan kind (plain as a dashed vertical line); lower-left is better."""
    fig = figure(7, 4.2)
    ax = fig.subplots()
    colors = cmap("tab10")
    markers = {"uniform": "s", "searched": "o", "edge": "^"}
    for k, (kind, g) in enumerate(plans.groupby("kind", sort=False)):
        if kind == "plain":
            ax.axvline(float(g["bytes_per_token"].iloc[0]), color="gray", ls="--", lw=1, label="plain (KLD 0)")
            continue
        g = g[g["kld_mean"] > 0]
        ax.scatter(g["bytes_per_token"], g["kld_mean"], color=colors(k % 10), marker=markers.get(kind, "x"), s=36,
                   label=kind)
        for _, r in g.iterrows():
            ax.annotate(r["label"].split(" at <=")[0], (r["bytes_per_token"], r["kld_mean"]), fontsize=6,
                        xytext=(3, 3), textcoords="offset points")
    if (plans["kld_mean"] > 0).any():
        ax.set_yscale("log")
    ax.set_xlabel("KV bytes per token (all layers)")
    ax.set_ylabel("mean KLD vs plain (nats, log)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig
