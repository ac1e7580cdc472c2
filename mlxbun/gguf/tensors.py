"""One GGUF tensor as MLX arrays: kept packed, dequantized, or re-quantized.

    read_tensor(t)             Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K -> `Packed` (the same bits, `blocks.repack`;
                               with unpack=True dequantized like every other type);
                               F32 / F16 / BF16 / F64 and every other GGML type -> float32 numpy
                               (other types through `gguf.quants.dequantize`, llama.cpp's own code)
    to_mlx(value, ...)         -> {suffix: mx.array} and the module's packing (bits, group) or None

`to_mlx` casts floats and the scales/biases of packed tensors to the import dtype; with
`quant` 4 or 8 it quantizes float matrices as mlx-lm's convert does (affine, group 64, after
the cast). A packed tensor stays packed whatever `quant` says: re-quantizing it would only
add error.
"""

from __future__ import annotations

from typing import Optional, Union

import numpy as np

from mlxbun.gguf.blocks import EXACT_TYPES, Packed, repack
from mlxbun.gguf.reader import GGUFError

__all__ = ["DTYPES", "FLOAT_TYPES", "REQUANT_GROUP_SIZE", "read_tensor", "readable", "to_mlx"]

DTYPES = ("float32", "float16", "bfloat16")
REQUANT_GROUP_SIZE = 64  # mlx-lm's default group for --quant 4|8
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # BF16 is read through gguf.quants


def readable(t) -> Optional[str]:
    """Why tensor `t` cannot be imported (its GGML type), or None."""
    from gguf import quants

    type_name = t.tensor_type.name
    if type_name in EXACT_TYPES or type_name in FLOAT_TYPES:
        return None
    traits = getattr(quants, "_type_traits", None)  # the types gguf.quants can dequantize
    if traits is not None and t.tensor_type not in traits:
        return f"GGML type {type_name} cannot be dequantized by llama.cpp's gguf package"
    return None


def read_tensor(t, *, path: str = "GGUF file", unpack: bool = False) -> Union[np.ndarray, Packed]:
    """A tensor of the directory as `Packed` (exact types, unless `unpack`) or a float32 array,
    rows first."""
    type_name = t.tensor_type.name
    cols = int(t.shape[0])  # GGML lists dimensions innermost first
    if type_name in EXACT_TYPES and not unpack:
        if t.data.ndim != 2:
            raise GGUFError(f"{path}: tensor {t.name!r} is {type_name} with {t.data.ndim - 1} dimensions; "
                            "only matrices are imported packed")
        return repack(t.data, type_name, cols)
    if type_name in ("F32", "F16", "F64"):
        return np.asarray(t.data, dtype=np.float32)
    from gguf import quants

    try:
        out = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"{path}: tensor {t.name!r} has GGML type {type_name}, which llama.cpp's gguf "
                        "package cannot dequantize") from None
    if out.dtype != np.float32:  # integer tensors come back as they are stored
        raise GGUFError(f"{path}: tensor {t.name!r} has GGML type {type_name}, not a weight type")
    return out


def _mx_dtype(dtype: str):
    import mlx.core as mx

    if dtype not in DTYPES:
        raise GGUFError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return getattr(mx, dtype)


def to_mlx(name: str, value: Union[np.ndarray, Packed], *, dtype: str, quant: Optional[int],
           quantizable: bool) -> tuple[dict[str, "object"], Optional[tuple[int, int]]]:
    """The checkpoint tensors for Hugging Face tensor `name` (`X.weight`, plus `X.scales` and
    `X.biases` when packed), and (bits, group_size) when packed. `quantizable`: a Linear or
    Embedding weight that `quant` may re-quantize."""
    import mlx.core as mx

    target = _mx_dtype(dtype)
    module = name[: -len(".weight")] if name.endswith(".weight") else None
    if isinstance(value, Packed):
        if module is None:
            raise GGUFError(f"tensor {name!r} is quantized; only weights may be")
        scales, biases = mx.array(value.scales).astype(target), mx.array(value.biases).astype(target)
        if not (bool(mx.all(mx.isfinite(scales))) and bool(mx.all(mx.isfinite(biases)))):
            raise GGUFError(f"tensor {name!r}: its scales or biases overflow {dtype}; import with --dtype float32")
        return {name: mx.array(value.weight), f"{module}.scales": scales, f"{module}.biases": biases}, \
            (value.bits, value.group_size)
    w = mx.array(value).astype(target)
    if quant and quantizable and module and w.ndim == 2 and w.shape[-1] % REQUANT_GROUP_SIZE == 0:
        wq, scales, biases = mx.quantize(w, group_size=REQUANT_GROUP_SIZE, bits=quant)
        return {name: wq, f"{module}.scales": scales, f"{module}.biases": biases}, (quant, REQUANT_GROUP_SIZE)
    return {name: w}, None
