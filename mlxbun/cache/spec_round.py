"""The spec-round contract's shared bookkeeping (speculative decoding):

  spec_begin()            remember the cache as it is now
  spec_commit(n)          keep the first n tokens added since spec_begin, drop the rest
  spec_rollback()         drop every token added since spec_begin

`SpecRound` checks the calls and counts what a round added; `TrimSpecRound` is the
whole contract for caches whose prefix below `offset` is never rewritten (KVCache,
QuantizedKVCache, TurboQuantKVCache): rolling back is trimming. Caches that rewrite
their buffers (a rotating ring, a recurrent state) keep a `snapshot` instead.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

__all__ = ["SpecRound", "TrimSpecRound", "snapshot"]


def snapshot(x: Optional[mx.array]) -> Optional[mx.array]:
    """A copy of `x` that later in-place writes to `x` do not reach."""
    # A new array object: `cache.keys[...] = v` overwrites the *object's*
    # descriptor, so a plain reference would follow the in-place update.
    return None if x is None else mx.array(x)


class SpecRound:
    """Bookkeeping shared by the caches: what was added since spec_begin."""

    def _spec_state(self):
        spec = getattr(self, "_spec", None)
        if spec is None:
            raise RuntimeError(
                f"{type(self).__name__}: spec_commit/spec_rollback without spec_begin"
            )
        return spec

    def _spec_added(self, spec) -> int:
        return self.offset - spec["offset"]

    def _check_accepted(self, n_accepted: int, added: int) -> int:
        if isinstance(n_accepted, bool) or not isinstance(n_accepted, int):
            raise TypeError(f"n_accepted must be an int, got {n_accepted!r}")
        if not 0 <= n_accepted <= added:
            raise ValueError(
                f"{type(self).__name__}: n_accepted={n_accepted} but {added} tokens "
                "were added since spec_begin"
            )
        return n_accepted

    @property
    def in_spec_round(self) -> bool:
        return getattr(self, "_spec", None) is not None


class TrimSpecRound(SpecRound):
    """The spec-round contract for caches whose prefix below `offset` is never rewritten
    (growth copies it unchanged): trimming moves `offset` back, and rolling back a round is
    trimming what it added."""

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        return n

    def spec_begin(self):
        self._spec = {"offset": self.offset}

    def spec_commit(self, n_accepted: int):
        spec = self._spec_state()
        added = self._spec_added(spec)
        if added == 0 and self.offset == 0:  # a cache the model never writes (nemotron-nas keeps one
            self._spec = None  # per linear-replacement attention, as mlx-lm's list): nothing to keep
            return
        n = self._check_accepted(n_accepted, added)
        self.trim(added - n)
        self._spec = None

    def spec_rollback(self):
        spec = self._spec_state()
        self.trim(self._spec_added(spec))
        self._spec = None
