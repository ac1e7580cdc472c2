"""The decode attention kernels' checks and timings for `gpu_check.py` (on the H200).

Each case: random queries and a K/V buffer of `cap` positions of which the first `n` hold tokens
(the tail is filled with large values, so a read past `n` shows as an error). Rows:
- err_kernel / err_mlx: max |out - reference| of the kernel and of MLX's op, the reference being
  float32 attention over the first n positions computed with MLX ops (quantized K/V: dequantized
  with float32 scales); within_bound: err_kernel <= max(1.5 x err_mlx, 2^-7 x max |reference|);
- deterministic: three runs bit-equal; compiled_equal: the kernel inside `mx.compile` gives the
  eager call's bits;
- us_kernel, us_mlx: time per call (median of 5 timings of 50 calls). MLX's op is what mlxbun ran
  before: 16-bit K/V, `mx.fast.scaled_dot_product_attention` over the slice `[..., :n, :]` (mlx-lm's
  KVCache decode: no mask) and `us_mlx_masked` over the whole buffer under a bool mask (the compiled
  step's path before the kernel); quantized K/V, QuantizedKVCache's CUDA path (dequantize, then the
  fused kernel; in chunks of 8192 keys above 8192) and `us_fp16` the fused kernel over 16-bit K/V of
  the same length (the quantized-KV target is a ratio to it).
"""

from __future__ import annotations

import mlx.core as mx

from mlxbun.attention import chunked_quantized_sdpa, dequantized_sdpa
from mlxbun.cache.quantized import CUDA_ATTENTION_CHUNK
from mlxbun.cache.turboquant_codec import EPS, TurboQuantCodec, TurboQuantState, rotated_attention, unpack_indices
from mlxbun.kernels.sdpa_decode import (decode_attention, decode_gap, decode_split, quantized_decode_attention,
                                        turboquant_decode_attention, turboquant_decode_gap)
from mlxbun.kernels.turboquant_quantize import quantize_gap, turboquant_quantize

__all__ = ["ATTENTION_CASES", "QUANTIZE_CASES", "TURBOQUANT_CASES", "attention_checks", "quantize_checks",
           "turboquant_checks"]

# name, B, H, KV, D, dtype, capacity, n, bits (0: 16-bit), group, sinks, timed
ATTENTION_CASES = [
    ("8B ctx 641", 1, 32, 8, 128, mx.bfloat16, 768, 641, 0, 64, False, True),
    ("8B ctx 16k", 1, 32, 8, 128, mx.bfloat16, 16640, 16385, 0, 64, False, True),
    ("1B ctx 641", 1, 32, 8, 64, mx.bfloat16, 768, 641, 0, 64, False, True),
    ("kv-heavy 16k fp16", 1, 16, 4, 128, mx.float16, 16640, 16400, 0, 64, False, True),
    ("kv-heavy 16k q8", 1, 16, 4, 128, mx.float16, 16640, 16400, 8, 64, False, True),
    ("kv-heavy 16k q4", 1, 16, 4, 128, mx.float16, 16640, 16400, 4, 64, False, True),
    ("8B ctx 641 q4", 1, 32, 8, 128, mx.bfloat16, 768, 641, 4, 64, False, True),
    ("8B ctx 641 q8", 1, 32, 8, 128, mx.bfloat16, 768, 641, 8, 64, False, True),
    ("sinks (gpt-oss shape)", 1, 64, 8, 64, mx.bfloat16, 1024, 700, 0, 64, True, True),
    ("q4 g32", 1, 16, 4, 128, mx.float16, 2048, 1500, 4, 32, False, False),
    ("q4 g128", 1, 16, 4, 128, mx.float16, 2048, 1500, 4, 128, False, False),
    ("q8 g32", 1, 16, 4, 128, mx.float16, 2048, 1500, 8, 32, False, False),
    ("q8 g128 bf16", 1, 16, 4, 128, mx.bfloat16, 2048, 1500, 8, 128, False, False),
    ("n = 1", 1, 32, 8, 128, mx.bfloat16, 256, 1, 0, 64, False, False),
    ("n = capacity", 1, 32, 8, 128, mx.bfloat16, 512, 512, 0, 64, False, False),
    ("batch 2, G = 1", 2, 8, 8, 128, mx.bfloat16, 1024, 777, 0, 64, False, False),
    ("G = 8", 1, 64, 8, 128, mx.bfloat16, 1024, 999, 0, 64, False, False),
    ("D = 256", 1, 8, 2, 256, mx.bfloat16, 768, 500, 0, 64, False, False),
    ("D = 32, q8", 1, 4, 4, 32, mx.float16, 512, 300, 8, 32, False, False),
]


