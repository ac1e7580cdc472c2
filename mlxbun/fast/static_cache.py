"""Fixed-shape caches for the compiled decode step: buffers that never grow, positions as arrays.

`mx.compile` traces Python once, so nothing a compiled step does may live in Python ints. Each
class here stands in for an exact cache during the step, built from arrays the step takes as
inputs, and hands its arrays back as outputs:

- `StaticKVCache` (for KVCache): a buffer of `capacity` positions; new keys/values go in at the
  offset (`write_rows`: a scatter into large buffers, which MLX writes in place), attention runs
  over the whole buffer under a mask hiding the unwritten tail.
- `StaticRotatingKVCache` (for a sliding-window RotatingKVCache with keep=0): a ring of `window`
  slots, the token at position p in slot p % window; before the ring fills, the unwritten slots
  are masked.
- `static_arrays_cache` (for ArraysCache: conv / SSM states): the same class over the step's
  arrays; recurrent states have fixed shapes already.
- `StaticQuantizedKVCache` (for QuantizedKVCache): the same buffer as mlx's affine triples
  (codes, scales, biases) for K and for V; new tokens are quantized as QuantizedKVCache does.
- `StaticTurboQuantCache` (for TurboQuantKVCache): the packed norms and codeword indices of K and
  V; new tokens are quantized by the same codecs, attention runs in the rotated space over the
  packed codes (`rotated_attention`, one pass over the buffer under the mask: no chunks, no
  dequantized copy of the cache; with the switch on a CUDA GPU, the TurboQuant decode kernel).
- a CacheList (falcon_h1's mixer + attention, deepseek_v32's latent + indexer) is a CacheList of
  its children's stand-ins.

A masked sum over a whole buffer is not the sum over the filled part that the exact caches do,
so results are close to, not equal to, the exact path's: the fast path measures them.

Given the fast path's switch (`kernels`, on while the step is traced), one-query attention runs
mlxbun's decode kernel (`kernels.sdpa_decode`: reads the buffer up to the filled length, a device
array, no mask; the quantized and TurboQuant buffers' packed codes directly); where it does not apply (no CUDA,
dtype, head dim, a mask it did not make) MLX's attention runs and the reason is counted in
`kernels.attention_gaps` (the FastPath's notes). Without a switch the stand-ins attend as before.
`adapter_for(cache)` picks the class and converts back and forth (`CompileGap` when none fits).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

from mlxbun.attention import (
    backend_has_quantized_attention,
    dequantized_sdpa,
    fused_sdpa,
    quantized_scaled_dot_product_attention,
)
from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.cache_list import CacheList
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.quantized import QuantizedKVCache
from mlxbun.cache.turboquant import TurboQuantKVCache
from mlxbun.cache.turboquant_codec import EPS, TurboQuantCodec, TurboQuantState, rotated_attention
from mlxbun.errors import UnsupportedModelError
from mlxbun.kernels.common import Gap
from mlxbun.kernels.sdpa_decode import (decode_attention, decode_gap, quantized_decode_attention,
                                        turboquant_decode_attention, turboquant_decode_gap)
from mlxbun.kernels.turboquant_quantize import quantize_gap, turboquant_quantize

__all__ = ["CacheAdapter", "CompileGap", "StaticKVCache", "StaticQuantizedKVCache", "StaticRotatingKVCache",
           "StaticTurboQuantCache", "adapter_for"]

# the adapters' kinds whose buffers hold every position (a multi-token step and a rewind apply)
FULL_ATTENTION_KINDS = ("kv", "qkv", "tq")


class CompileGap(Exception):
    """The compiled step does not apply to this model or cache (the reason is the message)."""


# Buffers from this size on take their new rows by scatter (see `write_rows`).
SCATTER_FROM_BYTES = 8 << 20


def write_rows(buffer: mx.array, rows: mx.array, at: mx.array) -> mx.array:
    """`buffer` [B, H, capacity, ...] with `rows` [B, H, T, ...] written at positions `at` .. `at`
    + T - 1 (`at`: an int32 array on the device). The same values land in the same places whichever
    op writes them; the op is chosen for speed on MLX's CUDA backend (0.32.4, H200):

    - `mx.slice_update` at an array start copies its whole input every call there (56 one-row writes
      into 16 MiB buffers: 3.7 ms against 0.53 ms, with 10x the buffers' peak; benchmarks/gpu-h200-fast.md
      section 8), which cost the fast path half its fp16 decode at 16k;
    - a scatter (`put_along_axis`) writes in place but encodes more work per call, which the
      host-bound step pays: at 16k, fp16 K/V (16 MiB a buffer) decoded 1.7-2.0x faster by scatter,
      q4 and TurboQuant 3.5 (3-4 MiB) 6-16% slower, q8 (8 MiB) either way (raw 18).

    So buffers of SCATTER_FROM_BYTES and more are scattered into, smaller ones slice-updated (the
    size is static: the choice is made once per trace)."""
    if buffer.nbytes < SCATTER_FROM_BYTES:
        return mx.slice_update(buffer, rows, at.reshape(1), axes=(2,))
    T = rows.shape[2]
    positions = at.reshape(1) + mx.arange(T, dtype=mx.int32)
    index = mx.broadcast_to(positions.reshape(1, 1, T, *([1] * (rows.ndim - 3))), rows.shape)
    return mx.put_along_axis(buffer, index, rows, axis=2)


def _padded(a: mx.array, size: int) -> mx.array:
    """`a` [B, H, n, ...] with zeros appended along the positions (axis 2) up to `size`."""
    n = a.shape[2]
    if size <= n:
        return a
    return mx.concatenate([a, mx.zeros((*a.shape[:2], size - n, *a.shape[3:]), a.dtype)], axis=2)


class _StaticBuffers:
    """Key and value buffers of a fixed length (axis 2), the write position as a 0-d array."""

    def __init__(self, keys, values, offset: mx.array, kernels=None):
        self.keys, self.values, self.offset, self.kernels = keys, values, offset, kernels

    @property
    def length(self) -> int:
        return self.keys.shape[2]

    def _write(self, keys: mx.array, values: mx.array, at: mx.array):
        self.keys = write_rows(self.keys, keys, at)
        self.values = write_rows(self.values, values, at)
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def filled(self) -> mx.array:
        """Positions holding tokens after this step's write (int32, on the device)."""
        return self.offset

    def keys_and_values(self):
        """The whole buffers (a KV-shared layer reads its owner's: gemma3n); the step's mask, or the
        decode kernel's filled length, keeps attention off the unwritten positions."""
        return self.keys, self.values

    def _kernel_applies(self, mask, gap: Optional[Gap]) -> bool:
        """Whether the decode kernel runs this call; a gap that is no choice of design is counted."""
        if self.kernels is None or not self.kernels.enabled:
            return False
        if gap is None and mask is not None and not (
                isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.size == self.length):
            gap = Gap(f"a mask the static cache did not make ({getattr(mask, 'shape', mask)})")
        if gap is not None and not gap.by_design:
            self.kernels.attention_gaps[gap.reason] += 1
        return gap is None

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        gap = decode_gap(queries, keys.shape, keys.dtype, values_shape=values.shape, sinks=sinks)
        if self._kernel_applies(mask, gap):
            self.kernels.attention_calls += 1
            return decode_attention(queries, keys, values, self.filled(), scale, sinks)
        return fused_sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


