"""KV quantization quality on one model: KLD and top-1 agreement of a quantized KV cache against
plain KV over a fixed prompt and its greedy continuation.

The continuation is generated greedily through plain caches; then the prompt + continuation is
teacher-forced (`mlxbun.parity.forced.teacher_forced`: a prefill, the scheme's conversion at
mlx-lm's quantization points, one token at a time) once with plain KV and once per scheme, and
`compare_logits` (llama.cpp's KLD statistics) compares the continuation's positions.

Schemes (`QUALITY_SCHEMES`): `q8`, `q4` (mlx-lm's uniform affine KV, group 64), `turboquant3.5`
(generation's own settings: refused where generation refuses them; `turboquant3.5,keys=4` a
key/value split, `mlxbun.bench.kv_bytes.turboquant_scheme`), and `q8-latent`,
`q4-latent`: the opt-in uniform quantization of a cache read as arrays
(`mlxbun.cache.latent_quant`), for MLA latent caches only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx

from mlxbun.bench.kv_bytes import turboquant_scheme
from mlxbun.cache.latent_quant import quantize_latent_caches
from mlxbun.errors import MlxbunError
from mlxbun.generation_caches import make_generation_cache
from mlxbun.names import KVSettings
from mlxbun.parity.forced import teacher_forced
from mlxbun.parity.metrics import compare_logits

__all__ = ["QUALITY_SCHEMES", "QualityRow", "greedy_continuation", "kv_quality"]

QUALITY_SCHEMES = ("q8", "q4", "turboquant3.5", "q8-latent", "q4-latent")


@dataclass(frozen=True)
class QualityRow:
    scheme: str
    kv_bytes: int | None = None  # bytes of the cached tokens at the end (None: refused)
    kld_mean: float | None = None
    kld_p99: float | None = None
    kld_max: float | None = None
    top1: float | None = None  # fraction of positions whose argmax agrees with plain KV's
    refused: str | None = None


def greedy_continuation(model, prompt: Sequence[int], n: int) -> list[int]:
    """`n` tokens greedily generated after `prompt` through plain caches."""
    cache = make_generation_cache(model)
    logits = model(mx.array([list(prompt)], dtype=mx.int32), cache=cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]).item())
        out.append(tok)
        logits = model(mx.array([[tok]], dtype=mx.int32), cache=cache)
    return out


def _forced(model, ids, prefill: int, scheme: str, group_size: int):
    if scheme.endswith("-latent"):
        if not getattr(model, "latent_kv", False):
            raise MlxbunError(f"{scheme} is for caches that hold an MLA latent; this model's take "
                              f"{scheme.split('-')[0]} directly")
        bits = int(scheme[1])
        return teacher_forced(model, ids, prefill=prefill,
                              quantize=lambda cache: quantize_latent_caches(cache, bits, group_size))
    if scheme in ("q8", "q4"):
        kv = KVSettings("uniform", int(scheme[1]), group_size)
    elif scheme.startswith("turboquant"):
        kv = turboquant_scheme(scheme)
    else:
        raise MlxbunError(f"unknown KV scheme {scheme!r}; choose from {', '.join(QUALITY_SCHEMES)}")
    return teacher_forced(model, ids, prefill=prefill, kv=kv)


def kv_quality(model, prompt: Sequence[int], continuation: int, schemes: Sequence[str] = QUALITY_SCHEMES,
               group_size: int = 64) -> tuple[int, list[QualityRow]]:
    """(plain KV bytes, one row per scheme) over `prompt` + its greedy continuation of
    `continuation` tokens; a scheme the model's caches cannot take is a row with `refused`."""
    ids = list(prompt) + greedy_continuation(model, prompt, continuation)
    base = teacher_forced(model, ids, prefill=len(prompt))
    rows = []
    for scheme in schemes:
        try:
            r = _forced(model, ids, len(prompt), scheme, group_size)
        except MlxbunError as e:
            rows.append(QualityRow(scheme, refused=str(e)))
            continue
        s = compare_logits(base.logits, r.logits, r.next_tokens)
        rows.append(QualityRow(scheme, r.kv_bytes, s.kld_mean, s.kld_percentiles["99"], s.kld_max, s.same_top_p))
    return base.kv_bytes, rows
