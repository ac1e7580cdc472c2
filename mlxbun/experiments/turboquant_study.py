"""TurboQuant's drift over rotation seeds and over how its bits are split between keys and values
(lab/kv_pareto's seed section, lab/tq_bits).

A TurboQuant width b is mlx-vlm's split: keys floor(b) bits, values ceil(b) bits. A configuration here
is a width (that split) or an explicit [key_bits, value_bits] pair; each runs under several rotation
seeds (generation uses seed 0, so seed 0 of a width is `kv_quant.kv_sweep`'s row, bit for bit),
teacher-forced as the sweep measures: `context` tokens, then `n_eval` one-token steps through the
cache, KLD against the plain cache over those steps. The caches convert as generation converts them
(`maybe_turboquant_kv_cache`: the same layers, once filled), only the seed and the split differ.
"""

from __future__ import annotations

from typing import Sequence

from mlxbun.cache.turboquant import TurboQuantKVCache
from mlxbun.cache.turboquant_codec import resolve_kv_bits
from mlxbun.errors import MlxbunError
from mlxbun.experiments.common import model_path, optional_tokenizer, output_stem, write_run_outputs
from mlxbun.generation_caches import turboquant_layers
from mlxbun.lab.plots import cmap, figure
from mlxbun.lab.recording import recording
from mlxbun.locate import open_runtime
from mlxbun.names import KVSettings
from mlxbun.parity.forced import eval_ids, teacher_forced
from mlxbun.parity.metrics import compare_logits

__all__ = ["SEED_COLUMNS", "bits_plot", "configuration", "seed_spread_plot", "seed_summary",
           "turboquant_seed_spread", "write_seed_outputs"]

SEED_COLUMNS = ["model", "label", "bits", "key_bits", "value_bits", "seed", "context", "bytes_per_token",
                "kld_mean", "kld_mean_unc", "kld_median", "kld_p99", "kld_max", "positions_over_1", "top1_agreement"]
_KEYS = ["model", "label", "bits", "key_bits", "value_bits"]


def configuration(width) -> tuple[str, float, int, int]:
    """(label, mean bits, key bits, value bits) of a width (mlx-vlm's split: "turboquant 3.5-bit") or
    of a [key_bits, value_bits] pair ("turboquant K4/V3"); checked as TurboQuantKVCache checks them.
    The label is generation's (`KVSettings.label` of `--kv turboquant:3.5`, `turboquant:keys=4,values=3`)."""
    if isinstance(width, (list, tuple)):
        if len(width) != 2:
            raise MlxbunError(f"a TurboQuant split is [key_bits, value_bits], got {list(width)}")
        kb, vb = (float(w) for w in width)
        _, key_bits, value_bits = resolve_kv_bits(max(kb, vb), kb, vb)
        label = KVSettings("turboquant", key_bits=key_bits, value_bits=value_bits).label
        return label, (key_bits + value_bits) / 2, key_bits, value_bits
    bits, key_bits, value_bits = resolve_kv_bits(float(width))
    return KVSettings("turboquant", float(bits)).label, float(bits), key_bits, value_bits


def _turboquant_hook(key_bits: int, value_bits: int, seed: int):
    """Generation's TurboQuant conversion with these widths and rotation seed `seed` (generation's is 0)."""
    def convert(cache: list) -> None:
        for i in turboquant_layers(cache):
            cache[i] = TurboQuantKVCache.from_cache(cache[i], bits=max(key_bits, value_bits), key_bits=key_bits,
                                                    value_bits=value_bits, seed=seed)

    return convert


def turboquant_seed_spread(models: Sequence[str] = ("zoo:llama",), widths=(3, 3.5, 4), seeds=(0, 1, 2, 3), *,
                           context: int = 64, n_eval: int = 16, text: str | None = None, variant: str = "float32",
                           head_dim: int | None = 64, results_path=None, record: bool = True,
                           experiment: str = "kv_pareto"):
    """Per model, configuration (`widths`: widths or [key_bits, value_bits] pairs) and rotation seed: bytes
    per cached token and the drift (mean KLD and its uncertainty, median, p99, max, the positions over
    1 nat, top-1 agreement). One row each (SEED_COLUMNS), recorded as `experiment` with part
    "turboquant_seeds"."""
    import pandas as pd

    if not models or not widths or not seeds:
        raise MlxbunError("turboquant_seed_spread: give at least one model, width and seed")
    if int(context) < 2 or int(n_eval) < 1:
        raise MlxbunError(f"context must be >= 2 and n_eval >= 1 (got context={context}, n_eval={n_eval})")
    configs = [configuration(w) for w in widths]  # refused before any model opens
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
        with recording(experiment, model=path, params=params, results_path=results_path, record=record) as run:
            for label, bits, key_bits, value_bits in configs:
                for seed in seeds:
                    r = teacher_forced(m, ids, prefill=int(context),
                                       quantize=_turboquant_hook(key_bits, value_bits, int(seed)))
                    st = compare_logits(base.logits, r.logits)
                    rows.append({"model": str(name), "label": label, "bits": bits, "key_bits": key_bits,
                                 "value_bits": value_bits, "seed": int(seed), "context": int(context),
                                 "bytes_per_token": r.kv_bytes / (len(ids) - 1),
                                 "kld_mean": st.kld_mean, "kld_mean_unc": st.kld_mean_unc, "kld_median": st.kld_median,
                                 "kld_p99": st.kld_percentiles["99"], "kld_max": st.kld_max,
                                 "positions_over_1": int((st.kld_values > 1.0).sum()), "top1_agreement": st.same_top_p})
                    if run is not None:
                        extra = {"kv": label, "kv_bits": bits, "key_bits": key_bits, "value_bits": value_bits,
                                 "seed": int(seed)}
                        run.record_many((k, rows[-1][k], "nats" if k.startswith("kld") else None, extra)
                                        for k in ("kld_mean", "kld_median", "kld_max", "positions_over_1",
                                                  "top1_agreement", "bytes_per_token"))
        del m
    return pd.DataFrame(rows, columns=SEED_COLUMNS)


