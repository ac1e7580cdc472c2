"""TurboQuantKVCache: mlx-vlm 0.7.10's TurboQuant KV cache, usable inside mlx-lm models.

Storage is the packed TurboQuant MSE code (`turboquant_codec`): per token and
kv head a float16 norm and uint32-packed codeword indices; keys use
`key_bits`, values `value_bits` (bits=3.5 -> 3-bit keys, 4-bit values), the
key codec seeded `seed`, the value codec `seed + 1`, as in mlx-vlm.

Attention. mlx-lm's `scaled_dot_product_attention` sends a cache that has a
`bits` attribute to `mx.quantized_matmul` (affine group quantization), which
would be wrong here, so this cache deliberately has no `bits` (the width is
`kv_bits`). Its `update_and_fetch` returns the dequantized keys and values as
ordinary arrays, so any model computes correct attention over them with plain
SDPA; this is mlx-vlm's prefill path (dequantize + SDPA). For decode,
`TurboQuantKVCache.attention` (what mlxbun's graphs call through their sdpa, and
what `patch_mlxlm_attention()` routes mlx-lm's sdpa to) computes attention in the
rotated space straight from the packed codes (`decode_attention`, mlx-vlm's
decode maths). It only does so when the keys and values it is handed are the
very arrays this cache's last `update_and_fetch` returned (so they stand for the
whole packed cache) and there are no sinks; anything else falls through to plain
SDPA on the arrays given. The returned arrays are lazy: on the routed path they
are never evaluated, so decode never dequantizes the cache.

Decode memory. The rotated-space decode needs a float32 codeword per key and
value coordinate (mlx-vlm's op sequence), 2x an fp16 cache each, so one pass over
a long context raised the step's peak far above fp16 SDPA's. Over more than
`attention_chunk` keys (default 512) decode runs in chunks merged by online
softmax (mlx-vlm's own chunked loop, bit-exact to it; float32 rounding away from
the one pass), and codewords come from byte-wide indices (same values as
mlx-vlm's uint32 unpack, a quarter of its temporaries). One layer, 8 kv x 128,
32 query heads, float16, one decode query, CPU (`mlxbun.bench.kv_memory.measure_decode_memory`;
MiB):

    context  scheme                        cache  transient  cache+transient
    4096     fp16 KV + fast SDPA           16.00       0.27    16.27 (1.00x)
    4096     TurboQuant 3.5, before         3.62     128.82   132.44 (8.14x)
    4096     TurboQuant 3.5, one pass       3.62      48.81    52.44 (3.22x)
    4096     TurboQuant 3.5, chunk 512      3.62       8.81    12.43 (0.76x)
    16384    fp16 KV + fast SDPA           64.00       1.02    65.02 (1.00x)
    16384    TurboQuant 3.5, before        14.50     515.07   529.57 (8.15x)
    16384    TurboQuant 3.5, one pass      14.50     195.06   209.56 (3.22x)
    16384    TurboQuant 3.5, chunk 512     14.50       8.83    23.33 (0.36x)
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from typing import Optional

import mlx.core as mx

from mlxbun.attention import cached_causal_mask, fused_sdpa
from mlxbun.cache.spec_round import TrimSpecRound
from mlxbun.cache.turboquant_codec import (
    TurboQuantCodec,
    TurboQuantState,
    resolve_kv_bits,
    rotated_attention,
    state_nbytes_per_vector,
)
from mlxbun.errors import ConfigError

__all__ = [
    "DEFAULT_ATTENTION_CHUNK",
    "TurboQuantKVCache",
    "patch_mlxlm_attention",
    "turboquant_sdpa",
]


# Keys per decode-attention chunk. A chunk's transient is ~18 bytes per coordinate
# of its keys (float32 K and V codewords, byte-wide indices, the ops in flight);
# the fp16 cache costs 4 per coordinate of the context, the 3.5-bit one 0.9. So at
# 512 a TurboQuant decode step (cache + transient) is under the fp16 cache alone
# from ~3k keys (0.76x at 4k, 0.36x at 16k); 1024 crosses at ~6k (1.3x at 4k).
# See `measure_decode_memory` in `mlxbun.bench.kv_memory`.
DEFAULT_ATTENTION_CHUNK = 512


def _check_chunk(chunk):
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int)
                              or chunk < 1):
        raise ConfigError(f"TurboQuantKVCache: attention_chunk must be a positive int "
                          f"or None, got {chunk!r}")
    return chunk


def _slice(state: TurboQuantState, end: int) -> TurboQuantState:
    return TurboQuantState(state.norms[..., :end], state.indices[..., :end, :])


def _grow(state: Optional[TurboQuantState], used: int, like: TurboQuantState,
          capacity: int) -> TurboQuantState:
    """A buffer of `capacity` tokens shaped like `like`, holding the first `used`."""
    B, H = like.norms.shape[:2]
    grown = TurboQuantState(
        mx.zeros((B, H, capacity), dtype=like.norms.dtype),
        mx.zeros((B, H, capacity, like.indices.shape[-1]), dtype=like.indices.dtype),
    )
    if state is not None and used:
        grown.norms[..., :used] = state.norms[..., :used]
        grown.indices[..., :used, :] = state.indices[..., :used, :]
    return grown


class TurboQuantKVCache(TrimSpecRound):
    """A KV cache storing TurboQuant-packed keys and values (mlx-lm cache interface).

    TurboQuantKVCache(bits=3.5, seed=0, key_bits=None, value_bits=None, *,
                      attention_chunk=DEFAULT_ATTENTION_CHUNK)
      bits        integer or half width; a half width b means floor(b)-bit keys and
                  ceil(b)-bit values (mlx-vlm's convention); 1 <= bits <= 8
      seed        rotation seed (keys use seed, values seed + 1)
      key_bits / value_bits   integer overrides
      attention_chunk   decode attention over more keys than this runs in chunks
                  of this many (online softmax, transient memory O(chunk)); up to
                  it, and always when None, one pass as mlx-vlm computes it

    update_and_fetch(k, v) -> (k_hat, v_hat): quantizes and stores the new tokens
    and returns the dequantized cache (lazy) in the input dtype.
    decode_attention(q, scale, mask) -> rotated-space attention over the packed cache.
    Spec rounds trim: tokens below `offset` are never rewritten.
    """

    step = 256

    def __init__(
        self,
        bits: float = 3.5,
        seed: int = 0,
        key_bits: Optional[int] = None,
        value_bits: Optional[int] = None,
        *,
        attention_chunk: Optional[int] = DEFAULT_ATTENTION_CHUNK,
    ):
        # NB: never name an attribute `bits` (mlx-lm's quantized-sdpa probe).
        self.kv_bits, self.key_bits, self.value_bits = resolve_kv_bits(
            bits, key_bits, value_bits
        )
        self.seed = int(seed)
        self.attention_chunk = _check_chunk(attention_chunk)
        self.keys: Optional[TurboQuantState] = None
        self.values: Optional[TurboQuantState] = None
        self.offset = 0
        self.key_dim = 0
        self.value_dim = 0
        self.key_codec: Optional[TurboQuantCodec] = None
        self.value_codec: Optional[TurboQuantCodec] = None
        self._dtype = mx.float32
        # (offset, weakrefs to k_hat, v_hat) of the last fetch: weak, so an evaluated
        # float copy of the cache does not outlive the caller's use of it
        self._fetched = None
        self._spec = None

    @classmethod
    def from_cache(cls, cache, bits: float = 3.5, seed: int = 0, **kw) -> "TurboQuantKVCache":
        """Quantize the tokens of a full-precision cache (anything with
        `keys_and_values()`, or `state` = (keys, values, ...))."""
        out = cls(bits=bits, seed=seed, **kw)
        if cache.empty():
            return out
        if hasattr(cache, "keys_and_values"):
            keys, values = cache.keys_and_values()
        else:
            keys, values = cache.state[:2]
        out.update_and_fetch(keys, values)
        return out

    # -- codecs --------------------------------------------------------------------

    def _build_codecs(self):
        self.key_codec = TurboQuantCodec(self.key_dim, self.key_bits, self.seed)
        self.value_codec = TurboQuantCodec(self.value_dim, self.value_bits, self.seed + 1)

    def _check_new(self, keys: mx.array, values: mx.array):
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
            raise ValueError(
                "TurboQuantKVCache.update_and_fetch expects keys/values [B, H, L, D] "
                f"with equal B, H, L; got {keys.shape} and {values.shape}"
            )
        if self.key_codec is None:
            self.key_dim, self.value_dim = keys.shape[-1], values.shape[-1]
            self._build_codecs()
        elif (keys.shape[-1], values.shape[-1]) != (self.key_dim, self.value_dim):
            raise ValueError(
                f"TurboQuantKVCache: head dims {keys.shape[-1]}/{values.shape[-1]} differ "
                f"from the cache's {self.key_dim}/{self.value_dim}"
            )
        if self.keys is not None and keys.shape[:2] != self.keys.norms.shape[:2]:
            raise ValueError(
                f"TurboQuantKVCache: batch/heads {keys.shape[:2]} differ from the "
                f"cache's {self.keys.norms.shape[:2]}"
            )

    # -- the mlx-lm cache interface -----------------------------------------------

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_new(keys, values)
        new_k = self.key_codec.quantize(keys)
        new_v = self.value_codec.quantize(values)
        prev, n = self.offset, keys.shape[2]
        end = prev + n
        if self.keys is None or end > self.keys.norms.shape[2]:
            capacity = ((end + self.step - 1) // self.step) * self.step
            self.keys = _grow(self.keys, prev, new_k, capacity)
            self.values = _grow(self.values, prev, new_v, capacity)
        self.keys.norms[..., prev:end] = new_k.norms
        self.keys.indices[..., prev:end, :] = new_k.indices
        self.values.norms[..., prev:end] = new_v.norms
        self.values.indices[..., prev:end, :] = new_v.indices
        self.offset = end
        self._dtype = keys.dtype
        self._fetched = None
        return self.keys_and_values()

    def keys_and_values(self):
        """The dequantized cache (float, the dtype of the last update), lazily built."""
        fetched = self._live_fetch()
        if fetched is not None:
            return fetched
        if self.empty() or self.key_codec is None:
            raise RuntimeError("TurboQuantKVCache.keys_and_values on an empty cache")
        k_state, v_state = self.packed()
        k_hat = self.key_codec.dequantize(k_state).astype(self._dtype)
        v_hat = self.value_codec.dequantize(v_state).astype(self._dtype)
        self._fetched = (self.offset, weakref.ref(k_hat), weakref.ref(v_hat))
        return k_hat, v_hat

    def _live_fetch(self):
        f = self._fetched
        if f is None or f[0] != self.offset:
            return None
        k_hat, v_hat = f[1](), f[2]()
        return None if k_hat is None or v_hat is None else (k_hat, v_hat)

    def packed(self):
        """(keys, values) as `TurboQuantState`s over the first `offset` tokens."""
        return _slice(self.keys, self.offset), _slice(self.values, self.offset)

    def dequantize(self):
        """float32 (keys, values) decoded from the packed cache."""
        k_state, v_state = self.packed()
        return self.key_codec.dequantize(k_state), self.value_codec.dequantize(v_state)

    def size(self):
        return self.offset

    @property
    def state(self):
        if self.keys is None:
            return ()
        k, v = self.packed()
        return k.norms, k.indices, v.norms, v.indices

    @state.setter
    def state(self, v):
        self._fetched = None
        if v is None or len(v) == 0:
            self.keys = self.values = None
            self.offset = 0
            return
        k_norms, k_indices, v_norms, v_indices = v
        self.keys = TurboQuantState(k_norms, k_indices)
        self.values = TurboQuantState(v_norms, v_indices)
        self.offset = k_norms.shape[2]

    @property
    def meta_state(self):
        return tuple(map(str, (self.kv_bits, self.key_bits, self.value_bits, self.seed,
                               self.key_dim, self.value_dim)))

    @meta_state.setter
    def meta_state(self, v):
        kv_bits, key_bits, value_bits, seed, key_dim, value_dim = v
        self.kv_bits, self.key_bits, self.value_bits = resolve_kv_bits(
            float(kv_bits), int(key_bits), int(value_bits)
        )
        self.seed, self.key_dim, self.value_dim = int(seed), int(key_dim), int(value_dim)
        self.key_codec = self.value_codec = None
        if self.key_dim and self.value_dim:
            self._build_codecs()
        self._fetched = None

    @classmethod
    def from_state(cls, state, meta_state):
        """Rebuild from `state` and `meta_state` (the codecs need the meta's dims)."""
        obj = cls()
        obj.meta_state = meta_state
        obj.state = state
        return obj

    def trim(self, n):
        self._fetched = None  # the last fetch no longer images the cache
        return super().trim(n)

    def make_mask(self, *args, **kwargs):
        return cached_causal_mask(*args, offset=self.offset, **kwargs)

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        """Bytes of the packed tokens held (`offset` of them; as mlx-vlm counts):
        B * H * offset * (2 + 4*ceil(Dk*kb/32) + 2 + 4*ceil(Dv*vb/32))."""
        if self.keys is None:
            return 0
        return sum(a.nbytes for a in self.state)

    @staticmethod
    def bytes_per_token(n_kv_heads: int, key_dim: int, value_dim: int,
                        key_bits: int, value_bits: int) -> int:
        """Packed bytes one token takes over `n_kv_heads` heads (batch 1)."""
        return n_kv_heads * (state_nbytes_per_vector(key_dim, key_bits)
                             + state_nbytes_per_vector(value_dim, value_bits))

    # -- attention ------------------------------------------------------------------

    def decode_attention(self, queries: mx.array, scale: float, mask=None) -> mx.array:
        """Attention of `queries` [B, Hq, L, Dk] over the packed cache, computed in
        the rotated space (no dequantization); the queries are the last L cache
        positions when mask == "causal". Over more than `attention_chunk` keys it
        runs chunked (see `rotated_attention`)."""
        if self.empty() or self.offset == 0:
            raise RuntimeError("TurboQuantKVCache.decode_attention on an empty cache")
        k_state, v_state = self.packed()
        return rotated_attention(
            queries, self.key_codec, k_state, self.value_codec, v_state, scale, mask,
            chunk_size=self.attention_chunk,
        )

    def serves(self, keys, values) -> bool:
        """Whether (keys, values) are exactly what this cache's last fetch returned,
        i.e. the dequantized image of the whole packed cache as it is now."""
        live = self._live_fetch()
        return live is not None and keys is live[0] and values is live[1]

    def attention(self, queries, keys, values, scale, mask, sinks=None):
        """Attention over (keys, values): single-query attention over this cache's own
        fetch runs in the rotated space from the packed codes (`decode_attention`);
        anything else (prefill, sinks, other arrays) is the fused kernel over the
        arrays given, which for the fetch is mlx-vlm's prefill (dequantize + SDPA)."""
        if sinks is None and queries.shape[-2] == 1 and self.serves(keys, values):
            return self.decode_attention(queries, scale=scale, mask=mask)
        return fused_sdpa(queries, keys, values, scale=scale, mask=mask, sinks=sinks)


# -- routing mlx-lm's attention -------------------------------------------------------


def _default_sdpa():
    from mlx_lm.models.base import scaled_dot_product_attention

    return scaled_dot_product_attention


def turboquant_sdpa(queries, keys, values, cache, scale, mask, sinks=None, *, fallback=None):
    """mlx-lm's `scaled_dot_product_attention` signature: a TurboQuantKVCache attends
    itself (`TurboQuantKVCache.attention`), any other cache goes to `fallback`
    (mlx-lm's sdpa by default)."""
    if isinstance(cache, TurboQuantKVCache):
        return cache.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    fallback = fallback or _default_sdpa()
    return fallback(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)


def _routed(original):
    @functools.wraps(original)
    def sdpa(queries, keys, values, cache, scale, mask, sinks=None):
        return turboquant_sdpa(
            queries, keys, values, cache, scale, mask, sinks, fallback=original
        )

    sdpa._turboquant_original = original
    return sdpa


def _mlxlm_model_modules():
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "mlx_lm.models" or name.startswith("mlx_lm.models.")):
            yield module


@contextlib.contextmanager
def patch_mlxlm_attention():
    """Route mlx-lm's `scaled_dot_product_attention` through `turboquant_sdpa` while the
    block runs, so decode over TurboQuantKVCache layers of an mlx-lm model runs in the
    rotated space without dequantizing. (mlxbun's own graphs need no patch: their
    sdpa asks the cache.)

    Model modules bind the function by name (`from .base import ...`), so every loaded
    `mlx_lm.models.*` module bound to it is rebound, as is the base (modules imported
    inside the block pick the routed one up); all are restored on exit. Without the
    patch the cache is still correct: attention then runs over the dequantized arrays."""
    try:
        from mlx_lm.models import base
    except ImportError:  # no mlx-lm: nothing to route
        yield
        return
    original = base.scaled_dot_product_attention
    if hasattr(original, "_turboquant_original"):  # already inside a patch
        yield
        return
    routed = _routed(original)
    try:
        for module in _mlxlm_model_modules():
            if getattr(module, "scaled_dot_product_attention", None) is original:
                module.scaled_dot_product_attention = routed
        yield
    finally:
        for module in _mlxlm_model_modules():
            if getattr(module, "scaled_dot_product_attention", None) is routed:
                module.scaled_dot_product_attention = original
