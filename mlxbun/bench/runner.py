"""`run_bench`: llama-bench-style prefill (pp) and decode (tg) tests, engines alternating.

Both engines run the SAME driver loop (below), so the ratio measures the model graphs and
caches, not two different generation stacks. The loops follow mlx-lm's `generate_step`:

- pp<N>: from a fresh cache, the prompt minus its last token in chunks of `prefill_step`
  (the cache evaluated after each chunk, so no logits are computed for them), then the last
  token's logits and the greedy first token. t/s = N / time; TTFT = the same time.
- tg<M>: after an untimed prefill of `tg_context` tokens, M greedy decode steps one token at a
  time, pipelined as mlx-lm does (the next step is queued with `async_eval` before the current
  token is read). t/s = M / time.

Every sample starts after `mx.synchronize()` and ends when its last output is on the host, so
times are wall-clock device work. Peak memory is `mx.get_peak_memory()` after a reset at the
start of the sample (it includes the resident weights). Engine order alternates every round.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import mlx.core as mx

from mlxbun.bench.engines import ENGINES, Engine, load_engines, shares_weights
from mlxbun.bench.fast import fast_engine, fast_fidelity
from mlxbun.bench.report import BenchResult, Sample, TestResult
from mlxbun.errors import MlxbunError
from mlxbun.parallel.world import gather_floats

__all__ = ["BenchArgumentError", "measure_copy_bandwidth", "run_bench", "time_decode", "time_prefill"]

PROGRESS_AFTER_S = 2.0  # show the bar only for runs longer than this


class BenchArgumentError(MlxbunError, ValueError):
    """A benchmark argument out of range."""


# ------------------------------------------------------------------ timing primitives


def _sync(stream) -> None:
    mx.synchronize(stream)
    mx.synchronize()


def _greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits[:, -1, :], axis=-1)


def time_prefill(engine: Engine, prompt: mx.array, stream, prefill_step: int = 2048
                 ) -> tuple[Sample, int, mx.array]:
    """One pp sample: (timing, greedy first token, last-position logits)."""
    cache = engine.make_cache()
    _sync(stream)
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    with mx.stream(stream):
        rest = prompt
        while rest.size > 1:
            n = min(prefill_step, rest.size - 1)
            engine.forward(rest[None, :n], cache)
            mx.eval([c.state for c in cache])
            rest = rest[n:]
        logits = engine.forward(rest[None], cache)[:, -1, :]
        token = mx.argmax(logits, axis=-1)
    mx.eval(token, logits)
    first = token.item()
    seconds = time.perf_counter() - t0
    return Sample(seconds, int(mx.get_peak_memory())), first, logits


def time_decode(engine: Engine, context: mx.array, n_tokens: int, stream) -> tuple[Sample, list[int]]:
    """One tg sample: (timing of n_tokens decode steps, the greedy tokens)."""
    cache = engine.make_cache()
    with mx.stream(stream):
        y = _greedy(engine.forward(context[None], cache))
    mx.eval(y, [c.state for c in cache])
    if engine.decode_step is not None:
        step = engine.decode_step(cache, n_tokens + 1)
    else:
        def step(ids):
            return engine.forward(ids, cache)[:, -1, :]
    _sync(stream)
    mx.reset_peak_memory()
    tokens: list[int] = []
    t0 = time.perf_counter()
    with mx.stream(stream):
        nxt = mx.argmax(step(y[:, None]), axis=-1)
    mx.async_eval(nxt)
    for i in range(n_tokens):
        if i + 1 < n_tokens:
            with mx.stream(stream):
                after = mx.argmax(step(nxt[:, None]), axis=-1)
            mx.async_eval(after)
        tokens.append(nxt.item())
        if i + 1 < n_tokens:
            nxt = after
    seconds = time.perf_counter() - t0
    return Sample(seconds, int(mx.get_peak_memory())), tokens


def measure_copy_bandwidth(size_mb: Optional[int] = None, reps: int = 10) -> float:
    """The device's copy bandwidth in GB/s: (read + write bytes) / time of an elementwise pass
    over a large float32 array, median of `reps` (default size: 1 GiB on a GPU, 256 MiB on CPU)."""
    if size_mb is None:
        size_mb = 1024 if mx.default_device().type == mx.gpu else 256
    if size_mb <= 0 or reps <= 0:
        raise BenchArgumentError(f"bandwidth probe: size_mb and reps must be positive, got {size_mb}, {reps}")
    n = size_mb * (1 << 20) // 4
    a = mx.ones((n,), dtype=mx.float32)
    mx.eval(a)
    mx.eval(a + 1)  # warm-up: kernel build, allocator
    times = []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        b = a + 1
        mx.eval(b)
        times.append(time.perf_counter() - t0)
        del b
    times.sort()
    return 2 * a.nbytes / times[len(times) // 2] / 1e9


# ------------------------------------------------------------------ progress


class _LazyProgress:
    """A rich bar on stderr that appears only once the run has taken PROGRESS_AFTER_S."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.done, self.enabled = total, 0, enabled
        self.t0 = time.perf_counter()
        self._bar = self._task = None

    def advance(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is None and time.perf_counter() - self.t0 >= PROGRESS_AFTER_S and self.done < self.total:
            try:
                from rich.console import Console
                from rich.progress import Progress
            except ImportError:  # rich is a dependency, but a bare device install may lack it
                self.enabled = False
                return
            self._bar = Progress(console=Console(stderr=True), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("bench", total=self.total, completed=self.done)
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=what)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def _progress_default() -> bool:
    try:
        from rich.console import Console
    except ImportError:
        return False
    c = Console(stderr=True)
    return c.is_terminal or c.is_jupyter


# ------------------------------------------------------------------ run_bench


def _check_args(prompt_len: int, gen_len: int, trials: int, warmup: int, prefill_step: int,
                tg_context: int, seed: int, bandwidth_mb: Optional[int]) -> None:
    for name, v, lo in (("prompt_len", prompt_len, 0), ("gen_len", gen_len, 0), ("trials", trials, 1),
                        ("warmup", warmup, 0), ("prefill_step", prefill_step, 1),
                        ("tg_context", tg_context, 1), ("seed", seed, 0)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise BenchArgumentError(f"{name.replace('_', '-')} must be an integer >= {lo}, got {v!r}")
    if bandwidth_mb is not None and (isinstance(bandwidth_mb, bool) or not isinstance(bandwidth_mb, int)
                                     or bandwidth_mb <= 0):
        raise BenchArgumentError(f"bandwidth-mb must be a positive integer, got {bandwidth_mb!r}")
    if prompt_len == 0 and gen_len == 0:
        raise BenchArgumentError("nothing to run: prompt-len and gen-len are both 0")


def run_bench(model: str, *, dtype: Optional[str] = None, quant: Optional[int] = None, prompt_len: int = 512,
              gen_len: int = 128, trials: int = 5, warmup: int = 1, vs: Optional[str] = "mlx-lm", seed: int = 0,
              prefill_step: int = 2048, tg_context: int = 16, measure_bandwidth: bool = False,
              bandwidth_mb: Optional[int] = None, scale_down: Optional[int] = None, zoo_root: Any = None,
              results: Any = None, record: bool = True, progress: Optional[bool] = None,
              fast: bool = False, tensor_group: Any = None) -> BenchResult:
    """Benchmark mlxbun (and mlx-lm, `vs="mlx-lm"`) on one model; see the module docstring.

    `model`: a checkpoint directory, `zoo:ARCH` or `random:SHAPE` (bench.shapes.SHAPES, or a
    config.json path). `dtype`/`quant` pick the zoo variant or the random weights' dtype and
    affine quantization (4 or 8 bits, group 64). `prompt_len`/`gen_len` 0 skip pp/tg.
    With `record`, rows go to the results table at `results` (a path, an open ResultsStore, or
    None for the default table). `progress`: a rich bar on stderr (default: when interactive).
    `fast`: mlxbun runs its fast path (`mlxbun.fast`, fidelity L2-fast); the result then carries
    its drift against the exact path over the tg test's tokens (`BenchResult.fast`).
    `tensor_group`: an `mx.distributed` group of more than one rank splits both engines across it
    (mlx-lm by its file's own shard()); every rank runs the same tests in step, the result carries
    each rank's peak memory, and only rank 0 records.
    """
    _check_args(prompt_len, gen_len, trials, warmup, prefill_step, tg_context, seed, bandwidth_mb)
    if vs not in (None, "none", "mlx-lm"):
        raise BenchArgumentError(f"vs {vs!r}: use 'mlx-lm' or 'none'")
    names = ENGINES if vs == "mlx-lm" else ("mlxbun",)
    if record and not hasattr(results, "new_run"):
        from mlxbun.results import check_results

        check_results(results)  # a bad results path fails now, not after the whole run; created when recording
    t_load = time.perf_counter()
    if tensor_group is not None and tensor_group.size() == 1:
        tensor_group = None
    if tensor_group is not None and tensor_group.rank() != 0:
        record = False  # rank 0 records for the run
    mut = load_engines(model, dtype=dtype, quant=quant, seed=seed, engines=names, scale_down=scale_down,
                       zoo_root=zoo_root, tensor_group=tensor_group)
    fast_path = None
    if fast:
        if not gen_len:
            raise BenchArgumentError("--fast measures its drift on the tg test: give gen-len > 0")
        fast_path, mut.engines["mlxbun"] = fast_engine(mut.engines["mlxbun"])
    engines = [mut.engines[n] for n in names]
    load_seconds = time.perf_counter() - t_load
    stream = mx.new_stream(mx.default_device())

    key_prompt, key_ctx = mx.random.split(mx.random.key(seed))
    prompt = mx.random.randint(0, mut.vocab_size, (prompt_len,), key=key_prompt).astype(mx.int32)
    context = mx.random.randint(0, mut.vocab_size, (tg_context,), key=key_ctx).astype(mx.int32)
    mx.eval(prompt, context)

    tests = ([("pp", prompt_len)] if prompt_len else []) + ([("tg", gen_len)] if gen_len else [])
    rounds = warmup + trials
    bar = _LazyProgress(len(tests) * rounds * len(engines), _progress_default() if progress is None else progress)
    results_by: dict[tuple[str, str], TestResult] = {}
    first_tokens: dict[str, set] = {e.name: set() for e in engines}
    pp_logits: dict[str, mx.array] = {}
    tg_tokens: dict[str, list[list[int]]] = {e.name: [] for e in engines}
    try:
        for kind, n in tests:
            test = f"{kind}{n}"
            for e in engines:
                results_by[(e.name, test)] = TestResult(e.name, test, kind, n)
            for r in range(rounds):
                order = engines if r % 2 == 0 else engines[::-1]
                for e in order:
                    if kind == "pp":
                        sample, first, logits = time_prefill(e, prompt, stream, prefill_step)
                        first_tokens[e.name].add(first)
                        pp_logits.setdefault(e.name, logits)
                    else:
                        sample, toks = time_decode(e, context, n, stream)
                        tg_tokens[e.name].append(toks)
                    if r >= warmup:
                        results_by[(e.name, test)].samples.append(sample)
                    bar.advance(f"{e.name} {test} {'warm-up' if r < warmup else f'trial {r - warmup + 1}'}")
    finally:
        bar.close()

    checks: dict[str, Any] = {}
    if len(engines) == 2:
        a, b = (e.name for e in engines)
        checks["weights_shared"] = shares_weights(engines[0].module, engines[1].module)
        same = first_tokens[a] == first_tokens[b] and len(first_tokens[a]) <= 1
        if gen_len:
            runs = tg_tokens[a] + tg_tokens[b]
            same = same and all(t == runs[0] for t in runs)
        checks["same_greedy_tokens"] = same
        checks["prefill_logits_bit_exact"] = (
            bool(mx.array_equal(pp_logits[a], pp_logits[b])) if prompt_len and not fast else None)
    pp_logits.clear()
    fidelity = None if fast_path is None else fast_fidelity(fast_path, context.tolist(), tg_tokens["mlxbun"][0])

    split = None
    if tensor_group is not None:
        split = {"ranks": tensor_group.size(), "peak_memory_gb": {
            f"{t.engine} {t.test}": gather_floats(t.peak_memory_gb, tensor_group) for t in results_by.values()}}
    bandwidth = measure_copy_bandwidth(bandwidth_mb) if measure_bandwidth else None
    from mlxbun.results.identity import environment

    env = environment()
    result = BenchResult(
        model=mut.spec, label=mut.label, kind=mut.kind, model_type=mut.model_type, dtype=mut.dtype,
        quant=mut.quant, weights_bytes=mut.weights_bytes, n_params=mut.n_params, identity=mut.identity,
        decode_bytes=mut.decode_bytes,
        backend=env["backend"], device=env["device"], device_name=env["device_name"],
        params={"model": mut.spec, "dtype": mut.dtype, "quant": quant, "prompt_len": prompt_len,
                "gen_len": gen_len, "trials": trials, "warmup": warmup, "vs": "mlx-lm" if len(engines) == 2 else None,
                "seed": seed, "prefill_step": prefill_step, "tg_context": tg_context, "scale_down": scale_down,
                "fast": bool(fast), "tp": 1 if split is None else split["ranks"]},
        tests=list(results_by.values()), checks=checks,
        tokens={name: runs[0] for name, runs in tg_tokens.items() if runs},
        device_bandwidth_gb_s=bandwidth, load_seconds=load_seconds, fast=fidelity, tensor_parallel=split,
    )
    if record:
        result.record(results)
    return result
