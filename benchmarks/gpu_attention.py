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
from mlxbun.kernels.sdpa_decode import decode_attention, decode_gap, decode_split, quantized_decode_attention

__all__ = ["ATTENTION_CASES", "attention_checks"]

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


def attention_checks(time_fn, progress=print) -> list[dict]:
    """One row per ATTENTION_CASES entry (see the module docstring)."""
    rows = []
    for case in ATTENTION_CASES:
        rows.append(_one(case, time_fn))
        progress(rows[-1])
        mx.clear_cache()
    return rows


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
