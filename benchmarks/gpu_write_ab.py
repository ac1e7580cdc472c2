"""On the H200: the fast path's KV writes, scatter (`static_cache.write_rows`) against MLX's dynamic
slice update, in one process: `run_kv_memory` at 16k on KV_HEAVY, fast path, per scheme.

    python3 benchmarks/gpu_write_ab.py [--context 16384] [--schemes fp16,q8,turboquant3.5]
"""

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from mlxbun.bench.kv_memory import kv_heavy_model, run_kv_memory  # noqa: E402
from mlxbun.fast import enable_fast, static_cache  # noqa: E402

SCATTER = static_cache.write_rows


def slice_update_rows(buffer, rows, at):
    return mx.slice_update(buffer, rows, at.reshape(1), axes=(2,))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--schemes", default="fp16,q8,turboquant3.5")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    model = kv_heavy_model()
    fast = enable_fast(model)
    print("| round | write | scheme | decode tok/s | peak MiB |\n|---|---|---|---:|---:|")
    for r in range(args.rounds):
        for label, fn in (("scatter", SCATTER), ("dynamic slice_update", slice_update_rows)):
            static_cache.write_rows = fn
            model.__dict__.pop("_mlxbun_compiled_steps", None)  # trace again with this write
            for row in run_kv_memory(model, (args.context,), args.schemes.split(","), 32, fast=fast):
                print(f"| {r} | {label} | {row.scheme} | {row.decode_tps:.1f} | {row.peak_decode_bytes / 2**20:.0f} |",
                      flush=True)
    static_cache.write_rows = SCATTER
    return 0


if __name__ == "__main__":
    sys.exit(main())
