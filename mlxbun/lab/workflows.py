"""What the standard notebooks compute: one function per notebook, each returning a result
object with the tables the notebook shows and writing its rows to the results table.

- `bringup(model, ...)`            port_bringup.ipynb: coverage, weight audit, gate verdict,
                                   layer-by-layer diff vs mlx-lm, trajectory diff, manifest entry;
- `logit_diff(base, new, ...)`     logit_diff.ipynb: llama.cpp-style KLD statistics of two
                                   configurations (weights and/or KV cache) of a model;
- `kv_sweep(model, specs, ...)`    kv_quant.ipynb: KV schemes x bits x group sizes x context
                                   lengths against plain KV (KLD, top-1, bytes, memory, speed);
- `benchmark(model, ...)`          benchmark.ipynb: mlxbun vs mlx-lm speed and the bandwidth wall.

Each takes `results_path` (None: the default store) and `record=True`; rows carry the
experiment name of the notebook. When `mlxbun lab run` executes the notebook, its run id
(`$MLXBUN_LAB_RUN`) joins every row's parameters as `lab_run`, tying the rows to that run.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from mlxbun.errors import MlxbunError
from mlxbun.lab.models import KVSpec, eval_ids, load_model, resolve_model, teacher_forced

__all__ = [
    "Benchmark", "Bringup", "LogitDiff", "Side", "benchmark", "bringup", "kv_grid", "kv_sweep", "logit_diff",
    "pareto_front", "recording",
]

LAB_RUN_ENV = "MLXBUN_LAB_RUN"


# ---------------------------------------------------------------- results rows


@contextlib.contextmanager
def recording(experiment: str, *, model: Any = None, params: dict | None = None, results_path=None,
              record: bool = True):
    """A results `Run` for `experiment` (None when record=False), its store closed afterwards."""
    if not record:
        yield None
        return
    from mlxbun.results import open_results

    params = dict(params or {})
    lab_run = os.environ.get(LAB_RUN_ENV)
    if lab_run:
        params["lab_run"] = lab_run
    with open_results(results_path) as store:
        yield store.new_run(experiment, model=model, params=params)


def _tokenizer(path):
    """The checkpoint's tokenizer, or None when it has none (ids are then shown without text)."""
    from mlxbun.tokenizer import load_tokenizer

    try:
        return load_tokenizer(path)
    except MlxbunError:
        return None


# ---------------------------------------------------------------- port bring-up


@dataclass
class Bringup:
    """Everything port_bringup.ipynb shows for one checkpoint (side a of the diffs: mlxbun,
    side b: mlx-lm, the reference)."""

    target: str
    path: Path
    port: Any  # mlxbun.parity.port.PortResult: coverage / audit / trajectory / verdict summary
    coverage: Any = None  # CoverageReport (None when the profile refused first)
    audit: Any = None  # AuditReport from safetensors headers
    layer_diff: Any = None  # LayerDiff (None when refused)
    trajectory: Any = None  # TrajectoryDiff, a = mlx-lm (base), b = mlxbun
    manifest: dict | None = None  # the golden manifest entry as written
    manifest_path: str | None = None
    run_id: str | None = None
    tokenizer: Any = field(default=None, repr=False)  # the checkpoint's, for token texts (None: ids only)

    @property
    def verdict(self) -> str:
        return self.port.verdict

    def coverage_table(self):
        """One row per config key: how the universal graph treats it."""
        import pandas as pd

        rows = []
        c = self.coverage
        if c is not None:
            rows += [(k, "understood", "") for k in c.understood]
            rows += [(k, "harmless", "") for k in c.harmless]
            rows += [(k, "ignored", why) for k, why in c.ignored.items()]
            rows += [(k, "unknown (neutral value)", "") for k in c.unknown]
            rows += [(k, "offending", why) for k, why in c.offending.items()]
        return pd.DataFrame(rows, columns=["key", "status", "note"])

    def audit_table(self):
        """One row per tensor: consumed / dropped (with the rule) / missing / unconsumed / mismatched."""
        import pandas as pd

        rows = []
        a = self.audit
        if a is not None:
            rows += [(n, "consumed", "") for n in a.consumed]
            rows += [(n, "dropped", why) for n, why in a.dropped.items()]
            rows += [(n, "missing", "") for n in a.missing]
            rows += [(n, "unconsumed", "") for n in a.unconsumed]
            rows += [(m.name, "mismatched", f"want {m.want}, have {m.have}") for m in a.mismatched]
        return pd.DataFrame(rows, columns=["tensor", "status", "note"])

    def steps_table(self):
        """The port's steps and verdict as a two-column table."""
        import pandas as pd

        p = self.port
        rows = [("target", p.target), ("model_type", p.model_type), ("dtype", p.dtype),
                ("coverage", p.coverage), ("audit", p.audit), ("trajectory", p.trajectory),
                ("max |diff|", p.max_abs_diff), ("verdict", p.verdict), ("reason", p.reason)]
        if p.first_divergence:
            rows.append(("first divergence", p.first_divergence.get("path")))
        return pd.DataFrame(rows, columns=["step", "result"]).set_index("step")

    def heatmap(self, step: int | None = None):
        """Units x sub-steps -> max |mlxbun - mlx-lm| (rows with no comparable cell dropped)."""
        if self.layer_diff is None:
            raise MlxbunError(f"{self.target}: no layer diff ({self.port.verdict}: {self.port.reason})")
        return self.layer_diff.heatmap(step).dropna(how="all")