def _reference(q, k, v, n, scale, sinks):
    B, H, _, D = q.shape
    KV = k.shape[1]
    G = H // KV
    qf = q.astype(mx.float32).reshape(B, KV, G, 1, D)
    s = (qf @ k[:, :, None, :n, :].swapaxes(-1, -2)) * scale  # [B, KV, G, 1, n]
    if sinks is not None:
        col = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, KV, G, 1, 1), (B, KV, G, 1, 1))
        s = mx.concatenate([s, col], axis=-1)
    p = mx.softmax(s, axis=-1)[..., :n]
    return (p @ v[:, :, None, :n, :]).reshape(B, H, 1, -1)


def _case_arrays(B, H, KV, D, dtype, cap, n, bits, group, sinks, seed):
    keys = mx.random.split(mx.random.key(seed), 4)
    q = mx.random.normal((B, H, 1, D), key=keys[0]).astype(dtype)
    kv = [mx.random.normal((B, KV, cap, D), key=keys[i]) for i in (1, 2)]
    tail = mx.arange(cap)[None, None, :, None] >= n
    kv = [mx.where(tail, 100.0, x).astype(dtype) for x in kv]  # a read past n shows
    sk = mx.random.normal((H,), key=keys[3]).astype(dtype) if sinks else None
    if not bits:
        return q, kv, [x.astype(mx.float32) for x in kv], sk
    quant = [mx.quantize(x, group_size=group, bits=bits) for x in kv]
    deq = [mx.dequantize(c, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits)
           for c, s, b in quant]
    return q, quant, deq, sk


