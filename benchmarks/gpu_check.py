"""On the H200: check mlxbun's CUDA kernels and measure the fast path (issue 16).

    python3 benchmarks/gpu_check.py [--out DIR] [--sweep] [--bench SPEC ...] [--quick]

1. Kernel checks (always): for each weight shape of the Llama-3.2-1B / Llama-3-8B decode, 4 and
   8 bits (group 64; groups 32 and 128 and float16 on one shape), rows M = 1 (4 and 16 on one
   shape): the kernel's max |error| against a float32 reference (x @ dequantize(w).T) next to
   `mx.quantized_matmul`'s, asserted within `max(1.5 x MLX's error, 2^-7 x max |reference|)`;
   three runs bit-equal (asserted); time per call vs `mx.quantized_matmul` (median of 5 timings
   of 50 chained calls) and the weight bandwidth each reaches.
2. `--sweep`: the same timing for every (rows per warp, warps per block) launch shape on the
   4-bit 8B shapes (what `mlxbun/kernels/tuning.py` is chosen from).
3. `--bench SPEC`: `run_bench(SPEC, fast=True)` side by side with mlx-lm, e.g.
   `random:llama-3-8b@4` (random weights of the shape, bf16, 4-bit g64).
4. Decode attention checks (`--checks attention`, in the default): the one-query attention kernels
   over static 16-bit and affine-quantized K/V (`benchmarks/gpu_attention.py` says what each column
   is): error bound against a float32 reference, run-to-run bits, bits under `mx.compile`, time vs
   MLX's op.
   TurboQuant checks (`--checks turboquant`, in the default): the TurboQuant decode kernel with the
   rotations around it against the exact cache's rotated attention in float32, the same three
   checks, time vs the compiled step's one-pass path, the exact cache's chunked decode and fp16 K/V.
   Fused decode kernel checks (`--checks fused`, in the default): `benchmarks/gpu_fused.py`'s check
   (each fused kernel against its MLX-op reference, run-to-run bits, the in-place K/V write).
5. `--kv CONTEXTS`: `mlxbun.bench.kv_memory` on its KV_HEAVY model, the exact path and the fast path
   (compiled step, decode attention kernels), for `--kv-schemes` (default fp16,q8,q4).

Writes `gpu_check.json` and `gpu_check.md` under --out (default $OUT or .). Exits non-zero when
an assertion fails (the tables are still written).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

import mlxbun.bench.fast as fast_bench  # noqa: E402
from mlxbun.bench.kv_bytes import split_schemes  # noqa: E402
from gpu_attention import (L2_BYTES, attention_checks, attention_sweep, quantize_checks, time_rotating,  # noqa: E402
                           turboquant_checks)
from gpu_fused import CHECK_COLS, check_rows  # noqa: E402
from mlxbun.fast import enable_fast  # noqa: E402
from mlxbun.kernels import fused_decode, sdpa_decode  # noqa: E402
from mlxbun.kernels import turboquant_quantize  # noqa: E402
from mlxbun.kernels.qmv import fast_quantized_matmul  # noqa: E402

SHAPES_8B = [(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)]
SHAPES_1B = [(2048, 2048), (512, 2048), (8192, 2048), (2048, 8192), (128256, 2048)]
LAUNCH = [(r, w) for r in (1, 2, 4) for w in (2, 4, 8)]


def _weights(n, k, bits, group, dtype, seed=0):
    key = mx.random.key(seed)
    w = (mx.random.normal((n, k), key=key) * 0.02).astype(dtype)
    wq, s, b = mx.quantize(w, group_size=group, bits=bits)
    return wq, s, b


def _time(fn, reps=50, rounds=5):
    out = fn()
    mx.eval(out)
    times = []
    for _ in range(rounds):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(reps)])
        mx.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def check_one(n, k, bits, group, dtype, m, timing=True):
    wq, s, b = _weights(n, k, bits, group, dtype)
    x = (mx.random.normal((m, k), key=mx.random.key(1))).astype(dtype)
    ref = x.astype(mx.float32) @ mx.dequantize(wq, s, b, group_size=group, bits=bits).astype(mx.float32).T
    mlx = mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits)
    runs = [fast_quantized_matmul(x, wq, s, b, group, bits) for _ in range(3)]
    mx.eval(ref, mlx, runs)
    err_k = mx.abs(runs[0].astype(mx.float32) - ref).max().item()
    err_m = mx.abs(mlx.astype(mx.float32) - ref).max().item()
    bound = max(1.5 * err_m, 2 ** -7 * mx.abs(ref).max().item())
    same = all(mx.array_equal(runs[0], r).item() for r in runs[1:])
    mlx_runs = [mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits) for _ in range(3)]
    mlx_same = all(mx.array_equal(mlx_runs[0], r).item() for r in mlx_runs[1:])
    row = dict(n=n, k=k, bits=bits, group=group, dtype=str(dtype).split(".")[-1], m=m, err_kernel=err_k,
               err_mlx=err_m, bound=bound, within_bound=err_k <= bound, deterministic=same,
               mlx_deterministic=mlx_same)
    if timing:
        nbytes = wq.nbytes + s.nbytes + b.nbytes
        t_k = _time(lambda: fast_quantized_matmul(x, wq, s, b, group, bits))
        t_m = _time(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits))
        row.update(us_kernel=t_k * 1e6, us_mlx=t_m * 1e6, speedup=t_m / t_k, tb_s_kernel=nbytes / t_k / 1e12,
                   tb_s_mlx=nbytes / t_m / 1e12)
    return row


def sweep(shapes, bits=4, group=64, dtype=mx.bfloat16):
    rows = []
    for n, k in shapes:
        wq, s, b = _weights(n, k, bits, group, dtype)
        x = mx.random.normal((1, k), key=mx.random.key(1)).astype(dtype)
        t_m = _time(lambda: mx.quantized_matmul(x, wq, s, b, transpose=True, group_size=group, bits=bits))
        for r, w in LAUNCH:
            t = _time(lambda: fast_quantized_matmul(x, wq, s, b, group, bits, rows_per_warp=r, warps_per_block=w))
            rows.append(dict(n=n, k=k, bits=bits, rows=r, warps=w, us=t * 1e6, speedup=t_m / t))
        print(f"sweep {n}x{k}: " + ", ".join(f"r{x['rows']}w{x['warps']} {x['speedup']:.2f}x"
                                              for x in rows if (x['n'], x['k']) == (n, k)), flush=True)
    return rows


def gemv_hbm(shapes=SHAPES_8B + SHAPES_1B, dtype=mx.bfloat16):
    """Kernel (tuned launch) vs mx.quantized_matmul at one row, cycling over enough weight copies
    that together they are 4x the L2: the weights come from HBM, as in a model's decode step."""
    from mlxbun.kernels import tuning

    rows, mode, tuning.MODE = [], tuning.MODE, "tuned"  # speedup_tuned: the table's launch shape
    for bits in (4, 8):
        for n, k in shapes:
            w0 = _weights(n, k, bits, 64, dtype)
            per = sum(a.nbytes for a in w0)
            ws = [w0] + [_weights(n, k, bits, 64, dtype, seed=s)
                         for s in range(1, min(16, max(2, -(-4 * L2_BYTES // per))))]
            x = mx.random.normal((1, k), key=mx.random.key(1)).astype(dtype)
            t_m = time_rotating([lambda w=w: mx.quantized_matmul(x, *w, transpose=True, group_size=64, bits=bits)
                                 for w in ws], _time)
            row = dict(n=n, k=k, bits=bits, copies=len(ws), us_mlx=t_m * 1e6, tb_s_mlx=per / t_m / 1e12)
            for r, wp in ((None, None), (1, 4), (2, 4), (4, 4), (4, 8)):
                t = time_rotating([lambda w=w: fast_quantized_matmul(x, *w, 64, bits, rows_per_warp=r,
                                                                     warps_per_block=wp) for w in ws], _time)
                row[f"speedup_{'tuned' if r is None else f'r{r}w{wp}'}"] = t_m / t
            rows.append(row)
            print(json.dumps(row), flush=True)
            mx.clear_cache()
    tuning.MODE = mode
    return rows


def kernel_checks(quick=False):
    rows = []
    for shapes in (SHAPES_8B, SHAPES_1B):
        for n, k in shapes:
            for bits in (4, 8):
                rows.append(check_one(n, k, bits, 64, mx.bfloat16, 1))
                print(json.dumps(rows[-1]), flush=True)
        if quick:
            break
    n, k = 4096, 4096
    for group in (32, 128):
        for bits in (4, 8):
            rows.append(check_one(n, k, bits, group, mx.bfloat16, 1, timing=False))
    for bits in (4, 8):
        rows.append(check_one(n, k, bits, 64, mx.float16, 1, timing=False))
    for m in (2, 4, 8, 16):
        rows.append(check_one(14336, 4096, 4, 64, mx.bfloat16, m))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def kv_section(contexts, schemes, decode) -> str:
    """The KV-memory bench on its KV_HEAVY model: exact path, then fast path (one model, one process)."""
    from mlxbun.bench.kv_memory import kv_heavy_model, run_kv_memory, to_markdown

    model = kv_heavy_model()
    out = []
    for label in ("exact path", "fast path"):
        fast = enable_fast(model) if label == "fast path" else None
        rows = run_kv_memory(model, contexts, schemes, decode, fast=fast)
        notes = ""
        if fast is not None:
            fast.collect_kernel_gaps()
            notes = f"{fast.describe()}\n" + "".join(f"- {n}\n" for n in fast.notes)
        out.append(f"### KV memory, {label} (KV_HEAVY, float16, decode {decode})\n\n{notes}\n{to_markdown(rows)}\n")
        mx.clear_cache()
    return "## KV memory and decode speed by KV scheme\n\n" + "\n".join(out)


def _md(rows, cols):
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    fmt = (lambda v: f"{v:.3g}" if isinstance(v, float) else str(v))
    return head + "".join("| " + " | ".join(fmt(r.get(c, "")) for c in cols) + " |\n" for r in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="8B shapes only")
    ap.add_argument("--bench", nargs="*", default=[], metavar="SPEC[@BITS]")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--gemv", nargs="*", default=["off"], choices=("tuned", "all", "off"),
                    help="kernels.tuning.MODE for each bench run (off: the compiled step alone)")
    ap.add_argument("--skip-checks", action="store_true", help="benches only")
    ap.add_argument("--checks", nargs="*", default=["gemv", "attention", "turboquant", "fused"],
                    choices=("gemv", "attention", "turboquant", "fused"))
    ap.add_argument("--kv", default="", help="contexts for the KV-memory section, e.g. 16384")
    ap.add_argument("--kv-schemes", default="fp16,q8,q4")
    ap.add_argument("--kv-decode", type=int, default=32)
    ap.add_argument("--hbm", action="store_true", help="GEMV and decode attention timed from HBM (buffers "
                    "cycled past the L2), attention over a launch sweep")
    ap.add_argument("--compile", nargs="*", default=["on"], choices=("on", "off"),
                    help="the fast path's compiled decode step on / off, for each bench run")
    args = ap.parse_args(argv)
    # the TurboQuant kernels run here whatever their flags say (a changed kernel is checked before its flag
    # goes back on); after their checks, the --kv / --bench runs use each only if it passed
    sdpa_decode.TURBOQUANT_CHECKED = turboquant_quantize.CHECKED = True
    sdpa_decode.METAL_TURBOQUANT_CHECKED = True  # on an Apple GPU: the untested Metal variant's first check
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": str(mx.default_device()), "mlx": mx.__version__}
    md = [f"device {report['device']}, mlx {report['mlx']}\n"]
    ok = True

    def save():  # after every section: a call stopped at its time limit still brings back what it measured
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu_check.md").write_text("\n".join(md))

    try:
        checks = kernel_checks(args.quick) if "gemv" in args.checks and not args.skip_checks else []
        report["kernel"] = checks
        ok = all(r["within_bound"] and r["deterministic"] for r in checks)
        if checks:
            md.append("## Kernel checks\n\n" + _md(checks, ["n", "k", "bits", "group", "dtype", "m", "err_kernel",
                                                           "err_mlx", "bound", "within_bound", "deterministic",
                                                           "mlx_deterministic", "us_kernel", "us_mlx", "speedup",
                                                           "tb_s_kernel", "tb_s_mlx"]))
        head = ["case", "dtype", "kv", "cap", "n", "chunk_splits", "gap", "err_kernel"]
        checked = ["within_bound", "deterministic", "compiled_equal"]
        sections = [  # (--checks name, report key, title, checks, columns)
            ("attention", "attention", "Decode attention checks", attention_checks,
             [*head, "err_mlx", "bound", *checked, "us_kernel", "us_mlx", "speedup", "us_mlx_masked",
              "speedup_vs_masked", "us_fp16", "vs_fp16"]),
            ("turboquant", "turboquant", "TurboQuant decode attention checks", turboquant_checks,
             [*head, "err_standin", "err_gpu_ref", "bound", *checked, "us_kernel", "us_standin", "us_exact",
              "speedup_vs_exact", "us_fp16", "vs_fp16"]),
            ("turboquant", "turboquant_quantize", "TurboQuant quantize checks", quantize_checks,
             ["case", "shape", "dtype", "bits", "gap", "norm_rel_err", "index_differ", "index_max_step", *checked,
              "us_kernel", "us_mlx", "us_mlx_compiled", "speedup_vs_compiled"])]
        for name, key, title, run_checks, cols in sections:
            if name not in args.checks or args.skip_checks:
                continue
            rows = run_checks(_time, progress=lambda r: print(json.dumps(r, default=str), flush=True))
            report[key] = rows
            passed = all(r.get("within_bound") and r.get("deterministic") and r.get("compiled_equal") for r in rows)
            ok = ok and passed
            if key == "turboquant":  # the fast path's runs below use a kernel only where it passed
                sdpa_decode.TURBOQUANT_CHECKED = sdpa_decode.METAL_TURBOQUANT_CHECKED = passed
            elif key == "turboquant_quantize":
                turboquant_quantize.CHECKED = passed
            md.append(f"## {title}\n\n" + _md(rows, [*cols, "error"]))
            print(md[-1], flush=True)
            save()
        if "fused" in args.checks and not args.skip_checks:  # the fused decode kernels (gpu_fused.py)
            fused_decode.FUSED_CHECKED = True
            fused = check_rows()
            report["fused"] = [r for _, rows in fused for r in rows]
            passed = all(r["passed"] for r in report["fused"])
            fused_decode.FUSED_CHECKED = passed  # the --bench runs below use them only if they passed
            ok = ok and passed
            md.append("## Fused decode kernel checks\n\n" + "\n".join(f"### {label}\n\n" + _md(rows, CHECK_COLS)
                                                                     for label, rows in fused))
            print(md[-1], flush=True)
            save()
        if args.hbm:
            report["gemv_hbm"] = gemv_hbm()
            md.append("## GEMV from HBM (one row, weights cycled past the L2)\n\n" + _md(report["gemv_hbm"], [
                "n", "k", "bits", "copies", "us_mlx", "tb_s_mlx", "speedup_tuned", "speedup_r1w4", "speedup_r2w4",
                "speedup_r4w4", "speedup_r4w8"]))
            save()
            report["attention_hbm"] = attention_sweep(_time, progress=lambda r: print(json.dumps(r), flush=True))
            md.append("## Decode attention from HBM, launch sweep\n\n" + _md(report["attention_hbm"], [
                "case", "sets", "mib_per_set", "warps", "target_blocks", "chunk_splits", "us_kernel", "us_mlx",
                "speedup", "gb_s", "us_fp16_sdpa", "max_diff_vs_first"]))
            print(md[-1], flush=True)
            save()
        if args.kv:
            md.append(kv_section([int(c) for c in args.kv.split(",")], split_schemes(args.kv_schemes), args.kv_decode))
            print(md[-1], flush=True)
            save()
        if args.sweep:
            report["sweep"] = sweep(SHAPES_8B)
            md.append("## Launch-shape sweep (4-bit g64, M = 1)\n\n"
                      + _md(report["sweep"], ["n", "k", "rows", "warps", "us", "speedup"]))
        for spec in args.bench:
            from mlxbun.bench import run_bench
            from mlxbun.kernels import tuning

            name, _, bits = spec.partition("@")
            modes = args.gemv if bits else args.gemv[:1]  # no quantized linear: the GEMV mode is moot
            for mode, comp in [(m, c) for m in modes for c in args.compile]:
                tuning.MODE = mode
                fast_bench.enable_fast = functools.partial(enable_fast, compile_decode=comp == "on")
                res = run_bench(name, quant=int(bits) if bits else None, prompt_len=512, gen_len=128,
                                trials=args.trials, warmup=1, fast=True, record=False, progress=False)
                report.setdefault("bench", []).append({"gemv": mode, "compile": comp, "rows": res.rows()})
                md.append(f"## `run_bench({name!r}, quant={bits or None}, fast=True)`, GEMV mode {mode}, "
                          f"compiled decode {comp}\n\n" + res.to_markdown())
                print(md[-1], flush=True)
                save()
                mx.clear_cache()
    finally:
        save()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
