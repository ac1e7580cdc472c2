"""quant_hurts.ipynb: where 4-bit weight quantization hurts a model, and whether keeping the
most-hurt modules at 8 bits recovers the KLD (experiment "quant_hurts").

- `reference_dir(model)`: the float reference (a GGUF model's float dequantization,
  `cached_import(quant="none")`; a zoo model's float32 weights);
- `substep_errors(candidate, reference, ids)`: teacher-forced on the same ids under layer taps
  (`parity.localize.tapped_steps`), per tapped module: the relative error ||a - b|| / ||b|| of
  its output, and the error it writes into the residual stream (||a - b|| over the norm of its
  block's output);
- `error_heatmap` / `unit_scores`: layers x sub-steps of relative error; units (each layer's
  attention and MLP, the embedding) ranked by their residual-stream error;
- `sweep(...)`: uniform 4-bit (g64, g32), uniform 8-bit, the top-N ranked units at 8 bits and a
  naive first/last-layers plan, each against the reference: KLD, top-1, PPL ratio, bits/weight.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer
from mlxbun.experiments.weight_plan import WeightPlan, applied, bits_per_weight, quantizable_modules
from mlxbun.lab.plots import cmap, figure
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.models.taps import block_paths, layer_index_of, substep_of
from mlxbun.parity.forced import eval_ids
from mlxbun.parity.localize import tapped_steps
from mlxbun.parity.metrics import compare_logits

__all__ = ["SWEEP_COLUMNS", "EMBED", "ablation_scores", "at_equal_bits", "save_outputs", "error_heatmap", "kld_bpw_plot", "heatmap_plot", "naive_order", "reference_dir",
           "substep_errors", "sweep", "unit_modules", "unit_of", "unit_scores"]

EMBED = "embed"  # the unit of the modules outside the blocks (embedding, tied or own head)
SWEEP_COLUMNS = ["label", "kind", "n_high", "bits", "group_size", "high_units", "bits_per_weight", "kld_mean",
                 "kld_p99", "kld_max", "top1_agreement", "ppl_ratio"]


def reference_dir(model: str) -> Path:
    """The float checkpoint of `model`: `real:NAME` or a .gguf file -> its float dequantization
    (float32: exact, and fast on MLX's CPU backend); `zoo:ARCH` -> its float32 weights; a
    directory -> itself (it must be unquantized)."""
    from mlxbun.gguf.importer import cached_import

    name = str(model)
    if name.startswith("real:"):
        from mlxbun.real_models import real_gguf

        return cached_import(real_gguf(name.split(":", 1)[1]), quant="none", dtype="float32")
    if name.endswith(".gguf"):
        return cached_import(name, quant="none", dtype="float32")
    return model_path(name, variant="float32")


# ---------------------------------------------------------------- where the error is


def _norm(x: mx.array) -> float:
    return float(mx.sqrt(mx.sum(mx.square(x.astype(mx.float32)))).item())


def substep_errors(candidate, reference, ids: Sequence[int], paths: Any = None):
    """One teacher-forced forward of `ids` through both models under taps (default: blocks and
    their direct children). A DataFrame, execution order: path, layer, substep, rel_err
    (||a - b|| / ||b||), err_norm (||a - b||), ref_norm, stream_err (err_norm over the norm of the
    block output it feeds: the share of the residual stream this output gets wrong), plus a
    final row "logits". Returns (table, candidate logits, reference logits)."""
    import pandas as pd

    rows = []
    for _, ta, tb, la, lb, _, _ in tapped_steps(candidate, reference, [list(ids)], None, paths):
        blocks = block_paths([(p, None) for p in tb.called()])
        for path, k in tb.order:
            if path not in ta or k >= len(ta[path]) or ta[path][k].shape != tb[path][k].shape:
                raise MlxbunError(f"{path}: the candidate's tapped output is missing or of another shape")
            a, b = ta[path][k], tb[path][k]
            err, ref = _norm(a - b), _norm(b)
            rows.append({"path": path, "layer": layer_index_of(path, blocks), "substep": substep_of(path, blocks),
                         "rel_err": err / ref if ref else math.nan, "err_norm": err, "ref_norm": ref})
        err, ref = _norm(la - lb), _norm(lb)
        rows.append({"path": "logits", "layer": None, "substep": "head", "rel_err": err / ref, "err_norm": err,
                     "ref_norm": ref})
        logits = (la, lb)
    df = pd.DataFrame(rows)
    block_norm = {r.layer: r.ref_norm for r in df.itertuples() if r.substep == "layer"}
    df["stream_err"] = [r.err_norm / block_norm[r.layer] if r.layer in block_norm else r.rel_err
                        for r in df.itertuples()]
    df["layer"] = df["layer"].astype("Int64")
    return df, logits[0], logits[1]


def error_heatmap(errors, value: str = "rel_err"):
    """Rows (embedding, layer 0..L-1, the modules after the blocks, logits) x sub-steps
    (attention, mlp, norm, ..., layer = the block's output) -> max `value` over the row's paths."""
    import pandas as pd

    df = errors.copy()
    df["row"] = [f"layer {r.layer}" if not pd.isna(r.layer) else r.path for r in df.itertuples()]
    df["col"] = ["output" if r.substep in ("layer", "embedding", "head") or pd.isna(r.layer) else r.substep
                 for r in df.itertuples()]
    grid = df.pivot_table(index="row", columns="col", values=value, aggfunc="max", sort=False)
    order = list(dict.fromkeys(df["row"]))
    cols = [c for c in ("attention", "mlp") if c in grid.columns]
    cols += [c for c in grid.columns if c not in cols and c != "output"] + ["output"]
    return grid.reindex(index=order, columns=cols)


# ---------------------------------------------------------------- units and their ranking


def unit_of(path: str) -> str:
    """The unit a quantizable module belongs to: "<layer>.attention" / "<layer>.mlp" (the block's
    child holding it), else EMBED (embedding, head)."""
    layer = layer_index_of(path)
    if layer is None:
        return EMBED
    return f"{layer}.{substep_of(path)}"


def unit_modules(model) -> dict[str, list[str]]:
    """unit -> the paths of its quantizable modules (4-bit g64 and g32 alike)."""
    out: dict[str, list[str]] = {}
    for path in quantizable_modules(model, WeightPlan(4, 64)):
        if WeightPlan(4, 32).predicate(path, dict(model.named_modules())[path]):
            out.setdefault(unit_of(path), []).append(path)
    return out


def unit_scores(errors, units: Sequence[str]):
    """Each unit's score from the taps, highest first: a layer's attention / MLP -> the
    stream_err of that sub-step's output; EMBED -> the larger of the embedding output's rel_err
    and the head's own share (the logits' rel_err less the final norm's: a tied embedding is
    the head too). A Series indexed by unit."""
    import pandas as pd

    outside = errors[errors["layer"].isna()]
    scores = {}
    for unit in units:
        if unit == EMBED:
            emb = outside.loc[outside["substep"] == "embedding", "rel_err"].max()
            norm = outside.loc[outside["substep"] == "norm", "rel_err"]
            head = outside.loc[outside["path"] == "logits", "rel_err"].max() - (norm.iloc[-1] if len(norm) else 0.0)
            scores[unit] = float(max(emb, head))
            continue
        layer, sub = unit.split(".", 1)
        rows = errors[(errors["layer"] == int(layer)) & (errors["substep"] == sub)]
        scores[unit] = float(rows["stream_err"].max()) if len(rows) else 0.0
    return pd.Series(scores, name="score").sort_values(ascending=False, kind="stable")


def ablation_scores(model, reference_logits: mx.array, ids: Sequence[int], units: dict[str, list[str]],
                    base: WeightPlan, high_bits: int = 8):
    """Each unit's score by ablation, highest first: mean KLD of `base` less that of `base` with
    only this unit at `high_bits` (one forward per unit). `reference_logits` are the float
    model's [1, len(ids), V]. A Series indexed by unit."""
    import pandas as pd

    def kld(plan):
        with applied(model, plan):
            logits = model(mx.array([ids], dtype=mx.int32))
        return compare_logits(reference_logits[0, :-1], logits[0, :-1]).kld_mean

    at_base = kld(base)
    scores = {u: at_base - kld(base.with_high(paths, bits=high_bits)) for u, paths in units.items()}
    return pd.Series(scores, name="score").sort_values(ascending=False, kind="stable")


def naive_order(units: Sequence[str]) -> list[str]:
    """The first/last-layers heuristic: layer 0, the last layer, layer 1, the one before it, ...
    (each layer's sub-steps together); the embedding is not kept."""
    layers = sorted({int(u.split(".")[0]) for u in units if u != EMBED})
    order, lo, hi = [], 0, len(layers) - 1
    while lo <= hi:
        order.append(layers[lo])
        if hi != lo:
            order.append(layers[hi])
        lo, hi = lo + 1, hi - 1
    return [u for layer in order for u in units if u != EMBED and int(u.split(".")[0]) == layer]


# ---------------------------------------------------------------- the sweep


def _row(plan: WeightPlan, kind: str, high_units: Sequence[str], bpw: float, stats) -> dict:
    return {"label": plan.label, "kind": kind, "n_high": len(high_units), "bits": plan.bits,
            "group_size": plan.group_size, "high_units": " ".join(high_units), "bits_per_weight": bpw,
            "kld_mean": stats.kld_mean, "kld_p99": stats.kld_percentiles["99"], "kld_max": stats.kld_max,
            "top1_agreement": stats.same_top_p,
            "ppl_ratio": stats.ppl_ratio if stats.ppl_ratio is not None else math.nan}


def sweep(model: str = "zoo:llama", *, n_tokens: int = 64, text: str | None = None, n_high: Sequence[int] = (1, 2, 4),
          group_sizes: Sequence[int] = (64, 32), high_bits: int = 8, rank_by: Sequence[str] = ("taps", "ablation"),
          results_path=None, record: bool = True):
    """Where 4-bit hurts `model` and what 8-bit units buy back (see the module docstring).

    The reference is `reference_dir(model)`; every candidate quantizes its weights in memory
    (`weight_plan.applied`: the QuantizedLinear a mixed checkpoint loads into). The text (None:
    the zoo corpus) gives two disjoint segments of `n_tokens`: the first ranks (taps, heat map,
    ablation), the second evaluates, each in one teacher-forced forward; KLD / top-1 compare the
    distributions at positions 0..n-2 with the next token known. Units kept at `high_bits`:
    the top-N by each ranking in `rank_by` ("taps": `unit_scores`; "ablation": `ablation_scores`,
    one forward per unit) and the naive first/last layers (kind "naive"), for each N in `n_high`.
    Returns (table, errors, scores: rank name -> Series)."""
    import pandas as pd

    if not n_high or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in n_high):
        raise MlxbunError(f"n_high must be a list of positive ints, got {n_high!r}")
    if not group_sizes or group_sizes[0] != 64:
        raise MlxbunError(f"group_sizes must start with 64 (the plan the ranking is measured on), got {group_sizes!r}")
    if not set(rank_by) <= {"taps", "ablation"}:
        raise MlxbunError(f"rank_by must name 'taps' and/or 'ablation', got {rank_by!r}")
    src = reference_dir(model)
    tok = optional_tokenizer(src)
    if tok is None:
        raise MlxbunError(f"{src}: no tokenizer to encode the evaluation text")
    both = eval_ids(tok, 2 * n_tokens, text)
    calib, ids = both[:n_tokens], both[n_tokens:]
    reference, candidate = open_runtime(src), open_runtime(src)
    units = unit_modules(reference)
    base = WeightPlan(4, 64, label="q4 g64")
    with applied(candidate, base):
        errors, _, calib_ref = substep_errors(candidate, reference, calib)
    scores = {}
    if "taps" in rank_by:
        scores["taps"] = unit_scores(errors, list(units))
    if "ablation" in rank_by:
        scores["ablation"] = ablation_scores(candidate, calib_ref, calib, units, base, high_bits)
    ref_logits = reference(mx.array([ids], dtype=mx.int32))[0, :-1]

    def measure(plan: WeightPlan, kind: str, high_units: Sequence[str]) -> dict:
        with applied(candidate, plan):
            logits = candidate(mx.array([ids], dtype=mx.int32))
        stats = compare_logits(ref_logits, logits[0, :-1], ids[1:])
        return _row(plan, kind, high_units, bits_per_weight(reference, plan), stats)

    rows = [measure(base, "uniform", ())]
    rows += [measure(WeightPlan(4, g, label=f"q4 g{g}"), "uniform", ()) for g in group_sizes[1:]]
    rows.append(measure(WeightPlan(high_bits, 64, label=f"q{high_bits} g64"), "uniform", ()))
    orders = [(f"ranked:{name}", list(s.index)) for name, s in scores.items()]
    for kind, order in orders + [("naive", naive_order(list(units)))]:
        for n in n_high:
            keep = order[:n]
            plan = base.with_high([p for u in keep for p in units[u]], bits=high_bits,
                                  label=f"q4 + {kind} top-{n} at q{high_bits}")
            rows.append(measure(plan, kind, keep))
    table = pd.DataFrame(rows, columns=SWEEP_COLUMNS)
    params = {"model": str(model), "n_tokens": n_tokens, "n_high": list(n_high), "group_sizes": list(group_sizes),
              "high_bits": high_bits, "rank_by": list(rank_by), "reference": str(src)}
    with recording("quant_hurts", model=src, params=params, results_path=results_path, record=record) as run:
        if run is not None:
            for r in rows:
                extra = {k: r[k] for k in ("label", "kind", "n_high", "bits", "group_size", "high_units")}
                run.record_many((m, r[m], unit, extra) for m, unit in (
                    ("kld_mean", "nats"), ("kld_p99", "nats"), ("kld_max", "nats"), ("top1_agreement", None),
                    ("ppl_ratio", None), ("bits_per_weight", "bits")))
            run.record_many(("rel_err", r.rel_err, None, {"path": r.path, "substep": r.substep, "plan": base.label})
                            for r in errors.itertuples())
            run.record_many((f"score_{name}", float(v), None, {"unit": unit})
                            for name, s in scores.items() for unit, v in s.items())
    return table, errors, scores