def _one(case, time_fn):
    name, B, H, KV, D, dtype, cap, n, bits, group, sinks, timed = case
    q, kv, ref_kv, sk = _case_arrays(B, H, KV, D, dtype, cap, n, bits, group, sinks, seed=len(name))
    scale = D ** -0.5
    length = mx.array([n], dtype=mx.int32)
    kv_shape = kv[0].shape if not bits else kv[0][0].shape
    gap = decode_gap(q, kv_shape, dtype, values_shape=kv_shape, head_dim=D, sinks=sk, bits=bits or None,
                     group_size=group if bits else None)
    row = dict(case=name, B=B, H=H, KV=KV, D=D, dtype=str(dtype).split(".")[-1], cap=cap, n=n,
               kv=f"q{bits} g{group}" if bits else "16-bit", sinks=sinks,
               chunk_splits="x".join(map(str, decode_split(cap, B * KV, H // KV, D))))
    if gap is not None:
        return dict(row, gap=gap.reason)
    if bits:
        def kernel(qq=q, ln=length):
            return quantized_decode_attention(qq, kv[0], kv[1], ln, scale, group, bits, sk)
        sliced = [tuple(a[..., :n, :] for a in t) for t in kv]
        sdpa = chunked_quantized_sdpa if n > CUDA_ATTENTION_CHUNK else dequantized_sdpa

        def mlx_op():
            if sdpa is chunked_quantized_sdpa:
                return sdpa(q, *sliced, scale, None, group, bits, CUDA_ATTENTION_CHUNK, dequantize=True)
            return sdpa(q, *sliced, scale, None, group, bits)
        fp16 = [x[..., :n, :].astype(dtype) for x in ref_kv]
    else:
        def kernel(qq=q, ln=length):
            return decode_attention(qq, kv[0], kv[1], ln, scale, sk)

        def mlx_op():
            return mx.fast.scaled_dot_product_attention(q, kv[0][..., :n, :], kv[1][..., :n, :], scale=scale,
                                                        sinks=sk)
        mask = (mx.arange(cap) < n)[None]
    ref = _reference(q, *ref_kv, n, scale, sk)
    runs = [kernel() for _ in range(3)]
    compiled = mx.compile(kernel)(q, length)
    mlx_out = mlx_op()
    mx.eval(ref, runs, compiled, mlx_out)
    err_k = mx.abs(runs[0].astype(mx.float32) - ref).max().item()
    err_m = mx.abs(mlx_out.astype(mx.float32) - ref).max().item()
    bound = max(1.5 * err_m, 2 ** -7 * mx.abs(ref).max().item())
    row.update(err_kernel=err_k, err_mlx=err_m, bound=bound, within_bound=err_k <= bound,
               deterministic=all(mx.array_equal(runs[0], r).item() for r in runs[1:]),
               compiled_equal=mx.array_equal(runs[0], compiled).item())
    if timed:
        t_k, t_m = time_fn(kernel), time_fn(mlx_op)
        row.update(us_kernel=t_k * 1e6, us_mlx=t_m * 1e6, speedup=t_m / t_k)
        if bits:
            t_f = time_fn(lambda: mx.fast.scaled_dot_product_attention(q, fp16[0], fp16[1], scale=scale))
            row.update(us_fp16=t_f * 1e6, vs_fp16=t_f / t_k)
        else:
            t_mask = time_fn(lambda: mx.fast.scaled_dot_product_attention(q, kv[0], kv[1], scale=scale, mask=mask,
                                                                          sinks=sk))
            row.update(us_mlx_masked=t_mask * 1e6, speedup_vs_masked=t_mask / t_k)
    return row


def _rows(cases, one, time_fn, progress) -> list[dict]:
    rows = []
    for case in cases:
        try:  # a case that fails is a row with its error, and the other cases still run
            rows.append(one(case, time_fn))
        except Exception as e:  # noqa: BLE001 - reported, not handled
            rows.append(dict(case=case[0], error=f"{type(e).__name__}: {str(e)[:2000]}", within_bound=False))
        progress(rows[-1])
        mx.clear_cache()
    return rows


def attention_checks(time_fn, progress=print) -> list[dict]:
    """One row per ATTENTION_CASES entry (see the module docstring)."""
    return _rows(ATTENTION_CASES, _one, time_fn, progress)


# ------------------------------------------------------------------ TurboQuant K/V

# name, B, H, KV, D, dtype, capacity, n, key bits, value bits, timed
TURBOQUANT_CASES = [
    ("kv-heavy 16k tq3.5", 1, 16, 4, 128, mx.float16, 16640, 16400, 3, 4, True),
    ("kv-heavy 16k K4/V3", 1, 16, 4, 128, mx.float16, 16640, 16400, 4, 3, True),
    ("8B ctx 16k tq3.5", 1, 32, 8, 128, mx.bfloat16, 16640, 16385, 3, 4, True),
    ("8B ctx 641 tq3.5", 1, 32, 8, 128, mx.bfloat16, 768, 641, 3, 4, True),
    ("1B ctx 641 tq4", 1, 32, 8, 64, mx.bfloat16, 768, 641, 4, 4, False),
    ("K1/V8, G = 8", 1, 64, 8, 128, mx.bfloat16, 1024, 999, 1, 8, False),
    ("K2/V5, D = 256", 1, 8, 2, 256, mx.float16, 768, 500, 2, 5, False),
    ("K8/V2, D = 32, batch 2", 2, 8, 8, 32, mx.float16, 512, 300, 8, 2, False),
    ("n = 1", 1, 32, 8, 128, mx.bfloat16, 256, 1, 3, 4, False),
    ("n = capacity", 1, 32, 8, 128, mx.bfloat16, 512, 512, 3, 4, False),
]


def _turboquant_arrays(B, H, KV, D, dtype, cap, n, kb, vb, seed):
    """Queries, the codecs and TurboQuant K/V of `cap` positions whose tail past n holds large vectors
    (a read past n shows), as TurboQuantKVCache stores them (keys under the seed, values seed + 1)."""
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, H, 1, D), key=keys[0]).astype(dtype)
    tail = mx.arange(cap)[None, None, :, None] >= n
    kc, vc = TurboQuantCodec(D, kb, seed).prepare(), TurboQuantCodec(D, vb, seed + 1).prepare()
    states = [codec.quantize(mx.where(tail, 100.0, mx.random.normal((B, KV, cap, D), key=k)).astype(dtype))
              for codec, k in zip((kc, vc), keys[1:])]
    return q, kc, vc, states


def _sliced(state: TurboQuantState, n: int) -> TurboQuantState:
    return TurboQuantState(state.norms[..., :n], state.indices[..., :n, :])


def _one_turboquant(case, time_fn):
    name, B, H, KV, D, dtype, cap, n, kb, vb, timed = case
    q, kc, vc, (k, v) = _turboquant_arrays(B, H, KV, D, dtype, cap, n, kb, vb, seed=len(name))
    scale, length = D ** -0.5, mx.array([n], dtype=mx.int32)
    split = decode_split(cap, B * KV, H // KV, D, book_floats=(1 << kb) + (1 << vb))
    row = dict(case=name, B=B, H=H, KV=KV, D=D, dtype=str(dtype).split(".")[-1], cap=cap, n=n, kv=f"K{kb}/V{vb}",
               chunk_splits="x".join(map(str, split)))
    gap = turboquant_decode_gap(q, k.norms.shape, D, D, kb, vb)
    if gap is not None:
        return dict(row, gap=gap.reason)

    def kernel(qq=q, ln=length):  # what StaticTurboQuantCache runs: rotate in, the kernel, rotate back
        return vc.unrotate(turboquant_decode_attention(kc.rotate(qq * scale), k, v, kc.codebook, vc.codebook, ln))

    # the reference: the exact cache's one-pass rotated attention over the first n positions, in float32
    # (its output before the cast to the queries' dtype), computed on the CPU: on the GPU MLX's float32
    # matmuls measured 0.4% off it (err_gpu_ref), more than the kernel's float32 sums in another order
    q_rot = kc.rotate(q * scale).reshape(B, KV, H // KV, 1, D)
    kn, vn = _sliced(k, n), _sliced(v, n)

    def reference():
        s = mx.einsum("bhmld,bhtd->bhmlt", q_rot, kc.codewords(kn)) * kn.norms.astype(mx.float32)[:, :, None, None, :]
        w = mx.softmax(s, axis=-1)
        return vc.unrotate(mx.einsum("bhmlt,bht,bhtd->bhmld", w, vn.norms.astype(mx.float32),
                                     vc.codewords(vn))).reshape(B, H, 1, D)

    gpu_ref = reference()
    mx.eval(q_rot, gpu_ref)
    with mx.stream(mx.cpu):
        ref = reference()
        mx.eval(ref)
    mask = (mx.arange(cap) < n)[None]

    def standin():  # the compiled step's path without the kernel: one pass over the buffer under a mask
        return rotated_attention(q, kc, k, vc, v, scale, mask)

    def exact():  # TurboQuantKVCache's decode: chunks of 512 keys over the filled part
        return rotated_attention(q, kc, kn, vc, vn, scale, None, chunk_size=512)

    runs = [kernel() for _ in range(3)]
    compiled = mx.compile(kernel)(q, length)
    mx.eval(ref, runs, compiled)
    err_k = mx.abs(runs[0] - ref).max().item()
    err_s = mx.abs(standin().astype(mx.float32) - ref).max().item()
    bound = 2 ** -14 * mx.abs(ref).max().item()  # float32 sums in another order; a misread code is O(1)
    row.update(err_kernel=err_k, err_standin=err_s, err_gpu_ref=mx.abs(gpu_ref - ref).max().item(), bound=bound,
               within_bound=err_k <= bound,
               deterministic=all(mx.array_equal(runs[0], r).item() for r in runs[1:]),
               compiled_equal=mx.array_equal(runs[0], compiled).item())
    if timed:
        fp16 = [mx.random.normal((B, KV, n, D), key=mx.random.key(i)).astype(dtype) for i in (7, 8)]
        t_k, t_s, t_e = time_fn(kernel), time_fn(standin), time_fn(exact)
        t_f = time_fn(lambda: mx.fast.scaled_dot_product_attention(q, fp16[0], fp16[1], scale=scale))
        row.update(us_kernel=t_k * 1e6, us_standin=t_s * 1e6, us_exact=t_e * 1e6, us_fp16=t_f * 1e6,
                   speedup_vs_exact=t_e / t_k, vs_fp16=t_f / t_k)
    return row


def turboquant_checks(time_fn, progress=print) -> list[dict]:
    """One row per TURBOQUANT_CASES entry: the TurboQuant decode kernel (with the rotations around it,
    as the static cache runs it) against the exact cache's one-pass rotated attention in float32
    (err_standin: the static cache's masked one-pass path, whose output comes in the queries' dtype:
    its rounding is in the column; err_gpu_ref: the same reference computed on the GPU); three runs bit-equal, the bits under `mx.compile`; time vs that path
    (us_standin), the exact cache's chunked decode (us_exact) and MLX's fused attention over 16-bit K/V
    of the same length (vs_fp16: the >= 0.7x target)."""
    return _rows(TURBOQUANT_CASES, _one_turboquant, time_fn, progress)


# name, vectors' shape [B, KV, L, D], dtype, bits, timed
QUANTIZE_CASES = [
    ("kv-heavy decode K3", (1, 4, 1, 128), mx.float16, 3, True),
    ("kv-heavy decode V4", (1, 4, 1, 128), mx.float16, 4, True),
    ("8B decode K3", (1, 8, 1, 128), mx.bfloat16, 3, True),
    ("1B decode 4-bit, D = 64", (1, 8, 1, 64), mx.bfloat16, 4, False),
    ("verify of 5, batch 2, 8-bit, D = 256", (2, 8, 5, 256), mx.float16, 8, False),
    ("1-bit, D = 32, float32", (1, 4, 1, 32), mx.float32, 1, False),
    ("prefill 512, 5-bit", (1, 8, 512, 128), mx.bfloat16, 5, True),
]


def _one_quantize(case, time_fn):
    """The kernel's state against the codec's MLX ops on the same device: norms within one float16
    step, indices equal but for coordinates a rounding from a midpoint (at most 1 in 1000, each off
    by one codeword); three runs and the compiled call bit-equal."""
    name, shape, dtype, bits, timed = case
    x = mx.random.normal(shape, key=mx.random.key(len(name))).astype(dtype)
    codec = TurboQuantCodec(shape[-1], bits, seed=1)
    row = dict(case=name, shape="x".join(map(str, shape)), dtype=str(dtype).split(".")[-1], bits=bits)
    gap = quantize_gap(x, codec.dim, codec.use_hadamard)
    if gap is not None:
        return dict(row, gap=gap.reason)

    def kernel(v=x):
        return TurboQuantState(*turboquant_quantize(v, codec.signs, codec.midpoints, bits, EPS))

    want = codec.quantize(x)
    runs = [kernel() for _ in range(3)]
    compiled = mx.compile(lambda v: tuple(kernel(v)))(x)
    mx.eval(want, runs, compiled)
    got = runs[0]
    norm_err = (mx.abs(got.norms.astype(mx.float32) - want.norms.astype(mx.float32))
                / mx.maximum(mx.abs(want.norms.astype(mx.float32)), 1e-6)).max().item()
    ids, ref = (unpack_indices(s.indices, bits, shape[-1]).astype(mx.int32) for s in (got, want))
    differ = (ids != ref).astype(mx.float32).mean().item()
    step = mx.abs(ids - ref).max().item()
    row.update(norm_rel_err=norm_err, index_differ=differ, index_max_step=step,
               within_bound=norm_err <= 2 ** -10 and differ <= 1e-3 and step <= 1,
               deterministic=all(mx.array_equal(got.indices, r.indices).item()
                                 and mx.array_equal(got.norms, r.norms).item() for r in runs[1:]),
               compiled_equal=mx.array_equal(got.indices, compiled[1]).item()
               and mx.array_equal(got.norms, compiled[0]).item())
    if timed:
        step_fn = mx.compile(lambda v: tuple(codec.quantize(v)))
        t_k = time_fn(kernel)
        t_m, t_c = time_fn(lambda: codec.quantize(x)), time_fn(lambda: step_fn(x))
        row.update(us_kernel=t_k * 1e6, us_mlx=t_m * 1e6, us_mlx_compiled=t_c * 1e6, speedup_vs_compiled=t_c / t_k)
    return row


def quantize_checks(time_fn, progress=print) -> list[dict]:
    """One row per QUANTIZE_CASES entry: the TurboQuant quantize kernel against the codec's MLX ops
    (see `_one_quantize`), time vs those ops eager and compiled."""
    return _rows(QUANTIZE_CASES, _one_quantize, time_fn, progress)


# ------------------------------------------------------------------ launch sweep, from HBM

L2_BYTES = 50 * 2 ** 20  # the H200's L2 (MLX's op and the kernel both run from it when a buffer fits)
SWEEP_CASES = [c for c in ATTENTION_CASES if c[0] in ("8B ctx 641", "kv-heavy 16k fp16", "kv-heavy 16k q8",
                                                     "kv-heavy 16k q4", "8B ctx 16k")]
SWEEP = [(w, t) for w in (4, 8) for t in (264, 528, 1056)]


def time_rotating(fns, time_fn):
    """Time per call of `fns` called in turn (one per buffer set, so that reads come from HBM)."""
    turn = iter(range(1 << 30))
    return time_fn(lambda: fns[next(turn) % len(fns)]())


def attention_sweep(time_fn, progress=print) -> list[dict]:
    """Kernel (per NWARPS x TARGET_BLOCKS) vs MLX's op, cycling over enough K/V buffer sets that
    together they are 4x the L2: what one layer after another costs in a model."""
    import mlxbun.kernels.sdpa_decode as sd

    rows = []
    for name, B, H, KV, D, dtype, cap, n, bits, group, sinks, _ in SWEEP_CASES:
        one = _case_arrays(B, H, KV, D, dtype, cap, n, bits, group, sinks, seed=1)
        per_set = sum(a.nbytes for a in (one[1] if not bits else [x for t in one[1] for x in t]))
        sets = [one] + [_case_arrays(B, H, KV, D, dtype, cap, n, bits, group, sinks, seed=s)
                        for s in range(2, 1 + min(16, max(2, -(-4 * L2_BYTES // per_set))))]
        length, scale = mx.array([n], dtype=mx.int32), D ** -0.5
        if bits:
            ref_fns = [lambda s=s: dequantized_sdpa(s[0], tuple(a[..., :n, :] for a in s[1][0]),
                                                    tuple(a[..., :n, :] for a in s[1][1]), scale, None, group, bits)
                       for s in sets]
            fp16 = [(s[0], *[x[..., :n, :].astype(dtype) for x in s[2]]) for s in sets[:len(sets) * bits // 16 or 1]]
        else:
            ref_fns = [lambda s=s: mx.fast.scaled_dot_product_attention(
                s[0], s[1][0][..., :n, :], s[1][1][..., :n, :], scale=scale) for s in sets]
        t_ref = time_rotating(ref_fns, time_fn)
        row0 = dict(case=name, sets=len(sets), mib_per_set=per_set / 2 ** 20, us_mlx=t_ref * 1e6)
        if bits:
            row0["us_fp16_sdpa"] = 1e6 * time_rotating(
                [lambda f=f: mx.fast.scaled_dot_product_attention(f[0], f[1], f[2], scale=scale) for f in fp16],
                time_fn)
        for warps, target in SWEEP:
            sd.NWARPS, sd.TARGET_BLOCKS = warps, target
            if bits:
                fns = [lambda s=s: quantized_decode_attention(s[0], s[1][0], s[1][1], length, scale, group, bits)
                       for s in sets]
            else:
                fns = [lambda s=s: decode_attention(s[0], s[1][0], s[1][1], length, scale) for s in sets]
            t = time_rotating(fns, time_fn)
            out = fns[0]()
            if (warps, target) == SWEEP[0]:
                first = out
            diff = mx.abs(out.astype(mx.float32) - first.astype(mx.float32)).max().item()
            rows.append(dict(row0, warps=warps, target_blocks=target, max_diff_vs_first=diff,
                             chunk_splits="x".join(map(str, decode_split(cap, B * KV, H // KV, D))),
                             us_kernel=t * 1e6, speedup=t_ref / t,
                             gb_s=per_set / t / 1e9))
            progress(rows[-1])
        sd.NWARPS, sd.TARGET_BLOCKS = 4, 528
        mx.clear_cache()
    return rows
