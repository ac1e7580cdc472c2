"""Samplers and logits processors, op for op as mlx-lm 0.32.2's `sample_utils.py`.

Same ops, same order, same `mx.compile(inputs=mx.random.state, outputs=mx.random.state)`
wrapping, so after `mx.random.seed(s)` a sampler here draws exactly the tokens mlx-lm's
`make_sampler(...)` draws. What differs: options are checked when the sampler is made (mlx-lm
checks some only inside the first call, some never) and a bad one is a `GenerationError`.

Composition (mlx-lm's `make_sampler`): temperature 0 is argmax; otherwise the filters run in the
order top-p, min-p, XTC, top-k on the log-probabilities, then `categorical(logprobs / temp)`.
Logits processors (`make_logits_processors`) run in the order logit bias, repetition, presence,
frequency penalty, each taking (tokens so far, logits [1, V]).
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from mlxbun.errors import GenerationError

__all__ = [
    "GenerationError",
    "LogitsProcessor",
    "Sampler",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "apply_xtc",
    "categorical_sampling",
    "greedy_sampler",
    "make_frequency_penalty",
    "make_logits_processors",
    "make_presence_penalty",
    "make_repetition_penalty",
    "make_sampler",
]

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_sampling_options(
    temp: float = 0.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
) -> None:
    """Refuse out-of-range sampling options with a `GenerationError` naming the option."""
    if not _is_number(temp) or temp < 0:
        raise GenerationError(f"temperature must be a finite number >= 0, got {temp!r}")
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise GenerationError(f"top_p must be in (0, 1] (1 disables it), got {top_p!r}")
    if not _is_number(min_p) or not 0 <= min_p <= 1:
        raise GenerationError(f"min_p must be in [0, 1] (0 disables it), got {min_p!r}")
    if not _is_int(min_tokens_to_keep) or min_tokens_to_keep < 1:
        raise GenerationError(f"min_tokens_to_keep must be an integer >= 1, got {min_tokens_to_keep!r}")
    if not _is_int(top_k) or top_k < 0:
        raise GenerationError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not _is_number(xtc_probability) or not 0 <= xtc_probability <= 1:
        raise GenerationError(f"xtc_probability must be in [0, 1], got {xtc_probability!r}")
    if not _is_number(xtc_threshold) or not 0 <= xtc_threshold <= 0.5:
        raise GenerationError(f"xtc_threshold must be in [0, 0.5], got {xtc_threshold!r}")


def make_sampler(
    temp: float = 0.0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    top_k: int = 0,
    xtc_probability: float = 0.0,
    xtc_threshold: float = 0.1,
    xtc_special_tokens: Optional[List[int]] = None,
) -> Sampler:
    """A sampler from log-probabilities [1, V] to a token [1] (mlx-lm's `make_sampler`).

    top_p defaults to 1.0 here (mlx-lm: 0.0); both mean "off" because only 0 < top_p < 1 filters.
    """
    check_sampling_options(temp, top_p, min_p, min_tokens_to_keep, top_k, xtc_probability, xtc_threshold)
    if temp == 0:
        return greedy_sampler

    xtc_special_tokens = [] if xtc_special_tokens is None else list(xtc_special_tokens)
    sampling_methods = []
    if 0 < top_p < 1.0:
        sampling_methods.append(lambda x: apply_top_p(x, top_p))
    if min_p != 0.0:
        sampling_methods.append(lambda x: apply_min_p(x, min_p, min_tokens_to_keep))
    if xtc_probability > 0.0:
        sampling_methods.append(
            lambda x: apply_xtc(x, xtc_probability, xtc_threshold, xtc_special_tokens)
        )
    if top_k > 0:
        sampling_methods.append(lambda x: _checked_top_k(x, top_k))

    def sampler(logprobs: mx.array) -> mx.array:
        for method in sampling_methods:
            logprobs = method(logprobs)
        return categorical_sampling(logprobs, temp)

    return sampler


def _checked_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    # The vocabulary is known only now; mlx-lm raises a bare ValueError here (inside compile).
    vocab_size = logprobs.shape[-1]
    if not 0 < top_k < vocab_size:
        raise GenerationError(f"top_k must be below the vocabulary size {vocab_size}, got {top_k}")
    return apply_top_k(logprobs, top_k)


def greedy_sampler(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def apply_top_k(logprobs: mx.array, top_k: int) -> mx.array:
    """Keep the top_k most likely tokens (the rest get -inf)."""
    mask_idx = mx.argpartition(-logprobs, kth=top_k - 1, axis=-1)[..., top_k:]
    masked_logprobs = mx.put_along_axis(
        logprobs, mask_idx, mx.array(-float("inf"), logprobs.dtype), axis=-1
    )
    return masked_logprobs


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def apply_min_p(logprobs: mx.array, min_p: float, min_tokens_to_keep: int = 1) -> mx.array:
    """Drop tokens whose probability is below min_p times the top token's."""
    top_logprobs = mx.max(logprobs, axis=-1, keepdims=True)
    scaled_min_p = top_logprobs + math.log(min_p)
    tokens_to_remove = logprobs < scaled_min_p

    if min_tokens_to_keep > 1:
        top_indices = mx.argpartition(logprobs, kth=-min_tokens_to_keep, axis=-1)
        top_indices = top_indices[..., -min_tokens_to_keep:]
        tokens_to_remove = mx.put_along_axis(
            tokens_to_remove,
            top_indices,
            mx.array(False),
            axis=-1,
        )

    return mx.where(tokens_to_remove, -float("inf"), logprobs)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def apply_top_p(logprobs: mx.array, top_p: float) -> mx.array:
    """Nucleus filter: keep the smallest set of top tokens whose mass reaches top_p."""
    sorted_logprobs = mx.sort(logprobs, axis=-1)
    sorted_probs = mx.exp(sorted_logprobs.astype(mx.float32))
    mass_above = mx.cumsum(sorted_probs, axis=-1, reverse=True, inclusive=False)
    total_mass = mass_above[..., :1] + sorted_probs[..., :1]
    num_dropped = (mass_above >= top_p * total_mass).sum(axis=-1, keepdims=True)
    threshold = mx.take_along_axis(sorted_logprobs, num_dropped, axis=-1)
    return mx.where(logprobs < threshold, -float("inf"), logprobs)


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def apply_xtc(
    logits: mx.array,
    xtc_probability: float,
    xtc_threshold: float,
    xtc_special_tokens: List[int],
) -> mx.array:
    """Exclude Top Choices: with probability xtc_probability drop every token above the
    threshold except the least likely of them (special tokens are never dropped)."""
    probs = mx.softmax(logits, -1)
    mask = probs > mx.where(probs > xtc_threshold, probs, mx.inf).min(axis=-1, keepdims=True)
    if xtc_special_tokens:
        mask[..., xtc_special_tokens] = False

    return mx.where(
        mx.random.uniform(0, 1) > xtc_probability,
        logits,
        mx.where(mask, -mx.inf, logits),
    )


@partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
def categorical_sampling(logits: mx.array, temp: float) -> mx.array:
    return mx.random.categorical(logits * (1.0 / temp))


# ----------------------------------------------------------------------------- logits processors


def make_logits_processors(
    logit_bias: Optional[Dict[int, float]] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: Optional[int] = 20,
    presence_penalty: Optional[float] = None,
    presence_context_size: Optional[int] = 20,
    frequency_penalty: Optional[float] = None,
    frequency_context_size: Optional[int] = 20,
) -> List[LogitsProcessor]:
    """mlx-lm's `make_logits_processors`: bias, then repetition / presence / frequency penalty
    (a penalty of None or 0 is off)."""
    logits_processors: List[LogitsProcessor] = []
    if logit_bias:
        try:
            indices = mx.array([int(k) for k in logit_bias.keys()])
            values = mx.array([float(v) for v in logit_bias.values()])
        except (TypeError, ValueError) as e:
            raise GenerationError(f"logit_bias must map token ids to numbers ({e})") from None

        def logit_bias_processor(_, logits):
            return logits.at[:, indices].add(values)

        logits_processors.append(logit_bias_processor)

    repetition_penalties = [
        (make_repetition_penalty, repetition_penalty, repetition_context_size, "repetition"),
        (make_presence_penalty, presence_penalty, presence_context_size, "presence"),
        (make_frequency_penalty, frequency_penalty, frequency_context_size, "frequency"),
    ]
    for make_penalty, penalty, context_size, name in repetition_penalties:
        if penalty is not None and penalty != 0:
            if not _is_number(penalty):
                raise GenerationError(f"{name}_penalty must be a finite number, got {penalty!r}")
            if not _is_int(context_size) or context_size < 1:
                raise GenerationError(f"{name}_context_size must be an integer >= 1, got {context_size!r}")
            logits_processors.append(make_penalty(penalty, context_size))

    return logits_processors


def make_repetition_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """Sign-aware multiplicative penalty on the last `context_size` tokens (CTRL paper)."""
    if not _is_number(penalty) or penalty < 0:
        raise GenerationError(f"repetition_penalty must be a non-negative number, got {penalty!r}")

    def repetition_penalty_processor(tokens, logits):
        if len(tokens) > 0:
            tokens = tokens[-context_size:]
            selected_logits = logits[:, tokens]
            selected_logits = mx.where(
                selected_logits < 0,
                selected_logits * penalty,
                selected_logits / penalty,
            )
            logits[:, tokens] = selected_logits
        return logits

    return repetition_penalty_processor


def make_presence_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """Subtract `penalty` from every token seen in the last `context_size` tokens."""

    def presence_penalty_processor(tokens, logits):
        if len(tokens) > 0:
            tokens = tokens[-context_size:]
            logits[:, tokens] -= penalty
        return logits

    return presence_penalty_processor


def make_frequency_penalty(penalty: float, context_size: int = 20) -> LogitsProcessor:
    """Subtract `penalty` once per occurrence in the last `context_size` tokens."""

    def frequency_penalty_processor(tokens, logits):
        if len(tokens) > 0:
            tokens = tokens[-context_size:]
            logits = logits.at[:, tokens].subtract(penalty)
        return logits

    return frequency_penalty_processor