def at_equal_bits(table, against: str = "naive"):
    """Each ranked row next to the `against` curve at the same bits per weight: that curve's mean
    KLD interpolated linearly in bits (through uniform q4 g64, N = 0), NaN outside its range;
    `kld_vs_against` = kld_mean / that, and `kld_recovered` = the share of uniform q4 g64's KLD
    that the plan removes."""
    import numpy as np

    base = table[(table["kind"] == "uniform") & (table["label"] == "q4 g64")].iloc[0]
    curve = table[table["kind"] == against].sort_values("bits_per_weight")
    xs = np.concatenate([[base["bits_per_weight"]], curve["bits_per_weight"].to_numpy(float)])
    ys = np.concatenate([[base["kld_mean"]], curve["kld_mean"].to_numpy(float)])
    out = table[table["kind"].str.startswith("ranked")][["label", "kind", "n_high", "bits_per_weight", "kld_mean",
                                                           "top1_agreement"]].copy()
    x = out["bits_per_weight"].to_numpy(float)
    out[f"kld_{against}"] = np.where((x >= xs.min()) & (x <= xs.max()), np.interp(x, xs, ys), np.nan)
    out[f"kld_vs_{against}"] = out["kld_mean"] / out[f"kld_{against}"]
    out["kld_recovered"] = 1 - out["kld_mean"] / base["kld_mean"]
    return out.reset_index(drop=True)


