"""Is a zoo checkpoint's forward bit-reproducible on this backend, in each engine, and do the two
engines agree? For each `zoo:ARCH@VARIANT` named: mlx-lm and mlxbun each run (a) a prefill of the
prompt and (b) the prompt then DECODE tokens one at a time through the cache, three times on the
same ids; the script prints run-to-run equality per engine and mlxbun vs mlx-lm on the first run.

Written for the hybrid rows' q4 runs on CUDA (benchmarks/gpu-h200-hybrid.md), where `mlxbun port`
failed while float32 / bfloat16 were bit-exact: a cross-engine difference only says something
about mlxbun when each engine reproduces itself.

    python3 benchmarks/cuda_hybrid_probe.py zoo:lfm2@q4 zoo:mamba2@q4 ... [--zoo-cache DIR]
"""

import argparse
import json
import sys

import mlx.core as mx

from mlxbun.locate import locate, open_runtime
from mlxbun.parity.oracle import default_prompt_ids

RUNS = 3
DECODE = 4


def _prefill(model, ids):
    return model(ids, cache=model.make_cache())


def _decode(model, ids):
    """The prompt, then each of the last DECODE ids alone through the cache: logits per step."""
    cache = model.make_cache()
    split = ids.shape[1] - DECODE
    steps = [model(ids[:, :split], cache=cache)[:, -1, :]]
    for i in range(split, ids.shape[1]):
        steps.append(model(ids[:, i:i + 1], cache=cache)[:, -1, :])
        mx.eval(steps[-1])
    return mx.stack(steps, axis=1)


def _maxdiff(a, b) -> float:
    return float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())


def _line(name: str, label: str, what: str, runs: list) -> str:
    same = [bool(mx.array_equal(runs[0], r)) for r in runs[1:]]
    diff = max(_maxdiff(runs[0], r) for r in runs[1:])
    return f"{name} [{label}] {what}: run-to-run bit-equal {same}, max |diff| {diff:.3g}"


def probe(name: str, zoo_root) -> list[str]:
    path = locate(name, zoo_root=zoo_root)
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("vocab_size") or config["text_config"]["vocab_size"]
    engines = {e: open_runtime(path, e) for e in ("mlx-lm", "mlxbun")}
    ids = mx.array([default_prompt_ids(vocab)])
    lines = []
    for label, fn in (("prefill", _prefill), (f"prefill + {DECODE} decode steps", _decode)):
        first = {}
        for engine, model in engines.items():
            runs = [fn(model, ids) for _ in range(RUNS)]
            mx.eval(runs)
            first[engine] = runs[0]
            lines.append(_line(name, label, engine, runs))
        a, b = first["mlxbun"], first["mlx-lm"]
        lines.append(f"{name} [{label}] mlxbun vs mlx-lm: bit-equal {bool(mx.array_equal(a, b))}, "
                     f"max |diff| {_maxdiff(a, b):.3g}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--zoo-cache", default=None)
    args = ap.parse_args(argv)
    print(f"device: {mx.default_device()}", flush=True)
    for name in args.names:
        for line in probe(name, args.zoo_cache):
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
