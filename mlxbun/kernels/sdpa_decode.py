"""One-query (decode) attention over a static K/V buffer read up to a length held on the device.

`decode_attention(q, keys, values, length, scale)` computes what
`mx.fast.scaled_dot_product_attention(q, keys[..., :n, :], values[..., :n, :], scale=scale)`
computes for one query token, where `n = length[0]` is a device array (so a compiled step needs no
mask and no Python int), with grouped-query heads (H query heads over KV heads), float32
accumulation and an optional attention sink per head. `quantized_decode_attention` does the same
over affine-quantized K/V in mlx's `mx.quantize` layout (uint32 codes, scales and biases per
group along the head dim; 4 or 8 bits, groups 32 / 64 / 128), dequantizing in registers: no
dequantized copy is made. `turboquant_decode_attention` does it over TurboQuant's packed codes
(`mlxbun.cache.turboquant_codec`: a float16 norm and one 1-8 bit codeword index per coordinate),
in the rotations' space: the caller rotates the query in and the output back, as the exact
cache's `rotated_attention` does around its own scoring. All three are split over the sequence
with a fixed-order reduction (`sdpa_decode_source`): the same inputs give the same bits on every run; the bits differ from
MLX's (another summation order), so a model running them is measured, never called bit-exact.

`decode_gap(...)` says why the kernels do not apply to an input (None when they do); the caller
then runs MLX's op and says so. `decode_split(...)` is the launch shape: positions per split and
the number of splits, from the buffer's capacity (fixed per buffer, so the bits never depend on
how full it is).

Metal: only the TurboQuant kernel has a Metal variant (`sdpa_decode_metal`), written but never compiled
by Metal nor run (no Apple GPU is reachable from this project's machines): it stays off
(`METAL_TURBOQUANT_CHECKED`) until its GPU check passes on one. On Metal the other two kernels' reasons
do not hold (MLX's fused one-query attention takes a mask there; `mx.quantized_matmul` reads packed K/V).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from mlxbun.kernels.common import HALF, Gap, cuda_available, float_bits, metal_available
from mlxbun.kernels.sdpa_decode_metal import (METAL_COMBINE, METAL_HEADER, METAL_PARTIAL_TURBOQUANT,
                                              METAL_SHARED_LIMIT)
from mlxbun.kernels.sdpa_decode_source import (COMBINE, COMBINE_SINKS, HEADER, PARTIAL_PLAIN, PARTIAL_QUANTIZED,
                                                PARTIAL_TURBOQUANT)

__all__ = ["CHUNKS", "HEAD_DIMS", "MAX_GROUP", "METAL_TURBOQUANT_CHECKED", "PREFETCH", "QUANT_BITS", "QUANT_GROUPS",
           "TURBOQUANT_BITS", "TURBOQUANT_CHECKED", "KernelCall", "decode_attention", "decode_gap", "decode_split",
           "partial_template", "plan", "quantized_decode_attention", "shared_bytes", "turboquant_decode_attention",
           "turboquant_decode_gap"]

HEAD_DIMS = (32, 64, 128, 256)  # D / 8 lanes per key row: a power of two up to a warp
MAX_GROUP = 8  # query heads per KV head: 2 x 8 floats per head and lane live in registers
QUANT_BITS = (4, 8)
QUANT_GROUPS = (32, 64, 128)
TURBOQUANT_BITS = tuple(range(1, 9))  # index widths: 8 of them fill whole bytes at any width
# Whether the TurboQuant kernel has passed `benchmarks/gpu_check.py --checks turboquant` on the H200
# (raw 13 of benchmarks/gpu-h200-fast-raw: within 2^-14 of a float32 CPU reference, deterministic,
# compiled-equal, every case). Set it False to take the kernel out while a change to it awaits
# that check; the static cache then runs its one-pass MLX path and the fast path says why.
TURBOQUANT_CHECKED = True
# The same for the Metal variant (`sdpa_decode_metal`): never compiled by Metal nor run, so off. An
# Apple GPU's `benchmarks/gpu_check.py --checks turboquant` run is what may turn it on.
METAL_TURBOQUANT_CHECKED = False
CHUNKS = (64, 128, 256, 512)  # positions per split
# Launch knobs, module-level so benchmarks/gpu_check.py can sweep them (not for users):
TARGET_BLOCKS = 528  # splits x batch x KV heads to aim for: 4 blocks on each of the H200's 132 SMs
NWARPS = 4  # warps per partial block
# Whether a partial block asks the L2 for its split's key and value rows before anything else (its
# value loads then wait on the L2, not on memory; a prefetch changes no value). On an H100 (raw 26 of
# benchmarks/gpu-fused.md) the one-launch attention of Llama-3-8B 4-bit took 17.4 us a layer with it,
# 22.2 without it and without the batched merge; the step decoded 1.07x faster with it.
PREFETCH = True
SHARED_LIMIT = 40 * 1024  # static shared memory per block (the hardware's static limit is 48 KiB)

_kernels: dict[str, object] = {}
# TurboQuant K/V as the kernels take them (CUDA and Metal alike): norms, packed indices, codebook
_TURBOQUANT_KV = tuple((f"{t}_{part}", {"norms": mx.float16, "codes": mx.uint32, "book": mx.float32}[part])
                       for t in ("k", "v") for part in ("norms", "codes", "book"))


def shared_bytes(chunk: int, group: int, head_dim: int, warps: Optional[int] = None, book_floats: int = 0) -> int:
    """Static shared memory of one partial block: the scores, the warps' output rows and (TurboQuant)
    the two codebooks' `book_floats` entries."""
    return 4 * (group * chunk + (warps or NWARPS) * group * head_dim + book_floats)