# ---------------------------------------------------------------- plots


def heatmap_plot(grid, title: str = "relative error ||q4 - ref|| / ||ref|| per layer and sub-step"):
    """Rows x sub-steps of relative error (log10 colour, values printed, blank = no module)."""
    import numpy as np

    fig = figure(1.8 + 1.1 * max(1, grid.shape[1]), 1.0 + 0.28 * max(1, grid.shape[0]))
    ax = fig.subplots()
    vals = grid.to_numpy(dtype=float)
    ok = np.isfinite(vals) & (vals > 0)
    shown = np.where(ok, np.log10(np.where(ok, vals, 1.0)), np.nan)
    im = ax.imshow(np.ma.masked_invalid(shown), cmap=cmap("magma").with_extremes(bad="#eeeeee"), aspect="auto")
    ax.set_xticks(range(grid.shape[1]), [str(c) for c in grid.columns])
    ax.set_yticks(range(grid.shape[0]), [str(r) for r in grid.index], fontsize=7)
    for (i, j), v in np.ndenumerate(vals):
        if np.isfinite(v):
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=6,
                    color="black" if ok[i, j] and shown[i, j] > np.nanmedian(shown) else "white")
    fig.colorbar(im, ax=ax, label="log10 relative error")
    ax.set_title(title, fontsize=9)
    return fig


