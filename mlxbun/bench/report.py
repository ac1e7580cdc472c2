"""Benchmark results: statistics, JSON rows, the llama-bench-like table, results-table rows."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

__all__ = ["BenchResult", "Sample", "TestResult", "format_bytes", "format_count"]

GB = 1e9


@dataclass
class Sample:
    """One timed run of a test by one engine."""

    seconds: float
    peak_memory_bytes: int


@dataclass
class TestResult:
    """All timed samples of one engine on one test (`pp512`, `tg128`)."""

    engine: str
    test: str
    kind: str  # "pp" | "tg"
    n_tokens: int
    samples: list[Sample] = field(default_factory=list)

    __test__ = False  # not a pytest class

    @property
    def tokens_per_s(self) -> list[float]:
        return [self.n_tokens / s.seconds for s in self.samples]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.tokens_per_s)

    @property
    def sd(self) -> float:
        tps = self.tokens_per_s
        return statistics.stdev(tps) if len(tps) > 1 else 0.0

    @property
    def median(self) -> float:
        return statistics.median(self.tokens_per_s)

    @property
    def ttft_ms(self) -> Optional[list[float]]:
        """pp only: time to the first token of the prompt, per sample."""
        return [1e3 * s.seconds for s in self.samples] if self.kind == "pp" else None

    @property
    def peak_memory_gb(self) -> float:
        return max(s.peak_memory_bytes for s in self.samples) / GB


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _gb(v: float) -> str:
    return f"{v:.3f}" if v >= 0.01 else f"{v:.2g}"


def format_count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return str(int(n))


@dataclass
class BenchResult:
    """What `run_bench` measured. `rows()` is the JSON form; `to_markdown()` the table."""

    model: str  # the spec as given
    label: str
    kind: str
    model_type: str
    dtype: str
    quant: Optional[str]
    weights_bytes: int
    n_params: int
    identity: dict
    backend: str
    device: str
    device_name: Optional[str]
    params: dict
    tests: list[TestResult]
    checks: dict
    tokens: dict  # engine -> greedy tg tokens of its first run
    device_bandwidth_gb_s: Optional[float] = None
    decode_bytes: Optional[int] = None  # weight bytes one decoded token reads (MoE: < weights_bytes)
    load_seconds: Optional[float] = None  # building both engines (random init, quantization, loading)
    fast: Optional[dict] = None  # the fast path's label, notes and drift vs exact (bench.fast.fast_fidelity)
    # split across ranks: {"ranks": N, "peak_memory_gb": {"ENGINE TEST": [rank 0, rank 1, ...]}}
    tensor_parallel: Optional[dict] = None
    run_id: Optional[str] = None
    results_path: Optional[str] = None

    # ------------------------------------------------------------ lookups

    def test(self, engine: str, test: str) -> TestResult:
        for t in self.tests:
            if t.engine == engine and t.test == test:
                return t
        raise KeyError(f"no {engine} {test} in this result")

    @property
    def engines(self) -> list[str]:
        return list(dict.fromkeys(t.engine for t in self.tests))

    def ratio(self, test: str) -> Optional[float]:
        """mlxbun mean t/s / mlx-lm mean t/s on `test` (None without an mlx-lm run)."""
        if "mlx-lm" not in self.engines:
            return None
        return self.test("mlxbun", test).mean / self.test("mlx-lm", test).mean

    def rank_peaks(self, t: TestResult) -> Optional[list[float]]:
        """Peak memory (GB) of each rank on test `t` when split across ranks, else None."""
        if not self.tensor_parallel:
            return None
        return self.tensor_parallel["peak_memory_gb"][f"{t.engine} {t.test}"]

    @property
    def read_bytes(self) -> int:
        """The weight bytes a decoded token reads: all of them, except an MoE's unrouted experts."""
        return self.weights_bytes if self.decode_bytes is None else self.decode_bytes

    def bandwidth_gb_s(self, engine: str) -> Optional[float]:
        """The bandwidth-wall figure: weight bytes read per token x decode tok/s (None without a tg test)."""
        tg = [t for t in self.tests if t.engine == engine and t.kind == "tg"]
        return self.read_bytes * tg[0].mean / GB if tg else None

    # ------------------------------------------------------------ JSON

    def rows(self) -> list[dict[str, Any]]:
        """One dict per engine x test, JSON-ready."""
        out = []
        for t in self.tests:
            row = {
                "model": self.label, "spec": self.model, "model_type": self.model_type, "dtype": self.dtype,
                "quant": self.quant, "size_bytes": self.weights_bytes, "n_params": self.n_params,
                "decode_bytes": self.read_bytes,
                "backend": self.backend, "device": self.device, "device_name": self.device_name,
                "engine": t.engine, "test": t.test, "n_tokens": t.n_tokens,
                "tokens_per_s": t.mean, "tokens_per_s_sd": t.sd, "tokens_per_s_median": t.median,
                "samples_tokens_per_s": t.tokens_per_s,
                "ttft_ms": statistics.median(t.ttft_ms) if t.kind == "pp" else None,
                "peak_memory_gb": t.peak_memory_gb,
                **({"tensor_parallel": self.tensor_parallel["ranks"],
                    "peak_memory_gb_per_rank": self.rank_peaks(t)} if self.tensor_parallel else {}),
                "bandwidth_gb_s": self.bandwidth_gb_s(t.engine) if t.kind == "tg" else None,
                "checks": dict(self.checks),
                "params": dict(self.params),
            }
            if t.engine == "mlxbun":
                row["ratio_vs_mlx_lm"] = self.ratio(t.test)
                if self.fast is not None:
                    row["fast"] = dict(self.fast)
            if self.load_seconds is not None:
                row["load_s"] = self.load_seconds
            if self.device_bandwidth_gb_s is not None:
                row["device_copy_bandwidth_gb_s"] = self.device_bandwidth_gb_s
            if self.run_id:
                row["run_id"] = self.run_id
            out.append(row)
        return out

    def to_dataframe(self):
        import pandas as pd

        return pd.DataFrame(self.rows())

    def as_dict(self) -> dict:
        d = asdict(self)
        d["rows"] = self.rows()
        return d

    # ------------------------------------------------------------ table

    def to_markdown(self) -> str:
        """A llama-bench-like Markdown table plus the bandwidth and check lines."""
        head = ["model", "size", "params", "backend", "engine", "test", "t/s", "vs mlx-lm", "TTFT ms", "peak GB"]
        align = ["---", "---:", "---:", "---", "---", "---:", "---:", "---:", "---:", "---:"]
        model = " ".join(x for x in (self.label, self.dtype, self.quant) if x)
        lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
        for t in self.tests:
            ratio = self.ratio(t.test) if t.engine == "mlxbun" else None
            ttft = statistics.median(t.ttft_ms) if t.kind == "pp" else None
            cells = [model, format_bytes(self.weights_bytes), format_count(self.n_params), self.backend, t.engine,
                     t.test, f"{t.mean:.2f} ± {t.sd:.2f}", "-" if ratio is None else f"{ratio:.3f}",
                     "-" if ttft is None else f"{ttft:.2f}", _gb(t.peak_memory_gb)]
            lines.append("| " + " | ".join(cells) + " |")
        notes = []
        walls = [(e, self.bandwidth_gb_s(e)) for e in self.engines]
        walls = [(e, w) for e, w in walls if w is not None]
        if walls:
            read = format_bytes(self.read_bytes)
            if self.read_bytes != self.weights_bytes:
                read += f" of {format_bytes(self.weights_bytes)}: the routed experts' top-k share"
            notes.append(f"bandwidth wall (weights read per token {read} x decode t/s): "
                         + ", ".join(f"{e} {w:.2f} GB/s" for e, w in walls))
        if self.device_bandwidth_gb_s is not None:
            notes.append(f"device copy bandwidth: {self.device_bandwidth_gb_s:.1f} GB/s")
        if self.tensor_parallel:
            peaks = "; ".join(f"{t.engine} {t.test} " + " / ".join(_gb(v) for v in self.rank_peaks(t))
                              for t in self.tests)
            notes.append(f"tensor parallel across {self.tensor_parallel['ranks']} ranks: t/s is the split "
                         f"model's (the ranks decode the same tokens together), size and peak GB rank 0's; "
                         f"peak GB per rank: {peaks}")
        checks = [f"{k}={v}" for k, v in self.checks.items() if v is not None]
        if checks:
            notes.append("checks: " + ", ".join(checks))
        if self.fast is not None:
            f = self.fast
            notes.append(f"mlxbun ran the {f['path']}; drift vs the exact path over {f['positions']} decode "
                         f"steps: mean KLD {f['kld_mean']:.3g}, max KLD {f['kld_max']:.3g}, top-1 agreement "
                         f"{f['top1_agreement']:.3f}, max |diff| {f['max_abs_diff']:.3g}")
            step = f.get("step") or {}
            if step.get("decoder") not in (None, "eager"):
                notes.append(f"fast decode step: {step['decoder']}, {step['kernels_per_step']} kernels per step "
                             f"({step['kernels_per_step'] / step['layers']:.1f} per layer, counted from its graph); "
                             f"host {step['host_us']:.0f} us, GPU after the host {step['gpu_after_host_us']:.0f} us "
                             f"per step (median)")
            notes += [f"fast path: {n}" for n in f["notes"]]
        dev = f"{self.backend} ({self.device_name})" if self.device_name else self.backend
        load = f"; load {self.load_seconds:.1f} s" if self.load_seconds is not None else ""
        notes.append(f"device: {dev}; trials {self.params['trials']}, warm-up {self.params['warmup']}, "
                     f"seed {self.params['seed']}{load}")
        return "\n".join(lines) + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n"

    # ------------------------------------------------------------ results table

    def record(self, results: Any = None) -> str:
        """Append this result to the results table (experiment "bench"); returns the run id.

        One row per engine x test x statistic (tokens_per_s.mean/.median/.sd/.min/.max,
        ttft_ms.median/.mean for pp, peak_memory_gb, ratio_vs_mlx_lm for mlxbun, bandwidth_gb_s
        for tg), plus the checks (check.<name>, 1/0) and the device copy bandwidth.
        `results`: a path, an open ResultsStore, or None (the default table).
        """
        from mlxbun.results import ResultsStore, open_results

        store = results if isinstance(results, ResultsStore) else open_results(results)
        try:
            run = store.new_run("bench", model=self.identity,
                                params={**self.params, "label": self.label, "n_params": self.n_params,
                                        "weights_bytes": self.weights_bytes, "decode_bytes": self.read_bytes})
            rows: list[tuple] = []
            for t in self.tests:
                p = {"engine": t.engine, "test": t.test}
                tps = t.tokens_per_s
                rows += [("tokens_per_s.mean", t.mean, "tok/s", {**p, "samples": tps}),
                         ("tokens_per_s.median", t.median, "tok/s", p),
                         ("tokens_per_s.sd", t.sd, "tok/s", p),
                         ("tokens_per_s.min", min(tps), "tok/s", p),
                         ("tokens_per_s.max", max(tps), "tok/s", p),
                         ("peak_memory_gb", t.peak_memory_gb, "GB", p)]
                rows += [("peak_memory_gb.rank", v, "GB", {**p, "rank": r})
                         for r, v in enumerate(self.rank_peaks(t) or [])]
                if t.kind == "pp":
                    rows += [("ttft_ms.median", statistics.median(t.ttft_ms), "ms", p),
                             ("ttft_ms.mean", statistics.fmean(t.ttft_ms), "ms", p)]
                else:
                    rows.append(("bandwidth_gb_s", self.bandwidth_gb_s(t.engine), "GB/s", p))
                ratio = self.ratio(t.test) if t.engine == "mlxbun" else None
                if ratio is not None:
                    rows.append(("ratio_vs_mlx_lm", ratio, "x", p))
            for name, ok in self.checks.items():
                if ok is not None:
                    rows.append((f"check.{name}", 1.0 if ok else 0.0, "bool", {"engine": "both"}))
            if self.fast is not None:
                p = {"engine": "mlxbun", "fidelity": self.fast["fidelity"], "positions": self.fast["positions"]}
                rows += [(f"fast.{k}", self.fast[k], None, p)
                         for k in ("kld_mean", "kld_max", "top1_agreement", "max_abs_diff")]
                step = self.fast.get("step") or {}
                units = {"kernels_per_step": "kernels", "host_us": "us", "gpu_after_host_us": "us", "step_us": "us"}
                rows += [(f"fast.step.{k}", step[k], unit, {**p, "decoder": step["decoder"]})
                         for k, unit in units.items() if k in step]
            if self.load_seconds is not None:
                rows.append(("load_s", self.load_seconds, "s", {"engine": "both"}))
            if self.device_bandwidth_gb_s is not None:
                rows.append(("device_copy_bandwidth_gb_s", self.device_bandwidth_gb_s, "GB/s", {"engine": "device"}))
            run.record_many(rows)
        finally:
            if store is not results:
                store.close()
        self.run_id, self.results_path = run.run_id, str(store.path)
        return run.run_id
