"""benchmark.ipynb: mlxbun vs mlx-lm on the same weights (`mlxbun.bench.run_bench`) and the
bandwidth wall: decode tok/s against device copy bandwidth / weight bytes (experiment "benchmark")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlxbun.bench import run_bench
from mlxbun.lab.plots import figure
from mlxbun.lab.recording import recording

__all__ = ["BENCH_COLUMNS", "Benchmark", "bandwidth_plot", "bench_bars", "benchmark"]


BENCH_COLUMNS = ["engine", "prefill_tps", "decode_tps", "ttft_ms", "peak_memory_gb", "decode_bandwidth_gb_s",
                 "wall_tps", "wall_fraction"]


@dataclass
class Benchmark:
    """`mlxbun.bench.run_bench`'s result and the bandwidth-wall view of it."""

    result: Any  # mlxbun.bench.BenchResult
    run_id: str | None = None  # this workflow's rows (experiment "benchmark"); the bench rows: result.run_id

    @property
    def weights_bytes(self) -> int:
        return self.result.weights_bytes

    @property
    def device_bandwidth_gb_s(self) -> float | None:
        return self.result.device_bandwidth_gb_s

    @property
    def wall_tps(self) -> float:
        """Decode tok/s if every token only had to read each weight byte once at device bandwidth."""
        bw = self.device_bandwidth_gb_s
        return bw * 1e9 / self.weights_bytes if bw and self.weights_bytes else math.nan

    def table(self):
        """One row per engine: prefill / decode tok/s, TTFT, peak memory, weight bytes x decode
        tok/s (the bandwidth the decode attains) and its fraction of the measured device bandwidth."""
        import pandas as pd

        rows = []
        for engine in self.result.engines:
            tests = {t.kind: t for t in self.result.tests if t.engine == engine}
            pp, tg = tests.get("pp"), tests.get("tg")
            decode_bw = self.result.bandwidth_gb_s(engine)
            bw = self.device_bandwidth_gb_s
            rows.append({
                "engine": engine,
                "prefill_tps": pp.mean if pp else math.nan,
                "decode_tps": tg.mean if tg else math.nan,
                "ttft_ms": float(np.median(pp.ttft_ms)) if pp else math.nan,
                "peak_memory_gb": max(t.peak_memory_gb for t in tests.values()),
                "decode_bandwidth_gb_s": decode_bw if decode_bw is not None else math.nan,
                "wall_tps": self.wall_tps,
                "wall_fraction": decode_bw / bw if decode_bw is not None and bw else math.nan,
            })
        return pd.DataFrame(rows, columns=BENCH_COLUMNS).set_index("engine")


def benchmark(model: str = "zoo:llama", *, dtype: str | None = None, quant: int | None = None,
              prompt_len: int = 128, gen_len: int = 32, trials: int = 3, warmup: int = 1, bandwidth_mb: int = 64,
              results_path=None, record: bool = True) -> Benchmark:
    """mlxbun vs mlx-lm on the same weights (`mlxbun.bench.run_bench`, which records its rows as
    experiment "bench"), with the device copy bandwidth measured for the bandwidth wall; the
    wall fractions are recorded as experiment "benchmark" (tied to the bench run)."""
    result = run_bench(model, dtype=dtype, quant=quant, prompt_len=prompt_len, gen_len=gen_len, trials=trials,
                       warmup=warmup, measure_bandwidth=True, bandwidth_mb=bandwidth_mb, results=results_path,
                       record=record, progress=False)
    out = Benchmark(result)
    table = out.table()
    params = {"model": model, "dtype": result.dtype, "quant": result.quant, "prompt_len": prompt_len,
              "gen_len": gen_len, "trials": trials, "bench_run": result.run_id}
    with recording("benchmark", model=result.identity, params=params, results_path=results_path,
                   record=record) as run:
        if run is not None:
            out.run_id = run.run_id
            rows = [("device_copy_bandwidth_gb_s", out.device_bandwidth_gb_s, "GB/s", {"engine": "device"}),
                    ("wall_tps", out.wall_tps, "tok/s", {"engine": "device"})]
            for engine, r in table.iterrows():
                if not math.isnan(r["wall_fraction"]):
                    rows.append(("wall_fraction", r["wall_fraction"], None, {"engine": engine}))
            run.record_many(rows)
    return out


# ---------------------------------------------------------------- plots


def bench_bars(df, metrics=("prefill_tps", "decode_tps", "ttft_ms", "peak_memory_gb"), by: str = "engine"):
    """One panel per metric, one bar per engine (mlxbun vs mlx-lm); `df` has an `engine`
    column or index (e.g. `Benchmark.table()`)."""
    df = df.reset_index() if by not in df.columns else df
    present = [m for m in metrics if m in df.columns]
    fig = figure(3.0 * max(1, len(present)), 3.4)
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
    fig = figure(6, 3.4)
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