class StaticKVCache(_StaticBuffers):
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        return self._write(keys, values, self.offset)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        if window_size is not None:
            raise ValueError("a sliding-window mask over a full-attention static cache")
        queries = self.offset + mx.arange(N, dtype=mx.int32)[:, None]
        return mx.arange(self.length, dtype=mx.int32)[None] <= queries


class StaticRotatingKVCache(_StaticBuffers):
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if keys.shape[2] != 1:
            raise ValueError("the static ring takes one token per step")
        return self._write(keys, values, self.offset % self.length)

    def make_mask(self, N: int, return_array: bool = False, window_size=None):
        # a window at least the ring's masks nothing more (RotatingKVCache.make_mask returns None for
        # one token then: plamo3's window_size + 1)
        if N != 1 or (window_size is not None and window_size < self.length):
            raise ValueError(f"a {N}-token step or a window {window_size} narrower than the ring's {self.length}")
        return (mx.arange(self.length, dtype=mx.int32) <= self.offset)[None]

    def filled(self) -> mx.array:
        return mx.minimum(self.offset, self.length)  # slot order does not matter to attention


class StaticQuantizedKVCache(StaticKVCache):
    """`keys` / `values`: mlx's affine triples (codes, scales, biases), each [B, KV, capacity, .]."""

    def __init__(self, keys, values, offset: mx.array, group_size: int, bits: int, kernels=None):
        super().__init__(tuple(keys), tuple(values), offset, kernels)
        self.group_size, self.bits = group_size, bits

    @property
    def length(self) -> int:
        return self.keys[0].shape[2]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        at = self.offset
        new = [mx.quantize(x, group_size=self.group_size, bits=self.bits) for x in (keys, values)]
        self.keys = tuple(write_rows(b, q, at) for b, q in zip(self.keys, new[0]))
        self.values = tuple(write_rows(b, q, at) for b, q in zip(self.values, new[1]))
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def attention(self, queries, q_keys, q_values, scale, mask, sinks=None):
        head_dim = q_keys[0].shape[-1] * 32 // self.bits
        gap = decode_gap(queries, q_keys[0].shape, q_keys[1].dtype, values_shape=q_values[0].shape,
                         head_dim=head_dim, sinks=sinks, bits=self.bits, group_size=self.group_size)
        if self._kernel_applies(mask, gap):
            self.kernels.attention_calls += 1
            return quantized_decode_attention(queries, q_keys, q_values, self.filled(), scale, self.group_size,
                                              self.bits, sinks)
        if sinks is not None:
            raise UnsupportedModelError("QuantizedKVCache: attention sinks are not supported by quantized "
                                        "attention (nor in mlx-lm)")
        if backend_has_quantized_attention():
            return quantized_scaled_dot_product_attention(queries, q_keys, q_values, scale=scale, mask=mask,
                                                          group_size=self.group_size, bits=self.bits)
        return dequantized_sdpa(queries, q_keys, q_values, scale, mask, self.group_size, self.bits)


