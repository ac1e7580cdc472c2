"""`FastQuantizedLinear`: an `nn.QuantizedLinear` that runs mlxbun's GEMV kernel when it applies.

It is a QuantizedLinear in every other respect (the same parameters, the same array objects, the
same checkpoint names), and with its switch off it is exactly `nn.QuantizedLinear.__call__`: the
bit-exact path stays one flag away, which is how a fast run measures its own drift. Only layers
whose weights the kernel takes (`kernels.qmv.weight_gap`: backend, bits, group, dtype, shape,
tuning) are swapped: on the H200 a decode step is bound by host work per op, so a layer that
would fall back anyway must not pay a Python check per call.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlxbun.kernels.qmv import input_gap, launch_qmv, weight_gap

__all__ = ["FastQuantizedLinear", "FastSwitch", "swap_quantized_linears"]


@dataclass
class FastSwitch:
    """Shared by every swapped layer and static cache of one model: whether the kernels run, and why
    they did not."""

    enabled: bool = True
    kernel_calls: int = 0  # graph builds (eager calls, or traces) that ran the kernel
    gaps: Counter = field(default_factory=Counter)  # reason -> layers / inputs that fell back
    attention_calls: int = 0  # static-cache attentions traced through the decode kernel
    attention_gaps: Counter = field(default_factory=Counter)  # reason -> attentions MLX's SDPA ran
    quantize_calls: int = 0  # static TurboQuant writes traced through the quantize kernel
    quantize_gaps: Counter = field(default_factory=Counter)  # reason -> writes the codec's MLX ops ran


class FastQuantizedLinear(nn.QuantizedLinear):
    """Swapped in place of a QuantizedLinear by `swap_quantized_linears` (never built directly)."""

    def __call__(self, x):
        switch: FastSwitch = self._fast_switch
        if not switch.enabled:
            return super().__call__(x)
        key = (x.shape, x.dtype, mx.default_device())
        decided = self.__dict__.setdefault("_fast_gaps", {})  # one check per input kind, then a lookup
        if key not in decided:
            decided[key] = input_gap(x, self["weight"], self["scales"])
            if decided[key] is not None and not decided[key].by_design:
                switch.gaps[decided[key].reason] += 1
        if decided[key] is not None:
            return super().__call__(x)
        switch.kernel_calls += 1
        y = launch_qmv(x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits)
        if "bias" in self:
            y = y + self["bias"]
        return y


def _as_fast(layer: nn.QuantizedLinear, switch: FastSwitch) -> FastQuantizedLinear:
    fast = FastQuantizedLinear.__new__(FastQuantizedLinear)
    dict.update(fast, layer)  # the very same parameter arrays
    fast.__dict__.update(layer.__dict__)
    object.__setattr__(fast, "_fast_switch", switch)
    return fast


def swap_quantized_linears(module: nn.Module, switch: FastSwitch) -> int:
    """Replace every exact `nn.QuantizedLinear` under `module` whose weights the kernel takes by a
    FastQuantizedLinear sharing its arrays and `switch`; the others stay, their reasons counted
    in `switch.gaps` (by layer). Returns how many were replaced."""
    swaps = []
    for path, m in module.named_modules():
        if type(m) is not nn.QuantizedLinear:
            continue
        gap = weight_gap(m["weight"], m["scales"], m.get("biases"), m.group_size, m.bits,
                         getattr(m, "mode", "affine"))
        if gap is None:
            swaps.append((path, _as_fast(m, switch)))
        elif not gap.by_design:
            switch.gaps[gap.reason] += 1
    if swaps:
        module.update_modules(tree_unflatten(swaps))
    return len(swaps)
