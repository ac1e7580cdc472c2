"""Which of a checkpoint's modules are not bit-reproducible on this backend? Runs every Linear /
QuantizedLinear / Conv1d of mlx-lm's own model for a zoo checkpoint three times on the same
random input (a prompt-length batch and a single row) and prints the modules whose outputs differ
run to run. Written to localize the hybrid rows' CUDA run-to-run differences
(benchmarks/gpu-h200-hybrid.md): if mlx-lm's own modules do not reproduce themselves, no engine
can be held bit-exact to them there.

    python3 benchmarks/cuda_module_probe.py zoo:mamba2@q8 zoo:mamba2 ... [--zoo-cache DIR]
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


def probe(name: str, zoo_root) -> list[str]:
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
    path = locate(name, zoo_root=zoo_root)
    config = json.loads((path / "config.json").read_text())
    ids = default_prompt_ids(config.get("vocab_size") or config["text_config"]["vocab_size"])
    for engine in ("mlx-lm", "mlxbun"):
        found = first_divergence(open_runtime(path, engine), open_runtime(path, engine), ids[:-4], ids[-4:])
        lines.append(f"{name}: {engine} vs itself, tapped prefill + 4 decode steps: "
                     f"{'bit-equal' if found is None else 'first differs at ' + str(found)}")
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