def bringup(model: str = "zoo:llama", *, variant: str = "float32", decode_steps: int = 8, prompt_len: int = 24,
            diff_decode_steps: int = 2, top_k: int = 5, goldens_dir=None, results_path=None,
            record: bool = True) -> Bringup:
    """Port one checkpoint (`mlxbun port`'s steps: coverage, header audit, live mlx-lm oracle,
    bit-exact gate, manifest entry), then explain the verdict: a layer-by-layer diff of the
    prefill and `diff_decode_steps` decode steps, and the greedy trajectory diff with top-k.

    `goldens_dir=None` writes the manifest entry to a temporary directory (shown, not kept).
    """
    from mlxbun.config import load_model_config
    from mlxbun.factory import audit_dry_run, check_target_coverage
    from mlxbun.models.mlxlm import load_mlxlm
    from mlxbun.parity.layer_diff import layer_diff
    from mlxbun.parity.oracle import default_prompt_ids, run_trajectory
    from mlxbun.parity.port import port_one, resolve_targets
    from mlxbun.parity.trajectory_diff import compare_trajectories

    if decode_steps < 1 or prompt_len < 2 or diff_decode_steps < 0:
        raise MlxbunError("decode_steps must be >= 1, prompt_len >= 2 and diff_decode_steps >= 0")
    target = resolve_targets([str(model)], variants=(variant,))[0]
    tmp = None if goldens_dir is not None else tempfile.mkdtemp(prefix="mlxbun-goldens-")
    try:
        port = port_one(target, decode_steps=decode_steps, prompt_len=prompt_len, goldens_dir=goldens_dir or tmp)
        manifest = json.loads(Path(port.manifest).read_text()) if port.manifest else None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    out = Bringup(target=target.label, path=target.path, port=port, manifest=manifest,
                  manifest_path=port.manifest if goldens_dir is not None else None)
    config = None
    with contextlib.suppress(MlxbunError):  # a refusal is reported by `port`; the tables stay empty
        config = load_model_config(target.path)
        out.coverage = check_target_coverage(config, target.path)
        out.audit = audit_dry_run(target.path, config)
    if port.verdict != "refused" and config is not None:
        candidate, oracle = load_model(target.path, "mlxbun"), load_mlxlm(target.path)
        prompt = default_prompt_ids(config.vocab_size, length=prompt_len)
        ot = run_trajectory(oracle, prompt, decode_steps)
        ct = run_trajectory(candidate, prompt, decode_steps)
        out.tokenizer = _tokenizer(target.path)
        out.trajectory = compare_trajectories(ot, ct, tokenizer=out.tokenizer, k=top_k)
        out.layer_diff = layer_diff(candidate, oracle, prompt, ot.greedy_ids[:diff_decode_steps])
    params = {"target": target.label, "variant": target.variant, "decode_steps": decode_steps,
              "prompt_len": prompt_len, "verdict": port.verdict}
    with recording("port_bringup", model=target.path, params=params, results_path=results_path,
                   record=record) as run:
        if run is not None:
            out.run_id = run.run_id
            rows = [("verdict_pass", float(port.verdict == "pass"), None, {"reason": port.reason})]
            if port.max_abs_diff is not None:
                rows.append(("max_abs_diff", port.max_abs_diff, None))
            if out.coverage is not None:
                rows.append(("coverage_keys", len(out.coverage.understood), "keys"))
            if out.audit is not None:
                rows.append(("tensors_consumed", len(out.audit.consumed), "tensors"))
            if out.layer_diff is not None:
                diffs = [r["max_abs_diff"] for r in out.layer_diff.records if r["max_abs_diff"] is not None]
                rows.append(("layer_diff_max", max(diffs, default=math.nan), None))
                recs = out.layer_diff.records
                both = [r for r in recs if r["a"] is not None and r["b"] is not None]
                rows.append(("modules_differing", sum(not r["equal"] for r in both), "outputs"))
                rows.append(("modules_one_side", len(recs) - len(both), "outputs"))
            if out.trajectory is not None and out.trajectory.first_divergence is not None:
                rows.append(("trajectory_first_divergence", out.trajectory.first_divergence, "step"))
            run.record_many(rows)
    return out


