"""On the H200: the fused decode kernels (issue 28), checked against their MLX-op reference and timed.

    python3 benchmarks/gpu_fused.py [--out DIR] [--sections check bench profile torch] [--specs ...]
        [--knobs LABEL:NAME=VALUE,... ...] [--smoke]

`--knobs` adds fused variants to `check`, `bench` and `profile`: `fused_decode`'s module knobs (RW, QKV_RW,
NW, MAX_SPLIT, TARGET_WARPS, CODES, QUNROLL, NORM_VEC, MMA, MMA_KINDS, MMA_EARLY, ROPE_ATTENTION,
ROPE_ATTENTION_MAX_SPLITS) and the decode attention's (ATTN_MIN_CHUNK: the smallest split of positions; ATTN_TARGET_BLOCKS; ATTN_PREFETCH; ATTN_NWARPS) set for
that variant only.

Sections:
- `check`: each fused kernel (qkv_rope with and without q/k norm and biases, traditional RoPE;
  gemv with norm / residual; gemv_swiglu) on a real shape's random weights, bf16 / fp16 and
  16-bit / 4-bit / 8-bit weights: the CUDA kernel against `ReferenceFusedOps` (max |diff|, in units
  of the reference's max |value|), twice (bit-equal run to run), and the in-place K/V write against
  the reference's scatter (the buffers bit-equal); for 4 / 8-bit weights, each GEMV's CODES 1 (subnormal
  floats) against CODES 0 (the 2^23 offset), bit for bit.
- `bench`: per model (random weights, real shapes, context 512): mlx-lm's decode step, mlxbun's
  compiled step (fused off), the fused step with the K/V rows written in place and by a scatter;
  each split into host build / encode / GPU-after / pipelined microseconds (gpu_profile's `split`),
  tokens/s from the pipelined time, kernels per step counted from the step's graph
  (`fast.kernel_count`), and the fused step's drift against the exact path (KLD, top-1).
- `profile`: where the fused step's GPU time goes, from CUPTI through torch.profiler (the device has
  no Nsight; CUPTI records every kernel the process launches, MLX's too): each of layer 0's fused
  ops launched alone (median kernel time, the bytes it reads, GB/s), and a run of pipelined steps
  (GPU busy time per step, the idle time between kernels, the kernels by name).
- `torch`: the PyTorch anchor: transformers' Llama (random weights, the same shape, bf16) decoding
  through its own `generate(cache_implementation="static")`, which compiles the forward with
  torch.compile(mode="reduce-overhead"); per step: a 192-token generation less a 64-token one.

Writes `gpu_fused.md` and `gpu_fused.json` under --out (default $OUT or .). `--smoke` shrinks the
shapes (a CPU check of the script: the reference executor stands in for the kernels there).
`--emulate` (with `--sections check` only) runs the CUDA kernels themselves on this CPU
(`mlxbun.kernels.emulator`: g++, each block's threads as fibers; the C library's exp2f / rsqrtf, so
the bits are the emulator's, not the device's): every check row but run-to-run determinism means
what it means on the device. `--smoke --emulate` takes several minutes on one core.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from unittest.mock import patch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402

from gpu_profile import ROWS, _md, record, split  # noqa: E402
from mlxbun.bench.engines import load_engines  # noqa: E402
from mlxbun.fast import enable_fast  # noqa: E402
from mlxbun.fast.decoders import fused_plan_of  # noqa: E402
from mlxbun.fast.fidelity import decode_fidelity, fast_decode_step  # noqa: E402
from mlxbun.fast.fused_decoder import FusedDecoder, forget_fused_steps  # noqa: E402
from mlxbun.fast.kernel_count import step_kernels  # noqa: E402
from mlxbun.kernels import cuda_available  # noqa: E402
from mlxbun.kernels import fused_decode, sdpa_decode  # noqa: E402
from mlxbun.kernels.emulator import emulating, emulator_gap  # noqa: E402
from mlxbun.kernels.fused_decode import CudaFusedOps, ReferenceFusedOps  # noqa: E402

# A kernel passes where its output is within CHECK_BOUND of the reference's (in units of the
# reference's max |value|: a bfloat16 rounding is 2^-8 relative, a residual sum can add one more,
# and both sides sum in float32 in different orders), bit-equal run to run, and (qkv_rope) its
# in-place write equals the reference's scatter bit for bit.
CHECK_BOUND = 2.0 ** -6
SPECS = ["llama-3.2-1b", "llama-3.2-1b@4", "llama-3-8b@4", "llama-3-8b", "qwen3-4b@4"]


EMULATE = False  # --emulate: the check's CUDA kernels run on this CPU (mlxbun.kernels.emulator)


def _ops(inplace: bool):
    return CudaFusedOps(inplace=inplace) if cuda_available() or EMULATE else ReferenceFusedOps()


def _diff(got: mx.array, ref: mx.array) -> float:
    ref32 = ref.astype(mx.float32)
    scale = max(mx.abs(ref32).max().item(), 1e-30)
    return mx.abs(got.astype(mx.float32) - ref32).max().item() / scale


def _check_layer(label: str, plan, dtype) -> list[dict]:
    rows = []
    layer = plan.layers[0]
    cuda, ref = _ops(True), ReferenceFusedOps()
    hidden = plan.hidden
    x = (mx.random.normal((hidden,), key=mx.random.key(3))).astype(dtype)
    res = (mx.random.normal((hidden,), key=mx.random.key(4))).astype(dtype)
    cases = {
        "gemv o_proj+residual": lambda ops: ops.gemv(
            (mx.random.normal((layer.o.width,), key=mx.random.key(5))).astype(dtype), layer.o, residual=res),
        "gemv norm+head": lambda ops: ops.gemv(x, plan.head, norm=plan.final_norm),
        "gemv_swiglu": lambda ops: ops.gemv_swiglu(x, layer.mlp_norm, layer.gate, layer.up),
        "gemv down+residual": lambda ops: ops.gemv(
            (mx.random.normal((layer.down.width,), key=mx.random.key(6)) * 0.1).astype(dtype), layer.down,
            residual=res),
    }
    for name, run in cases.items():
        a, b, r = run(cuda), run(cuda), run(ref)
        mx.eval(a, b, r)
        rows.append(record("check", f"{label}: {name}", rel_max_diff=_diff(a, r),
                           deterministic=bool(mx.array_equal(a, b))))
    if layer.o.bits != 16 and isinstance(cuda, CudaFusedOps):  # the two code conversions: the same bits
        cases["qkv sums"] = lambda ops: ops.qkv_sums(x, layer.attn_norm, (layer.q, layer.k, layer.v))
        for name, run in cases.items():
            by_codes = []
            for codes in (0, 1):
                with patch.object(fused_decode, "CODES", codes):
                    by_codes.append(run(cuda))
                    mx.eval(by_codes[-1])
            rows.append(record("check", f"{label}: {name}, CODES 1 against 0", rel_max_diff=_diff(*by_codes),
                               deterministic=True, equal_codes_0=bool(mx.array_equal(*by_codes))))
    a = layer.attn
    cap = 256
    for variant, attn in (("plain", a), ("traditional rope", _replace(a, traditional=True)),
                          ("q/k norm", _replace(a, q_norm=mx.ones((a.head_dim,), dtype) * 1.5,
                                                k_norm=mx.ones((a.head_dim,), dtype) * 0.5, qk_eps=1e-6)),
                          ("biases", _replace(a, bias=tuple(
                              (mx.random.normal((w.rows,), key=mx.random.key(9 + i)) * 0.1).astype(dtype)
                              for i, w in enumerate((layer.q, layer.k, layer.v)))))):
        buffer = (mx.random.normal((2, a.hkv, cap, a.head_dim), key=mx.random.key(7)) * 0.3).astype(dtype)
        mx.eval(buffer)
        pos = mx.array([37], mx.int32)
        ref_out = ref.qkv_rope(x, layer.attn_norm, (layer.q, layer.k, layer.v), attn.at(buffer, pos))
        mx.eval(ref_out)
        outs = []
        for _ in range(2):
            mine = buffer + 0  # a buffer of its own (the kernel writes into it)
            mx.eval(mine)
            got = cuda.qkv_rope(x, layer.attn_norm, (layer.q, layer.k, layer.v), attn.at(mine, pos))
            mx.eval(got)
            outs.append(got)
        (q1, buf1, np1, kv1), (q2, buf2, _, kv2) = outs
        rows.append(record("check", f"{label}: qkv_rope {variant}", rel_max_diff=_diff(q1, ref_out[0]),
                           kv_rel_max_diff=_diff(kv1, ref_out[3]), deterministic=bool(
                               mx.array_equal(q1, q2) and mx.array_equal(kv1, kv2)),
                           inplace_buffer_equal_scatter=bool(mx.array_equal(
                               buf1, _scatter(buffer, kv1, pos, attn))),
                           next_pos=int(np1.item())))
        rows += _check_rope_attention(f"{label}: rope_attention {variant}", cuda, ref, x, layer, attn, buffer)
        q = ref_out[0]
        length = mx.array([cap - 3], mx.int32)
        o1, o2, orf = (cuda.attention(q, buffer, length, attn.at(buffer, pos)),
                       cuda.attention(q, buffer, length, attn.at(buffer, pos)),
                       ref.attention(q, buffer, length, attn.at(buffer, pos)))
        mx.eval(o1, o2, orf)
        if variant == "plain":
            rows.append(record("check", f"{label}: attention", rel_max_diff=_diff(o1, orf),
                               deterministic=bool(mx.array_equal(o1, o2))))
    return rows


def _check_rope_attention(label: str, cuda, ref, x, layer, attn, buffer) -> list[dict]:
    """The one-launch rope_attention against the three launches it replaces (their output, buffer and
    next_pos bit for bit), against the reference, and run to run; at a position in the first split
    and one in the last of several (the merge of splits by the last block)."""
    rows, proj = [], (layer.q, layer.k, layer.v)
    for p in (37, buffer.shape[2] - 56):
        pos = mx.array([p], mx.int32)
        got = []
        for one_launch in (False, True, True):
            mine = buffer + 0
            mx.eval(mine)
            with patch.object(fused_decode, "ROPE_ATTENTION", one_launch):
                out = cuda.qkv_attention(x, layer.attn_norm, proj, attn.at(mine, pos))
                mx.eval(out)
            got.append(out)
        (oc, bc, nc), (o1, b1, n1), (o2, b2, _) = got
        orf = ref.qkv_attention(x, layer.attn_norm, proj, attn.at(buffer, pos))[0]
        mx.eval(orf)
        rows.append(record("check", f"{label} pos {p}", rel_max_diff=_diff(o1, orf), kv_rel_max_diff=_diff(b1, bc),
                           deterministic=bool(mx.array_equal(o1, o2) and mx.array_equal(b1, b2)),
                           equal_three_launches=bool(mx.array_equal(o1, oc) and mx.array_equal(b1, bc)
                                                     and mx.array_equal(n1, nc)),
                           next_pos=int(n1.item())))
    return rows


def _replace(attn, **kw):
    from dataclasses import replace
    return replace(attn, **kw)


def _scatter(buffer, kv_new, pos, attn):
    from mlxbun.kernels.fused_decode import _write
    return _write(buffer, kv_new, pos, attn)


CHECK_COLS = ["what", "rel_max_diff", "kv_rel_max_diff", "deterministic", "inplace_buffer_equal_scatter",
              "equal_three_launches", "equal_codes_0", "next_pos", "passed"]


def check_rows(smoke: bool = False, knobs=()) -> list[tuple[str, list[dict]]]:
    """(model label, rows) per checked model and knob variant (the defaults, then each of `knobs`):
    every fused kernel against its reference, each row's `passed` set (also `benchmarks/gpu_check.py
    --checks fused`)."""
    out = []
    for spec, dtype in (("llama-3.2-1b", "bfloat16"), ("llama-3.2-1b@4", "bfloat16"), ("llama-3.2-1b@8", "float16"),
                        ("qwen3-0.6b@4", "bfloat16")):
        name, _, bits = spec.partition("@")
        mut = load_engines(f"random:{name}", dtype=dtype, quant=int(bits) if bits else None, engines=("mlxbun",),
                           scale_down=16 if smoke else None)
        model = mut.engines["mlxbun"].module
        fast = enable_fast(model)
        plan = fused_plan_of(fast)
        for variant, variant_knobs in [("", {})] + list(knobs):
            label = f"{spec} {dtype}" + (f" ({variant})" if variant else "")
            with _knobs(model, variant_knobs):
                rows = _check_layer(label, plan, plan.dtype)
            for r in rows:
                r["passed"] = (r["rel_max_diff"] <= CHECK_BOUND and r.get("kv_rel_max_diff", 0.0) <= CHECK_BOUND
                               and r["deterministic"] and r.get("inplace_buffer_equal_scatter", True)
                               and r.get("equal_three_launches", True) and r.get("equal_codes_0", True))
            out.append((label, rows))
        del mut, fast, plan, model
        mx.clear_cache()
    return out


def section_check(smoke: bool, knobs=()) -> str:
    out = [f"## check: each fused kernel against its MLX-op reference (bound {CHECK_BOUND:g})\n"]
    verdicts = []
    for label, rows in check_rows(smoke, knobs):
        verdicts.extend(r["passed"] for r in rows)
        out.append(f"### {label}\n\n" + _md(rows, CHECK_COLS))
    out.insert(1, f"**{'every check passed' if all(verdicts) else 'SOME CHECKS FAILED'}** "
                  f"({sum(verdicts)} of {len(verdicts)})\n")
    record("check", "verdict", passed=all(verdicts), count=len(verdicts))
    return "\n".join(out)


SPLIT_COLS = ["what", "tok_s", "build_us", "encode_us", "gpu_after_us", "pipelined_us", "kernels", "per_layer"]


def _count(step_outputs, layers: int) -> dict:
    k = step_kernels(*step_outputs)
    return {"kernels": k.total, "per_layer": round(k.total / layers, 2), "views": k.views,
            "by_primitive": dict(k.kernels.most_common(12))}


def parse_knobs(items) -> list[tuple[str, dict]]:
    """`LABEL:NAME=VALUE,NAME=VALUE` items as (label, {NAME: int}), each NAME one of fused_decode's knobs."""
    out = []
    for item in items or []:
        label, _, rest = item.partition(":")
        knobs = {}
        for pair in filter(None, rest.split(",")):
            name, _, value = pair.partition("=")
            if name not in KNOBS or not value.lstrip("-").isdigit():
                raise SystemExit(f"--knobs {item!r}: {pair!r} is not NAME=INT with NAME one of {', '.join(KNOBS)}")
            knobs[name] = int(value)
        if not label or not knobs:
            raise SystemExit(f"--knobs {item!r}: expected LABEL:NAME=VALUE[,NAME=VALUE...]")
        out.append((label, knobs))
    return out


KNOBS = ("RW", "QKV_RW", "NW", "MAX_SPLIT", "TARGET_WARPS", "CODES", "QUNROLL", "NORM_VEC", "MMA", "MMA_KINDS",
         "MMA_EARLY", "ROPE_ATTENTION", "ROPE_ATTENTION_MAX_SPLITS", "ATTN_MIN_CHUNK", "ATTN_TARGET_BLOCKS",
         "ATTN_PREFETCH", "ATTN_NWARPS")
# The decode attention's knobs (sdpa_decode's module-level launch knobs), by --knobs name
_ATTN = {"ATTN_MIN_CHUNK": "CHUNKS", "ATTN_TARGET_BLOCKS": "TARGET_BLOCKS", "ATTN_PREFETCH": "PREFETCH",
         "ATTN_NWARPS": "NWARPS"}
ATTN_CHUNKS = (16, 32, 64, 128, 256, 512)


def _module_value(name: str, value: int):
    """(module, attribute, value) that --knobs NAME=value sets."""
    if name == "ATTN_MIN_CHUNK":
        return sdpa_decode, "CHUNKS", tuple(c for c in ATTN_CHUNKS if c >= value)
    if name in _ATTN:
        return sdpa_decode, _ATTN[name], value
    return fused_decode, name, value


class _knobs:
    """--knobs settings for a `with` block (and the compiled fused steps forgotten)."""

    def __init__(self, model, knobs: dict):
        self.model, self.knobs = model, knobs

    def __enter__(self):
        self.saved = []
        for name, value in self.knobs.items():
            module, attr, v = _module_value(name, value)
            self.saved.append((module, attr, getattr(module, attr)))
            setattr(module, attr, v)
        forget_fused_steps(self.model)

    def __exit__(self, *exc):
        for module, attr, v in reversed(self.saved):
            setattr(module, attr, v)
        forget_fused_steps(self.model)


def _engines(spec: str, smoke: bool):
    """mlx-lm and mlxbun on `spec`: a shape of `bench.shapes` with random weights (`NAME[@BITS]`,
    bfloat16), or a checkpoint directory (`dir:PATH`: its own weights and dtype, e.g. a real model's
    GGUF import)."""
    if spec.startswith("dir:"):
        return load_engines(spec[4:])
    name, _, bits = spec.partition("@")
    return load_engines(f"random:{name}", dtype="bfloat16", quant=int(bits) if bits else None,
                        scale_down=16 if smoke else None)


def section_bench(specs, context: int, smoke: bool, no_split: bool = True, scatter: bool = False,
                  knobs=()) -> str:
    out = [f"## bench: decode steps, context {context}\n"]
    for spec in specs:
        mut = _engines(spec, smoke)
        prompt = mx.random.randint(16, mut.vocab_size, (1, context), key=mx.random.key(1))
        tok = prompt[:, -1:]
        lm, mb = mut.engines["mlx-lm"], mut.engines["mlxbun"]
        model = mb.module
        layers = len(model.layers)
        fast = enable_fast(model)
        rows = []

        lm_cache = lm.make_cache()
        lm.forward(prompt, lm_cache)
        mx.eval([c.state for c in lm_cache])
        rows.append(record("bench", f"{spec}: mlx-lm", **split(lambda: lm.forward(tok, lm_cache)[:, -1])))

        fast.fused = False
        cache = mb.make_cache()
        with fast.on():
            mb.forward(prompt, cache)
        mx.eval([c.state for c in cache])
        step = fast_decode_step(fast, cache, 400)
        row = split(lambda: step(tok))
        rows.append(record("bench", f"{spec}: mlxbun compiled step", **row))
        del step, cache

        fast.fused = True
        plan = fused_plan_of(fast)
        variants = [("in place", True, {})]
        if no_split:
            variants.append(("in place, no split-K", True, {"MAX_SPLIT": 1}))
        if scatter:
            variants.append(("scatter", False, {}))
        variants += [(label, True, k) for label, k in knobs]
        for label, inplace, variant_knobs in variants:
            with _knobs(model, variant_knobs):
                cache = mb.make_cache()
                mb.forward(prompt, cache)
                mx.eval([c.state for c in cache])
                dec = FusedDecoder(model, plan, cache, 400, _ops(inplace))
                counted = _count(dec.pending(tok), layers)
                rows.append(record("bench", f"{spec}: fused ({label})", **split(lambda: dec(tok)), **counted))
                del dec, cache
        for r in rows:
            r["tok_s"] = 1e6 / r["pipelined_us"]
        base = rows[0]["tok_s"]
        for r in rows:
            r["vs_mlx_lm"] = r["tok_s"] / base
        ctx = mx.random.randint(16, mut.vocab_size, (64,), key=mx.random.key(2)).tolist()
        toks = mx.random.randint(16, mut.vocab_size, (32,), key=mx.random.key(3)).tolist()
        fast.fused = True
        fast.fused_ops = None if cuda_available() else ReferenceFusedOps()
        stats = decode_fidelity(fast, ctx, toks)
        rows.append(record("bench", f"{spec}: fused drift vs exact", kld_mean=stats.kld_mean, kld_max=stats.kld_max,
                           top1=stats.same_top_p, max_abs_diff=stats.max_abs_diff, notes=list(fast.notes)))
        out.append(f"### {spec} ({mut.weights_bytes / 2**30:.2f} GiB of weights, {layers} layers)\n\n"
                   + _md(rows[:-1], SPLIT_COLS + ["vs_mlx_lm"])
                   + _md(rows[-1:], ["what", "kld_mean", "kld_max", "top1", "max_abs_diff"]))
        del mut, rows, fast, model, lm, mb
        mx.clear_cache()
    return "\n".join(out)


def _kernels_of(run, times: int) -> list[dict]:
    """The kernels (name, ts, dur in us) CUPTI saw while `run()` ran `times` times."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.init()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            run()
        mx.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return [e for e in events if e.get("cat") == "kernel"]


def _weights_bytes(*ws) -> int:
    return sum(w.w.nbytes + (0 if w.bits == 16 else w.scales.nbytes + w.biases.nbytes) for w in ws)


def _median_kernel_us(kernels: list[dict]) -> dict:
    """Per launch of one op (its kernels grouped by name): the median time of each, and their sum."""
    by = {}
    for k in kernels:
        by.setdefault(k["name"], []).append(float(k["dur"]))
    med = {n: sorted(v)[len(v) // 2] for n, v in by.items()}
    return {"us": sum(med.values()), "launches": len(med)}


def _profile_ops(label: str, plan, dtype) -> list[dict]:
    layer, ops, rows = plan.layers[0], CudaFusedOps(inplace=True), []
    x = mx.random.normal((plan.hidden,), key=mx.random.key(3)).astype(dtype)
    inner = mx.random.normal((layer.down.width,), key=mx.random.key(6)).astype(dtype) * 0.1
    buffer = mx.zeros((2, layer.attn.hkv, 1024, layer.attn.head_dim), dtype)
    pos = mx.array([511], mx.int32)
    mx.eval(x, inner, buffer)
    cases = {
        "qkv_rope": (lambda: ops.qkv_rope(x, layer.attn_norm, (layer.q, layer.k, layer.v),
                                          layer.attn.at(buffer, pos))[0],
                     _weights_bytes(layer.q, layer.k, layer.v)),
        "gemv o_proj+residual": (lambda: ops.gemv(x, layer.o, residual=x), _weights_bytes(layer.o)),
        "gemv_swiglu": (lambda: ops.gemv_swiglu(x, layer.mlp_norm, layer.gate, layer.up),
                        _weights_bytes(layer.gate, layer.up)),
        "gemv down+residual": (lambda: ops.gemv(inner, layer.down, residual=x), _weights_bytes(layer.down)),
        "gemv norm+head": (lambda: ops.gemv(x, plan.head, norm=plan.final_norm), _weights_bytes(plan.head)),
    }
    for name, (run, nbytes) in cases.items():
        mx.eval(run())
        got = _median_kernel_us(_kernels_of(lambda: mx.eval(run()), 21))
        rows.append(record("profile", f"{label}: {name}", kernel_us=got["us"], launches=got["launches"],
                           mib=nbytes / 2**20, gb_s=nbytes / max(got["us"], 1e-9) / 1e3))
    return rows


def _profile_steps(label: str, step, steps: int = 24) -> dict:
    for _ in range(4):
        mx.eval(step())
    mx.synchronize()
    t0 = time.perf_counter()
    kernels = _kernels_of(lambda: mx.async_eval(step()), steps)
    wall = (time.perf_counter() - t0) / steps * 1e6
    if not kernels:
        return record("profile", f"{label}: step", error="CUPTI saw no kernels")
    start = min(float(k["ts"]) for k in kernels)
    end = max(float(k["ts"]) + float(k["dur"]) for k in kernels)
    busy = sum(float(k["dur"]) for k in kernels)
    by = {}
    for k in kernels:
        by.setdefault(k["name"][:80], []).append(float(k["dur"]))
    top = sorted(((sum(v) / steps, len(v) / steps, n) for n, v in by.items()), reverse=True)[:10]
    return record("profile", f"{label}: step", wall_us=wall, gpu_span_us=(end - start) / steps,
                  gpu_busy_us=busy / steps, idle_us=(end - start - busy) / steps,
                  kernels_per_step=len(kernels) / steps,
                  top=[{"us": round(us, 1), "per_step": round(c, 2), "name": n} for us, c, n in top])


def section_profile(specs, context: int, smoke: bool, knobs=()) -> str:
    out = ["## profile: the fused step's GPU time (CUPTI through torch.profiler)\n"]
    if not cuda_available():
        return out[0] + "\nNot run: it times the CUDA kernels, and this machine has no CUDA device.\n"
    for spec in specs:
        name, _, bits = spec.partition("@")
        mut = load_engines(f"random:{name}", dtype="bfloat16", quant=int(bits) if bits else None,
                           engines=("mlxbun",), scale_down=16 if smoke else None)
        mb = mut.engines["mlxbun"]
        model = mb.module
        fast = enable_fast(model)
        fast.fused = True
        plan = fused_plan_of(fast)
        prompt = mx.random.randint(16, mut.vocab_size, (1, context), key=mx.random.key(1))
        tok = prompt[:, -1:]
        op_rows, step_rows = [], []
        for label, variant_knobs in [("default", {})] + list(knobs):
            with _knobs(model, variant_knobs):
                op_rows += _profile_ops(f"{spec} {label}", plan, plan.dtype)
                cache = mb.make_cache()
                mb.forward(prompt, cache)
                mx.eval([c.state for c in cache])
                dec = FusedDecoder(model, plan, cache, 400, _ops(True))
                step_rows.append(_profile_steps(f"{spec} {label}", lambda: dec(tok)))
                del dec, cache
        out.append(f"### {spec}\n\n" + _md(op_rows, ["what", "kernel_us", "launches", "mib", "gb_s"])
                   + _md(step_rows, ["what", "wall_us", "gpu_span_us", "gpu_busy_us", "idle_us", "kernels_per_step"])
                   + "\n".join(f"- {r['what']}: " + "; ".join(f"{t['us']} us x{t['per_step']} {t['name']}"
                                                              for t in r.get("top", [])) for r in step_rows) + "\n")
        del mut, fast, model, mb, plan
        mx.clear_cache()
    return "\n".join(out)


def section_torch(specs, context: int, smoke: bool) -> str:
    """transformers' own static-cache decode: `generate(cache_implementation="static")`, which compiles
    the forward with torch.compile(mode="reduce-overhead") (CUDA graphs). Per decode step: the time of
    a 192-token generation less a 64-token one, over the 128 tokens between (prefill and compile
    excluded), each timed after a warm-up generation of its own length."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from mlxbun.bench.shapes import load_shape, scale_down

    out = ["## torch: transformers Llama, generate(cache_implementation='static'): torch.compile "
           "(mode='reduce-overhead'), bf16\n"]
    rows = []
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    for spec in specs:
        if "@" in spec:
            continue
        _, cfg = load_shape(spec)
        if smoke:
            cfg = scale_down(cfg, 16)
        config = LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
        with torch.device(dev):
            model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
        ids = torch.randint(16, config.vocab_size, (1, context), device=dev)
        kw = dict(do_sample=False, cache_implementation="static")
        try:
            from transformers import CompileConfig
            kw["compile_config"] = CompileConfig(fullgraph=True, mode="reduce-overhead")
        except ImportError:  # older transformers compile the same way by default
            pass

        def timed(n: int) -> float:
            """Seconds of a generation of exactly n tokens, after one of the same length (compiles)."""
            for _ in range(2):
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)
                if dev == "cuda":
                    torch.cuda.synchronize()
            return time.perf_counter() - t0

        t_compile = time.perf_counter()
        short = timed(64)
        t_compile = time.perf_counter() - t_compile - short
        long = timed(192)
        per = (long - short) / 128
        rows.append(record("torch", f"{spec}: transformers generate, static cache + torch.compile", tok_s=1 / per,
                           step_us=per * 1e6, warmup_s=t_compile, torch=torch.__version__))
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()
    out.append(_md(rows, ["what", "tok_s", "step_us", "warmup_s", "torch"]))
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--sections", nargs="+", default=["check", "bench"], choices=["check", "bench", "profile", "torch"])
    p.add_argument("--specs", nargs="+", default=SPECS)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--scatter", action="store_true", help="bench: also the K/V rows written by a scatter")
    p.add_argument("--no-split-variant", action="store_true", help="bench: also the kernels without split-K")
    p.add_argument("--knobs", nargs="*", default=[], help="check / bench / profile: more fused variants, LABEL:NAME=INT,...")
    p.add_argument("--emulate", action="store_true",
                   help="check only: the CUDA kernels emulated on this CPU (g++; mlxbun.kernels.emulator)")
    args = p.parse_args(argv)
    if args.emulate and args.sections != ["check"]:
        p.error("--emulate runs the check section only (--sections check): the others time the device")
    if args.emulate and (gap := emulator_gap()) is not None:
        p.error(f"--emulate: {gap}")
    if not args.emulate:
        return _run(args)
    global EMULATE
    EMULATE = True
    try:
        with emulating():
            return _run(args)
    finally:
        EMULATE = False


def _run(args) -> int:
    knobs = parse_knobs(args.knobs)
    parts = [f"# gpu_fused ({mx.__version__}, {mx.default_device()}, cuda={cuda_available()})\n"]
    fused_decode.FUSED_CHECKED = True  # this run is the check (its rows say whether it passed)
    for name in args.sections:
        try:
            if name == "check":
                parts.append(section_check(args.smoke, knobs))
            elif name == "bench":
                parts.append(section_bench(args.specs, args.context, args.smoke, args.no_split_variant, args.scatter,
                                           knobs))
            elif name == "profile":
                parts.append(section_profile(args.specs, args.context, args.smoke, knobs))
            else:
                parts.append(section_torch(args.specs, args.context, args.smoke))
        except Exception as e:  # one section's failure must not lose the others' rows
            import traceback
            traceback.print_exc()
            parts.append(f"## {name}: failed: {type(e).__name__}: {e}\n")
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_fused.md").write_text("\n".join(parts))
        (out / "gpu_fused.json").write_text(json.dumps(ROWS, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
