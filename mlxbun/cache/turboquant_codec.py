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
    "state_nbytes_per_vector",
    "rotated_attention",
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
        """The rotated-space unit vectors c[idx] (float32 [..., T, dim])."""
        idx = unpack_indices(state.indices, self.bits, self.dim).astype(mx.int32)
        return mx.take(self.codebook, idx, axis=0)

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
) -> mx.array:
    """softmax(q K^T * scale + mask) V over packed K/V without dequantizing them.

    q.k = |k| (Pi_k q).c_k[idx], so the queries are rotated once and scored
    against codewords; the softmax-weighted sum of |v| c_v[idx] is accumulated
    in the value rotation's space and rotated back once per query.
    queries [B, Hq, L, D]; keys/values hold [B, Hkv, T, ...] with Hq % Hkv == 0.
    `mask`: None, "causal" (the L queries are the last L of the T positions), or
    a bool / additive array broadcastable to [B, Hq, L, T]."""
    B, n_q_heads, L, D = queries.shape
    n_kv_heads = keys.norms.shape[1]
    T = keys.norms.shape[2]
    if n_q_heads % n_kv_heads:
        raise ValueError(
            f"rotated_attention: {n_q_heads} query heads over {n_kv_heads} kv heads"
        )
    repeats = n_q_heads // n_kv_heads
    grouped = (queries * scale).reshape(B, n_kv_heads, repeats, L, D)
    q_rot = key_codec.rotate(grouped)
    dots = mx.einsum("bhmld,bhtd->bhmlt", q_rot, key_codec.codewords(keys))
    scores = dots * keys.norms.astype(mx.float32)[:, :, None, None, :]
    scores = _apply_mask(scores, mask, B, n_kv_heads, repeats, L, T)
    weights = mx.softmax(scores, axis=-1)
    out_rot = mx.einsum(
        "bhmlt,bht,bhtd->bhmld",
        weights,
        values.norms.astype(mx.float32),
        value_codec.codewords(values),
    )
    out = value_codec.unrotate(out_rot)
    return out.reshape(B, n_q_heads, L, value_codec.dim).astype(queries.dtype)


def _apply_mask(scores, mask, B, n_kv_heads, repeats, L, T):
    if mask is None:
        return scores
    if isinstance(mask, str):
        if mask != "causal":
            raise ValueError(f"rotated_attention: unknown mask {mask!r}")
        if L == 1:
            return scores  # the single query is the newest position: sees every key
        q_pos = mx.arange(T - L, T)[:, None]
        mask = q_pos >= mx.arange(T)[None]
    # to [B, Hq, L, T], then split the query heads into (kv head, repeat) groups
    mask = mx.broadcast_to(mask, (B, n_kv_heads * repeats, L, T))
    mask = mask.reshape(B, n_kv_heads, repeats, L, T)
    if mask.dtype == mx.bool_:
        return mx.where(mask, scores, mx.finfo(scores.dtype).min)
    return scores + mask
