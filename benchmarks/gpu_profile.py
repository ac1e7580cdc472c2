"""On the H200: where a decode step's time goes (issue 16's open limits), without a profiler.

    python3 benchmarks/gpu_profile.py [--out DIR] [--sections split long moe launch] [--smoke]

The device has no Nsight; this script splits each step's wall time instead:

- `build`: Python building the step's graph (for a compiled step: the replay's call);
- `encode`: `mx.async_eval` until it returns (on a GPU stream MLX encodes and launches every
  kernel in the calling thread, so this is MLX's per-op host work);
- `total`: until the outputs are ready (`mx.synchronize`), from the start of the build;
- `pipelined`: per step over a run of steps each queued with `async_eval` before the last is
  waited on (the bench's decode loop): about max(host, GPU) per step when they overlap.

A step whose `total` is close to `build + encode` is bound by host work, not by the GPU;
`total - build - encode` is what the GPU still had to run after the last launch.

Sections:
- `split`: the decode step (context 512) of mlx-lm, mlxbun's exact path and mlxbun's fast path
  (compiled step) on real shapes with random weights.
- `long`: the KV_HEAVY model (`mlxbun.bench.kv_memory`) at 16k: the exact and the fast step,
  the fast step with the decode attention kernel taken out, both at 1k; one layer's attention
  kernel against MLX's fused SDPA over every layer's own buffers (from HBM), for several launch
  shapes; and whether the compiled step's cache writes copy the buffers.
- `moe`: Qwen3-30B-A3B's shape cut to 8 layers (each layer as in the model): the three engines'
  steps, then one token through every layer's MoE block, its experts alone and one expert
  projection (`gather_qmm`) alone, with the expert bytes each reads.
- `launch`: a chain of 64 one-row 4-bit products (4096 x 4096, 16 weights from HBM) through
  `mx.quantized_matmul` and through mlxbun's GEMV kernel, eager and compiled; a chain of 64
  trivial element-wise ops and of 64 trivial `mx.fast.cuda_kernel` copies: the host cost of a
  custom kernel's launch against MLX's own op.

Writes `gpu_profile.md` and `gpu_profile.json` under --out (default $OUT or .). `--smoke` runs
every section on shrunken shapes (a CPU check of the script itself: no kernel runs there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlxbun.bench.engines import load_engines  # noqa: E402
from mlxbun.bench.kv_memory import _prefill, kv_heavy_model  # noqa: E402
from mlxbun.bench.shapes import shape_config  # noqa: E402
from mlxbun.fast import enable_fast  # noqa: E402
from mlxbun.fast import static_cache  # noqa: E402
from mlxbun.fast.decode import forget_compiled_steps  # noqa: E402
from mlxbun.fast.fidelity import fast_decode_step  # noqa: E402
from mlxbun.kernels import cuda_available, sdpa_decode  # noqa: E402
from mlxbun.kernels.common import Gap  # noqa: E402
from mlxbun.kernels.qmv import launch_qmv  # noqa: E402
from mlxbun.models.universal.moe import MoEBlock  # noqa: E402

ROWS: list[dict] = []  # every measurement, for the JSON


def _median(xs):
    return statistics.median(xs) * 1e6


def split(step, n: int = 20, warm: int = 3, pipelined: int = 20) -> dict:
    """build / encode / total / pipelined microseconds of `step()` (returns the arrays to wait on)."""
    for _ in range(warm):
        mx.eval(step())
    mx.synchronize()
    build, encode, total = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        out = step()
        t1 = time.perf_counter()
        mx.async_eval(out)
        t2 = time.perf_counter()
        mx.synchronize()
        t3 = time.perf_counter()
        build.append(t1 - t0)
        encode.append(t2 - t1)
        total.append(t3 - t0)
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(pipelined):
        mx.async_eval(step())
    mx.synchronize()
    piped = (time.perf_counter() - t0) / pipelined
    b, e, t = _median(build), _median(encode), _median(total)
    return {"build_us": b, "encode_us": e, "total_us": t, "gpu_after_us": max(0.0, t - b - e),
            "pipelined_us": piped * 1e6}


def record(section: str, what: str, **fields) -> dict:
    row = {"section": section, "what": what, **fields}
    ROWS.append(row)
    print(json.dumps(row), flush=True)
    return row


def _md(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}"
        return "" if v is None else str(v)
    head = "| " + " | ".join(cols) + " |\n|" + "---|" * len(cols) + "\n"
    return head + "".join("| " + " | ".join(fmt(r.get(c)) for c in cols) + " |\n" for r in rows)


SPLIT_COLS = ["what", "build_us", "encode_us", "total_us", "gpu_after_us", "pipelined_us"]


# ------------------------------------------------------------------ split: whole decode steps


def _steps(mut, context: int, room: int) -> dict:
    """{engine label: step()} over caches holding `context` random tokens."""
    prompt = mx.random.randint(16, mut.vocab_size, (1, context), key=mx.random.key(1))
    tok = prompt[:, -1:]
    steps = {}
    lm = mut.engines["mlx-lm"]
    lm_cache = lm.make_cache()
    lm.forward(prompt, lm_cache)
    mx.eval([c.state for c in lm_cache])
    steps["mlx-lm"] = lambda: lm.forward(tok, lm_cache)[:, -1]
    mb = mut.engines["mlxbun"]
    exact_cache = mb.make_cache()
    mb.forward(prompt, exact_cache)
    mx.eval([c.state for c in exact_cache])
    steps["mlxbun exact"] = lambda: mb.forward(tok, exact_cache)[:, -1]
    fast = enable_fast(mb.module)
    fast_cache = mb.make_cache()
    with fast.on():
        mb.forward(prompt, fast_cache)
    mx.eval([c.state for c in fast_cache])
    fstep = fast_decode_step(fast, fast_cache, room)
    steps["mlxbun fast (compiled)"] = lambda: fstep(tok)
    return steps


def section_split(specs, context: int, smoke: bool) -> str:
    out = ["## split: the decode step, context %d\n" % context]
    for spec in specs:
        name, _, bits = spec.partition("@")
        mut = load_engines(name, dtype="bfloat16", quant=int(bits) if bits else None,
                           scale_down=16 if smoke else None)
        rows = []
        for label, step in _steps(mut, context, room=200).items():
            rows.append(record("split", f"{spec}: {label}", **split(step)))
        out.append(f"### {spec} ({mut.weights_bytes / 2**30:.2f} GiB of weights)\n\n" + _md(rows, SPLIT_COLS))
        del mut, rows
        mx.clear_cache()
    return "\n".join(out)


# ------------------------------------------------------------------ long: KV_HEAVY at 16k


def _long_steps(model, context: int, attention_kernel: bool = True) -> dict:
    prompt = mx.random.randint(16, 512, (1, context), key=mx.random.key(context))
    tok = prompt[:, -1:]
    exact = _prefill(model, prompt, 2048)
    fast_caches = _prefill(model, prompt, 2048)
    fast = enable_fast(model)
    forget_compiled_steps(model)  # this kernel choice must be traced again
    before = static_cache.decode_gap
    if not attention_kernel:
        static_cache.decode_gap = lambda *a, **k: Gap("taken out for profiling")
    try:
        fstep = fast_decode_step(fast, fast_caches, 200)
        fstep(tok)  # the trace, with the kernel choice above
    finally:
        static_cache.decode_gap = before
    return {"exact": lambda: model(tok, cache=exact)[:, -1], "fast": lambda: fstep(tok)}


def _layer_buffers(layers: int, kv: int, cap: int, dim: int, dtype):
    keys = [mx.random.normal((1, kv, cap, dim), key=mx.random.key(2 * i)).astype(dtype) for i in range(layers)]
    values = [mx.random.normal((1, kv, cap, dim), key=mx.random.key(2 * i + 1)).astype(dtype) for i in range(layers)]
    mx.eval(keys, values)
    return keys, values


def section_long(context: int, smoke: bool) -> str:
    layers = 4 if smoke else 28
    model = kv_heavy_model(layers)
    out = [f"## long: KV_HEAVY ({layers} layers, 16 query / 4 KV heads x 128, float16)\n"]
    rows = []
    for ctx, kernel in ((context, True), (context, False), (1024, True)):
        steps = _long_steps(model, ctx, kernel)
        for label, step in steps.items():
            if label == "exact" and not kernel:
                continue
            tag = "" if kernel else ", attention kernel taken out (MLX's masked SDPA)"
            rows.append(record("long", f"ctx {ctx}: {label}{tag}", **split(step, n=10, pipelined=10)))
        del steps
        mx.clear_cache()
    out.append(_md(rows, SPLIT_COLS))

    # one attention per layer over each layer's own buffers (28 x 34 MiB: from HBM)
    kv, heads, dim, dtype = 4, 16, 128, mx.float16
    cap = -(-(context + 34) // 256) * 256
    n = context + 16
    keys, values = _layer_buffers(layers, kv, cap, dim, dtype)
    q = mx.random.normal((1, heads, 1, dim)).astype(dtype)
    length = mx.array([n], dtype=mx.int32)
    scale = dim ** -0.5
    arows = []
    arows.append(record("long", f"MLX SDPA over keys[..., :{n}, :], {layers} layers",
                        **split(lambda: [mx.fast.scaled_dot_product_attention(q, k[..., :n, :], v[..., :n, :],
                                                                            scale=scale)
                                         for k, v in zip(keys, values)])))
    mask = mx.arange(cap)[None] < n
    arows.append(record("long", f"MLX SDPA over the buffer under a bool mask, {layers} layers",
                        **split(lambda: [mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
                                         for k, v in zip(keys, values)])))
    if cuda_available():
        saved = sdpa_decode.TARGET_BLOCKS, sdpa_decode.NWARPS
        try:
            for blocks in (264, 528, 1056, 2112):
                for warps in (4, 8):
                    sdpa_decode.TARGET_BLOCKS, sdpa_decode.NWARPS = blocks, warps
                    chunk, splits = sdpa_decode.decode_split(cap, kv, heads // kv, dim)
                    arows.append(record(
                        "long", f"decode kernel, {layers} layers, target {blocks} blocks, {warps} warps "
                                f"(chunk {chunk}, {splits} splits)",
                        **split(lambda: [sdpa_decode.decode_attention(q, k, v, length, scale)
                                         for k, v in zip(keys, values)])))
        finally:
            sdpa_decode.TARGET_BLOCKS, sdpa_decode.NWARPS = saved
    out.append("\n### one attention per layer, each over its own buffers\n\n" + _md(arows, SPLIT_COLS))

    # does the compiled step's slice_update copy the buffers, or write in place?
    row_k = mx.ones((1, kv, 1, dim), dtype)

    def writes(pos, *bufs):
        return (pos + 1, *[mx.slice_update(b, row_k, pos.reshape(1), axes=(2,)) for b in bufs])

    compiled = mx.compile(writes)
    state = [mx.array(n, dtype=mx.int32), *keys, *values]
    wrows = []
    for label, fn in (("eager", writes), ("compiled", compiled)):
        def step(fn=fn):
            nonlocal state
            state = list(fn(state[0], *state[1:]))
            return state
        wrows.append(record("long", f"{2 * layers} one-row writes ({label})", **split(step, n=10, pipelined=10)))
    out.append("\n### the cache writes alone (one row into each of 2 x layers buffers)\n\n" + _md(wrows, SPLIT_COLS))
    mx.clear_cache()
    return "\n".join(out)


# ------------------------------------------------------------------ writes: one row into a KV buffer


def _write_variants(cap: int, count: int, dtype=mx.float16):
    """{label: step()} writing one row into each of `count` fresh [1, 4, cap, 128] buffers per step,
    each variant over its own buffers (no other reference to them: donation is possible)."""
    row = mx.ones((1, 4, 1, 128), dtype)
    variants = {}

    def fresh():
        bufs = [mx.zeros((1, 4, cap, 128), dtype) + i for i in range(count)]
        mx.eval(bufs)
        return bufs

    def make(kind):
        state = {"bufs": fresh(), "pos": mx.array(cap // 2, dtype=mx.int32), "p": cap // 2}

        def write(b):
            if kind == "dynamic":  # DynamicSliceUpdate: the position an array (what the compiled step does)
                return mx.slice_update(b, row, state["pos"].reshape(1), axes=(2,))
            if kind == "static":  # SliceUpdate: the position a Python int (the exact caches' write)
                p = state["p"]
                b[:, :, p:p + 1, :] = row
                return b
            idx = mx.broadcast_to(state["pos"].reshape(1, 1, 1, 1), row.shape)  # Scatter
            return mx.put_along_axis(b, idx, row, axis=2)

        def step():
            state["bufs"] = [write(b) for b in state["bufs"]]
            return state["bufs"]
        return step

    for kind in ("dynamic", "static", "scatter"):
        variants[f"{count} x {kind}, capacity {cap}"] = make(kind)
    compiled = mx.compile(lambda pos, *bufs: [mx.slice_update(b, row, pos.reshape(1), axes=(2,)) for b in bufs])
    state = {"bufs": fresh(), "pos": mx.array(cap // 2, dtype=mx.int32)}

    def compiled_step():
        state["bufs"] = compiled(state["pos"], *state["bufs"])
        return state["bufs"]
    variants[f"{count} x dynamic (compiled), capacity {cap}"] = compiled_step
    return variants


def section_writes(smoke: bool) -> str:
    rows = []
    count = 4 if smoke else 56
    for cap in ((256, 1024) if smoke else (1024, 16640)):
        for label, step in _write_variants(cap, count).items():
            mx.reset_peak_memory()
            row = record("writes", label, **split(step, n=10, pipelined=10))
            row["peak_MiB"] = mx.get_peak_memory() / 2**20
            row["buffers_MiB"] = count * 4 * cap * 128 * 2 / 2**20
            rows.append(row)
            mx.clear_cache()
    return ("## writes: one row into each KV buffer, by the op that writes it\n\n"
            + _md(rows, SPLIT_COLS + ["peak_MiB", "buffers_MiB"]))


# ------------------------------------------------------------------ moe: Qwen3-30B-A3B, 8 layers


def _expert_bytes(switch) -> int:
    """Bytes of one expert in each of the block's three projections (weight, scales, biases)."""
    total = 0
    for _, arr in _arrays(switch):
        total += arr.nbytes // arr.shape[0]
    return total