def seed_summary(spread):
    """Per model and configuration, over the seeds: bytes per token, the mean, min, max and std of the
    mean KLD, the mean median, and one run's own uncertainty (the mean of kld_mean_unc) beside the
    seeds' spread."""
    g = spread.groupby(_KEYS, sort=False)
    out = g["kld_mean"].agg(["mean", "min", "max", "std"]).rename(columns=lambda c: f"kld_mean_{c}")
    out.insert(0, "bytes_per_token", g["bytes_per_token"].mean())
    out["kld_median_mean"] = g["kld_median"].mean()
    out["one_run_unc"] = g["kld_mean_unc"].mean()
    out["seeds"] = g["seed"].count()
    return out.reset_index()


def _short(label: str) -> str:
    return label.removeprefix("turboquant ")


def seed_spread_plot(spread, title: str = "TurboQuant mean KLD by rotation seed"):
    """One panel per model: each configuration's mean KLD per seed (points) and the seeds' mean (a bar)."""
    models = list(dict.fromkeys(spread["model"]))
    fig = figure(5.0 * len(models), 3.8)
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        g = spread[spread["model"] == model]
        labels = list(dict.fromkeys(g["label"]))
        for k, label in enumerate(labels):
            vals = g[g["label"] == label]["kld_mean"]
            ax.bar(k, vals.mean(), color=cmap("tab10")(1), alpha=0.35)
            ax.scatter([k] * len(vals), vals, color="k", s=16, zorder=3)
        ax.set_xticks(range(len(labels)), [_short(x) for x in labels], fontsize=7)
        ax.set_ylabel("mean KLD, nats")
        ax.set_title(f"{model}: {title}", fontsize=9)
    return fig


def bits_plot(summary, title: str = "TurboQuant: keys vs values bits"):
    """One panel per model (`seed_summary` rows): bytes per token vs the seeds' mean KLD (log), the
    seeds' min-max as an error bar, configurations of one key width joined, each labelled K/V."""
    models = list(dict.fromkeys(summary["model"]))
    fig = figure(6.0 * len(models), 4.4)
    axes = fig.subplots(1, len(models), squeeze=False)[0]
    for ax, model in zip(axes, models):
        g = summary[summary["model"] == model]
        for k, (kb, s) in enumerate(g.sort_values("bytes_per_token").groupby("key_bits")):
            y = s["kld_mean_mean"]
            err = [y - s["kld_mean_min"], s["kld_mean_max"] - y]
            ax.errorbar(s["bytes_per_token"], y, yerr=err, color=cmap("tab10")(k), marker="o", ms=5, lw=1,
                        capsize=3, label=f"{kb}-bit keys")
            for _, r in s.iterrows():
                ax.annotate(f"K{r['key_bits']}/V{r['value_bits']}", (r["bytes_per_token"], r["kld_mean_mean"]),
                            fontsize=6.5, xytext=(4, 3), textcoords="offset points")
        ax.set_yscale("log")
        ax.set_xlabel("bytes per cached token")
        ax.set_ylabel("mean KLD over seeds, nats (log)")
        ax.set_title(f"{model}: {title}", fontsize=9)
        ax.legend(fontsize=7)
    return fig


def write_seed_outputs(spread, fig, out_dir, stem: str | None = None, prefix: str = "kv_pareto",
                       bits_fig=None) -> list:
    """<stem>.csv (every run), <stem>_summary.md (`seed_summary`) and <stem>.png (`fig`) in `out_dir`;
    `stem` None: "<prefix>_<model>_turboquant_seeds" for one model, else "<prefix>_turboquant_seeds".
    `bits_fig` (`bits_plot`'s) goes to <prefix>[_<model>]_bytes_vs_kld.png beside them."""
    stem = stem or output_stem(spread, prefix, "_turboquant_seeds")
    paths = write_run_outputs(out_dir, stem, spread, seed_summary(spread), "_summary", fig)
    if bits_fig is not None:
        paths.append(paths[0].parent / f"{output_stem(spread, prefix, '_bytes_vs_kld')}.png")
        bits_fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    return paths
