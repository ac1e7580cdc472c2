"""mlx-lm 0.32.2's CacheList (one layer holding several caches: falcon_h1's parallel mamba +
attention layer holds CacheList(ArraysCache, KVCache)), ported with the spec-round contract.

The batching helpers and `state` are mlx-lm's (the state names each child's class; `from_state`
rebuilds them from mlxbun's classes, so a prompt-cache file holds a CacheList too). Spec rounds: every child begins, marks, rolls back together; a commit asks for
a replay when any child needs one (a recurrent child that cannot keep n tokens), and then every
child rolls back, so the replay feeds all of them the same tokens (as `commit_spec_round` does
over a model's list).
"""

from __future__ import annotations

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.quantized import QuantizedKVCache

__all__ = ["CacheList"]

_CLASSES = {c.__name__: c for c in (KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache)}


class CacheList:
    def __init__(self, *caches):
        self.caches = caches

    def __getitem__(self, idx):
        return self.caches[idx]

    def is_trimmable(self):
        return all(c.is_trimmable() for c in self.caches)

    def trim(self, n):
        for c in self.caches:
            m = c.trim(n)
        return m

    @property
    def state(self):
        return [(c.state, type(c).__name__) for c in self.caches]

    @property
    def meta_state(self):
        return [c.meta_state for c in self.caches]

    @classmethod
    def from_state(cls, state, meta_state=None):
        """The children rebuilt from mlxbun's classes (a prompt-cache file: `meta_state` too)."""
        metas = meta_state if meta_state is not None else [None] * len(state)
        if len(metas) != len(state) or any(name not in _CLASSES for _, name in state):
            raise ValueError(f"CacheList: children {[name for _, name in state]} with {len(metas)} meta states "
                             f"(known classes: {sorted(_CLASSES)})")
        return cls(*(_CLASSES[name].from_state(s, m) for (s, name), m in zip(state, metas)))

    def layout_params(self) -> dict:
        """What a prompt-cache file's layout check compares: the children's classes."""
        return {"caches": [type(c).__name__ for c in self.caches]}

    def filter(self, batch_indices):
        for c in self.caches:
            c.filter(batch_indices)

    def extend(self, other):
        for c, o in zip(self.caches, other.caches):
            c.extend(o)

    @classmethod
    def merge(cls, caches):
        cache = cls()
        cache.caches = tuple(caches[0].caches[i].merge([c.caches[i] for c in caches])
                             for i in range(len(caches[0].caches)))
        return cache

    def extract(self, idx):
        return CacheList(*(c.extract(idx) for c in self.caches))

    def prepare(self, **kwargs):
        for c in self.caches:
            c.prepare(**kwargs)

    def finalize(self):
        for c in self.caches:
            c.finalize()

    def size(self):
        return max(c.size() for c in self.caches)

    def empty(self):
        return self.caches[0].empty()

    @property
    def nbytes(self):
        return sum(c.nbytes for c in self.caches)

    @property
    def tokens_seen(self) -> int:
        """Tokens the children hold or report (attention offset, recurrent `advance` count)."""
        return max(int(getattr(c, "offset", 0) or getattr(c, "tokens_seen", 0)) for c in self.caches)

    # -- spec-round contract: the children together

    def spec_begin(self):
        for c in self.caches:
            c.spec_begin()

    def spec_mark(self):
        for c in self.caches:
            if hasattr(c, "spec_mark"):
                c.spec_mark()

    def spec_rollback(self):
        for c in self.caches:
            c.spec_rollback()

    def spec_needs_replay(self, n_accepted: int) -> bool:
        return any(c.spec_needs_replay(n_accepted) for c in self.caches if hasattr(c, "spec_needs_replay"))

    def spec_commit(self, n_accepted: int) -> int:
        """Keep n_accepted tokens in every child; return how many the caller must replay."""
        if self.spec_needs_replay(n_accepted):
            self.spec_rollback()
            return n_accepted
        for c in self.caches:
            c.spec_commit(n_accepted)
        return 0
