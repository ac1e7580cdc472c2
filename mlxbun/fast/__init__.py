"""The fast path: mlxbun's own kernels and a compiled decode step, an explicit lever
(`--fast`, `fast=True`) next to the bit-exact default. See `mlxbun.fast.path`."""

from mlxbun.fast.decode import CompiledDecoder, CompileGap, capacity_for
from mlxbun.fast.path import FAST_FIDELITY, FastPath, FastPathError, enable_fast

__all__ = ["FAST_FIDELITY", "CompileGap", "CompiledDecoder", "FastPath", "FastPathError", "capacity_for",
           "enable_fast"]