class StaticTurboQuantCache(StaticKVCache):
    """`keys` / `values`: TurboQuantStates (norms [B, KV, capacity], packed indices [B, KV,
    capacity, W]); `codecs`: the exact cache's (key, value) codecs, rebuilt from their spec."""

    def __init__(self, keys, values, offset: mx.array, codecs: tuple[TurboQuantCodec, TurboQuantCodec],
                 kernels=None):
        super().__init__(TurboQuantState(*keys), TurboQuantState(*values), offset, kernels)
        self.key_codec, self.value_codec = codecs

    @property
    def length(self) -> int:
        return self.keys.norms.shape[2]

    def _quantize(self, codec: TurboQuantCodec, x: mx.array) -> TurboQuantState:
        """The new vectors' state: the quantize kernel under the switch where it applies (one launch
        where the codec runs some 15 MLX kernels), else the codec's own ops."""
        if self.kernels is None or not self.kernels.enabled:
            return codec.quantize(x)
        gap = quantize_gap(x, codec.dim, codec.use_hadamard)
        if gap is not None:
            self.kernels.quantize_gaps[gap.reason] += 1
            return codec.quantize(x)
        self.kernels.quantize_calls += 1
        return TurboQuantState(*turboquant_quantize(x, codec.signs, codec.midpoints, codec.bits, EPS))

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        at = self.offset
        new_k, new_v = self._quantize(self.key_codec, keys), self._quantize(self.value_codec, values)
        self.keys = TurboQuantState(*(write_rows(b, q, at) for b, q in zip(self.keys, new_k)))
        self.values = TurboQuantState(*(write_rows(b, q, at) for b, q in zip(self.values, new_v)))
        self.offset = self.offset + keys.shape[2]
        return self.keys, self.values

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        if sinks is not None:  # TurboQuantKVCache attends with sinks over its dequantized copy
            raise ValueError("attention sinks over TurboQuant codes (the exact cache dequantizes for them)")
        kc, vc = self.key_codec, self.value_codec
        gap = turboquant_decode_gap(queries, keys.norms.shape, kc.dim, vc.dim, kc.bits, vc.bits)
        if self._kernel_applies(mask, gap):
            self.kernels.attention_calls += 1
            # the exact path's order: scale the queries, rotate them into the keys' space; the
            # kernel's output comes back from the values' space
            out = turboquant_decode_attention(kc.rotate(queries * scale), keys, values, kc.codebook, vc.codebook,
                                              self.filled())
            return vc.unrotate(out).astype(queries.dtype)
        return rotated_attention(queries, kc, keys, vc, values, scale, mask)


