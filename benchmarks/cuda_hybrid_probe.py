"""Is a zoo checkpoint's forward bit-reproducible on this backend, in each engine, and do the two
engines agree? For each `zoo:ARCH@VARIANT` named: mlx-lm and mlxbun each run (a) a prefill of the
prompt and (b) the prompt then DECODE tokens one at a time through the cache, three times on the
same ids; the script prints run-to-run equality per engine and mlxbun vs mlx-lm on the first run.

Written for the hybrid rows' q4 runs on CUDA (benchmarks/gpu-h200-hybrid.md), where `mlxbun port`
failed while float32 / bfloat16 were bit-exact: a cross-engine difference only says something
about mlxbun when each engine reproduces itself.

    python3 benchmarks/cuda_hybrid_probe.py zoo:lfm2@q4 zoo:mamba2@q4 ... [--zoo-cache DIR]

With --modules it localizes instead: every Linear / QuantizedLinear / Conv1d of mlx-lm's own model
three times on one random input (a prompt-length batch and a single row), printing the modules
whose outputs differ run to run; then each engine tapped against a second load of itself
(`first_divergence`): where a run first differs.
"""

import argparse
import json
import sys

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.locate import locate, open_runtime
from mlxbun.parity.localize import first_divergence
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


def _checkpoint_and_ids(name: str, zoo_root):
    path = locate(name, zoo_root=zoo_root)
    config = json.loads((path / "config.json").read_text())
    return path, default_prompt_ids(config.get("vocab_size") or config["text_config"]["vocab_size"])


def probe(name: str, zoo_root) -> list[str]:
    path, ids = _checkpoint_and_ids(name, zoo_root)
    engines = {e: open_runtime(path, e) for e in ("mlx-lm", "mlxbun")}
    ids = mx.array([ids])
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


KINDS = (nn.Linear, nn.QuantizedLinear, nn.Conv1d)


def _input(module, rows: int) -> mx.array:
    w = module.weight
    if isinstance(module, nn.Conv1d):  # weight (out, kernel, in / groups); input (B, L, in)
        width = w.shape[-1] * module.groups if hasattr(module, "groups") else w.shape[-1]
        shape = (1, max(rows, w.shape[1]), width)
    else:
        width = w.shape[-1] * 32 // module.bits if isinstance(module, nn.QuantizedLinear) else w.shape[-1]
        shape = (1, rows, width)
    dtype = module.scales.dtype if isinstance(module, nn.QuantizedLinear) else w.dtype
    return mx.random.normal(shape, key=mx.random.key(rows)).astype(dtype)


def probe_modules(name: str, zoo_root) -> list[str]:
    module = open_runtime(name, "mlx-lm", zoo_root=zoo_root).module
    lines, checked = [], 0
    for path, m in tree_flatten(module.leaf_modules(), is_leaf=lambda x: isinstance(x, nn.Module)):
        if not isinstance(m, KINDS):
            continue
        for rows in (40, 1):
            x = _input(m, rows)
            outs = [m(x) for _ in range(RUNS)]
            mx.eval(outs)
            checked += 1
            if not all(mx.array_equal(outs[0], o) for o in outs[1:]):
                diff = max(float(mx.abs(outs[0].astype(mx.float32) - o.astype(mx.float32)).max()) for o in outs[1:])
                lines.append(f"{name}: {path} ({type(m).__name__} {tuple(m.weight.shape)}, {rows} rows, "
                             f"{x.dtype}): NOT reproducible, max |diff| {diff:.3g}")
    lines.append(f"{name}: {checked} module runs checked, {len(lines)} not reproducible")
    # the whole model against a second load of itself, tapped: where a run first differs
    path, ids = _checkpoint_and_ids(name, zoo_root)
    for engine in ("mlx-lm", "mlxbun"):
        found = first_divergence(open_runtime(path, engine), open_runtime(path, engine), ids[:-4], ids[-4:])
        lines.append(f"{name}: {engine} vs itself, tapped prefill + 4 decode steps: "
                     f"{'bit-equal' if found is None else 'first differs at ' + str(found)}")
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="+")
    ap.add_argument("--zoo-cache", default=None)
    ap.add_argument("--modules", action="store_true", help="probe each module, then each engine tapped against itself")
    args = ap.parse_args(argv)
    print(f"device: {mx.default_device()}", flush=True)
    for name in args.names:
        for line in (probe_modules if args.modules else probe)(name, args.zoo_cache):
            print(line, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
