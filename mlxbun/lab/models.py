"""What the lab workflows share: model specs, evaluation text, and teacher-forced logits under KV options.

- `resolve_model("zoo:llama", variant="q4")` -> a checkpoint directory (zoo builds are cached;
  directories and hub-cache repo ids as `mlxbun port` takes them; never downloads);
- `wide_zoo_checkpoint(arch, head_dim=32)`: a zoo checkpoint whose heads are wide enough for
  uniform KV quantization (mx.quantize needs a group size of 32+ that divides head_dim; the
  zoo's head_dim is 16);
- `eval_ids(tokenizer, n)`: the zoo corpus encoded, repeated to n tokens;
- `KVSpec` + `teacher_forced(model, ids, prefill=, kv=)`: the logits a model gives at each
  position of a known text while decoding through a (possibly quantized) KV cache, quantized at
  the points mlx-lm's `generate_step` quantizes, plus the cache's bytes and the decode speed.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import mlx.core as mx

from mlxbun.errors import MlxbunError

__all__ = ["ENGINES", "KVSpec", "ForcedRun", "cache_nbytes", "eval_ids", "load_model", "resolve_model",
           "teacher_forced", "wide_zoo_checkpoint"]

ENGINES = ("mlxbun", "mlx-lm")


# ---------------------------------------------------------------- checkpoints


def wide_zoo_checkpoint(arch: str = "llama", head_dim: int = 32, *, variant: str = "float32", seed: int = 0,
                        root=None) -> Path:
    """The zoo checkpoint of `arch` with its heads widened to `head_dim` (the zoo's are 16;
    quantized KV needs a group of 32+ dividing the head), built once per zoo cache root."""
    from mlxbun.parity.port import VARIANT_ALIASES, ZOO_VARIANTS
    from mlxbun.zoo import cached_checkpoint

    variant = VARIANT_ALIASES.get(variant, variant)
    if variant not in ZOO_VARIANTS:
        raise MlxbunError(f"unknown zoo variant '{variant}' (choose from {', '.join(ZOO_VARIANTS)})")
    return cached_checkpoint(arch, seed=seed, root=root, head_dim=head_dim, **ZOO_VARIANTS[variant])

def resolve_model(spec: str | os.PathLike = "zoo:llama", *, variant: str = "float32",
                  head_dim: int | None = None) -> Path:
    """A checkpoint directory from `zoo:ARCH` (+ zoo `variant`, optional `head_dim`), a directory,
    or a repo id in the local hub cache. `variant` and `head_dim` apply to zoo specs only."""
    from mlxbun.parity.port import resolve_targets

    spec = str(spec)
    if spec.startswith("zoo:") and head_dim is not None:
        return wide_zoo_checkpoint(spec[4:], head_dim, variant=variant)
    if not spec.startswith("zoo:") and head_dim is not None:
        raise MlxbunError(f"head_dim={head_dim} only applies to zoo models, not '{spec}'")
    return resolve_targets([spec], variants=(variant,))[0].path


def load_model(path: str | os.PathLike, engine: str = "mlxbun"):
    """The checkpoint as a RuntimeModel: mlxbun's graph (`open_model`) or mlx-lm's (the adapter)."""
    if engine == "mlxbun":
        from mlxbun.factory import open_model

        return open_model(path)
    if engine == "mlx-lm":
        from mlxbun.models.mlxlm import load_mlxlm

        return load_mlxlm(path)
    raise MlxbunError(f"engine '{engine}': choose one of {', '.join(ENGINES)}")


def eval_ids(tokenizer, n_tokens: int, text: str | None = None) -> list[int]:
    """`n_tokens` ids of `text` (default: the zoo corpus), the text repeated as often as needed."""
    if n_tokens < 2:
        raise MlxbunError(f"n_tokens must be >= 2, got {n_tokens}")
    if text is None:
        from importlib.resources import files

        text = files("mlxbun.zoo").joinpath("corpus.txt").read_text(encoding="utf-8")
    ids = list(tokenizer.encode(text))
    if not ids:
        raise MlxbunError("the evaluation text encodes to no tokens")
    while len(ids) < n_tokens:
        ids += ids
    return ids[:n_tokens]


# ---------------------------------------------------------------- KV options


@dataclass(frozen=True)
class KVSpec:
    """A KV cache configuration: `plain` (full precision), `uniform` (mlx-lm's affine
    QuantizedKVCache: bits in 2..8, group_size 32/64/128) or `turboquant` (bits e.g. 3.5)."""

    scheme: str = "plain"
    bits: float | None = None
    group_size: int | None = None

    def __post_init__(self):
        from mlxbun.generate import check_kv_options

        if self.scheme == "plain":
            if self.bits is not None:
                raise MlxbunError(f"KV scheme 'plain' takes no bits (got {self.bits}); use 'uniform' or 'turboquant'")
            return
        if self.scheme not in ("uniform", "turboquant"):
            raise MlxbunError(f"KV scheme '{self.scheme}': choose plain, uniform or turboquant")
        if self.scheme == "turboquant" and self.group_size is not None:
            raise MlxbunError("KV scheme 'turboquant' has no group size (group_size must be None)")
        check_kv_options(kv_bits=self.bits, kv_group_size=self.group_size or 64, kv_scheme=self.scheme)

    @classmethod
    def of(cls, scheme: str = "plain", bits: float | None = None, group_size: int | None = None) -> "KVSpec":
        """Notebook-friendly: a group size is dropped where the scheme has none (plain, turboquant)."""
        return cls(scheme, bits, group_size if scheme == "uniform" else None)

    @property
    def label(self) -> str:
        if self.scheme == "plain":
            return "plain"
        if self.scheme == "turboquant":
            return f"turboquant {self.bits:g}-bit"
        return f"uniform {self.bits:g}-bit g{self.group_size or 64}"

    def quantizer(self):
        """What runs at mlx-lm's quantization points (after each forward): converts the caches."""
        if self.scheme == "plain":
            return lambda cache: None
        if self.scheme == "uniform":
            from mlxbun.cache.convert import maybe_quantize_kv_cache
        else:
            from mlxbun.generate import maybe_turboquant_kv_cache as maybe_quantize_kv_cache
        group = self.group_size or 64

        def quantize(cache):
            try:
                maybe_quantize_kv_cache(cache, quantized_kv_start=0, kv_group_size=group, kv_bits=self.bits)
            except ValueError as e:  # mx.quantize's shape checks
                raise MlxbunError(f"cannot quantize the KV cache as {self.label}: {e}") from None

        return quantize

    def attention(self):
        """TurboQuant decodes from the packed codes (as generation does); others need nothing."""
        import contextlib

        if self.scheme != "turboquant":
            return contextlib.nullcontext()
        from mlxbun.cache.turboquant import patch_mlxlm_attention

        return patch_mlxlm_attention()


# ---------------------------------------------------------------- teacher forcing


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
    from mlx.utils import tree_flatten

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


def teacher_forced(model, ids: Sequence[int], *, prefill: int, kv: KVSpec = KVSpec()) -> ForcedRun:
    """Feed `ids` as generation would, but with the known next token instead of a sampled one.

    ids[:prefill-1] go in as one prefill forward; the KV cache is then quantized (as mlx-lm's
    generate_step does after each prefill chunk), and ids[prefill-1:-1] follow one token at a
    time, each step's logits predicting the next id. So every evaluated position attends to
    the (quantized) cache, as decode does. Returns N = len(ids) - prefill logits rows.
    """
    from mlxbun.generate import make_generation_cache
    from mlxbun.models.mlxlm import ensure_runtime

    ids = [int(i) for i in ids]
    if not 2 <= prefill < len(ids):
        raise MlxbunError(f"prefill must be in [2, {len(ids) - 1}] for {len(ids)} ids, got {prefill}")
    model = ensure_runtime(model)
    cache = make_generation_cache(model)
    quantize = kv.quantizer()
    mx.synchronize()
    mx.reset_peak_memory()
    with kv.attention():
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