@functools.lru_cache(maxsize=None)
def _turboquant_codecs(spec: tuple[int, int, int, int, int]) -> tuple[TurboQuantCodec, TurboQuantCodec]:
    """(key, value) codecs of (key_dim, key_bits, value_dim, value_bits, seed), made once and
    prepared: TurboQuantKVCache's own (keys use the seed, values seed + 1)."""
    key_dim, key_bits, value_dim, value_bits, seed = spec
    return (TurboQuantCodec(key_dim, key_bits, seed).prepare(),
            TurboQuantCodec(value_dim, value_bits, seed + 1).prepare())


def static_arrays_cache(arrays) -> ArraysCache:
    cache = ArraysCache(len(arrays))
    cache.cache = list(arrays)
    return cache


@dataclass(frozen=True)
class CacheAdapter:
    """How one exact cache becomes static arrays and back. `kind`: "kv", "ring", "qkv" (quantized
    KV: `group_size`, `bits`), "tq" (TurboQuant: `codecs`, the spec of its two codecs), "arrays" or
    "list" (a CacheList: `children`, their adapters)."""

    kind: str
    n_arrays: int
    group_size: int = 0
    bits: int = 0
    codecs: tuple = ()
    children: tuple = ()

    @property
    def bounded(self) -> bool:
        """Whether it holds positions in buffers of the decoder's capacity (which can fill)."""
        return self.kind in FULL_ATTENTION_KINDS or any(c.bounded for c in self.children)

    @property
    def rewindable(self) -> bool:
        """Whether a multi-token step and a rewind apply: every buffer holds every position (a ring
        overwrites its slots, a recurrent state holds every token it saw)."""
        if self.kind == "list":
            return all(c.rewindable for c in self.children)
        return self.kind in FULL_ATTENTION_KINDS

    def _split(self, arrays) -> list:
        """`arrays` cut into the children's parts."""
        parts, at = [], 0
        for c in self.children:
            parts.append(arrays[at:at + c.n_arrays])
            at += c.n_arrays
        return parts

    def build(self, arrays, position, kernels=None):
        if self.kind == "kv":
            return StaticKVCache(arrays[0], arrays[1], position, kernels)
        if self.kind == "ring":
            return StaticRotatingKVCache(arrays[0], arrays[1], position, kernels)
        if self.kind == "qkv":
            return StaticQuantizedKVCache(arrays[:3], arrays[3:], position, self.group_size, self.bits, kernels)
        if self.kind == "tq":
            return StaticTurboQuantCache(arrays[:2], arrays[2:], position, _turboquant_codecs(self.codecs), kernels)
        if self.kind == "list":
            return CacheList(*(c.build(part, position, kernels) for c, part in zip(self.children, self._split(arrays))))
        return static_arrays_cache(arrays)

    def outputs(self, static) -> list:
        if self.kind == "list":
            return [x for c, child in zip(self.children, static.caches) for x in c.outputs(child)]
        if self.kind in ("qkv", "tq"):
            return [*static.keys, *static.values]
        return [static.keys, static.values] if self.kind in ("kv", "ring") else list(static.cache)

    def release(self, cache) -> None:
        """Let go of an exact full-attention cache's buffers once copied (`write_back` restores them)."""
        if self.kind == "list":
            for c, child in zip(self.children, cache.caches):
                c.release(child)
        elif self.kind in FULL_ATTENTION_KINDS:
            cache.keys = cache.values = None

    def write_back(self, cache, arrays, offset: int, n_new: int) -> None:
        if self.kind == "list":
            for c, child, part in zip(self.children, cache.caches, self._split(arrays)):
                c.write_back(child, part, offset, n_new)
        elif self.kind == "kv":
            cache.state = (arrays[0][..., :offset, :], arrays[1][..., :offset, :], offset)
        elif self.kind == "qkv":
            kept = [a[..., :offset, :] for a in arrays]
            cache.state = (tuple(kept[:3]), tuple(kept[3:]), offset, self.group_size, self.bits)
        elif self.kind == "tq":  # norms [B, H, T], indices [B, H, T, W]: the state sets the offset
            cache.state = tuple(a[:, :, :offset] for a in arrays)
        elif self.kind == "ring":
            window = arrays[0].shape[2]
            idx = offset if offset < window else offset % window
            cache.state = (arrays[0], arrays[1], offset, 0, window, idx)
        else:
            cache.cache = list(arrays)
            cache._seen += n_new


