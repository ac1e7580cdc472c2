"""Canvas draws and the two unmasking rules, transcribed from mlx-vlm 0.7.10
`generate/diffusion.py` (same ops, same float32 casts, same random calls in the same order).

- confidence-threshold: reveal every unrevealed position whose sampled token has probability
  >= threshold; when none qualifies, reveal the single most confident one. Revealed positions
  stay revealed.
- entropy-bound: sort positions by entropy and keep the longest prefix whose summed entropy,
  minus its largest member, stays <= entropy_bound. Not cumulative: a position kept at one step
  is re-noised at the next unless kept again.
"""

from __future__ import annotations

from typing import List, Optional

import mlx.core as mx

__all__ = [
    "MIN_SAMPLING_TEMPERATURE",
    "clamp_temperature",
    "confidence_transfer_mask",
    "entropy_transfer_mask",
    "initial_canvas",
    "random_canvas",
    "sample_canvas",
    "stable_and_confident",
    "token_entropy",
    "token_probability",
]

MIN_SAMPLING_TEMPERATURE = 0.01


def clamp_temperature(temperature: float) -> float:
    """Positive temperatures below 0.01 become 0.01; 0 stays 0 (greedy)."""
    if 0 < temperature < MIN_SAMPLING_TEMPERATURE:
        return MIN_SAMPLING_TEMPERATURE
    return temperature


def random_canvas(batch_size: int, canvas_length: int, vocab_size: int, dtype) -> mx.array:
    """Uniform random token ids: one `mx.random.randint` call (it advances the global key)."""
    return mx.random.randint(0, vocab_size, (batch_size, canvas_length)).astype(dtype)


def initial_canvas(decoder_input_ids: Optional[mx.array], start_index: int, batch_size: int,
                   canvas_length: int, vocab_size: int, dtype) -> mx.array:
    """A block's starting canvas: the caller's seed ids for this span where given (no random
    draw when they cover the whole canvas), random ids for the rest."""
    seed_canvas, seed_length = None, 0
    if decoder_input_ids is not None and start_index < decoder_input_ids.shape[1]:
        end_index = min(start_index + canvas_length, decoder_input_ids.shape[1])
        seed_canvas = decoder_input_ids[:, start_index:end_index].astype(dtype)
        seed_length = seed_canvas.shape[1]
        if seed_length == canvas_length:
            return seed_canvas
    canvas = random_canvas(batch_size, canvas_length, vocab_size, dtype)
    if seed_canvas is None:
        return canvas
    canvas[:, :seed_length] = seed_canvas
    return canvas


def sample_canvas(processed_logits: mx.array, dtype, temperature: float) -> mx.array:
    """The denoiser's proposal: argmax at temperature 0, else a categorical draw at `temperature`."""
    temperature = clamp_temperature(temperature)
    logits = processed_logits.astype(mx.float32)
    if temperature <= 0:
        return mx.argmax(logits, axis=-1).astype(dtype)
    if temperature != 1.0:
        logits = logits / temperature
    return mx.random.categorical(logits).astype(dtype)


def token_probability(processed_logits: mx.array, token_ids: mx.array) -> mx.array:
    logits = processed_logits.astype(mx.float32)
    token_logits = mx.take_along_axis(logits, token_ids[..., None], axis=-1).squeeze(-1)
    return mx.exp(token_logits - mx.logsumexp(logits, axis=-1))


def token_entropy(processed_logits: mx.array) -> mx.array:
    logits = processed_logits.astype(mx.float32)
    log_probs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    probs = mx.exp(log_probs)
    return -mx.sum(probs * log_probs, axis=-1)


def confidence_transfer_mask(confidence: mx.array, unrevealed_mask: mx.array, threshold: float,
                             *, force_all: bool = False) -> mx.array:
    if force_all:
        return unrevealed_mask
    transfer_mask = unrevealed_mask & (confidence >= threshold)
    has_unrevealed = mx.any(unrevealed_mask, axis=-1)
    has_transfer = mx.any(transfer_mask, axis=-1)
    needs_force = has_unrevealed & (~has_transfer)
    masked_confidence = mx.where(unrevealed_mask, confidence, -mx.inf)
    best_index = mx.argmax(masked_confidence, axis=-1)
    positions = mx.arange(confidence.shape[-1])[None, :]
    forced = (positions == best_index[:, None]) & needs_force[:, None]
    return transfer_mask | forced


def entropy_transfer_mask(entropy: mx.array, entropy_bound: float) -> mx.array:
    sorted_indices = mx.argsort(entropy, axis=-1)
    sorted_entropy = mx.take_along_axis(entropy, sorted_indices, axis=-1)
    cumulative_entropy = mx.cumsum(sorted_entropy, axis=-1)
    cumulative_maximum_entropy = mx.cummax(sorted_entropy, axis=-1)
    sorted_selection_mask = (cumulative_entropy - cumulative_maximum_entropy) <= entropy_bound
    selection_mask = mx.zeros_like(sorted_selection_mask)
    return mx.put_along_axis(selection_mask, sorted_indices, sorted_selection_mask, axis=-1)


def stable_and_confident(argmax_canvas: mx.array, processed_logits: mx.array, history: List[mx.array],
                         stability_threshold: Optional[int], confidence_threshold: Optional[float]) -> bool:
    """The stability stop: the argmax canvas equals each of the last `stability_threshold`
    ones AND the mean token entropy is below `confidence_threshold`. Appends to `history`."""
    if stability_threshold is None:
        return False
    if len(history) == stability_threshold:
        stable = all(bool(mx.all(argmax_canvas == canvas).item()) for canvas in history)
    else:
        stable = False
    history.append(argmax_canvas)
    if len(history) > stability_threshold:
        history.pop(0)
    if not stable:
        return False
    return bool((mx.mean(token_entropy(processed_logits)) < confidence_threshold).item())