def _arrays(module):
    return [(k, v) for k, v in tree_flatten(module.parameters()) if isinstance(v, mx.array) and v.ndim == 3]


def section_moe(layers: int, context: int, smoke: bool) -> str:
    cfg = shape_config("qwen3-30b-a3b")
    cfg.update(num_hidden_layers=layers, max_window_layers=layers)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.json"
        path.write_text(json.dumps(cfg))
        mut = load_engines(f"random:{path}", dtype="bfloat16", quant=4, scale_down=4 if smoke else None)
    out = [f"## moe: Qwen3-30B-A3B's layer shape, {layers} layers, 4-bit g64, context {context}\n"]
    rows = [record("moe", f"{label}", **split(step)) for label, step in _steps(mut, context, 200).items()]
    out.append(_md(rows, SPLIT_COLS))

    blocks = [m for _, m in mut.engines["mlxbun"].module.named_modules() if isinstance(m, MoEBlock)]
    hidden = mut.config["hidden_size"]
    x = (mx.random.normal((1, 1, hidden)) * 0.5).astype(mx.bfloat16)
    routes = [b.route(x) for b in blocks]
    mx.eval([r.experts for r in routes])
    top_k = routes[0].experts.shape[-1]
    switches = [b.fused_experts() for b in blocks]
    per_expert = _expert_bytes(switches[0])
    up = switches[0]._names[1]  # (gate, up, down)
    xe = mx.expand_dims(x, (-2, -3))
    brows = [
        record("moe", f"MoE block (route, experts, combine), {len(blocks)} layers", **split(
            lambda: [b(x) for b in blocks])),
        record("moe", f"experts alone (SwitchGLU: 3 gather_qmm + SwiGLU), {len(blocks)} layers", **split(
            lambda: [s(x, r.experts) for s, r in zip(switches, routes)])),
        record("moe", f"one projection alone (gather_qmm, {up}), {len(blocks)} layers", **split(
            lambda: [s[up](xe, r.experts) for s, r in zip(switches, routes)])),
    ]
    for r in brows[1:]:
        share = 1 if "one projection" in r["what"] else 3
        nbytes = len(blocks) * top_k * per_expert * share / 3
        r["expert_MiB"] = nbytes / 2**20
        r["GB_s"] = nbytes / (r["total_us"] * 1e-6) / 1e9
    out.append(f"\n### the MoE blocks alone (one token, top-{top_k}; one expert's three projections: "
               f"{per_expert / 2**20:.2f} MiB)\n\n" + _md(brows, SPLIT_COLS + ["expert_MiB", "GB_s"]))
    mx.clear_cache()
    return "\n".join(out)


