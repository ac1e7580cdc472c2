"""KV-cache memory benchmark: peak memory and decode speed per KV scheme and context length.

Two levels: a whole model (`run_kv_memory`, below) and one attention layer's TurboQuant
decode step (`measure_decode_memory`, `--layer`), which is what set TurboQuant's
`DEFAULT_ATTENTION_CHUNK`.

For each context length and scheme the prompt is prefilled through plain caches, converted to
the scheme's format (fp16 as is, q8/q4 with mlx-lm's conversion, TurboQuant 3.5 through its
codec), decoded for two warm-up tokens, then `decode` tokens are generated greedily while peak
memory is tracked (`mx.reset_peak_memory` right before decoding). Rows: kv bytes, peak
memory during decode, the part of that peak above weights + KV ("attention overhead"), and
decode tokens/s. Quantized KV must not raise peak memory above fp16 (mlx-lm issue #1587):
the `-chunked` schemes show the bounded attention path next to mlx-lm's.

    python -m mlxbun.bench.kv_memory --contexts 1024,4096,16384 --results out.sqlite
    python -m mlxbun.bench.kv_memory --layer --contexts 4096,16384
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import mlx.core as mx

from mlxbun.bench.kv_bytes import split_schemes, turboquant_scheme
from mlxbun.cache.convert import quantize_cache
from mlxbun.cache.turboquant import DEFAULT_ATTENTION_CHUNK, TurboQuantKVCache
from mlxbun.errors import MlxbunError

# Beside these, any TurboQuant width or split of the KV grammar: turboquant3, turboquant3.5,keys=4, ...
SCHEMES = ("fp16", "q8", "q4", "q8-chunked", "q4-chunked", "turboquant3.5")

# The zoo's llama recipe scaled until the KV cache matters: 28 layers, 16 query heads on 4 KV
# heads of 128 (grouped-query attention, as in real checkpoints: the case where mlx-lm's
# quantized attention copies the packed K/V per query head).
KV_HEAVY = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048, intermediate_size=2048,
    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=4, head_dim=128,
    rms_norm_eps=1e-5, vocab_size=512, rope_theta=500000.0, tie_word_embeddings=True,
    max_position_embeddings=32768,
)


@dataclass
class KVMemoryRow:
    scheme: str
    context: int
    kv_bytes: int
    weights_bytes: int
    peak_decode_bytes: int
    overhead_bytes: int  # peak - weights - kv: what attention materializes on top
    decode_tps: float
    decode_tokens: int


def _convert(caches: list, scheme: str) -> list:
    if scheme == "fp16":
        return caches
    if scheme.startswith("turboquant"):
        tq = turboquant_scheme(scheme)
        return [TurboQuantKVCache.from_cache(c, bits=tq.bits, key_bits=tq.key_bits, value_bits=tq.value_bits, seed=i)
                for i, c in enumerate(caches)]
    bits = int(scheme[1])
    out = [quantize_cache(c, group_size=64, bits=bits) for c in caches]
    if scheme.endswith("-chunked"):
        for c in out:
            c.attention_chunk = 1024
    return out


def _turboquant_ok(scheme: str) -> bool:
    if not scheme.startswith("turboquant"):
        return False
    try:
        turboquant_scheme(scheme)
    except MlxbunError:
        return False
    return True


def _kv_bytes(caches) -> int:
    return sum(c.nbytes for c in caches)


def run_kv_memory(model, contexts=(1024, 4096, 16384), schemes=SCHEMES, decode: int = 32,
                  prefill_step: int = 2048, progress=None, fast=None) -> list[KVMemoryRow]:
    """Measure every (context, scheme) on one model; returns one row per pair. `fast`: the model's
    FastPath (`mlxbun.fast`): decode through its step (the compiled step over static caches, with
    mlxbun's decode attention kernels on CUDA; eager where that does not apply, said in its notes)."""
    bad = [s for s in schemes if s not in SCHEMES and not _turboquant_ok(s)]
    if bad:
        raise MlxbunError(f"unknown KV scheme(s) {bad}; choose from {', '.join(SCHEMES)}, or another TurboQuant "
                          "width or split (turboquant3, turboquant3.5,keys=4)")
    rows = []
    weights = model.weights_bytes
    for ctx in contexts:
        prompt = mx.random.randint(16, model.args.vocab, (1, ctx), key=mx.random.key(ctx))
        for scheme in schemes:
            # A fresh prefill per scheme: a cache shared with another scheme's would pin its
            # buffers, and every in-place cache write would then copy them (counted as overhead).
            caches = _convert(_prefill(model, prompt, prefill_step), scheme)
            mx.eval([c.state for c in caches])
            tok = prompt[:, -1:]
            step = _decode_step(model, caches, fast, decode + 2)
            for _ in range(2):  # warm-up: first-call kernel compilation is not decode speed
                tok = mx.argmax(step(tok), axis=-1)[:, None]
                mx.eval(tok)
            mx.clear_cache()
            mx.reset_peak_memory()
            mx.synchronize()
            t0 = time.perf_counter()
            for _ in range(decode):
                tok = mx.argmax(step(tok), axis=-1)[:, None]
                mx.eval(tok)
            mx.synchronize()
            dt = time.perf_counter() - t0
            peak = mx.get_peak_memory()
            if fast is not None:
                step.write_back()
            kv = _kv_bytes(caches)
            rows.append(KVMemoryRow(scheme, ctx, kv, weights, peak, peak - weights - kv, decode / dt, decode))
            if progress:
                progress(rows[-1])
            del caches
            mx.clear_cache()
    return rows


def _decode_step(model, caches, fast, room: int):
    if fast is None:
        return lambda tok: model(tok, cache=caches)[:, -1]
    from mlxbun.fast.fidelity import fast_decode_step

    return fast_decode_step(fast, caches, room)


def _prefill(model, prompt, prefill_step: int) -> list:
    caches = model.make_cache()
    for start in range(0, prompt.shape[1], prefill_step):
        model(prompt[:, start:start + prefill_step], cache=caches)
        mx.eval([c.state for c in caches])
    return caches


def to_markdown(rows: list[KVMemoryRow]) -> str:
    mb = 1024 ** 2
    lines = ["| context | scheme | KV MiB | peak during decode MiB | overhead over weights+KV MiB | decode tok/s | peak vs fp16 |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    fp16 = {r.context: r.peak_decode_bytes for r in rows if r.scheme == "fp16"}
    for r in rows:
        rel = f"{r.peak_decode_bytes / fp16[r.context]:.2f}x" if r.context in fp16 else "-"
        lines.append(f"| {r.context} | {r.scheme} | {r.kv_bytes / mb:.1f} | {r.peak_decode_bytes / mb:.1f} | "
                     f"{r.overhead_bytes / mb:.1f} | {r.decode_tps:.1f} | {rel} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ one attention layer


def _transient_peak(run, repeats: int):
    """(bytes above what was live before `run()`, median seconds) over `repeats` runs."""
    mx.eval(run())  # warm-up: first-call allocations and lazy constants
    peaks, times = [], []
    for _ in range(repeats):
        mx.synchronize()
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        mx.eval(run())
        mx.synchronize()
        times.append(time.perf_counter() - t0)
        peaks.append(mx.get_peak_memory() - base)
    return max(peaks), statistics.median(times)


def measure_decode_memory(
    contexts=(4096, 16384),
    *,
    n_kv_heads: int = 8,
    n_q_heads: int = 32,
    head_dim: int = 128,
    bits: float = 3.5,
    chunks=(None, DEFAULT_ATTENTION_CHUNK),
    dtype=mx.float16,
    repeats: int = 3,
    cache_cls=TurboQuantKVCache,
    label: str = "turboquant",
) -> list[dict]:
    """Peak memory of one decode step of one attention layer (batch 1, one query).

    Per context: fp16 keys/values + `mx.fast.scaled_dot_product_attention`, then a
    `cache_cls` (TurboQuantKVCache) of `bits` holding the same keys/values (random
    normal), decoding through `decode_attention` with each `attention_chunk` in
    `chunks` (None: the one-pass path). Rows: context, scheme, cache_bytes (the
    stored K/V), transient_bytes (peak above everything live before the step:
    what attention materializes), peak_bytes = cache + transient, seconds (median
    of `repeats`; transient is their max). `decode_memory_table(rows)` formats them:

        from mlxbun.bench.kv_memory import measure_decode_memory, decode_memory_table
        print(decode_memory_table(measure_decode_memory((4096, 16384))))

    or `python -m mlxbun.bench.kv_memory --layer --contexts 4096,16384`.
    """
    scale = head_dim ** -0.5

    def rows_at(T):  # a function, so each context's arrays are gone before the next
        shape = (1, n_kv_heads, T, head_dim)
        keys = mx.random.normal(shape, key=mx.random.key(1)).astype(dtype)
        values = mx.random.normal(shape, key=mx.random.key(2)).astype(dtype)
        q = mx.random.normal((1, n_q_heads, 1, head_dim), key=mx.random.key(3)).astype(dtype)
        mx.eval(keys, values, q)
        transient, secs = _transient_peak(
            lambda: mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=None),
            repeats)
        fp16_bytes = keys.nbytes + values.nbytes
        out = [dict(context=T, scheme=f"{dtype} sdpa".replace("mlx.core.", ""),
                    cache_bytes=fp16_bytes, transient_bytes=transient,
                    peak_bytes=fp16_bytes + transient, seconds=secs)]
        cache = cache_cls(bits=bits)
        cache.update_and_fetch(keys, values)
        mx.eval(cache.keys, cache.values)
        keys = values = None  # only the packed cache stays live
        cache._fetched = None  # nor its (never evaluated) dequantized fetch
        for chunk in chunks:
            cache.attention_chunk = chunk
            transient, secs = _transient_peak(
                lambda: cache.decode_attention(q, scale=scale), repeats)
            out.append(dict(context=T, scheme=f"{label} {bits:g} "
                            + ("one pass" if chunk is None else f"chunk {chunk}"),
                            cache_bytes=cache.nbytes, transient_bytes=transient,
                            peak_bytes=cache.nbytes + transient, seconds=secs))
        return out

    return [row for T in contexts for row in rows_at(T)]


def decode_memory_table(rows: list[dict]) -> str:
    """Markdown table of `measure_decode_memory` rows (MiB, ms; peak vs fp16 per context)."""
    mib = 1024 ** 2
    ref = {}
    lines = ["| context | scheme | cache MiB | transient MiB | cache + transient MiB | vs fp16 | ms |",
             "|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        ref.setdefault(r["context"], r["peak_bytes"])  # the first row per context: fp16
        lines.append(f"| {r['context']} | {r['scheme']} | {r['cache_bytes'] / mib:.2f} | "
                     f"{r['transient_bytes'] / mib:.2f} | {r['peak_bytes'] / mib:.2f} | "
                     f"{r['peak_bytes'] / ref[r['context']]:.2f}x | {r['seconds'] * 1e3:.0f} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ CLI


def kv_heavy_model(layers: int = KV_HEAVY["num_hidden_layers"], dtype: str = "float16"):
    """The KV_HEAVY recipe with `layers` layers and random weights (seed 0) in `dtype`."""
    from mlx.utils import tree_map

    from mlxbun.models.universal.loader import build_model

    model = build_model(dict(KV_HEAVY, num_hidden_layers=layers))
    mx.random.seed(0)
    dt = getattr(mx, dtype)
    model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(dt), model.parameters()))
    mx.eval(model.parameters())
    return model


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m mlxbun.bench.kv_memory", description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,4096,16384")
    p.add_argument("--schemes", default=",".join(SCHEMES),
                   help="comma-separated: fp16, q8, q4, q8-chunked, q4-chunked, or a TurboQuant width or split "
                        "(turboquant3.5, turboquant3.5,keys=4)")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--layers", type=int, default=KV_HEAVY["num_hidden_layers"])
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16", "float32"))
    p.add_argument("--results", help="results table to record rows into")
    p.add_argument("--fast", action="store_true",
                   help="decode through the fast path (compiled step, mlxbun's decode attention kernels on CUDA)")
    p.add_argument("--layer", action="store_true",
                   help="one attention layer's decode step instead of the model: fp16 SDPA vs "
                        "TurboQuant 3.5 one pass / chunked (uses --contexts only)")
    args = p.parse_args(argv)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.layer:
        print(decode_memory_table(measure_decode_memory(contexts)))
        return 0
    cfg = dict(KV_HEAVY, num_hidden_layers=args.layers)
    model = kv_heavy_model(args.layers, args.dtype)
    fast = None
    if args.fast:
        from mlxbun.fast import enable_fast

        fast = enable_fast(model)
    schemes = split_schemes(args.schemes)
    rows = run_kv_memory(model, contexts, schemes, args.decode, fast=fast,
                         progress=lambda r: print(f"  {r.context:>6} {r.scheme:<14} peak {r.peak_decode_bytes / 2**20:9.1f} MiB "
                                                  f"kv {r.kv_bytes / 2**20:8.1f} MiB {r.decode_tps:8.1f} tok/s",
                                                  file=sys.stderr, flush=True))
    print(f"device: {mx.default_device()} {mx.device_info().get('device_name', '')}; model: zoo llama recipe scaled "
          f"to {args.layers} layers, 16 query / 4 KV heads x 128, {args.dtype}; decode {args.decode} tokens"
          f"{'; fast path: ' + fast.describe() if fast else ''}\n")
    if fast:
        fast.collect_kernel_gaps()
        print("".join(f"- {n}\n" for n in fast.notes))
    print(to_markdown(rows))
    if args.results:
        from mlxbun.results import open_results

        run = open_results(args.results).new_run("kv_memory", params=dict(cfg, dtype=args.dtype, decode=args.decode,
                                                                          fast=bool(fast)))
        for r in rows:
            params = dict(scheme=r.scheme, context=r.context)
            run.record("peak_decode_bytes", r.peak_decode_bytes, "B", **params)
            run.record("kv_bytes", r.kv_bytes, "B", **params)
            run.record("decode_tps", r.decode_tps, "tok/s", **params)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
