"""`mlxbun bench`: llama-bench-style pp/tg speed of mlxbun vs mlx-lm on the same weights.

A thin layer over `mlxbun.bench.run_bench`: prints the Markdown table (or `--json` rows) to
stdout, records the rows in the results table, and shows a progress bar on stderr.
"""

from __future__ import annotations

import json
import sys


def register(sub) -> None:
    from mlxbun.bench.engines import DTYPES, QUANT_BITS
    from mlxbun.bench.shapes import SHAPES
    from mlxbun.commands.hub_flags import add_offline
    from mlxbun.names import MODEL_FORMS

    p = sub.add_parser(
        "bench", help="speed of mlxbun vs mlx-lm (pp/tg tokens/s, TTFT, peak memory)",
        description="llama-bench-style tests: pp<N> (prefill N tokens) and tg<M> (decode M tokens), "
                    "mlxbun and mlx-lm alternating in one process over one set of weight arrays.")
    p.add_argument("--model", required=True, metavar="MODEL",
                   help=f"the model ({MODEL_FORMS}); random:SHAPE with SHAPE one of "
                        f"{', '.join(SHAPES)} or a config.json path (random weights, no files)")
    p.add_argument("--dtype", choices=DTYPES, help="zoo variant / random weights dtype "
                   "(default: float32 for zoo, bfloat16 for random)")
    p.add_argument("--quant", type=int, choices=QUANT_BITS, help="affine quantization bits (group 64)")
    p.add_argument("--prompt-len", type=int, default=512, metavar="N", help="pp test length (0: skip; default 512)")
    p.add_argument("--gen-len", type=int, default=128, metavar="M", help="tg test length (0: skip; default 128)")
    p.add_argument("--trials", type=int, default=5, help="timed runs per engine and test (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--vs", choices=("mlx-lm", "none"), default="mlx-lm",
                   help="reference engine run alternately (default mlx-lm; none: mlxbun only)")
    p.add_argument("--seed", type=int, default=0, help="random weights and prompt tokens (default 0)")
    p.add_argument("--prefill-step", type=int, default=2048, metavar="N",
                   help="prefill chunk size, as mlx-lm's prefill_step_size (default 2048)")
    p.add_argument("--tg-context", type=int, default=16, metavar="N",
                   help="untimed prefill before the tg test (default 16)")
    p.add_argument("--measure-bandwidth", action="store_true",
                   help="also measure the device's copy bandwidth (large mx.array pass)")
    p.add_argument("--bandwidth-mb", type=int, metavar="MB",
                   help="array size for --measure-bandwidth (default 1024 on GPU, 256 on CPU)")
    p.add_argument("--scale-down", type=int, metavar="F",
                   help="random: only; shrink the shape F times (smoke tests on small machines)")
    p.add_argument("--fast", action="store_true",
                   help="mlxbun runs its fast path (own GPU kernels, compiled decode; fidelity L2-fast: "
                        "its drift vs the exact path is measured and reported)")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor-parallel ranks: under `mlx.launch -n N --backend ring|nccl` both engines are "
                        "split across the N ranks (default: all of them; 1 opts out); rank 0 prints and records "
                        "the split model's t/s and every rank's peak memory")
    p.add_argument("--results", metavar="PATH", help="results database (default: $MLXBUN_RESULTS or the user cache)")
    p.add_argument("--no-record", action="store_true", help="do not write to the results table")
    p.add_argument("--zoo-cache", metavar="DIR", help="where zoo checkpoints are built (default ~/.cache/mlxbun/zoo)")
    add_offline(p)
    p.add_argument("--json", action="store_true", help="print a JSON list of rows (one per engine x test)")
    p.set_defaults(func=run)


def run(args) -> int:
    from mlxbun.bench import run_bench
    from mlxbun.parallel import is_primary, primary_output, tensor_group

    group = tensor_group(args.tp)
    with primary_output():
        return _report(args, run_bench(
            args.model, dtype=args.dtype, quant=args.quant, prompt_len=args.prompt_len, gen_len=args.gen_len,
            trials=args.trials, warmup=args.warmup, vs=args.vs, seed=args.seed, prefill_step=args.prefill_step,
            tg_context=args.tg_context, measure_bandwidth=args.measure_bandwidth, bandwidth_mb=args.bandwidth_mb,
            scale_down=args.scale_down, zoo_root=args.zoo_cache, results=args.results,
            record=not args.no_record and is_primary(), progress=sys.stderr.isatty(), fast=args.fast,
            tensor_group=group))


def _report(args, result) -> int:
    if args.json:
        print(json.dumps(result.rows(), indent=2))
    else:
        print(result.to_markdown(), end="")
    if result.run_id:
        print(f"recorded run {result.run_id} in {result.results_path}", file=sys.stderr)
    return 0
