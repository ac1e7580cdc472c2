"""Kernels per decode step, counted from the step's graph rather than assumed.

`step_kernels(outputs)` writes the graph behind a step's (unevaluated) outputs with
`mx.export_to_dot` and counts its primitives by name. A compiled step's outputs carry the graph
`mx.compile` replays, its fused element-wise chains as single `Compiled...` primitives. Views
(reshape, slice, broadcast, transpose, ...) are counted apart: MLX evaluates them without a kernel
where the layout allows (a non-contiguous one may still copy).
"""

from __future__ import annotations

import io
import re
from collections import Counter
from dataclasses import dataclass

import mlx.core as mx

__all__ = ["VIEWS", "StepKernels", "step_kernels"]

VIEWS = frozenset({"Reshape", "Slice", "Broadcast", "ExpandDims", "Squeeze", "Transpose", "Unflatten",
                   "Flatten", "AsStrided", "StopGradient"})
_NODE = re.compile(r'label ="([^"]+)", shape=rectangle')


@dataclass(frozen=True)
class StepKernels:
    kernels: Counter  # primitive name -> count, views left out
    views: int

    @property
    def total(self) -> int:
        return sum(self.kernels.values())


def step_kernels(*outputs: mx.array) -> StepKernels:
    """The primitives behind `outputs` (before they are evaluated), views counted apart."""
    text = io.StringIO()
    mx.export_to_dot(text, *outputs)
    names = Counter(_NODE.findall(text.getvalue()))
    views = sum(n for name, n in names.items() if name in VIEWS)
    return StepKernels(Counter({k: v for k, v in names.items() if k not in VIEWS}), views)
