"""On the H200: the fast path's KV writes by each policy of `static_cache.write_rows`, in one process.

    python3 benchmarks/gpu_write_ab.py [--context 16384] [--schemes fp16,q8,q4,turboquant3.5]
                                       [--scatter-from 0 8 off] [--rounds 2] [--spec random:llama-3-8b@4]

`--scatter-from MiB ...`: the policies to compare, as the buffer size from which rows go in by scatter
(`0`: every buffer; `off`: none, MLX's dynamic slice update everywhere; the committed default is 8).
For each round and policy: `run_kv_memory` at `--context` on KV_HEAVY through the fast path (decode
tok/s and peak per scheme), and with `--spec`, the fast compiled step of that model at context 512
timed by `gpu_profile.split` (where every buffer is small). The compiled step is traced again for each
policy. Raw 18 of gpu-h200-fast-raw is the first run (scatter into every buffer against none, 16k).
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from gpu_profile import _steps, split  # noqa: E402
from mlxbun.bench.engines import load_engines  # noqa: E402
from mlxbun.bench.kv_memory import kv_heavy_model, run_kv_memory  # noqa: E402
from mlxbun.fast import enable_fast, static_cache  # noqa: E402
from mlxbun.fast.decode import forget_compiled_steps  # noqa: E402

OFF = 1 << 62  # no buffer is this large: the dynamic slice update everywhere


def _policy(text: str) -> int:
    return OFF if text == "off" else int(float(text) * (1 << 20))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--schemes", default="fp16,q8,q4,turboquant3.5")
    ap.add_argument("--scatter-from", nargs="+", default=["0", "off"], metavar="MiB|off")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spec", default="",
                    help="also time this model's fast step at context 512, e.g. random:llama-3-8b@4")
    args = ap.parse_args(argv)
    policies = [(p, _policy(p)) for p in args.scatter_from]
    model = kv_heavy_model()
    fast = enable_fast(model)
    mut = None
    if args.spec:
        name, _, bits = args.spec.partition("@")
        mut = load_engines(name, dtype="bfloat16", quant=int(bits) if bits else None)
    default = static_cache.SCATTER_FROM_BYTES
    print("| round | scatter from MiB | what | decode tok/s or step us (pipelined) | peak MiB |\n"
          "|---|---|---|---:|---:|")
    try:
        for r in range(args.rounds):
            for label, size in policies:
                static_cache.SCATTER_FROM_BYTES = size
                forget_compiled_steps(model)  # trace again with this write
                for row in run_kv_memory(model, (args.context,), args.schemes.split(","), 32, fast=fast):
                    print(f"| {r} | {label} | KV_HEAVY {args.context}: {row.scheme} | {row.decode_tps:.1f} "
                          f"| {row.peak_decode_bytes / 2**20:.0f} |", flush=True)
                if mut is not None:
                    forget_compiled_steps(mut.engines["mlxbun"].module)
                    step = _steps(mut, 512, room=200)["mlxbun fast (compiled)"]
                    us = split(step)["pipelined_us"]
                    print(f"| {r} | {label} | {args.spec} ctx 512: fast step | {us:.0f} | |", flush=True)
                mx.clear_cache()
    finally:
        static_cache.SCATTER_FROM_BYTES = default
    return 0


if __name__ == "__main__":
    sys.exit(main())