def decode_split(capacity: int, batch_kv_heads: int, group: int, head_dim: int,
                 book_floats: int = 0, shared_limit: Optional[int] = None) -> tuple[int, int]:
    """(positions per split, splits) for a buffer of `capacity` positions: the smallest chunk of
    `CHUNKS` that keeps the grid near TARGET_BLOCKS and fits the shared memory (`shared_limit`,
    default SHARED_LIMIT: the CUDA kernels')."""
    if capacity < 1 or batch_kv_heads < 1:
        raise ValueError(f"decode_split: capacity {capacity} and batch x KV heads {batch_kv_heads} must be >= 1")
    want = -(-TARGET_BLOCKS // batch_kv_heads)
    per_split = -(-capacity // want)
    limit = SHARED_LIMIT if shared_limit is None else shared_limit
    fitting = [c for c in CHUNKS if shared_bytes(c, group, head_dim, book_floats=book_floats) <= limit] \
        or CHUNKS[:1]
    chunk = next((c for c in fitting if c >= per_split), fitting[-1])
    return chunk, -(-capacity // chunk)


def decode_gap(queries: mx.array, kv_shape: Sequence[int], kv_dtype, *, values_shape: Sequence[int] = (),
               head_dim: Optional[int] = None, sinks: Optional[mx.array] = None, bits: Optional[int] = None,
               group_size: Optional[int] = None) -> Optional[Gap]:
    """Why the decode attention kernel does not run for these queries over a key buffer of `kv_shape`
    [B, KV, capacity, last] and a value buffer of `values_shape` (the same, else a gap; for quantized
    K/V both are the codes' shapes). `kv_dtype`: the 16-bit K/V's dtype, or the scales' for
    quantized K/V (`bits`, `group_size` then given); `head_dim` defaults to kv_shape[-1]."""
    gap = _launch_gap(queries, kv_shape)
    if gap is not None:
        return gap
    H, D = queries.shape[1], queries.shape[-1]
    if queries.dtype not in HALF or kv_dtype != queries.dtype:
        return Gap(f"{queries.dtype} queries over {kv_dtype} K/V (the kernel does bfloat16 and float16, "
                   "both the same)")
    if D not in HEAD_DIMS or D != (head_dim or kv_shape[-1]):
        return Gap(f"head dim {D} over K/V of {head_dim or kv_shape[-1]} (the kernel does {HEAD_DIMS}, "
                   "queries and K/V alike)")
    if tuple(values_shape) != tuple(kv_shape):
        return Gap(f"values {tuple(values_shape)} unlike keys {tuple(kv_shape)} (the kernel takes one shape "
                   "for both)")
    if bits is not None and (bits not in QUANT_BITS or group_size not in QUANT_GROUPS):
        return Gap(f"{bits}-bit K/V in groups of {group_size} (the kernel does {QUANT_BITS} bits, "
                   f"groups {QUANT_GROUPS})")
    if sinks is not None and sinks.shape != (H,):
        return Gap(f"sinks of shape {sinks.shape} for {H} heads (the kernel takes one logit per head)")
    return None


def _backend() -> Optional[str]:
    """The GPU backend MLX runs here ("cuda", "metal"), or None."""
    return "cuda" if cuda_available() else "metal" if metal_available() else None


def _launch_gap(queries: mx.array, kv_shape: Sequence[int], metal: bool = False) -> Optional[Gap]:
    """What every decode attention kernel needs: a CUDA default device (or a Metal one, for a kernel
    with a Metal variant: `metal`), one query token, and a query head count that the KV heads of
    `kv_shape` [B, KV, positions, ...] group evenly, up to MAX_GROUP."""
    backend = _backend()
    if backend is None:
        return Gap("no CUDA device (the kernel is CUDA only)")
    if backend == "metal" and not metal:
        return Gap("a Metal device (the kernel is CUDA only: on Metal MLX's fused attention takes the mask)")
    if mx.default_device() != mx.gpu:
        return Gap(f"default device {mx.default_device()} (the kernel runs on the GPU)")
    if queries.ndim != 4 or len(kv_shape) < 3:
        return Gap(f"queries {queries.shape} over K/V {tuple(kv_shape)} (the kernel takes [B, H, 1, D] "
                   "over [B, KV, positions, ...])")
    B, H, L, _ = queries.shape
    if L != 1:
        return Gap(f"{L} queries per head (the kernel decodes one; MLX's fused kernel runs the rest)", True)
    if kv_shape[0] != B or kv_shape[1] < 1 or H % kv_shape[1]:
        return Gap(f"{B} x {H} query heads over K/V {tuple(kv_shape)} (the kernel needs the same batch "
                   "and query heads a multiple of the KV heads)")
    if H // kv_shape[1] > MAX_GROUP:
        return Gap(f"{H // kv_shape[1]} query heads per KV head (the kernel does up to {MAX_GROUP})")
    return None


def turboquant_decode_gap(queries: mx.array, norms_shape: Sequence[int], key_dim: int, value_dim: int,
                          key_bits: int, value_bits: int, sinks: Optional[mx.array] = None) -> Optional[Gap]:
    """Why the TurboQuant decode kernel does not run for these queries over TurboQuant K/V whose norms
    are `norms_shape` [B, KV, capacity] (any query dtype: the kernel reads them rotated, in float32)."""
    gap = _launch_gap(queries, norms_shape, metal=True)
    if gap is not None:
        return gap
    metal = _backend() == "metal"
    if metal and not METAL_TURBOQUANT_CHECKED:
        return Gap("the TurboQuant kernel's Metal variant has never run on an Apple GPU (written untested; "
                   "benchmarks/gpu_check.py --checks turboquant there is what turns it on)")
    if not metal and not TURBOQUANT_CHECKED:
        return Gap("the TurboQuant kernel has not yet passed its GPU check (benchmarks/gpu_check.py "
                   "--checks turboquant)")
    D = queries.shape[-1]
    if D not in HEAD_DIMS or key_dim != D or value_dim != D:
        return Gap(f"head dim {D} over TurboQuant keys of {key_dim} and values of {value_dim} (the kernel "
                   f"does {HEAD_DIMS}, queries, keys and values alike)")
    if key_bits not in TURBOQUANT_BITS or value_bits not in TURBOQUANT_BITS:
        return Gap(f"TurboQuant widths keys {key_bits} / values {value_bits} (the kernel does {TURBOQUANT_BITS})")
    if sinks is not None:
        return Gap("attention sinks over TurboQuant codes (the exact cache dequantizes for them)")
    if metal:
        G = queries.shape[1] // norms_shape[1]
        books = (1 << key_bits) + (1 << value_bits)
        chunk, _ = decode_split(norms_shape[2], queries.shape[0] * norms_shape[1], G, D, books, METAL_SHARED_LIMIT)
        if shared_bytes(chunk, G, D, book_floats=books) > METAL_SHARED_LIMIT:
            return Gap(f"{G} query heads per KV head of dim {D}: more threadgroup memory than Metal's "
                       f"{METAL_SHARED_LIMIT // 1024} KiB")
    return None


@dataclass(frozen=True)
class KernelCall:
    """One launch of a kernel: what `mx.fast.cuda_kernel` (or, `backend` "metal",
    `mx.fast.metal_kernel`) is built from and called with."""

    name: str
    source: str
    inputs: tuple  # (name, dtype) pairs, in the signature's order
    outputs: tuple  # (name, dtype, shape) triples
    template: tuple
    grid: tuple
    threadgroup: tuple
    backend: str = "cuda"


def partial_template(dtype, D: int, G: int, kv_heads: int, H: int, capacity: int, chunk: int, scale: float,
                     bits: int = 0, group_size: int = 64) -> tuple:
    """The partial body's template constants (also `rope_attention`'s, which runs the same body)."""
    return (("T", dtype), ("BF16", dtype == mx.bfloat16), ("D", D), ("G", G), ("KV", kv_heads), ("H", H),
            ("CAP", capacity), ("CHUNK", chunk), ("NWARPS", NWARPS), ("QBITS", bits), ("GS", group_size),
            ("QF32", dtype == mx.float32), ("SCALE_BITS", float_bits(scale)), ("PREFETCH", PREFETCH))


def plan(queries_shape: Sequence[int], dtype, kv_heads: int, capacity: int, scale: float, *, bits: int = 0,
         group_size: int = 64, sinks: bool = False, turboquant: Optional[tuple[int, int]] = None,
         backend: str = "cuda") -> tuple[KernelCall, KernelCall]:
    """The two launches (partial, combine) of one decode attention call; `bits` 0: 16-bit K/V;
    `turboquant`: (key bits, value bits) of TurboQuant K/V, whose queries and output are float32;
    `backend` "metal": the TurboQuant kernel's Metal variant (TurboQuant only)."""
    if backend == "metal":
        if not turboquant or sinks:
            raise ValueError("plan: the Metal variant is TurboQuant's, without sinks")
        return _metal_turboquant_plan(queries_shape, kv_heads, capacity, scale, turboquant)
    B, H, _, D = queries_shape
    G = H // kv_heads
    books = sum(1 << b for b in turboquant) if turboquant else 0
    chunk, splits = decode_split(capacity, B * kv_heads, G, D, book_floats=books)
    if turboquant:
        dtype = mx.float32
    template = partial_template(dtype, D, G, kv_heads, H, capacity, chunk, scale, bits, group_size)
    if turboquant:
        kv = _TURBOQUANT_KV
        template += (("KBITS", turboquant[0]), ("VBITS", turboquant[1]))
        name, source = "mlxbun_sdpa_decode_tq", PARTIAL_TURBOQUANT
    elif bits:
        kv = tuple((f"{t}_{part}", mx.uint32 if part == "codes" else dtype)
                   for t in ("k", "v") for part in ("codes", "scales", "biases"))
        name, source = "mlxbun_sdpa_decode_q", PARTIAL_QUANTIZED
    else:
        kv, name, source = (("k", dtype), ("v", dtype)), "mlxbun_sdpa_decode", PARTIAL_PLAIN
    partial = KernelCall(name, source, (("q", dtype), *kv, ("length", mx.int32)),
                         (("o_part", mx.float32, (B * H, splits, D)), ("ml", mx.float32, (B * H, splits, 2))),
                         template, (splits * 32 * NWARPS, B * kv_heads, 1), (32 * NWARPS, 1, 1))
    combine = KernelCall("mlxbun_sdpa_decode_combine" + ("_sinks" if sinks else ""), COMBINE_SINKS if sinks else COMBINE,
                         (("o_part", mx.float32), ("ml", mx.float32), ("length", mx.int32))
                         + ((("sinks", mx.float32),) if sinks else ()),
                         (("out", dtype, (B, H, 1, D)),),
                         (("T", dtype), ("D", D), ("H", H), ("SPLITS", splits), ("CHUNK", chunk)),
                         (B * H * D, 1, 1), (D, 1, 1))
    return partial, combine


def _metal_turboquant_plan(queries_shape, kv_heads: int, capacity: int, scale: float,
                           turboquant: tuple[int, int]) -> tuple[KernelCall, KernelCall]:
    """The Metal variant's two launches: the CUDA plan's grid and shapes; the splits a template
    constant (`SPLITS`), the threadgroup memory within Metal's limit."""
    B, H, _, D = queries_shape
    G = H // kv_heads
    chunk, splits = decode_split(capacity, B * kv_heads, G, D, sum(1 << b for b in turboquant), METAL_SHARED_LIMIT)
    template = (("D", D), ("G", G), ("KV", kv_heads), ("H", H), ("CAP", capacity), ("CHUNK", chunk),
                ("NWARPS", NWARPS), ("SPLITS", splits), ("KBITS", turboquant[0]), ("VBITS", turboquant[1]),
                ("SCALE_BITS", float_bits(scale)))
    partial = KernelCall("mlxbun_sdpa_decode_tq_metal", METAL_PARTIAL_TURBOQUANT,
                         (("q", mx.float32), *_TURBOQUANT_KV, ("length", mx.int32)),
                         (("o_part", mx.float32, (B * H, splits, D)), ("ml", mx.float32, (B * H, splits, 2))),
                         template, (splits * 32 * NWARPS, B * kv_heads, 1), (32 * NWARPS, 1, 1), "metal")
    combine = KernelCall("mlxbun_sdpa_decode_combine_metal", METAL_COMBINE,
                         (("o_part", mx.float32), ("ml", mx.float32), ("length", mx.int32)),
                         (("out", mx.float32, (B, H, 1, D)),), (("D", D), ("SPLITS", splits), ("CHUNK", chunk)),
                         (B * H * D, 1, 1), (D, 1, 1), "metal")
    return partial, combine


def _run(call: KernelCall, inputs: list) -> list:
    if call.name not in _kernels:
        build = mx.fast.metal_kernel if call.backend == "metal" else mx.fast.cuda_kernel
        _kernels[call.name] = build(
            name=call.name, input_names=[n for n, _ in call.inputs], output_names=[n for n, _, _ in call.outputs],
            source=call.source, header=METAL_HEADER if call.backend == "metal" else HEADER,
            ensure_row_contiguous=True)
    return _kernels[call.name](inputs=inputs, template=list(call.template), grid=call.grid,
                               threadgroup=call.threadgroup, output_shapes=[s for _, _, s in call.outputs],
                               output_dtypes=[d for _, d, _ in call.outputs])


def _launch(queries, kv_arrays, capacity: int, kv_heads: int, length, scale: float, sinks, bits: int,
            group_size: int, turboquant: Optional[tuple[int, int]] = None) -> mx.array:
    backend = "metal" if turboquant and _backend() == "metal" else "cuda"
    partial, combine = plan(queries.shape, queries.dtype, kv_heads, capacity, scale, bits=bits,
                            group_size=group_size, sinks=sinks is not None, turboquant=turboquant, backend=backend)
    o_part, ml = _run(partial, [queries, *kv_arrays, length])
    return _run(combine, [o_part, ml, length, *([] if sinks is None else [sinks.astype(mx.float32)])])[0]


def decode_attention(queries: mx.array, keys: mx.array, values: mx.array, length: mx.array, scale: float,
                     sinks: Optional[mx.array] = None) -> mx.array:
    """queries [B, H, 1, D] over keys / values [B, KV, capacity, D] up to `length` (int32, one
    element, on the device) -> [B, H, 1, D]. Callers check `decode_gap` first."""
    return _launch(queries, [keys, values], keys.shape[2], keys.shape[1], length, scale, sinks, 0, 64)


def quantized_decode_attention(queries: mx.array, q_keys: Sequence[mx.array], q_values: Sequence[mx.array],
                               length: mx.array, scale: float, group_size: int, bits: int,
                               sinks: Optional[mx.array] = None) -> mx.array:
    """As `decode_attention` over `mx.quantize` triples (codes [B, KV, capacity, D * bits / 32],
    scales, biases [B, KV, capacity, D / group_size]). Callers check `decode_gap` first."""
    codes = q_keys[0]
    return _launch(queries, [*q_keys, *q_values], codes.shape[2], codes.shape[1], length, scale, sinks, bits,
                   group_size)


def turboquant_decode_attention(rotated_queries: mx.array, keys: Sequence[mx.array], values: Sequence[mx.array],
                                key_book: mx.array, value_book: mx.array, length: mx.array) -> mx.array:
    """softmax(q.k) v for one query token over TurboQuant K/V up to `length`, in the rotations' space:
    `rotated_queries` [B, H, 1, D] are the key rotation of the scaled queries (the kernel applies no
    scale), `keys` / `values` are (norms float16 [B, KV, capacity], packed indices uint32 [B, KV,
    capacity, D * bits / 32]), the books the codecs' float32 codebooks (2^bits entries). Returns
    float32 [B, H, 1, D] in the value rotation's space. Callers check `turboquant_decode_gap` first."""
    norms = keys[0]
    widths = tuple(int(book.shape[0]).bit_length() - 1 for book in (key_book, value_book))
    return _launch(rotated_queries.astype(mx.float32), [keys[0], keys[1], key_book, values[0], values[1], value_book],
                   norms.shape[2], norms.shape[1], length, 1.0, None, 0, 64, turboquant=widths)
