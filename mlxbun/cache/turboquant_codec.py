"""The TurboQuant MSE codec, held bit-exact to mlx-vlm 0.7.10 (`mlx_vlm/turboquant.py`).

A vector x is stored as its norm (float16) plus one b-bit index per coordinate:
  1. u = x / max(|x|, 1e-6)                      (a unit vector)
  2. r = Pi u                                    (a fixed random rotation)
  3. idx_i = #{midpoints below r_i}              (nearest codeword of a per-coordinate
     Lloyd-Max codebook for the coordinate law of a random unit vector in R^D)
  4. the indices are bit-packed little-endian into uint32 words.
Decoding is |x| * Pi^T c[idx].

The rotation is a randomized Hadamard transform H diag(s) / sqrt(D) for power-of-two
head dims and a Haar-random orthogonal matrix (numpy QR) otherwise. Codebooks,
rotations and sign vectors come from numpy with mlx-vlm's seeds and float32
arithmetic, so the same (dim, bits, seed) yields the same arrays; every mlx op
below is the one mlx-vlm's CPU path runs, in the same order and dtypes, so packed
indices, dequantized vectors and rotated-space attention match it bit for bit on
the same backend. (mlx-vlm's Metal kernels compute the same maths but are not
what the oracle tests hold us to.)

Bit widths (mlx-vlm's convention): integers, or halves meaning keys floor(b) bits
and values ceil(b) bits (3.5 = 3-bit keys + 4-bit values).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np

from mlxbun.errors import ConfigError, UnsupportedModelError

__all__ = [
    "EPS",
    "MAX_BITS",
    "TurboQuantState",
    "TurboQuantCodec",
    "resolve_kv_bits",
    "lloyd_max_codebook",
    "rotation_matrix",
    "hadamard_signs",
    "packed_width",
    "pack_indices",
    "unpack_indices",
    "unpack_indices_u8",
    "state_nbytes_per_vector",
    "rotated_attention",
    "merge_softmax_partials",
]

EPS = 1e-6  # norm floor before normalizing (mlx-vlm's _EPS)
MAX_BITS = 8  # 256 codewords; wider widths gain nothing over fp16 norms + fp32 math
_GRID_POINTS = 32768
_LLOYD_ITERS = 100
_LLOYD_TOL = 1e-6


class TurboQuantState(NamedTuple):
    """Packed vectors: `norms` float16 [..., T], `indices` uint32 [..., T, packed_width]."""

    norms: mx.array
    indices: mx.array


# -- bit widths ---------------------------------------------------------------------


def _half_step(bits, what: str) -> float:
    try:
        b = float(bits)
    except (TypeError, ValueError):
        raise ConfigError(f"TurboQuant {what}={bits!r} is not a number") from None
    if isinstance(bits, bool) or not math.isfinite(b):
        raise ConfigError(f"TurboQuant {what}={bits!r} is not a bit width")
    rounded = round(b * 2) / 2
    if not math.isclose(b, rounded, abs_tol=1e-6):
        raise ConfigError(
            f"TurboQuant {what}={bits!r}: only integer and .5 bit widths are defined"
        )
    if not 1 <= rounded <= MAX_BITS:
        raise ConfigError(f"TurboQuant {what}={bits!r}: must be between 1 and {MAX_BITS}")
    return rounded


def resolve_kv_bits(
    bits: float, key_bits: Optional[float] = None, value_bits: Optional[float] = None
) -> Tuple[float, int, int]:
    """(bits, key_bits, value_bits) as mlx-vlm resolves them: a half width b gives
    keys floor(b) and values ceil(b) unless overridden. Per-tensor half widths
    (mlx-vlm's data-dependent outlier-channel split codec) are not ported."""
    bits = _half_step(bits, "bits")
    fractional = bits != int(bits)
    kb = _half_step(key_bits, "key_bits") if key_bits is not None else (
        math.floor(bits) if fractional else bits)
    vb = _half_step(value_bits, "value_bits") if value_bits is not None else (
        math.ceil(bits) if fractional else bits)
    for name, b in (("key_bits", kb), ("value_bits", vb)):
        if b != int(b):
            raise UnsupportedModelError(
                f"TurboQuant {name}={b}: a fractional per-tensor width selects mlx-vlm's "
                "outlier-channel split codec, which mlxbun does not port"
            )
    return bits, int(kb), int(vb)


# -- codebook -----------------------------------------------------------------------


def _coordinate_pdf(grid: np.ndarray, dim: int) -> np.ndarray:
    """Discretized density of one coordinate of a uniform unit vector in R^dim:
    p(x) ~ (1 - x^2)^((dim - 3) / 2), in logs so large dims do not overflow."""
    if dim <= 1:
        pdf = np.ones_like(grid)
    else:
        log_coeff = (
            math.lgamma(dim / 2) - 0.5 * math.log(math.pi) - math.lgamma((dim - 1) / 2)
        )
        log_pdf = log_coeff + ((dim - 3) / 2) * np.log(np.clip(1.0 - grid**2, 1e-30, None))
        pdf = np.exp(log_pdf - np.max(log_pdf))
    total = pdf.sum()
    if total == 0:
        return np.full_like(grid, 1.0 / len(grid))
    return pdf / total


@lru_cache(maxsize=None)
def _codebook_np(dim: int, bits: int) -> np.ndarray:
    levels = 1 << bits
    if dim <= 1:
        return np.linspace(-1.0, 1.0, levels, dtype=np.float32)
    grid = np.linspace(-1.0 + 1e-6, 1.0 - 1e-6, _GRID_POINTS, dtype=np.float32)
    weights = _coordinate_pdf(grid, dim)
    cdf = np.cumsum(weights)
    quantiles = (np.arange(levels, dtype=np.float32) + 0.5) / levels
    centroids = np.interp(quantiles, cdf, grid).astype(np.float32)  # start at quantiles

    for _ in range(_LLOYD_ITERS):
        bounds = np.empty(levels + 1, dtype=np.float32)
        bounds[0], bounds[-1] = -1.0, 1.0
        bounds[1:-1] = 0.5 * (centroids[:-1] + centroids[1:])
        # The grid is sorted, so each cell [b_i, b_i+1) is a contiguous slice (the
        # last cell is closed); summing the slice adds the same float32 values in
        # the same order as mlx-vlm's boolean masks, at O(grid) per sweep.
        lo = np.searchsorted(grid, bounds[:-1], side="left")
        hi = np.searchsorted(grid, bounds[1:], side="left")
        hi[-1] = np.searchsorted(grid, bounds[-1], side="right")
        updated = centroids.copy()
        for i in range(levels):
            w = weights[lo[i] : hi[i]]
            if w.size == 0:
                continue
            total = w.sum()
            if total > 0:
                updated[i] = np.sum(w * grid[lo[i] : hi[i]]) / total
        converged = np.max(np.abs(updated - centroids)) < _LLOYD_TOL
        centroids = updated
        if converged:
            break
    return centroids.astype(np.float32)


def lloyd_max_codebook(dim: int, bits: int) -> mx.array:
    """The 2**bits float32 codewords minimizing the MSE of one coordinate of a random
    unit vector in R^dim (Lloyd-Max on a 32768-point grid, float32, as mlx-vlm)."""
    if bits <= 0:
        return mx.zeros((0,), dtype=mx.float32)
    return mx.array(_codebook_np(int(dim), int(bits)))


# -- rotations ----------------------------------------------------------------------


def _rng(dim: int, seed: int) -> np.random.Generator:
    return np.random.default_rng(seed + dim * 7919)


@lru_cache(maxsize=None)
def rotation_matrix(dim: int, seed: int) -> mx.array:
    """A Haar-random orthogonal float32 matrix Pi (QR of a Gaussian, signs fixed by
    diag(R)); rows are the rotated basis, so rotate(u) = u @ Pi.T."""
    if dim <= 0:
        return mx.zeros((0, 0), dtype=mx.float32)
    if dim == 1:
        return mx.ones((1, 1), dtype=mx.float32)
    gaussian = _rng(dim, seed).standard_normal((dim, dim), dtype=np.float32)
    q, r = np.linalg.qr(gaussian)
    q *= np.sign(np.diag(r))
    return mx.array(q.astype(np.float32))


@lru_cache(maxsize=None)
def hadamard_signs(dim: int, seed: int) -> mx.array:
    """The +-1 float32 diagonal of the randomized Hadamard transform."""
    if dim <= 0:
        return mx.zeros((0,), dtype=mx.float32)
    return mx.array(_rng(dim, seed).choice([-1.0, 1.0], size=dim).astype(np.float32))


def _is_power_of_two(n: int) -> bool:
    return n > 0 and (n & (n - 1)) == 0


# -- bit packing --------------------------------------------------------------------


def packed_width(length: int, bits: int) -> int:
    """uint32 words holding `length` indices of `bits` bits (no padding between them)."""
    if length == 0 or bits == 0:
        return 0
    return (length * bits + 31) // 32


@lru_cache(maxsize=None)
def _pack_plan(length: int, bits: int):
    """For each output word, the indices that land in it and their shifts.

    Index i occupies bits [i*bits, (i+1)*bits) of the little-endian bit stream;
    a word gets the low part of an index starting in it (<< offset) and the high
    part of one spilling into it (>> (bits - spill)). Slot s of word w is
    (source index, left shift, right shift, valid)."""
    width = packed_width(length, bits)
    slots = [[] for _ in range(width)]
    for i in range(length):
        start = i * bits
        word, offset = divmod(start, 32)
        slots[word].append((i, offset, 0))
        spill = offset + bits - 32
        if spill > 0:
            slots[word + 1].append((i, 0, bits - spill))
    depth = max(len(s) for s in slots)
    src = np.zeros((depth, width), np.int32)
    lsh = np.zeros((depth, width), np.uint32)
    rsh = np.zeros((depth, width), np.uint32)
    valid = np.zeros((depth, width), bool)
    for w, entries in enumerate(slots):
        for s, (i, left, right) in enumerate(entries):
            src[s, w], lsh[s, w], rsh[s, w], valid[s, w] = i, left, right, True
    return src, lsh, rsh, valid


def pack_indices(indices: mx.array, bits: int) -> mx.array:
    """Pack integer indices in [0, 2**bits) along the last axis into uint32 words,
    bit-identical to mlx-vlm's `_pack_lowbit` (index i at bit i*bits, spilling
    into the next word)."""
    length = indices.shape[-1]
    if bits == 0 or length == 0:
        return mx.zeros((*indices.shape[:-1], 0), dtype=mx.uint32)
    values = indices.astype(mx.uint32)
    src, lsh, rsh, valid = _pack_plan(length, bits)
    packed = None
    for s in range(src.shape[0]):  # slots are disjoint bit ranges: OR them
        part = mx.take(values, mx.array(src[s]), axis=-1)
        part = mx.left_shift(mx.right_shift(part, mx.array(rsh[s])), mx.array(lsh[s]))
        part = mx.where(mx.array(valid[s]), part, mx.array(0, dtype=mx.uint32))
        packed = part if packed is None else mx.bitwise_or(packed, part)
    return packed


@lru_cache(maxsize=None)
def _unpack_plan(length: int, bits: int):
    word = np.zeros(length, np.int32)
    offset = np.zeros(length, np.uint32)
    spill_shift = np.zeros(length, np.uint32)
    spills = np.zeros(length, bool)
    for i in range(length):
        w, off = divmod(i * bits, 32)
        word[i], offset[i] = w, off
        spill = off + bits - 32
        if spill > 0:
            spills[i], spill_shift[i] = True, bits - spill
    return word, offset, spill_shift, spills


def unpack_indices(packed: mx.array, bits: int, length: int) -> mx.array:
    """Inverse of `pack_indices`: uint32 indices [..., length]."""
    if bits == 0:
        return mx.zeros((*packed.shape[:-1], 0), dtype=mx.uint32)
    packed = packed.astype(mx.uint32)
    word, offset, spill_shift, spills = _unpack_plan(length, bits)
    low = mx.right_shift(mx.take(packed, mx.array(word), axis=-1), mx.array(offset))
    mask = mx.array((1 << bits) - 1, dtype=mx.uint32)
    if not spills.any():
        return mx.bitwise_and(low, mask)
    nxt = np.minimum(word + 1, packed.shape[-1] - 1).astype(np.int32)
    high = mx.left_shift(mx.take(packed, mx.array(nxt), axis=-1), mx.array(spill_shift))
    high = mx.where(mx.array(spills), high, mx.array(0, dtype=mx.uint32))
    return mx.bitwise_and(mx.bitwise_or(low, high), mask)


@lru_cache(maxsize=None)
def _byte_plan(length: int, bits: int):
    """Index i starts at byte i*bits // 8, bit i*bits % 8 of the little-endian byte
    stream; with bits <= 8 it spans at most that byte and the next."""
    start = np.arange(length, dtype=np.int64) * bits
    byte, shift = start // 8, start % 8
    spills = shift + bits > 8
    # An index that does not spill takes its own byte again, shifted to land at or
    # above bit `bits` (8 - shift >= bits; 7 when shift is 0: only widths <= 7
    # spill), where the mask drops it: no select needed.
    nxt = np.where(spills, byte + 1, byte)
    back = np.where(shift > 0, 8 - shift, 7)
    return (byte.astype(np.int32), shift.astype(np.uint8), nxt.astype(np.int32),
            back.astype(np.uint8), bool(spills.any()))


def unpack_indices_u8(packed: mx.array, bits: int, length: int) -> mx.array:
    """`unpack_indices` as uint8 (the same integers), computed on the bytes of the
    packed words: every temporary is one byte per coordinate, where the uint32 path
    holds several four-byte ones (the decode-path memory hog at long context)."""
    if bits == 0:
        return mx.zeros((*packed.shape[:-1], 0), dtype=mx.uint8)
    if bits > 8:
        raise ValueError(f"unpack_indices_u8: {bits}-bit indices do not fit a byte")
    data = mx.view(packed.astype(mx.uint32), mx.uint8)  # little-endian words -> bytes
    byte, shift, nxt, back, spills = _byte_plan(length, bits)
    low = mx.right_shift(mx.take(data, mx.array(byte), axis=-1), mx.array(shift))
    mask = mx.array((1 << bits) - 1, dtype=mx.uint8)
    if not spills:
        return mx.bitwise_and(low, mask)
    # the high part: the next byte's low bits, shifted up past the (8 - shift) bits
    # the first byte gave (uint8 arithmetic drops what lies above bit 7)
    high = mx.left_shift(mx.take(data, mx.array(nxt), axis=-1), mx.array(back))
    return mx.bitwise_and(mx.bitwise_or(low, high), mask)


def state_nbytes_per_vector(dim: int, bits: int) -> int:
    """Bytes one packed vector takes: a float16 norm plus its uint32 index words."""
    return 2 + 4 * packed_width(dim, bits)


# -- the codec ----------------------------------------------------------------------


class TurboQuantCodec:
    """TurboQuant MSE codec for vectors of one head dim.

    `quantize(x) -> TurboQuantState`, `dequantize(state) -> float32`, `rotate` /
    `unrotate` (the orthogonal map and its inverse), `codewords(state)` (the
    rotated-space unit vectors c[idx], no inverse rotation)."""

    def __init__(self, dim: int, bits: int, seed: int):
        if dim < 1:
            raise ValueError(f"TurboQuantCodec: head dim must be >= 1, got {dim}")
        self.dim, self.bits, self.seed = int(dim), int(bits), int(seed)
        self.use_hadamard = _is_power_of_two(self.dim)
        self.signs = hadamard_signs(self.dim, self.seed) if self.use_hadamard else None
        self.rotation = None if self.use_hadamard else rotation_matrix(self.dim, self.seed)
        self.codebook = lloyd_max_codebook(self.dim, self.bits)
        if self.codebook.shape[0] > 1:
            self.midpoints = (self.codebook[:-1] + self.codebook[1:]) / 2
        else:
            self.midpoints = mx.zeros((0,), dtype=mx.float32)
        self._table = None  # `_byte_table`, built on first use

    def rotate(self, x: mx.array) -> mx.array:
        """Pi x along the last axis."""
        if self.use_hadamard:
            return mx.hadamard_transform(x * self.signs, scale=1.0 / math.sqrt(self.dim))
        return mx.matmul(x, self.rotation.transpose())

    def unrotate(self, x: mx.array) -> mx.array:
        """Pi^T x along the last axis."""
        if self.use_hadamard:
            return mx.hadamard_transform(x, scale=1.0 / math.sqrt(self.dim)) * self.signs
        return mx.matmul(x, self.rotation)

    def quantize(self, vectors: mx.array) -> TurboQuantState:
        """Norms (float16) and packed codeword indices of `vectors` [..., dim]."""
        x = vectors.astype(mx.float32)
        norms = mx.linalg.norm(x, axis=-1)
        unit = x / mx.maximum(norms[..., None], EPS)
        rotated = self.rotate(unit)
        return TurboQuantState(
            norms.astype(mx.float16), pack_indices(self._nearest(rotated), self.bits)
        )

    def _nearest(self, rotated: mx.array) -> mx.array:
        """Per coordinate, the number of midpoints strictly below it (mlx-vlm counts
        all 2**bits - 1 `rotated > midpoint` tests); the midpoints are sorted, so a
        bits-step binary search gives the same integers in O(bits) passes and O(1)
        extra memory per coordinate."""
        idx = mx.zeros(rotated.shape, dtype=mx.uint32)
        for k in reversed(range(self.bits)):
            step = 1 << k
            probe = mx.take(self.midpoints, (idx + (step - 1)).astype(mx.int32))
            idx = idx + (rotated > probe).astype(mx.uint32) * step
        return idx

    def codewords(self, state: TurboQuantState) -> mx.array:
        """The rotated-space unit vectors c[idx] (float32 [..., T, dim]): mlx-vlm's
        codebook entries for the same integers, copied without its uint32 unpack."""
        if 8 % self.bits == 0:
            # widths 1/2/4/8: a byte holds 8/bits whole indices, so one gather from
            # a [256, 8/bits] table of their codewords decodes the packed bytes
            n_bytes = (self.dim * self.bits + 7) // 8
            data = mx.view(state.indices.astype(mx.uint32), mx.uint8)[..., :n_bytes]
            out = mx.take(self._byte_table(), data, axis=0)
            out = out.reshape(*data.shape[:-1], n_bytes * (8 // self.bits))
            return out if out.shape[-1] == self.dim else out[..., : self.dim]
        idx = unpack_indices_u8(state.indices, self.bits, self.dim)
        return mx.take(self.codebook, idx, axis=0)

    def prepare(self) -> "TurboQuantCodec":
        """Build (and evaluate) the tables made on first use now: a compiled step must not make
        them while it traces, or the codec would keep an array of that trace."""
        if 8 % self.bits == 0:
            mx.eval(self._byte_table())
        return self

    def _byte_table(self) -> mx.array:
        """table[b, j] = codebook[index j of byte b] (little-endian bit order)."""
        if self._table is None:
            per, mask = 8 // self.bits, (1 << self.bits) - 1
            idx = (np.arange(256)[:, None] >> (np.arange(per) * self.bits)[None]) & mask
            self._table = mx.take(self.codebook, mx.array(idx.astype(np.int32)), axis=0)
        return self._table

    def dequantize(self, state: TurboQuantState) -> mx.array:
        """|x| * Pi^T c[idx], float32."""
        unit = self.unrotate(self.codewords(state))
        return state.norms[..., None].astype(unit.dtype) * unit


def rotated_attention(
    queries: mx.array,
    key_codec: TurboQuantCodec,
    keys: TurboQuantState,
    value_codec: TurboQuantCodec,
    values: TurboQuantState,
    scale: float,
    mask=None,
    chunk_size: Optional[int] = None,
) -> mx.array:
    """softmax(q K^T * scale + mask) V over packed K/V without dequantizing them.

    q.k = |k| (Pi_k q).c_k[idx], so the queries are rotated once and scored
    against codewords; the softmax-weighted sum of |v| c_v[idx] is accumulated
    in the value rotation's space and rotated back.
    queries [B, Hq, L, D]; keys/values hold [B, Hkv, T, ...] with Hq % Hkv == 0.
    `mask`: None, "causal" (the L queries are the last L of the T positions), or
    a bool / additive array broadcastable to [B, Hq, L, T].

    `chunk_size` None, or T <= chunk_size: one pass over all T keys, mlx-vlm's
    unchunked CPU op sequence (bit-exact); its transient memory grows with T (a
    float32 codeword per key coordinate, 2x an fp16 cache, for K and then V).
    Otherwise the keys go in chunks of `chunk_size` merged by online softmax in
    float32, op for op mlx-vlm's own chunked decode loop (`decode_key_chunk_size`):
    transient O(chunk), and a different summation order than the one pass, so
    the two agree to float32 rounding only."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys.norms.shape[1]
    T = keys.norms.shape[2]
    if n_q_heads % n_kv_heads:
        raise ValueError(
            f"rotated_attention: {n_q_heads} query heads over {n_kv_heads} kv heads"
        )
    if chunk_size is not None and (isinstance(chunk_size, bool)
                                   or not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"rotated_attention: chunk_size must be a positive int or None, "
                         f"got {chunk_size!r}")
    repeats = n_q_heads // n_kv_heads
    grouped = (queries * scale).reshape(B, n_kv_heads, repeats, L, D)
    q_rot = key_codec.rotate(grouped)
    if chunk_size is None or T <= chunk_size:
        scores = _scores(q_rot, key_codec, keys)
        scores = _apply_mask(scores, mask, T, 0, T)
        weights = mx.softmax(scores, axis=-1)
        out = value_codec.unrotate(_weighted_rot(weights, value_codec, values))
    else:
        out = _chunked_attention(q_rot, key_codec, keys, value_codec, values, mask, chunk_size)
    return out.reshape(B, n_q_heads, L, value_codec.dim).astype(queries.dtype)


def _scores(q_rot, key_codec: TurboQuantCodec, keys: TurboQuantState) -> mx.array:
    """(Pi q).c[idx] * |k|: [B, H, rep, L, T] float32 (mlx-vlm's score_prepared)."""
    dots = mx.einsum("bhmld,bhtd->bhmlt", q_rot, key_codec.codewords(keys))
    return dots * keys.norms.astype(mx.float32)[:, :, None, None, :]


def _weighted_rot(weights, value_codec: TurboQuantCodec, values: TurboQuantState) -> mx.array:
    """sum_t w_t |v_t| c[idx_t] in the value rotation's space (mlx-vlm's weighted_sum
    before its inverse rotation)."""
    return mx.einsum("bhmlt,bht,bhtd->bhmld", weights,
                     values.norms.astype(mx.float32), value_codec.codewords(values))


def _token_range(state: TurboQuantState, start: int, end: int) -> TurboQuantState:
    return TurboQuantState(state.norms[..., start:end], state.indices[..., start:end, :])


def merge_softmax_partials(acc, part):
    """Merge two partial softmax-attention results over disjoint key sets.

    Each is (out, denom, max): out = sum_t exp(s_t - max) v_t, denom = sum_t
    exp(s_t - max), max = max_t s_t (per query row; out has a trailing value
    axis). The merged triple covers both key sets; out / denom at the end is the
    softmax-weighted sum. Start from (0, 0, -inf). Op for op mlx-vlm's merge."""
    out, denom, max_score = acc
    part_out, part_denom, part_max = part
    new_max = mx.maximum(max_score, part_max)
    prev_scale = mx.exp(max_score - new_max)
    part_scale = mx.exp(part_max - new_max)
    out = out * prev_scale[..., None] + part_out * part_scale[..., None]
    denom = denom * prev_scale + part_denom * part_scale
    return out, denom, new_max


def _chunked_attention(q_rot, key_codec, keys, value_codec, values, mask, chunk_size):
    B, H, repeats, L, _ = q_rot.shape
    T = keys.norms.shape[2]
    acc = (mx.zeros((B, H, repeats, L, value_codec.dim), dtype=mx.float32),
           mx.zeros((B, H, repeats, L), dtype=mx.float32),
           mx.full((B, H, repeats, L), -float("inf"), dtype=mx.float32))
    for start in range(0, T, chunk_size):
        end = min(T, start + chunk_size)
        # Order the lazy graph chunk by chunk (mlx-vlm evaluates each chunk
        # eagerly instead): a chunk's codewords are decoded only after the
        # previous merge; without this edge evaluation may decode every chunk's
        # before the first merge (measured: 5x the transient at 16k keys).
        kst = _token_range(keys, start, end)
        if start:
            kst = TurboQuantState(kst.norms, mx.depends(kst.indices, list(acc)))
        scores = _scores(q_rot, key_codec, kst)
        scores = _apply_mask(scores, mask, T, start, end)
        chunk_max = mx.max(scores, axis=-1)
        weights = mx.exp(scores - chunk_max[..., None])
        chunk_out = value_codec.unrotate(
            _weighted_rot(weights, value_codec, _token_range(values, start, end)))
        acc = merge_softmax_partials(acc, (chunk_out, mx.sum(weights, axis=-1), chunk_max))
    out, denom, _ = acc
    return out / mx.maximum(denom[..., None], EPS)


def _apply_mask(scores, mask, T, start, end):
    """Mask the scores [B, Hkv, rep, L, end - start] of keys start..end of T."""
    if mask is None:
        return scores
    B, n_kv_heads, repeats, L, _ = scores.shape
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"rotated_attention: unknown mask {mask!r}")
        if L == 1:
            return scores  # the single query is the newest position: sees every key
        q_pos = mx.arange(T - L, T)[:, None]
        mask = q_pos >= mx.arange(start, end)[None]
    else:
        # to [B, Hq, L, T], cut to the keys in hand
        mask = mx.broadcast_to(mask, (B, n_kv_heads * repeats, L, T))[..., start:end]
    # split the query heads into (kv head, repeat) groups
    mask = mx.broadcast_to(mask, (B, n_kv_heads * repeats, L, end - start))
    mask = mask.reshape(B, n_kv_heads, repeats, L, end - start)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask
