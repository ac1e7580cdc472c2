"""Teacher forcing: the logits a model gives at each position of a known text while decoding
through a (possibly quantized) KV cache, quantized at the points mlx-lm's `generate_step`
quantizes, plus the cache's bytes and the decode speed. What logit_diff and kv_quant compare.

- `eval_ids(tokenizer, n)`: the zoo corpus encoded, repeated to n tokens;
- `teacher_forced(model, ids, prefill=, kv=KVSettings(...))` -> `ForcedRun`;
- `cache_nbytes(cache)`: (bytes of the cached tokens, bytes allocated).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Callable, Sequence

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxbun.errors import MlxbunError
from mlxbun.generate import check_token_ids, vocab_size_of
from mlxbun.generation_caches import attention_routing, kv_quantizer, load_kv_plan, make_generation_cache
from mlxbun.models.mlxlm import ensure_runtime
from mlxbun.names import KVSettings

__all__ = ["ForcedRun", "cache_nbytes", "eval_ids", "teacher_forced"]


def eval_ids(tokenizer, n_tokens: int, text: str | None = None) -> list[int]:
    """`n_tokens` ids of `text` (default: the zoo corpus), the text repeated as often as needed."""
    if n_tokens < 2:
        raise MlxbunError(f"n_tokens must be >= 2, got {n_tokens}")
    if text is None:
        text = files("mlxbun.zoo").joinpath("corpus.txt").read_text(encoding="utf-8")
    ids = list(tokenizer.encode(text))
    if not ids:
        raise MlxbunError("the evaluation text encodes to no tokens")
    while len(ids) < n_tokens:
        ids += ids
    return ids[:n_tokens]



@dataclass
class ForcedRun:
    logits: mx.array  # [N, V]: row i predicts next_tokens[i]
    next_tokens: list[int]
    kv_bytes: int  # bytes of the cached tokens after the last step (the caches' state)
    kv_bytes_allocated: int  # bytes the caches' buffers take (they grow in steps of 256 tokens)
    peak_memory: int  # mx.get_peak_memory() over the run, bytes
    decode_s: float  # wall time of the one-token steps
    prefill_s: float

    @property
    def decode_tps(self) -> float:
        return len(self.next_tokens) / self.decode_s if self.decode_s > 0 else float("nan")


def _used_bytes(c: Any) -> int:
    """Bytes of the tokens a cache holds: its buffers grow in steps of 256 tokens (mlx-lm's
    layout), so the allocated bytes are scaled by offset / capacity along the token axis."""
    if hasattr(c, "packed"):  # TurboQuant: its state is already cut to the tokens held
        return sum(v.nbytes for _, v in tree_flatten(c.state) if isinstance(v, mx.array))
    keys = getattr(c, "keys", None)
    first = keys[0] if isinstance(keys, (tuple, list)) else keys  # quantized: (packed, scales, biases)
    if not isinstance(first, mx.array) or first.ndim < 2:
        return int(getattr(c, "nbytes", 0) or 0)
    capacity = first.shape[-2]
    held = min(int(getattr(c, "offset", capacity)), capacity)
    return int(c.nbytes * held // capacity) if capacity else 0


def cache_nbytes(cache: Sequence[Any]) -> tuple[int, int]:
    """(bytes of the cached tokens, bytes allocated) over the layers' caches; only the first
    compares fairly across schemes, whose buffers grow differently."""
    return sum(_used_bytes(c) for c in cache), int(sum(getattr(c, "nbytes", 0) or 0 for c in cache))


def teacher_forced(model, ids: Sequence[int], *, prefill: int, kv: KVSettings = KVSettings(),
                   plan=None, quantize: Callable[[list], None] | None = None) -> ForcedRun:
    """Feed `ids` as generation would, but with the known next token instead of a sampled one.
    `plan`: a per-layer KV plan (a `KVPlan`, or what `load_kv_plan` reads) instead of `kv`.
    The caches are built as generation builds them for these settings, so what generation
    refuses (e.g. uniform KV on an MLA latent cache) is refused here too (`GenerationError`).
    `quantize`: an explicit conversion run at the same points instead of the settings' (an
    opt-in beyond generation's KV options, e.g. `mlxbun.cache.latent_quant`); plain `kv` only.

    ids[:prefill-1] go in as one prefill forward; the KV cache is then quantized (as mlx-lm's
    generate_step does after each prefill chunk), and ids[prefill-1:-1] follow one token at a
    time, each step's logits predicting the next id. So every evaluated position attends to
    the (quantized) cache, as decode does. Returns N = len(ids) - prefill logits rows.
    """
    ids = [int(i) for i in ids]
    if not 2 <= prefill < len(ids):
        raise MlxbunError(f"prefill must be in [2, {len(ids) - 1}] for {len(ids)} ids, got {prefill}")
    model = ensure_runtime(model)
    check_token_ids(ids, vocab_size_of(model), "ids")
    if (plan is not None or quantize is not None) and kv.quantized:
        raise MlxbunError("give a per-layer KV plan, a quantize hook or quantized KV settings, not more")
    if plan is not None and quantize is not None:
        raise MlxbunError("give a per-layer KV plan or a quantize hook, not both")
    options = kv.as_options()
    cache = make_generation_cache(model, **options, kv_config=plan)
    if plan is not None:
        plan = load_kv_plan(plan, len(cache))
    if quantize is None:
        quantize = kv_quantizer(options["kv_scheme"], kv.bits, kv.group, kv.start, plan,
                                key_bits=kv.key_bits, value_bits=kv.value_bits)
    mx.synchronize()
    mx.reset_peak_memory()
    with attention_routing(kv.scheme == "turboquant"):
        tic = time.perf_counter()
        model(mx.array([ids[: prefill - 1]], dtype=mx.int32), cache=cache)
        quantize(cache)
        mx.eval([c.state for c in cache])
        prefill_s = time.perf_counter() - tic
        rows = []
        tic = time.perf_counter()
        for tok in ids[prefill - 1: -1]:
            logits = model(mx.array([[tok]], dtype=mx.int32), cache=cache)[0, -1]
            quantize(cache)
            mx.eval(logits)
            rows.append(logits)
        decode_s = time.perf_counter() - tic
    out = mx.stack(rows)
    mx.eval(out)
    used, allocated = cache_nbytes(cache)
    return ForcedRun(logits=out, next_tokens=ids[prefill:], kv_bytes=used, kv_bytes_allocated=allocated,
                     peak_memory=int(mx.get_peak_memory()), decode_s=decode_s, prefill_s=prefill_s)