def kld_bpw_plot(table, title: str = "mean KLD vs bits per weight"):
    """Mean KLD (log) against bits per weight: uniform plans as points, ranked and naive plans as
    lines through N = 0 (uniform 4-bit g64) and their N."""
    fig = figure(7, 4.2)
    ax = fig.subplots()
    base = table[(table["kind"] == "uniform") & (table["label"] == "q4 g64")]
    kinds = [k for k in dict.fromkeys(table["kind"]) if k != "uniform"]
    for i, kind in enumerate(kinds):
        color = cmap("tab10")(i)
        g = table[table["kind"] == kind].sort_values("bits_per_weight")
        import pandas as pd

        g = pd.concat([base, g])
        ax.plot(g["bits_per_weight"], g["kld_mean"], "o-", color=color, label=f"q4 + {kind} units at q8")
        for _, r in g.iloc[1:].iterrows():
            ax.annotate(f"N={r['n_high']}", (r["bits_per_weight"], r["kld_mean"]), fontsize=7, color=color,
                        xytext=(3, 3), textcoords="offset points")
    for _, r in table[table["kind"] == "uniform"].iterrows():
        ax.scatter([r["bits_per_weight"]], [r["kld_mean"]], marker="s", color="black", zorder=3)
        ax.annotate(r["label"], (r["bits_per_weight"], r["kld_mean"]), fontsize=8, xytext=(4, -10),
                    textcoords="offset points")
    if (table["kld_mean"] > 0).all():
        ax.set_yscale("log")
    ax.set_xlabel("bits per weight (scales and biases at 16 bits)")
    ax.set_ylabel("mean KLD vs float reference (nats)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return fig


def save_outputs(out_dir, table, grid, scores, figures, equal=None) -> list[Path]:
    """The run's committed outputs: sweep.csv, heatmap.csv, rankings.csv (unit, score per
    ranking), each figure as NAME.png and `equal` (`at_equal_bits`) as equal_bits.csv; returns
    the paths written."""
    import pandas as pd

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "sweep.csv", out / "heatmap.csv", out / "rankings.csv"]
    table.to_csv(written[0], index=False, float_format="%.6g")
    grid.to_csv(written[1], float_format="%.6g")
    pd.DataFrame({f"score_{name}": s for name, s in scores.items()}).rename_axis("unit").to_csv(
        written[2], float_format="%.6g")
    if equal is not None:
        written.append(out / "equal_bits.csv")
        equal.to_csv(written[-1], index=False, float_format="%.6g")
    for name, fig in figures.items():
        written.append(out / f"{name}.png")
        fig.savefig(written[-1], dpi=110)
    return written
