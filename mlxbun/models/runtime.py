"""The RuntimeModel contract: what every engine (caches, spec, diffusion, bench, parity) takes.

An mlxbun graph implements it directly; any mlx-lm model satisfies it through
`mlxbun.models.mlxlm.MlxLmRuntimeModel`. It is a structural `Protocol`, so
`isinstance(x, RuntimeModel)` checks that the members exist (not their types).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol, runtime_checkable

import mlx.core as mx

__all__ = ["RuntimeModel"]


@runtime_checkable
class RuntimeModel(Protocol):
    """A causal LM over token ids, with a cache, a hidden/logits split and layer taps."""

    # Normalized config (`mlxbun.config.TextConfig`; an adapter may hold the raw dict instead).
    config: Any
    # The resolved `mlxbun.profile.ModelProfile`, None where none applies (an mlx-lm oracle).
    profile: Optional[Any]

    @property
    def model_type(self) -> str:
        """The (remapped) model_type the graph implements, e.g. "llama"."""
        ...

    @property
    def weights_bytes(self) -> int:
        """Bytes held by the parameters (packed sizes for quantized weights)."""
        ...

    def make_cache(self, **kv_options: Any) -> list[Any]:
        """A fresh per-layer cache list (mlx-lm cache shape: `update_and_fetch`, `offset`, ...)."""
        ...

    def __call__(self, ids: mx.array, cache: Optional[list[Any]] = None) -> mx.array:
        """Logits [B, L, V] for ids [B, L]; advances `cache` when given."""
        ...

    def forward_hidden(self, ids: mx.array, cache: Optional[list[Any]] = None) -> mx.array:
        """Final hidden states [B, L, H] (after the final norm), advancing `cache`."""
        ...

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        """The head: `logits_from_hidden(forward_hidden(x))` equals `self(x)` bit for bit."""
        ...

    def layers_tap(self, paths: Any = None) -> AbstractContextManager[dict[str, list[mx.array]]]:
        """Context manager recording module outputs by path (see `mlxbun.models.taps.capture`)."""
        ...
