"""Denoising schedule and per-request settings, resolved the way mlx-vlm 0.7.10 resolves them.

Defaults come from `mlx_vlm/generate/common.py` and `generate/diffusion.py`; a checkpoint's
generation_config (`sampler_config`, `linear_temperature_schedule_config` or `t_min`/`t_max`,
`diffusion_stopping_config` or `stability_threshold`/`confidence_threshold`,
`max_denoising_steps`, `max_new_tokens`) fills what the caller leaves as None.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from mlxbun.sampling import GenerationError

__all__ = [
    "DEFAULT_ENTROPY_BOUND",
    "DEFAULT_MAX_DENOISING_STEPS",
    "DEFAULT_MAX_NEW_TOKENS",
    "DEFAULT_MIN_CANVAS_LENGTH",
    "DEFAULT_THRESHOLD",
    "DEFAULT_T_MAX",
    "DEFAULT_T_MIN",
    "SAMPLERS",
    "DiffusionSettings",
    "block_canvas_length",
    "linear_temperature",
    "resolve_settings",
]

SAMPLERS = ("confidence-threshold", "entropy-bound")
DEFAULT_MIN_CANVAS_LENGTH = 64
DEFAULT_MAX_DENOISING_STEPS = 48
DEFAULT_THRESHOLD = 0.9
DEFAULT_ENTROPY_BOUND = 0.1
DEFAULT_T_MIN, DEFAULT_T_MAX = 0.4, 0.8
DEFAULT_MAX_NEW_TOKENS = 256
DEFAULT_STABILITY_THRESHOLD, DEFAULT_STABILITY_CONFIDENCE = 1, 0.005


def linear_temperature(cur_step: int, max_denoising_steps: int, t_min: float, t_max: float) -> float:
    """Temperature at `cur_step` (counting DOWN from max_denoising_steps to 1): the logits are
    DIVIDED by it. Python floats throughout, as the reference computes it."""
    return t_min + ((t_max - t_min) * (cur_step / max_denoising_steps))


def block_canvas_length(remaining_tokens: int, model_canvas_length: int, *, full_canvas: bool,
                        min_canvas_length: int, max_canvas_length: int) -> int:
    """The canvas of the next block: the model's when `full_canvas`, else the remaining tokens
    clamped to [min_canvas_length, max_canvas_length]."""
    if full_canvas:
        return model_canvas_length
    return min(max_canvas_length, max(remaining_tokens, min_canvas_length))


@dataclass(frozen=True)
class DiffusionSettings:
    max_new_tokens: int
    steps: int  # max denoising steps per block
    sampler: str
    threshold: float  # confidence-threshold sampler
    entropy_bound: float  # entropy-bound sampler
    t_min: float
    t_max: float
    temperature: float  # extra sampling temperature (0 = argmax denoiser)
    stability_threshold: Optional[int]  # None: no stability stop
    stability_confidence: Optional[float]
    full_canvas: bool
    min_canvas_length: int
    max_canvas_length: int
    model_canvas_length: int

    @property
    def stability_stop(self) -> bool:
        return self.stability_threshold is not None


def _dict(x: Any) -> dict:
    return dict(x) if isinstance(x, Mapping) else {}


def _number(name: str, v, *, lo=None, hi=None, integer=False):
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if isinstance(v, bool) or not ok or not math.isfinite(v):
        raise GenerationError(f"{name} must be {'an integer' if integer else 'a number'}, got {v!r}")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"{'>= ' + str(lo) if lo is not None else ''}{' and ' if lo is not None and hi is not None else ''}{'<= ' + str(hi) if hi is not None else ''}"
        raise GenerationError(f"{name} must be {rng}, got {v!r}")
    return v


def _positive_int(name: str, v):
    v = _number(name, v, integer=True)
    if v <= 0:
        raise GenerationError(f"{name} must be a positive integer, got {v!r}")
    return v


def resolve_settings(
    generation_config: Optional[Mapping],
    model_canvas_length: int,
    *,
    max_tokens: Optional[int] = None,
    steps: Optional[int] = None,
    sampler: str = "confidence-threshold",
    threshold: Optional[float] = None,
    entropy_bound: Optional[float] = None,
    t_min: Optional[float] = None,
    t_max: Optional[float] = None,
    temperature: float = 0.0,
    stability_stop: Optional[bool] = None,
    stability_threshold: Optional[int] = None,
    stability_confidence: Optional[float] = None,
    full_canvas: bool = False,
    min_canvas_length: Optional[int] = None,
    max_canvas_length: Optional[int] = None,
) -> DiffusionSettings:
    gc = _dict(generation_config)
    if max_tokens is not None:
        _positive_int("max_tokens", max_tokens)
    max_new_tokens = int(max_tokens or gc.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    if steps is None:
        steps = int(gc.get("max_denoising_steps") or DEFAULT_MAX_DENOISING_STEPS)
    steps = _positive_int("steps", steps)
    if sampler not in SAMPLERS:
        raise GenerationError(f"unknown diffusion sampler {sampler!r}; choose one of: {', '.join(SAMPLERS)}")
    threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    _number("threshold", threshold, lo=0.0, hi=1.0)
    for name, v in (("min_canvas_length", min_canvas_length), ("max_canvas_length", max_canvas_length)):
        if v is not None:
            _positive_int(name, v)
    _number("temperature", temperature, lo=0.0)

    # the reference reads the sampler config whichever sampler runs, and refuses other kinds
    sampler_config = _dict(gc.get("sampler_config"))
    kind = sampler_config.get("_cls_name", "EntropyBoundSamplerConfig")
    if kind != "EntropyBoundSamplerConfig":
        raise GenerationError(f"generation_config sampler_config {kind!r} is not supported")
    if entropy_bound is None:
        entropy_bound = float(sampler_config.get("entropy_bound", DEFAULT_ENTROPY_BOUND))
    _number("entropy_bound", entropy_bound, lo=0.0)

    sched = _dict(gc.get("linear_temperature_schedule_config"))
    if not sched and ("t_min" in gc or "t_max" in gc):
        sched = {"t_min": gc.get("t_min", DEFAULT_T_MIN), "t_max": gc.get("t_max", DEFAULT_T_MAX)}
    t_min = float(sched.get("t_min", DEFAULT_T_MIN)) if t_min is None else t_min
    t_max = float(sched.get("t_max", DEFAULT_T_MAX)) if t_max is None else t_max
    _number("t_min", t_min)
    _number("t_max", t_max)
    if linear_temperature(1, steps, t_min, t_max) <= 0 or t_max <= 0:
        raise GenerationError(f"the temperature schedule must stay positive (t_min={t_min}, t_max={t_max})")

    stop = _dict(gc.get("diffusion_stopping_config"))
    if not stop:
        stop = {k: gc[k] for k in ("confidence_threshold", "stability_threshold") if k in gc}
    if stability_stop is None:
        stability_stop = bool(stop) or stability_threshold is not None or stability_confidence is not None
    if stability_stop:
        if stability_threshold is None:
            stability_threshold = int(stop.get("stability_threshold", DEFAULT_STABILITY_THRESHOLD))
        if stability_confidence is None:
            stability_confidence = float(stop.get("confidence_threshold", DEFAULT_STABILITY_CONFIDENCE))
        _number("stability_threshold", stability_threshold, lo=0, integer=True)
        _number("stability_confidence", stability_confidence)
    else:
        stability_threshold = stability_confidence = None

    max_canvas = (
        model_canvas_length
        if full_canvas
        else min(model_canvas_length, int(max_canvas_length or model_canvas_length))
    )
    min_canvas = min(max_canvas, int(min_canvas_length or DEFAULT_MIN_CANVAS_LENGTH))
    return DiffusionSettings(
        max_new_tokens=max_new_tokens,
        steps=steps,
        sampler=sampler,
        threshold=threshold,
        entropy_bound=entropy_bound,
        t_min=t_min,
        t_max=t_max,
        temperature=temperature,
        stability_threshold=stability_threshold,
        stability_confidence=stability_confidence,
        full_canvas=bool(full_canvas),
        min_canvas_length=min_canvas,
        max_canvas_length=max_canvas,
        model_canvas_length=model_canvas_length,
    )
