"""The fused decode kernels' launchers (`fused_decode_source`), their MLX-op references, and gaps.

A dense layer's one-token step runs as `qkv_attention`: `qkv_rope` (norm + q/k/v GEMVs + q/k norm +
RoPE + the new K/V rows) and decode attention (`sdpa_decode`, two launches), or, with the rows
written in place, the q/k/v GEMV and one `rope_attention` launch for the rest; then `gemv` (output
projection + residual), `gemv_swiglu` (norm + gate/up GEMVs + silu * up) and `gemv` (down projection
+ residual); the step ends with `gemv` (final norm + head). With `MMA` (off by default) the 4-bit
GEMVs run on the tensor cores instead (`mma_gemv_source`: the same three kernels, mma.sync products).
Two executors run that plan with one interface:

- `CudaFusedOps`: the CUDA kernels through `mx.fast.cuda_kernel` (CUDA only);
- `ReferenceFusedOps`: the same math as MLX ops (float32 sums, the same roundings to T): what
  `benchmarks/gpu_check.py` holds each kernel to on the device, and what runs the fused decoder's
  plumbing (weights, RoPE frequencies, norms, buffers) on the CPU in the tests.

The new K/V rows reach the static buffer [2, HKV, CAP, D] (keys, then values) in one of two ways:
`INPLACE` (the default where the kernel runs): `qkv_rope` writes them into the buffer it is given
through a const_cast, and no other op is encoded. That is safe only for a buffer nothing else can
see: the fused decoder makes its buffers itself (copies of the prefix, never the exact cache's
arrays), hands them only to its compiled step, and takes every later read (attention, write-back)
from the same array after the write (attention reads the queries `qkv_rope` returns, so it is
ordered after it). `scatter`: `qkv_rope` returns the rows and one `put_along_axis` writes them
(one more kernel per layer); `KV_WRITE` chooses, for measuring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import numpy as np

from mlxbun.kernels.common import HALF, Gap, cuda_available, float_bits
from mlxbun.kernels.fused_decode_source import GEMV, GEMV_SWIGLU, HEADER, QKV_PROJ, ROPE_KV
from mlxbun.kernels.mma_gemv_source import GEMV_MMA, GEMV_SWIGLU_MMA, QKV_PROJ_MMA
from mlxbun.kernels.mma_gemv_source import HEADER as MMA_HEADER
from mlxbun.kernels.rope_attention import Counters, rope_attention, rope_attention_gap
from mlxbun.kernels.sdpa_decode import decode_attention, decode_gap

__all__ = ["CODES", "FUSED_BITS", "FUSED_CHECKED", "FUSED_GROUPS", "KV_WRITE", "MAX_HEAD_DIM", "MMA", "MMA_EARLY",
           "MMA_HEAD", "MMA_KINDS", "MMA_MAX_K", "MMA_PLAIN", "MMA_QKV", "MMA_SWIGLU", "NORM_VEC", "NW", "QUNROLL",
           "ROPE_ATTENTION", "ROPE_ATTENTION_MAX_SPLITS", "CudaFusedOps", "ReferenceFusedOps", "Weights",
           "backend_gap", "composed_qkv_attention", "dtype_gap", "kernel_signature", "mma_split", "rope_inv_freq",
           "split_for", "uses_mma", "weights_gap"]

FUSED_BITS = (16, 4, 8)  # 16: bfloat16 / float16 weights; 4, 8: affine codes
FUSED_GROUPS = (32, 64, 128)
NW = 8  # warps per block of the GEMVs
# Rows per warp (gemv and gemv_swiglu: RW of gate and RW of up; the q / k / v projection: QKV_RW): a
# chunk of x is read and converted once for all of them, and their loads are in flight together.
RW = 2
QKV_RW = 2
# How a lane turns 4 / 8-bit codes into floats (fused_decode_source's mlxbun_rows_dot): 0 the 2^23
# offset (three instructions a code), 1 subnormal floats (two; the same bits: 30 of 30 GEMVs bit-equal
# to CODES 0 on an H100, raw 26). Llama-3-8B 4-bit decoded 298 tok/s against CODES 0's 272 there.
CODES = 1
# The code loop's unrolling (0: two chunks per lane for one row per warp, else one; 2 measured 0.96x
# on the 8B 4-bit step, raw 26).
QUNROLL = 0
# The 4-bit GEMVs on the tensor cores (`mma_gemv_source`): 0 off (the FFMA loop), 1 (codes as exact
# 16-bit pairs), 2 (bf16 only: the codes' 2^7 taken out in the scale term; half runs MMA 1's pairs).
# Off: on an H100 (benchmarks/gpu-fused.md, raw 27) they passed the device check (MMA 1 and 2, every
# kind) and decoded the 8B 4-bit step no faster (the q/k/v GEMV a third faster, the down projection a
# quarter slower). Since then their source was reshaped (the staging shared with NORM_VEC, the loads a
# lambda for MMA_EARLY): other sm_90 code, the same bits on the emulator (48 of 48 outputs compared).
# A knob of benchmarks/gpu_fused.py until a bench says where it is faster.
MMA = 0
# Which GEMVs MMA takes, a bit each: MMA_QKV (the q/k/v projection), MMA_SWIGLU (norm + gate/up),
# MMA_PLAIN (o_proj and down_proj, no norm), MMA_HEAD (norm + the head).
MMA_QKV, MMA_SWIGLU, MMA_PLAIN, MMA_HEAD = 1, 2, 4, 8
MMA_KINDS = MMA_QKV | MMA_SWIGLU | MMA_PLAIN | MMA_HEAD
MMA_MAX_K = 16384  # inputs wider than this keep the FFMA loop (x lives in shared memory)
# Whether a warp's first loads of codes go out before the block stages x (they do not need it): the
# staging's latency hidden behind them, at the price of more registers live at once (swiglu 106 -> 132
# at the 8B's shape, ptxas). Not yet run on a GPU.
MMA_EARLY = 0
# How the FFMA GEMVs with a norm stage rms_norm(x) in shared memory: 0 two passes of 2-byte loads
# (`mlxbun_rms_to_shared`, device-checked), 1 x and the norm weight read once in 16-byte loads
# (`mlxbun_stage_x`, as the MMA kernels do; its sum of squares adds in another order). A knob of
# benchmarks/gpu_fused.py, not yet run on a GPU: raw 27 saw the q/k/v GEMV a third faster on the MMA
# kernels, which stage so.
NORM_VEC = 0
MAX_HEAD_DIM = 1024  # rope_kv: a thread per element of a head
# Split-K across warps: a GEMV of few rows gives each row SPLIT warps (each takes every SPLIT-th run
# of 32 chunks; their sums added in warp order), so the GPU has enough loads in flight. The GEMVs
# aim at TARGET_WARPS warps in all (about 32 per SM of an H100 / H200). Module-level knobs, swept by
# benchmarks/gpu_fused.py --knobs.
TARGET_WARPS = 4096
MAX_SPLIT = NW
KV_WRITE = "inplace"  # or "scatter" (see the module docstring)
# Whether a layer's q / k norm, RoPE, K/V append, attention and merge run as one launch
# (`rope_attention`: ROPE_KV and the attention's two launches in one, the same arithmetic: bit-equal
# to them in benchmarks/gpu_fused.py's check, 136 of 136 on an H100, raw 24) where the K/V rows are
# written in place and the buffer has at most ROPE_ATTENTION_MAX_SPLITS splits; else three launches.
# On the H100 at 12 splits (context 512) it decoded 1.04x (1B bf16) to 1.32x (1B 4-bit) the three
# launches' speed, 8B 4-bit even; at 65 splits (16k) 0.88-0.95x: its merge runs in one block per KV
# head. Knobs of benchmarks/gpu_fused.py.
ROPE_ATTENTION = True
ROPE_ATTENTION_MAX_SPLITS = 16
# Whether the kernels have passed `benchmarks/gpu_fused.py --sections check` on a CUDA GPU (each
# within its bound of the MLX-op reference, bit-equal run to run, the in-place write equal to the
# scatter). These kernels (QKV_PROJ + ROPE_KV, RW rows per warp, the conversion-free code loop) have,
# on an H100: 180 of 180 in five knob variants (benchmarks/gpu-h200-fast-raw/22-fused-h100-qkv-split;
# raw 21 before the q / k / v split); with CODES, the attention's prefetch and batched merge, 166 of
# 166 in two variants (raw 26). Set it False to take the kernels out while a change to them
# awaits that check: a fast run then takes the compiled step and says why (the check script turns
# them on for its run).
FUSED_CHECKED = True


@dataclass(frozen=True)
class Weights:
    """One projection as the kernels read it: 16-bit `w` [N, K] (`bits` 16; scales and biases are
    `w` again, never read), or affine codes `w` [N, K * bits / 32] uint32 with per-group scales and
    biases [N, K / group_size]."""

    w: mx.array
    scales: mx.array
    biases: mx.array
    bits: int = 16
    group_size: int = 0

    @property
    def rows(self) -> int:
        return self.w.shape[0]

    @property
    def width(self) -> int:
        return self.w.shape[1] if self.bits == 16 else self.w.shape[1] * 32 // self.bits

    @property
    def dtype(self):
        return self.scales.dtype

    @classmethod
    def dense(cls, w: mx.array) -> "Weights":
        return cls(w, w, w)

    def dequantized(self) -> mx.array:
        """The weight as float32 [N, K] (the references' operand)."""
        if self.bits == 16:
            return self.w.astype(mx.float32)
        return mx.dequantize(self.w, self.scales.astype(mx.float32), self.biases.astype(mx.float32),
                             group_size=self.group_size, bits=self.bits)


def weights_gap(name: str, weights: list[Weights], width: int, dtype) -> Optional[Gap]:
    """Why the kernels cannot read these projections (one kernel's operands: one format) of input
    `width` with activations of `dtype`."""
    first = weights[0]
    for w in weights:
        if (w.bits, w.group_size) != (first.bits, first.group_size):
            return Gap(f"{name}: projections of one kernel in two formats ({first.bits}-bit g{first.group_size} "
                       f"and {w.bits}-bit g{w.group_size})")
        if w.dtype != dtype:
            return Gap(f"{name}: {w.dtype} weights with {dtype} activations (the kernels want one dtype)")
        if w.width != width:
            return Gap(f"{name}: input width {w.width}, expected {width}")
    if first.bits not in FUSED_BITS or (first.bits != 16 and first.group_size not in FUSED_GROUPS):
        return Gap(f"{name}: {first.bits}-bit weights in groups of {first.group_size} (the kernels do 16-bit "
                   f"and affine {FUSED_BITS[1:]} bits in groups {FUSED_GROUPS})")
    chunk = 8 if first.bits == 16 else 128 // first.bits
    if width % chunk or (first.bits != 16 and width % first.group_size):
        return Gap(f"{name}: input width {width} (the kernels read whole 16-byte chunks of one group)")
    return None


def rope_inv_freq(dims: int, base: Optional[float] = None, freqs: Optional[mx.array] = None) -> mx.array:
    """The inverse frequencies [dims / 2] `mx.fast.rope` rotates by: 1 / freqs when given, else
    2^(-(i / (dims / 2)) * log2(base)), as MLX's kernel computes them (float32)."""
    if freqs is not None:
        inv = (1.0 / freqs.astype(mx.float32)).astype(mx.float32)
        mx.eval(inv)  # a constant of the step, not a division it repeats (the H100 run counted 16 per step)
        return inv
    d = np.arange(dims // 2, dtype=np.float32) / np.float32(dims // 2)
    return mx.array(np.exp2(-d * np.float32(np.log2(base))).astype(np.float32))


def kernel_signature(kind: str, dtype, bits: int) -> tuple[list, list]:
    """((name, dtype) inputs, (name, dtype) outputs) of kernel `kind` ("gemv", "swiglu", "qkv", "rope")."""
    wt = mx.uint32 if bits != 16 else dtype
    proj = lambda p: [(f"w{p}", wt), (f"s{p}", dtype), (f"b{p}", dtype)]  # noqa: E731
    if kind == "gemv":
        return ([("x", dtype), ("norm_w", dtype), ("w", wt), ("scales", dtype), ("biases", dtype),
                 ("residual", dtype)], [("out", dtype)])
    if kind == "swiglu":
        return [("x", dtype), ("norm_w", dtype), *proj("g"), *proj("u")], [("out", dtype)]
    if kind == "qkv":
        return [("x", dtype), ("norm_w", dtype), *proj("q"), *proj("k"), *proj("v")], [("sums", mx.float32)]
    if kind == "rope":
        return ([("sums", mx.float32), ("bias_q", dtype), ("bias_k", dtype), ("bias_v", dtype), ("q_norm", dtype),
                 ("k_norm", dtype), ("inv_freq", mx.float32), ("pos", mx.int32), ("kv", dtype)],
                [("q_out", dtype), ("kv_new", dtype), ("next_pos", mx.int32)])
    raise ValueError(f"kernel_signature: no kernel {kind!r} (gemv, swiglu, qkv, rope)")


_SOURCES = {"gemv": GEMV, "swiglu": GEMV_SWIGLU, "qkv": QKV_PROJ, "rope": ROPE_KV}
_MMA_SOURCES = {"gemv": GEMV_MMA, "swiglu": GEMV_SWIGLU_MMA, "qkv": QKV_PROJ_MMA}
_kernels: dict[tuple, object] = {}


def _kernel(kind: str, dtype, bits: int, mma: bool = False):
    key = (kind, dtype, bits, mma)
    if key not in _kernels:
        inputs, outputs = kernel_signature(kind, dtype, bits)
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"mlxbun_fused_{kind}_{'mma' if mma else ('q' if bits != 16 else 'h')}",
            input_names=[n for n, _ in inputs], output_names=[n for n, _ in outputs],
            source=(_MMA_SOURCES if mma else _SOURCES)[kind], header=MMA_HEADER if mma else HEADER,
            ensure_row_contiguous=True)
    return _kernels[key]


def uses_mma(w: Weights, kind: int) -> bool:
    """Whether the GEMV of `kind` (an MMA_* bit) over `w` runs on the tensor cores (MMA on for that
    kind, 4-bit codes, x fits shared memory)."""
    return MMA != 0 and bool(MMA_KINDS & kind) and w.bits == 4 and w.width <= MMA_MAX_K


def mma_split(w: Weights, rows: int, target: Optional[int] = None) -> int:
    """Warps per 16-row tile of the tensor-core GEMVs: the smallest power of two up to MAX_SPLIT (and
    NW: a block holds whole tiles) that gives `target` (TARGET_WARPS) warps in all, each taking an
    equal run of at least 4 groups."""
    groups = w.width // w.group_size
    split = 1
    while (split < min(MAX_SPLIT, NW) and -(-rows // 16) * split < (target or TARGET_WARPS)
           and groups % (2 * split) == 0 and groups // (2 * split) >= 4):
        split *= 2
    return split


def _layout(w: Weights, rows: int, rw: int, kind: int) -> tuple[bool, int, int]:
    """(tensor cores?, split, rows a warp takes of each matrix) of the GEMV of `kind` (an MMA_* bit)
    over `rows` rows of `w` (the swiglu's warps take rows of gate and of up)."""
    if uses_mma(w, kind):
        return True, mma_split(w, rows), 16
    matrices = 2 if kind == MMA_SWIGLU else 1
    return False, split_for(w, matrices * rows, rw=matrices * rw), rw


def split_for(w: Weights, rows: int, target: Optional[int] = None, rw: int = 1) -> int:
    """Warps per `rw` output rows: the smallest power of two up to MAX_SPLIT that gives `target`
    (TARGET_WARPS) warps in all, while every lane still reads at least one 16-byte chunk."""
    chunks = w.width // (8 if w.bits == 16 else 128 // w.bits)
    split = 1
    while split < MAX_SPLIT and -(-rows // rw) * split < (target or TARGET_WARPS) and chunks >= 64 * split:
        split *= 2
    return split


def _common(dtype, w: Weights, K: int, N: Optional[int], nw: int = NW, split: int = 1, rw: int = 1) -> list:
    """The GEMV kernels' shared template constants (N None: QKV_PROJ, which counts its rows itself)."""
    rows = [] if N is None else [("N", N)]
    return [("T", dtype), ("BF16", dtype == mx.bfloat16), ("K", K), *rows, ("BITS", w.bits),
            ("GS", w.group_size or 32), ("NW", nw), ("SPLIT", split), ("RW", rw), ("CODES", CODES),
            ("QUNROLL", QUNROLL), ("NORM_VEC", bool(NORM_VEC)), ("MMA", MMA), ("MMA_EARLY", bool(MMA_EARLY))]


def _grid(N: int, split: int, rw: int) -> tuple:
    rows_per_block = NW // split * rw
    return (-(-N // rows_per_block) * NW * 32, 1, 1)


def _operands(w: Weights) -> list:
    return [w.w, w.scales, w.biases]


class CudaFusedOps:
    """The fused kernels on MLX's CUDA backend (`inplace`: the K/V rows written by `qkv_rope`)."""

    name = "cuda"

    def __init__(self, inplace: Optional[bool] = None):
        self.inplace = (KV_WRITE == "inplace") if inplace is None else inplace
        self.counters = Counters()  # rope_attention's merge counters (zero between launches)

    @staticmethod
    def gemv(x, w: Weights, *, norm: Optional[tuple] = None, residual: Optional[mx.array] = None) -> mx.array:
        """(residual +) w . (rms_norm(x, *norm) or x) -> [N]; `norm`: (weight, eps)."""
        dtype, K, N = x.dtype, w.width, w.rows
        norm_w, eps = norm if norm is not None else (x, 0.0)
        mma, split, rw = _layout(w, N, RW, MMA_HEAD if norm is not None else MMA_PLAIN)
        template = _common(dtype, w, K, N, split=split, rw=rw) + [
            ("NORM", norm is not None), ("RESIDUAL", residual is not None), ("EPS_BITS", float_bits(eps))]
        return _kernel("gemv", dtype, w.bits, mma)(
            inputs=[x, norm_w, *_operands(w), x if residual is None else residual], template=template,
            grid=_grid(N, split, rw), threadgroup=(NW * 32, 1, 1), output_shapes=[(N,)], output_dtypes=[dtype])[0]

    @staticmethod
    def gemv_swiglu(x, norm: tuple, gate: Weights, up: Weights) -> mx.array:
        dtype, K, N = x.dtype, gate.width, gate.rows
        mma, split, rw = _layout(gate, N, RW, MMA_SWIGLU)
        template = _common(dtype, gate, K, N, split=split, rw=rw) + [("EPS_BITS", float_bits(norm[1]))]
        return _kernel("swiglu", dtype, gate.bits, mma)(
            inputs=[x, norm[0], *_operands(gate), *_operands(up)], template=template,
            grid=_grid(N, split, rw), threadgroup=(NW * 32, 1, 1), output_shapes=[(N,)], output_dtypes=[dtype])[0]

    def qkv_attention(self, x, norm: tuple, proj: tuple, attn) -> tuple[mx.array, mx.array, mx.array]:
        """(attention output [HQ * D], the buffer holding the new rows, next_pos [1]): `qkv_rope` then
        `attention`, or, with ROPE_ATTENTION and the rows written in place, QKV_PROJ then one
        `rope_attention` launch (the same arithmetic)."""
        if ROPE_ATTENTION and self.inplace and rope_attention_gap(attn, ROPE_ATTENTION_MAX_SPLITS) is None:
            out, next_pos = rope_attention(self.qkv_sums(x, norm, proj), attn, x.dtype, self.counters)
            return out, attn.buffer, next_pos
        return composed_qkv_attention(self, x, norm, proj, attn)

    @staticmethod
    def qkv_sums(x, norm: tuple, proj: tuple) -> mx.array:
        """QKV_PROJ: rms_norm(x) through the q, k and v projections, float32 sums [NQ + 2 NKV]."""
        q, k, v = proj
        dtype, K = x.dtype, q.width
        rows = q.rows + k.rows + v.rows
        mma, split, rw = _layout(q, rows, QKV_RW, MMA_QKV)
        template = _common(dtype, q, K, None, split=split, rw=rw) + [
            ("NQ", q.rows), ("NKV", k.rows), ("EPS_BITS", float_bits(norm[1]))]
        return _kernel("qkv", dtype, q.bits, mma)(
            inputs=[x, norm[0], *_operands(q), *_operands(k), *_operands(v)], template=template,
            grid=_grid(rows, split, rw), threadgroup=(NW * 32, 1, 1), output_shapes=[(rows,)],
            output_dtypes=[mx.float32])[0]

    def qkv_rope(self, x, norm: tuple, proj: tuple, attn) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """(queries [HQ * D], the buffer holding the new rows, next_pos [1], kv_new [2 * HKV * D]).
        `proj`: the q, k, v Weights; `attn`: the layer's `FusedAttention` facts and arrays."""
        dtype, a = x.dtype, attn
        buffer, pos = a.buffer, a.pos
        sums = self.qkv_sums(x, norm, proj)
        warps = -(-a.head_dim // 32)
        template = [("T", dtype), ("NW", warps), ("HQ", a.hq), ("HKV", a.hkv), ("D", a.head_dim),
                    ("QK_NORM", a.q_norm is not None), ("QK_EPS_BITS", float_bits(a.qk_eps)),
                    ("BIAS", a.bias is not None), ("ROPE_TRAD", a.traditional),
                    ("ROPE_SCALE_BITS", float_bits(a.rope_scale)), ("CAP", buffer.shape[2]), ("INPLACE", self.inplace)]
        bias = a.bias or (x, x, x)
        qn, kn = (a.q_norm, a.k_norm) if a.q_norm is not None else (x, x)
        q_out, kv_new, next_pos = _kernel("rope", dtype, 16)(
            inputs=[sums, *bias, qn, kn, a.inv_freq, pos, buffer], template=template,
            grid=((a.hq + 2 * a.hkv) * warps * 32, 1, 1), threadgroup=(warps * 32, 1, 1),
            output_shapes=[(a.hq * a.head_dim,), (2 * a.hkv * a.head_dim,), (1,)],
            output_dtypes=[dtype, dtype, mx.int32])
        if not self.inplace:
            buffer = _write(buffer, kv_new, pos, a)
        return q_out, buffer, next_pos, kv_new

    @staticmethod
    def attention(q, buffer, length, attn) -> mx.array:
        """softmax(q k / sqrt) v over the buffer's first `length` positions -> [HQ * D]."""
        queries = q.reshape(1, attn.hq, 1, attn.head_dim)
        return decode_attention(queries, buffer[0:1], buffer[1:2], length, attn.scale).reshape(-1)

    @staticmethod
    def attention_gap(attn, dtype) -> Optional[Gap]:
        queries = mx.zeros((1, attn.hq, 1, attn.head_dim), dtype)
        return decode_gap(queries, (1, attn.hkv, attn.capacity, attn.head_dim), dtype,
                          values_shape=(1, attn.hkv, attn.capacity, attn.head_dim))


def composed_qkv_attention(ops, x, norm: tuple, proj: tuple, attn) -> tuple[mx.array, mx.array, mx.array]:
    """`qkv_attention` as `ops.qkv_rope` then `ops.attention`: (output [HQ * D], buffer, next_pos)."""
    q, buffer, next_pos, _ = ops.qkv_rope(x, norm, proj, attn)
    return ops.attention(q, buffer, next_pos, attn), buffer, next_pos


def _write(buffer: mx.array, kv_new: mx.array, pos: mx.array, attn) -> mx.array:
    """The buffer [2, HKV, CAP, D] with the rows kv_new [2 * HKV * D] at position `pos` (one scatter)."""
    rows = kv_new.reshape(2, attn.hkv, 1, attn.head_dim)
    index = mx.broadcast_to(pos.reshape(1, 1, 1, 1), rows.shape)
    return mx.put_along_axis(buffer, index, rows, axis=2)


def _r(x: mx.array, dtype) -> mx.array:
    """Round float32 `x` to `dtype` and back (where the kernels round)."""
    return x.astype(dtype).astype(mx.float32)


def _rms(x: mx.array, w: mx.array, eps: float, dtype) -> mx.array:
    x = x.astype(mx.float32)
    inv = mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)
    return _r(_r(x * inv, dtype) * w.astype(mx.float32), dtype)


def _matvec(x32: mx.array, w: Weights) -> mx.array:
    return (w.dequantized() @ x32.reshape(-1, 1)).reshape(-1)


class ReferenceFusedOps:
    """The fused kernels' math as MLX ops (any backend): float32 sums, the kernels' roundings."""

    name = "reference"
    inplace = False

    @staticmethod
    def gemv(x, w: Weights, *, norm: Optional[tuple] = None, residual: Optional[mx.array] = None) -> mx.array:
        dtype = x.dtype
        xin = _rms(x.reshape(-1), norm[0], norm[1], dtype) if norm is not None else x.reshape(-1).astype(mx.float32)
        y = _r(_matvec(xin, w), dtype)
        if residual is not None:
            y = residual.reshape(-1).astype(mx.float32) + y
        return y.astype(dtype)

    @staticmethod
    def gemv_swiglu(x, norm: tuple, gate: Weights, up: Weights) -> mx.array:
        dtype = x.dtype
        xin = _rms(x.reshape(-1), norm[0], norm[1], dtype)
        g, u = _r(_matvec(xin, gate), dtype), _r(_matvec(xin, up), dtype)
        return (_r(g / (1.0 + mx.exp(-g)), dtype) * u).astype(dtype)

    def qkv_rope(self, x, norm: tuple, proj: tuple, attn):
        a, dtype, D = attn, x.dtype, attn.head_dim
        xin = _rms(x.reshape(-1), norm[0], norm[1], dtype)
        heads = []
        for i, w in enumerate(proj):
            y = _matvec(xin, w)
            if a.bias is not None:
                y = y + a.bias[i].astype(mx.float32)
            heads.append(_r(y, dtype).reshape(-1, D))
        q, k, v = heads
        if a.q_norm is not None:
            q, k = (_r(_r(t * mx.rsqrt(mx.mean(t * t, axis=-1, keepdims=True) + a.qk_eps), dtype)
                       * n.astype(mx.float32), dtype) for t, n in ((q, a.q_norm), (k, a.k_norm)))
        theta = a.pos.astype(mx.float32) * a.rope_scale * a.inv_freq  # [D / 2]
        cos, sin = mx.cos(theta), mx.sin(theta)
        q, k = (_r(_rope(t, cos, sin, a.traditional), dtype) for t in (q, k))
        kv_new = mx.concatenate([k.reshape(-1), v.reshape(-1)]).astype(dtype)
        next_pos = (a.pos + 1).astype(mx.int32).reshape(1)
        return q.reshape(-1).astype(dtype), _write(a.buffer, kv_new, a.pos, a), next_pos, kv_new

    def qkv_attention(self, x, norm: tuple, proj: tuple, attn) -> tuple[mx.array, mx.array, mx.array]:
        return composed_qkv_attention(self, x, norm, proj, attn)

    @staticmethod
    def attention(q, buffer, length, attn) -> mx.array:
        queries = q.reshape(1, attn.hq, 1, attn.head_dim)
        mask = (mx.arange(buffer.shape[2]) < length.reshape(1))[None, None, None, :]
        out = mx.fast.scaled_dot_product_attention(queries, buffer[0:1], buffer[1:2], scale=attn.scale, mask=mask)
        return out.reshape(-1)

    @staticmethod
    def attention_gap(attn, dtype) -> Optional[Gap]:
        return None


def _rope(t: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """RoPE of heads t [n, D] (float32) with cos / sin [D / 2]."""
    if traditional:
        even, odd = t[:, 0::2], t[:, 1::2]
        return mx.stack([even * cos - odd * sin, odd * cos + even * sin], axis=-1).reshape(t.shape)
    half = t.shape[-1] // 2
    a, b = t[:, :half], t[:, half:]
    return mx.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)


def backend_gap() -> Optional[Gap]:
    """Why the CUDA kernels cannot run here at all."""
    if not cuda_available():
        return Gap("no CUDA device (the fused kernels are CUDA only)")
    if mx.default_device() != mx.gpu:
        return Gap(f"default device {mx.default_device()} (the fused kernels run on the GPU)")
    if not FUSED_CHECKED:
        return Gap("the fused kernels have not yet passed their GPU check (benchmarks/gpu_fused.py "
                   "--sections check)")
    return None


def dtype_gap(dtype) -> Optional[Gap]:
    if dtype not in HALF:
        return Gap(f"{dtype} activations (the fused kernels do bfloat16 and float16)")
    return None