def adapter_for(cache: Any, capacity: int) -> tuple[CacheAdapter, list]:
    """(the adapter, the static input arrays) for an exact cache that holds a prefix."""
    kind = type(cache)
    if kind is KVCache:
        if cache.keys is None:
            raise CompileGap("an empty KVCache (nothing prefilled)")
        keys, values = cache.keys_and_values()
        if cache.offset > capacity:
            raise CompileGap(f"capacity {capacity} is below the {cache.offset} tokens a cache holds")
        return CacheAdapter("kv", 2), [_padded(keys, capacity), _padded(values, capacity)]
    if kind is QuantizedKVCache:
        if cache.keys is None:
            raise CompileGap("an empty QuantizedKVCache (nothing prefilled)")
        if cache.offset > capacity:
            raise CompileGap(f"capacity {capacity} is below the {cache.offset} tokens a cache holds")
        keys, values = cache.keys_and_values()
        return (CacheAdapter("qkv", 6, cache.group_size, cache.bits),
                [_padded(a, capacity) for a in (*keys, *values)])
    if kind is CacheList:
        pairs = [adapter_for(c, capacity) for c in cache.caches]
        children = tuple(a for a, _ in pairs)
        return (CacheAdapter("list", sum(a.n_arrays for a in children), children=children),
                [x for _, arrays in pairs for x in arrays])
    if kind is TurboQuantKVCache:
        if cache.empty() or cache.offset == 0:
            raise CompileGap("an empty TurboQuantKVCache (nothing prefilled)")
        if cache.offset > capacity:
            raise CompileGap(f"capacity {capacity} is below the {cache.offset} tokens a cache holds")
        keys, values = cache.packed()
        spec = (cache.key_dim, cache.key_bits, cache.value_dim, cache.value_bits, cache.seed)
        return CacheAdapter("tq", 4, codecs=spec), [_padded(a, capacity) for a in (*keys, *values)]
    if kind is RotatingKVCache:
        if cache.keys is None or cache.keep:
            raise CompileGap("a RotatingKVCache that is empty or keeps sink tokens")
        window, n = cache.max_size, cache.offset
        ordered = [cache._temporal_order(a) for a in (cache.keys, cache.values)]
        if n <= window:
            arrays = [_padded(a[..., :n, :], window) for a in ordered]
        else:  # the last `window` tokens, the one at position p in slot p % window
            arrays = [mx.roll(a[..., -window:, :], n % window, axis=2) for a in ordered]
        return CacheAdapter("ring", 2), arrays
    if kind is ArraysCache:
        if cache.empty() or any(a is None for a in cache.cache):
            raise CompileGap("an ArraysCache with an unset state")
        if cache.lengths is not None or cache.left_padding is not None:
            raise CompileGap("an ArraysCache with batch padding")
        return CacheAdapter("arrays", len(cache.cache)), list(cache.cache)
    raise CompileGap(f"caches of kind {kind.__name__} (the compiled step holds KVCache, QuantizedKVCache, "
                     "TurboQuantKVCache, RotatingKVCache, ArraysCache and CacheLists of them)")
