"""Is a prefill bit-reproducible on this backend? Runs each engine's prefill twice on the same
ids and compares within and across engines (the bench's `prefill_logits_bit_exact` check).

    python3 benchmarks/cuda_determinism.py random:llama-3-8b 4
"""

import sys

import mlx.core as mx

from mlxbun.bench.engines import load_engines


def main(spec: str, quant: str | None) -> None:
    mut = load_engines(spec, dtype="bfloat16", quant=int(quant) if quant else None)
    ids = mx.random.randint(16, 1000, (1, 512), key=mx.random.key(0))
    out = {}
    for name, eng in mut.engines.items():
        runs = []
        for _ in range(3):
            logits = eng.forward(ids, eng.make_cache())
            mx.eval(logits)
            runs.append(logits)
        out[name] = runs
        same = [bool(mx.array_equal(runs[0], r)) for r in runs[1:]]
        diff = max(float(mx.abs(runs[0].astype(mx.float32) - r.astype(mx.float32)).max()) for r in runs[1:])
        print(f"{spec} q{quant}: {name} run-to-run bit-equal {same}, max |diff| {diff:.3g}")
    a, b = out["mlxbun"][0], out["mlx-lm"][0]
    print(f"{spec} q{quant}: mlxbun vs mlx-lm bit-equal {bool(mx.array_equal(a, b))}, "
          f"max |diff| {float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max()):.3g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
