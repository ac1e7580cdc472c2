"""GGML's three affine block types as MLX affine quantization, with the same bits.

A GGML row of Q4_0 / Q4_1 / Q8_0 is a run of 32-element blocks, each one fp16 scale `d`
(Q4_1 also an fp16 minimum `m`) and 32 codes:

    Q4_0  w = d * (q - 8)       q in 0..15   ->  MLX 4-bit: scale d, bias -8d
    Q4_1  w = d * q + m         q in 0..15   ->  MLX 4-bit: scale d, bias m
    Q8_0  w = d * q             q in -128..127 -> MLX 8-bit: code q + 128, scale d, bias -128d

MLX affine packs codes little-end first into uint32 words (element j of a word at bits
bits*j), one scale and one bias per group of 32 along the row. GGML's 4-bit block puts
element i in the low nibble of byte i and element i+16 in its high nibble; its 8-bit block
is one int8 per element. `repack` reorders the codes and nothing else, so dequantizing the
result gives the same numbers as GGML's own dequantization (exactly, with float32 scales:
every product and the one addition are exact or rounded once, as GGML rounds them; the one
difference is the sign of a zero, Q4_0's code 8 under a negative scale: -0 there, +0 here).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["EXACT_TYPES", "GROUP_SIZE", "Packed", "repack"]

GROUP_SIZE = 32  # GGML's block length for the three types
# GGML type name -> (MLX bits, bytes per block)
EXACT_TYPES = {"Q4_0": (4, 18), "Q4_1": (4, 20), "Q8_0": (8, 34)}


@dataclass
class Packed:
    """MLX affine arrays for one matrix: rows along axis 0. Scales and biases are float32
    here (fp16 -> fp32 is exact); the writer casts them to the import dtype."""

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


def repack(raw: np.ndarray, type_name: str, cols: int) -> Packed:
    """One GGML tensor's raw bytes (rows x bytes per row, as `gguf` reads it) as MLX affine."""
    bits, block_bytes = EXACT_TYPES[type_name]
    if cols % GROUP_SIZE:
        raise ValueError(f"{type_name} row of {cols} elements is not whole blocks of {GROUP_SIZE}")
    n_blocks = cols // GROUP_SIZE
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1, n_blocks, block_bytes)
    rows = blocks.shape[0]
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if type_name == "Q8_0":
        codes = blocks[..., 2:] ^ np.uint8(0x80)  # int8 q -> uint8 q + 128, bit for bit
        biases = d * np.float32(-128.0)
    else:
        qs = blocks[..., 4:] if type_name == "Q4_1" else blocks[..., 2:]
        nibbles = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)  # element order
        codes = nibbles[..., 0::2] | (nibbles[..., 1::2] << np.uint8(4))  # two elements a byte, low first
        if type_name == "Q4_1":
            biases = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        else:
            biases = d * np.float32(-8.0)
    weight = np.ascontiguousarray(codes).reshape(rows, -1).view("<u4")
    return Packed(weight, d.reshape(rows, n_blocks), biases.reshape(rows, n_blocks), bits)
