"""How a speculative round rolls a recurrent target back after a rejection (`Rollback`).

A recurrent state (conv window, SSM / DeltaNet state: an ArraysCache) cannot be trimmed: after the
verify forward over [token, d1..dm] it holds the state after all m + 1 tokens, and the target kept
only n + 1 of them. Two exact ways back, both from the snapshot taken at spec_begin:

- `Rollback.MODEL`: every cache goes back to the round's start and the n + 1 kept tokens are fed
  again through the whole target (`commit_spec_round`; any model).
- `Rollback.MIXERS`: attention caches trim to n + 1 as usual; each recurrent cache goes back to
  its snapshot and only its mixer (the module the layer hands the ArraysCache to: lfm2's
  ShortConv, qwen3_next's GatedDeltaNet, a Mamba2 mixer ...) is called again, on the inputs it
  received in the verify forward cut to the n + 1 kept positions. Those inputs are what a full
  replay would recompute: in a causal forward, positions 0..n never see the rejected drafts. The
  mixers are found once per request by a one-token probe (`MixerReplay.attach`).

Either way MLX evaluates only what the cache states need (the engine evaluates the states, not the
replay's output), so the LM head, and in MIXERS a mixer's output projection, never run.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.arrays import ArraysCache, commit_spec_round
from mlxbun.errors import MlxbunError, UnsupportedModelError

try:
    from enum import StrEnum
except ImportError:  # Python 3.10: the same str-valued enum, by hand
    from enum import Enum

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return self.value

__all__ = ["MixerReplay", "Rollback", "mixer_replay", "parse_rollback"]


class Rollback(StrEnum):
    MODEL = "model"  # restore every cache, feed the kept tokens through the whole target
    MIXERS = "mixers"  # trim attention; restore each recurrent cache, re-run only its mixer


def parse_rollback(value) -> Rollback:
    try:
        return Rollback(value)
    except ValueError:
        raise MlxbunError(f"rollback must be one of {[r.value for r in Rollback]}, got {value!r}") from None


def _leaves(caches: Sequence[Any]) -> list:
    """The caches themselves, a CacheList's children in its place."""
    return [x for c in caches for x in (getattr(c, "caches", None) or [c])]


def _takes_cache(module: nn.Module) -> bool:
    try:
        return "cache" in inspect.signature(type(module).__call__).parameters
    except (TypeError, ValueError):
        return False


_RECORDING_CLASSES: dict = {}
_RECORDERS: dict[int, Any] = {}  # id(module) -> what its calls report to


def _recording_class(cls):
    """A subclass of `cls` whose call first reports to the module's recorder (if any)."""
    sub = _RECORDING_CLASSES.get(cls)
    if sub is None:
        def __call__(self, *args, **kwargs):
            record = _RECORDERS.get(id(self))
            if record is not None:
                record(self, args, kwargs)
            return cls.__call__(self, *args, **kwargs)

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _RECORDING_CLASSES[cls] = sub
    return sub


@contextmanager
def _recording(modules: Sequence[nn.Module], record) -> Iterator[None]:
    """Within the block, a call of any of `modules` first reports (module, args, kwargs)."""
    originals = [m.__class__ for m in modules]
    try:
        for m, cls in zip(modules, originals):
            m.__class__ = _recording_class(cls)
            _RECORDERS[id(m)] = record
        yield
    finally:
        for m, cls in zip(modules, originals):
            m.__class__ = cls
            _RECORDERS.pop(id(m), None)


def _array_caches(args: tuple, kwargs: dict) -> list:
    return [v for v in (*args, *kwargs.values()) if isinstance(v, ArraysCache)]


class MixerReplay:
    """Records the recurrent mixers' calls during verify forwards; replays them after a rejection."""

    def __init__(self, target, blocks: Sequence[nn.Module]):
        self.target = target
        self._candidates = [m for b in blocks for _, m in b.named_modules() if _takes_cache(m)]
        self._calls: dict[int, tuple] = {}  # id(ArraysCache) -> (mixer, args, kwargs)
        self._on = False

    def _record(self, module, args, kwargs):
        if self._on:
            for c in _array_caches(args, kwargs):
                self._calls[id(c)] = (module, args, kwargs)  # the innermost call comes last

    @contextmanager
    def attach(self, make_cache) -> Iterator[None]:
        """Record while inside; first check on a throwaway cache (one token) that every recurrent
        cache reaches a mixer that takes it as an argument."""
        with _recording(self._candidates, self._record):
            probe = make_cache()
            self._on = True
            try:
                self.target(mx.array([[0]], dtype=mx.int32), cache=probe)
            finally:
                self._on = False
            missing = [i for i, c in enumerate(_leaves(probe)) if isinstance(c, ArraysCache) and id(c) not in self._calls]
            self._calls.clear()
            if missing:
                raise UnsupportedModelError(
                    f"rollback='mixers': no module of {type(self.target).__name__} takes recurrent cache(s) "
                    f"{missing} as an argument; use rollback='model'")
            yield

    def verify(self, ids: mx.array, cache: list) -> mx.array:
        """The target's verify forward, recording each recurrent mixer's call."""
        self._calls.clear()
        self._on = True
        try:
            return self.target(ids, cache=cache)
        finally:
            self._on = False

    def commit(self, cache: Sequence[Any], n_keep: int, fed: int) -> int:
        """Commit the round keeping `n_keep` of the `fed` tokens; return the tokens replayed
        (n_keep when some recurrent cache had to go back, else 0)."""
        leaves = _leaves(cache)
        back = [c for c in leaves if isinstance(c, ArraysCache) and c.spec_needs_replay(n_keep)]
        if not back:
            return commit_spec_round(cache, n_keep)
        going_back = {id(c) for c in back}
        for c in leaves:
            if id(c) in going_back:
                c.spec_rollback()
            else:
                c.spec_commit(n_keep)

        def cut(v):
            return v[:, :n_keep] if isinstance(v, mx.array) and v.ndim >= 2 and v.shape[1] == fed else v

        for c in back:
            call: Optional[tuple] = self._calls.get(id(c))
            if call is None:
                raise MlxbunError("rollback='mixers': a recurrent cache was not reached in the verify forward")
            module, args, kwargs = call
            module(*[cut(a) for a in args], **{k: cut(v) for k, v in kwargs.items()})
        return n_keep


def mixer_replay(target, cache: Sequence[Any], rollback, blocks_of) -> Optional[MixerReplay]:
    """The MixerReplay a round loop uses: None for Rollback.MODEL or a model without a recurrent
    cache (nothing to replay). blocks_of(target): its decoder blocks, where the mixers are."""
    if parse_rollback(rollback) is Rollback.MODEL or not any(isinstance(c, ArraysCache) for c in _leaves(cache)):
        return None
    return MixerReplay(target, blocks_of(target))
