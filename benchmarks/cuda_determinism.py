"""Is a forward bit-reproducible on this backend? Each engine runs (a) a 512-token prefill and
(b) the bench's pp path (511 tokens, then the last token alone through the cache: a 1-row
matmul) three times on the same ids; compares run to run and across engines (the bench's
`prefill_logits_bit_exact` check).

    python3 benchmarks/cuda_determinism.py random:llama-3-8b 4
"""

import sys

import mlx.core as mx

from mlxbun.bench.engines import load_engines


def _full(eng, ids):
    return eng.forward(ids, eng.make_cache())[:, -1, :]


def _last_alone(eng, ids):
    cache = eng.make_cache()
    eng.forward(ids[:, :-1], cache)
    mx.eval([c.state for c in cache])
    return eng.forward(ids[:, -1:], cache)[:, -1, :]


def _maxdiff(a, b) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


def main(spec: str, quant: str | None) -> None:
    mut = load_engines(spec, dtype="bfloat16", quant=int(quant) if quant else None)
    probe = next(iter(mut.engines.values()))
    vocab = probe.forward(mx.array([[1]]), probe.make_cache()).shape[-1]
    ids = mx.random.randint(16, min(1000, vocab), (1, 512), key=mx.random.key(0))
    for label, fn in (("512-token prefill", _full), ("511 + last token alone", _last_alone)):
        out = {}
        for name, eng in mut.engines.items():
            runs = [fn(eng, ids) for _ in range(3)]
            mx.eval(runs)
            out[name] = runs
            same = [bool(mx.array_equal(runs[0], r)) for r in runs[1:]]
            diff = max(_maxdiff(runs[0], r) for r in runs[1:])
            print(f"{spec} q{quant} [{label}]: {name} run-to-run bit-equal {same}, max |diff| {diff:.3g}")
        a, b = out["mlxbun"][0], out["mlx-lm"][0]
        print(f"{spec} q{quant} [{label}]: mlxbun vs mlx-lm bit-equal {bool(mx.array_equal(a, b))}, "
              f"max |diff| {_maxdiff(a, b):.3g}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else None)