# ---------------------------------------------------------------- logit diff


@dataclass(frozen=True)
class Side:
    """One configuration of a model: checkpoint (zoo spec + variant / head_dim, or a path),
    engine (mlxbun's graph or mlx-lm's) and KV cache."""

    model: str = "zoo:llama"
    variant: str = "float32"
    head_dim: int | None = None
    engine: str = "mlxbun"
    kv: KVSpec = field(default_factory=KVSpec)

    @property
    def path(self) -> Path:
        return resolve_model(self.model, variant=self.variant, head_dim=self.head_dim)

    @property
    def label(self) -> str:
        name = self.model + (f"/{self.variant}" if self.model.startswith("zoo:") else "")
        if self.head_dim is not None:
            name += f" hd{self.head_dim}"
        return f"{name} [{self.engine}] kv={self.kv.label}"

    def as_params(self) -> dict:
        return {"model": self.model, "variant": self.variant, "head_dim": self.head_dim, "engine": self.engine,
                "kv": self.kv.label}


@dataclass
class LogitDiff:
    base: Side
    new: Side
    stats: Any  # mlxbun.parity.metrics.KLDStats (new against base)
    ids: list[int]
    prefill: int
    run_id: str | None = None

    def table(self):
        return self.stats.as_table()

    def per_position(self):
        return self.stats.per_position()


def logit_diff(base: Side, new: Side, *, n_tokens: int = 128, prefill: int = 32, comparison: str | None = None,
               results_path=None, record: bool = True) -> LogitDiff:
    """KLD statistics of `new` against `base` over the same text, teacher-forced as decode
    (see `models.teacher_forced`): the first `prefill` ids are context, the other positions
    are scored against the actual next token (so delta-p and perplexities are reported too)."""
    from mlxbun.parity.metrics import compare_logits

    pa, pb = base.path, new.path
    tok = _tokenizer(pa)
    if tok is None:
        raise MlxbunError(f"{pa}: no tokenizer to encode the evaluation text")
    ids = eval_ids(tok, n_tokens)
    ra = teacher_forced(load_model(pa, base.engine), ids, prefill=prefill, kv=base.kv)
    rb = teacher_forced(load_model(pb, new.engine), ids, prefill=prefill, kv=new.kv)
    if ra.logits.shape != rb.logits.shape:
        raise MlxbunError(f"{base.label} and {new.label} give logits of different shapes "
                          f"{tuple(ra.logits.shape)} vs {tuple(rb.logits.shape)}")
    stats = compare_logits(ra.logits, rb.logits, ra.next_tokens)
    out = LogitDiff(base=base, new=new, stats=stats, ids=ids, prefill=prefill)
    params = {"comparison": comparison or f"{base.label} vs {new.label}", "base": base.as_params(),
              "new": new.as_params(), "n_tokens": n_tokens, "prefill": prefill}
    with recording("logit_diff", model=pb, params=params, results_path=results_path, record=record) as run:
        if run is not None:
            out.run_id = run.run_id
            run.record_many(stats.as_rows())
    return out


# ---------------------------------------------------------------- KV quantization sweep


def kv_grid(uniform_bits: Iterable[int] = (4, 8), group_sizes: Iterable[int] = (32, 64),
            turboquant_bits: Iterable[float] = (3.5,)) -> list[KVSpec]:
    """The quantized KV configurations to sweep: uniform bits x group sizes, then TurboQuant bits."""
    specs = [KVSpec("uniform", int(b), int(g)) for b in uniform_bits for g in group_sizes]
    return specs + [KVSpec("turboquant", float(b)) for b in turboquant_bits]


