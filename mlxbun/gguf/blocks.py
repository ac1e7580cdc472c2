"""GGML's affine block types as MLX affine quantization, with the same bits.

Every type here is, per run of 32 elements along a row, codes q and one (scale, bias) pair, so
it is MLX affine group 32 (w = scale * q + bias) without touching a code:

    Q4_0  w = d * (q - 8)        q in 0..15     ->  4-bit: scale d, bias -8d
    Q4_1  w = d * q + m          q in 0..15     ->  4-bit: scale d, bias m
    Q5_0  w = d * (q - 16)       q in 0..31     ->  5-bit: scale d, bias -16d
    Q5_1  w = d * q + m          q in 0..31     ->  5-bit: scale d, bias m
    Q8_0  w = d * q              q in -128..127 ->  8-bit: code q + 128, scale d, bias -128d
    Q4_K  w = d*sc * q - dmin*m  q in 0..15     ->  4-bit: scale d*sc, bias -(dmin*m)
    Q5_K  w = d*sc * q - dmin*m  q in 0..31     ->  5-bit: scale d*sc, bias -(dmin*m)

(d, m, dmin fp16; the K-quants' super-block of 256 holds eight 32-element sub-blocks, each with
6-bit integers sc and m.) Q6_K (16-element sub-blocks; MLX groups are 32, 64 or 128) and the
other types are not here: `tensors.read_tensor` dequantizes them.

Exactness, with float32 scales and biases (the import's default dtype): fp16 -> fp32 is exact;
d*sc and dmin*m are products of an 11-bit and a 6-bit significand (17 bits), exact in float32;
so is scale * q (at most 22 bits), and MLX's `scale * q + bias` then rounds once, where
llama.cpp's `d*sc * q - dmin*m` (gguf-py's own dequantization) rounds the same sum once. The
one difference is the sign of a zero: Q4_0 / Q5_0's middle code under a negative scale gives
-0 in llama.cpp, +0 here. float16 holds d, m, -8d, -16d, -128d (short of overflow) but not
d*sc in general (17 significant bits); bfloat16 rounds even d. `exact_in` says, per tensor,
whether a narrower dtype keeps them.

MLX packs codes into uint32 words as one little-endian bit stream (element j of a row at bits
bits*j .. bits*j + bits - 1). GGML's 4/5-bit blocks hold the low nibbles of elements i and i+16
in byte i (the K-quants: sub-blocks 2j and 2j+1 in the low and high nibbles of 32 bytes), the
fifth bits in a separate mask; its 8-bit block is one int8 per element.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EXACT_TYPES", "GROUP_SIZE", "Packed", "exact_in", "pack_codes", "repack"]

GROUP_SIZE = 32  # MLX's group: GGML's block (Q4_0..Q8_0) or K-quant sub-block length
# GGML type name -> (MLX bits, bytes per block, elements per block)
EXACT_TYPES = {"Q4_0": (4, 18, 32), "Q4_1": (4, 20, 32), "Q5_0": (5, 22, 32), "Q5_1": (5, 24, 32),
               "Q8_0": (8, 34, 32), "Q4_K": (4, 144, 256), "Q5_K": (5, 176, 256)}


@dataclass
class Packed:
    """MLX affine arrays for one matrix: rows along axis 0. Scales and biases are float32
    here (exact, see the module docstring); the writer casts them to the import dtype."""

    weight: np.ndarray  # uint32, (rows, cols * bits / 32)
    scales: np.ndarray  # float32, (rows, cols / group_size)
    biases: np.ndarray
    bits: int
    group_size: int = GROUP_SIZE

    def take_rows(self, index: np.ndarray) -> "Packed":
        """The same matrix with its rows reordered (exact: whole rows move)."""
        return Packed(self.weight[index], self.scales[index], self.biases[index], self.bits, self.group_size)

    @property
    def rows(self) -> int:
        return self.weight.shape[0]


def exact_in(p: Packed, dtype: str) -> bool:
    """Whether `p`'s scales and biases survive a cast to `dtype` (float32, float16, bfloat16)."""
    if dtype == "float32":
        return True
    import mlx.core as mx

    target = getattr(mx, dtype)
    return all(bool(mx.array_equal(mx.array(a).astype(target).astype(mx.float32), mx.array(a)))
               for a in (p.scales, p.biases))


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes (rows, cols), each < 2**bits, as MLX's uint32 words (rows, cols * bits / 32)."""
    rows = codes.shape[0]
    if bits == 8:
        packed = codes
    elif bits == 4:
        packed = codes[:, 0::2] | (codes[:, 1::2] << np.uint8(4))
    elif bits == 5:  # 8 codes -> 40 bits -> 5 bytes
        eight = codes.reshape(rows, -1, 8).astype(np.uint64)
        word = np.zeros(eight.shape[:2], dtype=np.uint64)
        for j in range(8):
            word |= eight[..., j] << np.uint64(5 * j)
        packed = word[..., None].view(np.uint8)[..., :5]  # little-endian: the low 5 bytes
    else:
        raise ValueError(f"no packing for {bits}-bit codes")
    return np.ascontiguousarray(packed).reshape(rows, -1).view("<u4")


