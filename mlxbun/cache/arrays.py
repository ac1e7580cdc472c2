"""State cache of recurrent / SSM / conv layers (mlx-lm 0.32.2's ArraysCache), plus
the spec-round contract by snapshot and replay.

`ArraysCache` is ported from `mlx_lm/models/cache.py` (same slots, batching
helpers, masks, state), so it drops into mlx-lm hybrid models. It also counts
the tokens the model reports through `advance(N)` (every mlx-lm recurrent
layer calls it after a forward), which is what the spec round needs.

Spec-round contract for a recurrent state (it cannot be trimmed: the state
after n of the round's tokens was never materialized):
  spec_begin()                 snapshot the arrays (and batching vectors)
  spec_rollback()              restore the snapshot
  spec_commit(n, n_added=None) -> replay
      n == added: keep the state, return 0.
      n <  added: restore the snapshot and return n: the caller must feed the
                  round's first n tokens through the model again (replay) to
                  bring the state up to date. 0 means a plain rollback.
  spec_mark()                  record the state as it is now, after `added` tokens of
                               the round: a later commit of n == that count restores
                               the mark instead of asking for a replay (a drafter
                               that feeds one token per call marks after each one,
                               so its rounds never replay)
  `added` is counted from `advance()` calls since spec_begin; for a model that
  does not call advance, pass `n_added` (else a commit with n > 0 raises).
In a hybrid model every cache must see the same tokens, so a replay needs the
attention caches rolled back too: `commit_spec_round(caches, n)` does that for
a model's whole cache list and returns the number of tokens to replay.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import mlx.core as mx

from mlxbun.cache.spec_round import snapshot

__all__ = ["ArraysCache", "begin_spec_round", "commit_spec_round", "rollback_spec_round"]


class ArraysCache:
    def __init__(self, size, left_padding: Optional[List[int]] = None):
        self.cache = [None] * size
        self.left_padding = mx.array(left_padding) if left_padding else None
        self.lengths = None
        self._seen = 0
        self._spec = None

    @property
    def batch_size(self):
        for c in self.cache:
            if c is not None:
                return c.shape[0]
        if self.left_padding is not None:
            return self.left_padding.size
        elif self.lengths is not None:
            return self.lengths.size
        else:
            return 1

    def __setitem__(self, idx, value):
        self.cache[idx] = value

    def __getitem__(self, idx):
        return self.cache[idx]

    @property
    def state(self):
        return self.cache, self.left_padding, self.lengths

    @state.setter
    def state(self, v):
        self.cache, self.left_padding, self.lengths = v

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, v):
        if v is not None and v:
            raise ValueError("ArraysCache has no meta_state but one was set.")

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        obj._seen, obj._spec = 0, None
        obj.state = state
        if meta_state is not None:
            obj.meta_state = meta_state
        return obj

    def filter(self, batch_indices):
        """In-place filter to keep just the given indices in the cache."""
        self.cache = [c[batch_indices] if c is not None else None for c in self.cache]
        if self.left_padding is not None:
            self.left_padding = self.left_padding[batch_indices]
        if self.lengths is not None:
            self.lengths = self.lengths[batch_indices]

    def extend(self, other):
        """In-place extend this cache with the other cache."""
        a_batch = self.batch_size
        b_batch = other.batch_size

        def cat(a, b):
            shape = dtype = None
            if a is not None:
                shape = a.shape
                dtype = a.dtype
            if b is not None:
                shape = b.shape
                dtype = b.dtype

            if shape is None:
                return None

            if a is None:
                a = mx.zeros((a_batch,) + shape[1:], dtype=dtype)
            if b is None:
                b = mx.zeros((b_batch,) + shape[1:], dtype=dtype)

            return mx.concatenate([a, b])

        self.cache = [cat(c, o) for c, o in zip(self.cache, other.cache)]
        self.left_padding = cat(self.left_padding, other.left_padding)
        self.lengths = cat(self.lengths, other.lengths)

    def extract(self, idx):
        cache = ArraysCache(len(self.cache))
        cache.cache = [c[idx : idx + 1] for c in self.cache]
        return cache

    def prepare(self, lengths=None, **kwargs):
        self.lengths = mx.array(lengths)

    def finalize(self):
        self.lengths = None
        self.left_padding = None

    def advance(self, N):
        self._seen += N
        if self.lengths is not None:
            self.lengths -= N
        if self.left_padding is not None:
            self.left_padding -= N

    def make_mask(self, N: int):
        pos = mx.arange(N)
        mask = None
        if self.left_padding is not None:
            mask = pos >= self.left_padding[:, None]
        if self.lengths is not None:
            in_length = pos < self.lengths[:, None]
            mask = in_length if mask is None else (mask & in_length)
        return mask

    @classmethod
    def merge(cls, caches):
        n_state = len(caches[0].cache)
        B = len(caches)
        cache = cls(n_state)

        # All caches are empty so return early
        if all(c.empty() for c in caches):
            cache.left_padding = mx.array([0] * B)
            return cache

        for e in range(n_state):
            c_init = next(iter(c[e] for c in caches if c[e] is not None))
            shape = list(c_init.shape)
            shape[0] = B
            cache[e] = mx.zeros(shape, c_init.dtype)
            for i in range(B):
                if caches[i][e] is None:
                    continue
                cache[e][i : i + 1] = caches[i][e]
        return cache

    def empty(self):
        return self.cache[0] is None

    def size(self):
        return 0  # mlx-lm: a state cache has no sequence length

    def is_trimmable(self):
        return False

    @property
    def nbytes(self):
        return sum(c.nbytes for c in self.cache if c is not None)

    @property
    def tokens_seen(self) -> int:
        """Tokens reported through `advance` since construction (not saved in `state`)."""
        return getattr(self, "_seen", 0)

    # -- spec-round contract: snapshot / restore / replay

    @property
    def in_spec_round(self) -> bool:
        return getattr(self, "_spec", None) is not None

    def _snapshot(self) -> dict:
        # copies: a model may write a slot in place (`cache[0][...] = x`)
        return {"cache": [snapshot(c) for c in self.cache], "left_padding": snapshot(self.left_padding),
                "lengths": snapshot(self.lengths), "seen": self.tokens_seen}

    def spec_begin(self):
        self._spec = {**self._snapshot(), "marks": {}}

    def spec_mark(self):
        """Remember the state after the tokens added so far in the round (see the module doc)."""
        spec = self._spec_state()
        spec["marks"][self.tokens_seen - spec["seen"]] = self._snapshot()

    def _spec_state(self):
        if getattr(self, "_spec", None) is None:
            raise RuntimeError("ArraysCache: spec_commit/spec_rollback without spec_begin")
        return self._spec

    def _restore(self, state):
        self.cache = list(state["cache"])
        self.left_padding, self.lengths = state["left_padding"], state["lengths"]
        self._seen = state["seen"]
        self._spec = None

    def spec_rollback(self):
        self._restore(self._spec_state())

    def _added(self, spec, n_added):
        counted = self.tokens_seen - spec["seen"]
        if n_added is None:
            return counted
        if isinstance(n_added, bool) or not isinstance(n_added, int) or n_added < 0:
            raise TypeError(f"n_added must be a non-negative int, got {n_added!r}")
        if counted and counted != n_added:
            raise ValueError(f"ArraysCache: n_added={n_added} but the model advanced the "
                             f"cache by {counted} tokens since spec_begin")
        return n_added

    def spec_needs_replay(self, n_accepted: int, n_added: Optional[int] = None) -> bool:
        """Whether committing `n_accepted` would restore the snapshot and ask for a replay
        (0 < n < added, no mark at n)."""
        spec = self._spec_state()
        added = self._added(spec, n_added)
        n = self._check(n_accepted, added)
        return 0 < n < added and n not in spec["marks"]

    def _check(self, n_accepted, added):
        if isinstance(n_accepted, bool) or not isinstance(n_accepted, int):
            raise TypeError(f"n_accepted must be an int, got {n_accepted!r}")
        if not 0 <= n_accepted <= added:
            hint = ("" if added else " (if the model does not call cache.advance, "
                    "pass n_added to spec_commit)")
            raise ValueError(f"ArraysCache: n_accepted={n_accepted} but {added} tokens were "
                             f"added since spec_begin{hint}")
        return n_accepted

    def spec_commit(self, n_accepted: int, n_added: Optional[int] = None) -> int:
        """Keep n_accepted tokens of the round; return how many the caller must replay."""
        spec = self._spec_state()
        added = self._added(spec, n_added)
        n = self._check(n_accepted, added)
        if n == added:
            self._spec = None
            return 0
        if n in spec["marks"]:
            self._restore(spec["marks"][n])
            return 0
        self._restore(spec)
        return n


# ------------------------------------------------------------------ a model's cache list


def begin_spec_round(caches: Sequence[Any]) -> None:
    for c in caches:
        c.spec_begin()


def rollback_spec_round(caches: Sequence[Any]) -> None:
    for c in caches:
        c.spec_rollback()


def commit_spec_round(caches: Sequence[Any], n_accepted: int) -> int:
    """Commit a round over a model's caches; return the number of tokens to replay.

    If no cache needs a replay (attention caches trim exactly; a recurrent cache
    needs none when every drafted token was accepted, none were, or it holds a
    `spec_mark` at n_accepted) each cache commits and this returns 0. Otherwise every cache rolls back to spec_begin and this
    returns n_accepted: feed the round's first n_accepted tokens through the
    model again, so attention and recurrent layers see the same tokens.
    """
    replay = any(c.spec_needs_replay(n_accepted) for c in caches if hasattr(c, "spec_needs_replay"))
    if not replay:
        for c in caches:
            c.spec_commit(n_accepted)
        return 0
    rollback_spec_round(caches)
    return n_accepted