KV_COLUMNS = ["scheme", "bits", "group_size", "label", "context", "kld_mean", "kld_p99", "kld_max",
              "top1_agreement", "kv_bytes", "kv_bytes_ratio", "kv_bytes_allocated", "peak_memory",
              "decode_tps", "error"]


def kv_sweep(model: str = "zoo:llama", specs: Sequence[KVSpec] | None = None, *, context_lengths=(64, 192),
             n_eval: int = 32, variant: str = "float32", head_dim: int | None = 64, engine: str = "mlxbun",
             results_path=None, record: bool = True):
    """Every KV spec at every context length against plain KV on the same model and text.

    Per (spec, context): the prompt is `context` tokens, then `n_eval` teacher-forced decode
    steps through the cache; KLD / top-1 agreement are over those steps' distributions. A
    configuration the model cannot take (e.g. a group size that does not divide head_dim)
    gets a failure row in the results table and its message in the `error` column.
    `head_dim` widens a zoo model's heads (see `models.wide_zoo_checkpoint`); other models
    keep their own.
    Returns a pandas DataFrame (KV_COLUMNS; plain rows included, ratio 1).
    """
    import pandas as pd

    from mlxbun.parity.metrics import compare_logits

    specs = list(kv_grid() if specs is None else specs)
    if not str(model).startswith("zoo:"):
        head_dim = None  # a real checkpoint keeps its own heads (and records None)
    path = resolve_model(model, variant=variant, head_dim=head_dim)
    m = load_model(path, engine)
    tok = _tokenizer(path)
    if tok is None:
        raise MlxbunError(f"{path}: no tokenizer to encode the evaluation text")
    rows = []
    params = {"model": str(model), "variant": variant, "head_dim": head_dim, "engine": engine, "n_eval": n_eval}
    with recording("kv_quant", model=path, params=params, results_path=results_path, record=record) as run:
        for ctx in context_lengths:
            ids = eval_ids(tok, int(ctx) + n_eval)
            base = teacher_forced(m, ids, prefill=int(ctx), kv=KVSpec())
            rows.append(_kv_row(KVSpec(), ctx, base, None, base.kv_bytes))
            if run is not None:
                _record_kv(run, rows[-1])
            for spec in specs:
                try:
                    r = teacher_forced(m, ids, prefill=int(ctx), kv=spec)
                except MlxbunError as e:
                    rows.append({**_kv_row(spec, ctx, None, None, base.kv_bytes), "error": str(e)})
                    if run is not None:
                        run.record_failure(str(e), **_kv_params(rows[-1]))
                    continue
                stats = compare_logits(base.logits, r.logits, r.next_tokens)
                rows.append(_kv_row(spec, ctx, r, stats, base.kv_bytes))
                if run is not None:
                    _record_kv(run, rows[-1])
    return pd.DataFrame(rows, columns=KV_COLUMNS)


def _kv_row(spec: KVSpec, ctx: int, r, stats, plain_bytes: int) -> dict:
    """One table row; `r` None: the configuration failed; `stats` None: the plain baseline itself."""
    row = dict.fromkeys(KV_COLUMNS, math.nan)
    row.update(scheme=spec.scheme, label=spec.label, context=int(ctx), error=None,
               bits=spec.bits if spec.bits is not None else math.nan,
               group_size=(spec.group_size or 64) if spec.scheme == "uniform" else math.nan)
    if r is None:
        return row
    row.update(kv_bytes=r.kv_bytes, kv_bytes_ratio=r.kv_bytes / plain_bytes if plain_bytes else math.nan,
               kv_bytes_allocated=r.kv_bytes_allocated, peak_memory=r.peak_memory, decode_tps=r.decode_tps)
    if stats is None:
        row.update(kld_mean=0.0, kld_p99=0.0, kld_max=0.0, top1_agreement=1.0)
    else:
        row.update(kld_mean=stats.kld_mean, kld_p99=stats.kld_percentiles["99"], kld_max=stats.kld_max,
                   top1_agreement=stats.same_top_p)
    return row


def _kv_params(row: dict) -> dict:
    return {"kv": row["label"], "scheme": row["scheme"], "kv_bits": None if math.isnan(row["bits"]) else row["bits"],
            "kv_group_size": None if math.isnan(row["group_size"]) else int(row["group_size"]),
            "context": row["context"]}


_KV_METRICS = (("kld_mean", "nats"), ("kld_p99", "nats"), ("kld_max", "nats"), ("top1_agreement", None),
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


# ---------------------------------------------------------------- benchmark


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
    from mlxbun.bench import run_bench

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