# ------------------------------------------------------------------ launch: custom kernel launches

_COPY = """
  unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) {
    out[i] = x[i];
  }
"""


def section_launch(smoke: bool) -> str:
    n = k = 512 if smoke else 4096
    chain, distinct = 64, 16
    weights = []
    for i in range(distinct):
        w = mx.random.normal((n, k), key=mx.random.key(100 + i)).astype(mx.bfloat16) * 0.02
        weights.append(mx.quantize(w, group_size=64, bits=4))
    mx.eval(weights)
    x0 = mx.random.normal((1, k)).astype(mx.bfloat16)
    mx.eval(x0)

    def mlx_chain(x):
        for i in range(chain):
            w, s, b = weights[i % distinct]
            x = mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4)
        return x

    def kernel_chain(x):
        for i in range(chain):
            w, s, b = weights[i % distinct]
            x = launch_qmv(x, w, s, b, 64, 4)
        return x

    def ew_chain(x):
        for _ in range(chain):
            x = x * 1.0
        return x

    copy = mx.fast.cuda_kernel(name="mlxbun_profile_copy", input_names=["x"], output_names=["out"],
                               source=_COPY) if cuda_available() else None

    def copy_chain(x):
        for _ in range(chain):
            x = copy(inputs=[x], template=[("N", x.size)], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
                     output_shapes=[x.shape], output_dtypes=[x.dtype])[0]
        return x

    cases = [("mx.quantized_matmul", mlx_chain), ("element-wise x * 1.0", ew_chain)]
    if cuda_available():
        cases += [("mlxbun GEMV kernel", kernel_chain), ("trivial cuda_kernel copy", copy_chain)]
    rows = []
    for label, fn in cases:
        compiled = mx.compile(fn)
        rows.append(record("launch", f"{chain} x {label} (eager)", **split(lambda fn=fn: fn(x0))))
        rows.append(record("launch", f"{chain} x {label} (compiled)", **split(lambda c=compiled: c(x0))))
    for r in rows:
        r["us_per_op"] = r["total_us"] / chain
        r["host_us_per_op"] = (r["build_us"] + r["encode_us"]) / chain
    return (f"## launch: chains of {chain} ops (one-row {n} x {k} 4-bit products over {distinct} weights; "
            "trivial ops)\n\n" + _md(rows, SPLIT_COLS + ["us_per_op", "host_us_per_op"]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--sections", nargs="*", default=["launch", "split", "long", "moe"],
                    choices=("launch", "split", "long", "moe", "writes"))
    ap.add_argument("--specs", nargs="*", default=["random:llama-3.2-1b", "random:llama-3.2-1b@4",
                                                    "random:llama-3-8b@4"])
    ap.add_argument("--context", type=int, default=16384, help="the long section's context")
    ap.add_argument("--moe-layers", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="shrunken shapes (a CPU check of the script)")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = [f"# gpu_profile ({mx.default_device()}, mlx {mx.__version__}, cuda {cuda_available()})\n",
             "Columns: microseconds, medians (see the script's docstring).\n"]
    failed = False
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            parts.append(_section(name, args))
        except Exception as e:  # one section's failure must not lose the others' tables
            parts.append(f"## {name}: failed ({type(e).__name__}: {e})\n")
            failed = True
        parts.append(f"\n({name}: {time.perf_counter() - t0:.0f} s)\n")
        (out_dir / "gpu_profile.md").write_text("\n".join(parts))
        (out_dir / "gpu_profile.json").write_text(json.dumps(ROWS, indent=1))
    print("\n".join(parts))
    return 1 if failed else 0


def _section(name: str, args) -> str:
    if name == "split":
        return section_split(args.specs, 512 if not args.smoke else 64, args.smoke)
    if name == "long":
        return section_long(args.context if not args.smoke else 600, args.smoke)
    if name == "moe":
        return section_moe(args.moe_layers, 512 if not args.smoke else 64, args.smoke)
    if name == "writes":
        return section_writes(args.smoke)
    return section_launch(args.smoke)


if __name__ == "__main__":
    sys.exit(main())