def _f16(b: np.ndarray) -> np.ndarray:
    """Two bytes (last axis) as fp16, widened to float32 (exact)."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """A 32-element block's 16 bytes: element i low nibble of byte i, element i+16 its high."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1: the fifth bit of element i is bit i of the little-endian uint32 `qh`."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The K-quants' 12 bytes as eight 6-bit scales and eight 6-bit mins (llama.cpp's
    get_scale_min_k4)."""
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _k_quant(blocks: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes, scales, biases) of Q4_K / Q5_K super-blocks (…, bytes) -> per 32-element sub-block."""
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, mn = _k_scale_min(blocks[..., 4:16])
    qs = blocks[..., -128:].reshape(*blocks.shape[:-1], 4, 32)  # 4 chunks: sub-blocks 2j (low) and 2j+1 (high)
    codes = np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-2).reshape(*blocks.shape[:-1], 8, 32)
    if bits == 5:  # bit k of qh[i]: the fifth bit of element i of sub-block k
        qh = blocks[..., 16:48]
        high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & np.uint8(1)
        codes = codes | (high << np.uint8(4))
    scales = d[..., None] * sc.astype(np.float32)  # exact: 11 x 6 significant bits
    biases = -(dmin[..., None] * mn.astype(np.float32))
    return codes, scales, biases


def repack(raw: np.ndarray, type_name: str, cols: int) -> Packed:
    """One GGML tensor's raw bytes (rows x bytes per row, as `gguf` reads it) as MLX affine."""
    bits, block_bytes, block_len = EXACT_TYPES[type_name]
    if cols % block_len:
        raise ValueError(f"{type_name} row of {cols} elements is not whole blocks of {block_len}")
    n_blocks = cols // block_len
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, n_blocks, block_bytes)
    rows = blocks.shape[0]
    if type_name in ("Q4_K", "Q5_K"):
        codes, scales, biases = _k_quant(blocks, bits)
    else:
        d = _f16(blocks[..., 0:2])
        scales = d
        if type_name == "Q8_0":
            codes = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q -> uint8 q + 128, bit for bit
            biases = d * np.float32(-128.0)
        elif type_name in ("Q4_0", "Q4_1"):
            codes = _nibbles(blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:])
            biases = _f16(blocks[..., 2:4]) if type_name == "Q4_1" else d * np.float32(-8.0)
        else:  # Q5_0 / Q5_1: d [m] qh(4) qs(16)
            at = 4 if type_name == "Q5_1" else 2
            codes = _nibbles(blocks[..., at + 4:]) | (_high_bits(blocks[..., at:at + 4]) << np.uint8(4))
            biases = _f16(blocks[..., 2:4]) if type_name == "Q5_1" else d * np.float32(-16.0)
    weight = pack_codes(np.ascontiguousarray(codes).reshape(rows, cols), bits)
    groups = cols // GROUP_SIZE
    return Packed(weight, np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, groups),
                  np.ascontiguousarray(biases, dtype=np.float32).reshape(rows, groups), bits)
