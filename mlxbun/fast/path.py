"""`FastPath`: the explicit lever that trades bit-exactness for speed on one model.

`enable_fast(model)` swaps every `nn.QuantizedLinear` for a `FastQuantizedLinear` sharing its
arrays (switch off: the model stays bit-exact), and `FastPath.on()` turns the kernels on while a
step's graph is built. Generation with `fast=True` also decodes through `CompiledDecoder`. What
did not apply (no CUDA device, a bit width, a cache kind) is collected as notes, said once.
The fidelity label of a fast run is `L2-fast`: measured (KLD, top-1 vs the exact path), never
claimed bit-exact.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.nn as nn

from mlxbun.errors import MlxbunError
from mlxbun.fast.linear import FastSwitch, swap_quantized_linears
from mlxbun.kernels import cuda_available, tuning

__all__ = ["FAST_FIDELITY", "FastPath", "FastPathError", "enable_fast"]

FAST_FIDELITY = "L2-fast"


class FastPathError(MlxbunError):
    """The fast path was asked of something it cannot speed up (e.g. mlx-lm's own model)."""


@dataclass
class FastPath:
    model: nn.Module
    switch: FastSwitch
    quantized_linears: int  # layers that may run the GEMV kernel
    compile_decode: bool = True
    fused: bool = True  # decode through the fused kernels where they apply (`fast.decoders`)
    fused_ops: Optional[object] = None  # their executor (None: the CUDA kernels; tests: the MLX reference)
    notes: list[str] = field(default_factory=list)  # what did not apply, in the order seen
    _said: set = field(default_factory=set)

    @contextlib.contextmanager
    def on(self) -> Iterator[None]:
        """Kernels on while the enclosed code builds its graph (restores the previous state)."""
        before, self.switch.enabled = self.switch.enabled, True
        try:
            yield
        finally:
            self.switch.enabled = before

    def note(self, text: str) -> None:
        if text not in self._said:
            self._said.add(text)
            self.notes.append(text)

    def collect_kernel_gaps(self) -> None:
        for reason, count in self.switch.gaps.items():
            self.note(f"GEMV kernel not used ({count}x): {reason}; MLX's quantized_matmul ran")
        for reason in self.switch.attention_gaps:  # counted per traced attention call, not per layer
            self.note(f"decode attention kernel not used: {reason}; MLX's attention ran")
        for reason in self.switch.quantize_gaps:
            self.note(f"TurboQuant quantize kernel not used: {reason}; the codec's MLX ops ran")

    def describe(self) -> str:
        if self.quantized_linears:
            kernels = f"GEMV kernel on {self.quantized_linears} quantized linears"
        elif not cuda_available():
            kernels = "GEMV kernel off (no CUDA device: MLX's ops run)"
        elif tuning.MODE == "off":
            kernels = "GEMV kernel off (measured slower than MLX's op in the decode step)"
        else:
            kernels = "GEMV kernel on no layer (none it takes; MLX's ops run)"
        decode = "eager decode"
        if self.compile_decode:
            decode = "compiled decode step" + (" (decode attention kernel where it applies)"
                                               if cuda_available() else "")
            if self.fused:
                decode = f"fused decode kernels where they apply, else the {decode}"
        return f"fast path ({FAST_FIDELITY}, measured not bit-exact): {kernels}; {decode}"


def enable_fast(model, *, compile_decode: bool = True) -> FastPath:
    """The model's FastPath (made once: later calls return the same one, `compile_decode` updated)."""
    existing: Optional[FastPath] = getattr(model, "_fast_path", None)
    if existing is not None:
        existing.compile_decode = compile_decode
        return existing
    if not isinstance(model, nn.Module) or not type(model).__module__.startswith("mlxbun.models."):
        raise FastPathError(f"the fast path runs mlxbun's own graphs; {type(model).__name__} is not one "
                            "(engine mlx-lm has no fast path)")
    switch = FastSwitch(enabled=False)
    swapped = swap_quantized_linears(model, switch) if cuda_available() else 0
    fast = FastPath(model, switch, swapped, compile_decode)
    fast.collect_kernel_gaps()
    object.__setattr__(model, "_fast_path", fast)
    return fast
