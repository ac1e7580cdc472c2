"""KV caches with mlx-lm 0.32.2's layout and semantics, plus the spec-round contract.

`KVCache` and `RotatingKVCache` are ported op-for-op from `mlx_lm/models/cache.py`
(same buffers, the step-256 growth, the same slicing), so attention over them is
bit-identical to attention over mlx-lm's caches, and either kind drops into an
mlx-lm model: its code probes only `offset`, `update_and_fetch`, `make_mask`,
truthiness, `bits` (absent here: full-precision sdpa), `state`, `is_trimmable`
and `trim`.

Attention: `cache.attention(q, k, v, scale=, mask=, sinks=)` is the fused kernel over
what `update_and_fetch` returned (what mlx-lm's sdpa does for a cache without `bits`).

Spec rounds (`mlxbun.cache.spec_round`): a KVCache trims (its buffer prefix is never
rewritten). A RotatingKVCache may overwrite or reorder its ring buffer while the round
runs, so spec_begin keeps a snapshot of its arrays and position, and commit restores
that snapshot and re-appends the accepted keys/values as one chunk, exactly as if only
those had been fed.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlxbun.attention import cached_causal_mask, create_causal_mask, fused_sdpa
from mlxbun.cache.quantized import QuantizedKVCache
from mlxbun.cache.spec_round import SpecRound, TrimSpecRound, snapshot
from mlxbun.errors import UnsupportedModelError

__all__ = ["KVCache", "RotatingKVCache"]


class _FusedAttention:
    """Full-precision caches attend with the fused kernel over their fetched keys/values."""

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        return fused_sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


class KVCache(_FusedAttention, TrimSpecRound):
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0
        self._spec = None

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            k_shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            v_shape = (B, n_kv_heads, n_steps * self.step, v_head_dim)
            new_k = mx.zeros(k_shape, keys.dtype)
            new_v = mx.zeros(v_shape, values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v

        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys_and_values()

    def keys_and_values(self):
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        else:
            return self.keys, self.values

    def size(self):
        return self.offset

    @property
    def state(self):
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset = v

    @property
    def meta_state(self):
        return ""

    @meta_state.setter
    def meta_state(self, v):
        if v is not None and v:
            raise ValueError("KVCache has no meta_state but one was set.")

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        obj._spec = None
        obj.state = state
        if meta_state is not None:
            obj.meta_state = meta_state
        return obj

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        # mlx-lm's generate(kv_bits=...) calls this: same conversion as mlx-lm's KVCache.
        return QuantizedKVCache.from_buffers(self.keys, self.values, self.offset,
                                             group_size=group_size, bits=bits)

    def make_mask(self, *args, **kwargs):
        return cached_causal_mask(*args, offset=self.offset, **kwargs)

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes


class RotatingKVCache(_FusedAttention, SpecRound):
    step = 256

    def __init__(self, max_size, keep=0):
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0
        self._spec = None

    def _trim(self, trim_size, v, append=None):
        to_cat = []
        if trim_size > 0:
            to_cat = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]]
        else:
            to_cat = [v]
        if append is not None:
            to_cat.append(append)
        return mx.concatenate(to_cat, axis=2)

    def _temporal_order(self, v):
        """
        Rearrange the cache into temporal order, slicing off the end if unused.
        """
        if self._idx == v.shape[2]:
            return v
        elif self._idx < self.offset:
            return mx.concatenate(
                [
                    v[..., : self.keep, :],
                    v[..., self._idx :, :],
                    v[..., self.keep : self._idx, :],
                ],
                axis=2,
            )
        else:
            return v[..., : self._idx, :]

    def _update_concat(self, keys, values):
        if self.keys is None:
            self.keys = keys
            self.values = values
        else:
            # Put the keys/values in temporal order to
            # preserve context
            self.keys = self._temporal_order(self.keys)
            self.values = self._temporal_order(self.values)
            self._idx = self.keys.shape[2]

            # The largest size is self.max_size + S - 1 to ensure
            # every token gets at least self.max_size context
            trim_size = self._idx - self.max_size + 1
            self.keys = self._trim(trim_size, self.keys, keys)
            self.values = self._trim(trim_size, self.values, values)
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        # May not have hit the max size yet, so potentially
        # keep growing the cache
        B, n_kv_heads, S, k_head_dim = keys.shape
        prev = self.offset
        if self.keys is None or (
            prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size
        ):
            v_head_dim = values.shape[3]
            new_size = min(self.step, self.max_size - prev)
            k_shape = (B, n_kv_heads, new_size, k_head_dim)
            v_shape = (B, n_kv_heads, new_size, v_head_dim)
            new_k = mx.zeros(k_shape, keys.dtype)
            new_v = mx.zeros(v_shape, values.dtype)
            if self.keys is not None:
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev

        # Trim if needed
        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size

        # Rotate
        if self._idx == self.max_size:
            self._idx = self.keep

        # Assign
        self.keys[..., self._idx : self._idx + S, :] = keys
        self.values[..., self._idx : self._idx + S, :] = values
        self.offset += S
        self._idx += S

        return self.keys_and_values()

    def update_and_fetch(self, keys, values):
        if self._spec is not None:
            self._spec["added"].append((keys, values))
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def keys_and_values(self):
        if self.offset < self.keys.shape[2]:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        else:
            return self.keys, self.values

    def size(self):
        return min(self.offset, self.max_size)

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.keep, self.max_size, self._idx

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v

    @property
    def meta_state(self):
        return tuple(map(str, (self.keep, self.max_size, self.offset, self._idx)))

    @meta_state.setter
    def meta_state(self, v):
        self.keep, self.max_size, self.offset, self._idx = map(int, v)

    @classmethod
    def from_state(cls, state, meta_state=None):
        obj = cls.__new__(cls)
        obj._spec = None
        obj.state = state
        if meta_state is not None:
            obj.meta_state = meta_state
        return obj

    def is_trimmable(self):
        return self.offset < self.max_size

    def trim(self, n):
        n = min(self.offset, n)
        self.offset -= n
        self._idx -= n
        return n

    def to_quantized(self, group_size: int = 64, bits: int = 4):
        raise UnsupportedModelError("RotatingKVCache quantization is not supported (nor in mlx-lm)")

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        if N > 1:
            window_size = window_size or self.max_size
            offset = min(self.max_size - 1, self.offset)
            if offset + N > window_size or return_array:
                return create_causal_mask(N, offset, window_size=window_size)
            else:
                return "causal"
        else:
            if window_size is None:
                return None
            # May need a mask for when window_size < max_size
            if self.offset >= window_size and self.max_size > window_size:
                idx = self._idx
                if idx >= self.max_size:
                    idx = 0
                if self.offset < self.max_size:
                    mask_size = self.offset + 1
                else:
                    mask_size = self.max_size
                mask = mx.arange(mask_size) >= (mask_size - window_size)
                mask = mx.roll(mask, shift=idx + 1)
                return mask

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    # -- spec-round contract: the ring may wrap or be reordered mid-round, so
    # restore the snapshot and replay the accepted keys/values.

    def spec_begin(self):
        self._spec = {
            "keys": snapshot(self.keys),
            "values": snapshot(self.values),
            "offset": self.offset,
            "idx": self._idx,
            "added": [],
        }

    def _spec_restore(self, spec):
        self.keys, self.values = spec["keys"], spec["values"]
        self.offset, self._idx = spec["offset"], spec["idx"]
        self._spec = None

    def spec_commit(self, n_accepted: int):
        spec = self._spec_state()
        n = self._check_accepted(n_accepted, self._spec_added(spec))
        if n == self._spec_added(spec):
            self._spec = None  # everything accepted: the cache is already right
            return
        added = spec["added"]
        self._spec_restore(spec)
        if n == 0:
            return
        if len(added) == 1:
            keys, values = added[0]
        else:
            keys = mx.concatenate([k for k, _ in added], axis=2)
            values = mx.concatenate([v for _, v in added], axis=2)
        self.update_and_fetch(keys[..., :n, :], values[..., :n, :])

    def spec_rollback(self):
        self._spec_restore(self._spec_state())
