"""Masked (mask-token) diffusion decoding for LLaDA-style models: semi-autoregressive blocks,
confidence-threshold unmasking with a per-step floor.

The canvas is the prompt followed by `max_tokens` mask tokens, rounded up to whole blocks of
`block_length` counted from position 0 (so the prompt's last partial block is decoded with its
prompt positions fixed). Full prompt blocks are prefilled into the model's KV cache. Each
later block starts fully masked; at each denoising step the model reads the block (plus the
cached committed blocks, bidirectionally) and proposes a token and a confidence (its
probability) for every position. Masked positions are unmasked when their confidence exceeds
`threshold`; at least `floor` of them (the most confident) are unmasked every step, where the
floor is the larger of `min_transfer` and an even split of the block's masked count over
`steps` (so every block finishes within `steps` forwards). A finished block is run through
the model once more to commit its keys/values (not the last one: nothing would read them),
and decoding stops after the first block that ends with an EOS among the generated tokens,
or at `max_tokens`.

Held to mlx-vlm 0.7.10 `llada2_moe` `LanguageModel.generate` (L2): with `min_transfer=1`
and `steps` at least the block's masked count its transfer rule (threshold, best token as
fallback) is this rule, each forward has the same inputs and cache contents, and generated
ids are identical (tests/test_masked_diffusion.py). Departures, each on purpose:
- the even-split floor: mlx-vlm takes `num_to_transfer` but never applies it, so with
  `steps` below the masked count it leaves mask tokens in the output; this loop finishes the
  block (mlx-optiq's `llada2.diffusion_generate` uses the same floor schedule);
- `seed` draws from an explicit key (the same sequence `mx.random.seed(seed)` gives the
  global generator mlx-vlm uses), so a run never touches global random state.
As in both references a prediction equal to the mask id leaves its position masked; a
position still masked after `steps` stays masked and is counted in `stats.unrevealed`.

The model is any RuntimeModel whose attention is bidirectional (`model.bidirectional` is
True, e.g. `mlxbun.models.llada2.LLaDA2Model`) and whose cache is trimmable.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import mlx.core as mx

from mlxbun.errors import MlxbunError, UnsupportedModelError
from mlxbun.generate import check_token_ids, vocab_size_of

__all__ = [
    "DiffusionArgumentError",
    "MaskedBlockResponse",
    "MaskedDiffusionStats",
    "masked_diffusion",
    "masked_diffusion_generate",
    "transfer_floors",
]


class DiffusionArgumentError(MlxbunError, ValueError):
    """A masked-diffusion argument is out of range (names the argument)."""


@dataclass(frozen=True)
class MaskedDiffusionStats:
    """What one generation cost and how it revealed its tokens.

    `nfe` counts denoising forwards (the diffusion literature's NFE); `cache_forwards` counts
    the forwards that only fill the KV cache (prompt blocks, and each finished block's commit).
    Per generated position `reveal_step` is the 1-based denoising step within its block that
    unmasked it and `reveal_nfe` the 1-based global denoising forward (0: never unmasked).
    """

    prompt_tokens: int
    generation_tokens: int
    blocks: int
    nfe: int
    cache_forwards: int
    revealed_per_step: tuple[tuple[int, ...], ...]  # per decoded block, per denoising step
    reveal_step: tuple[int, ...]
    reveal_nfe: tuple[int, ...]
    unrevealed: int
    finish_reason: str
    prompt_time_s: float
    generation_time_s: float

    @property
    def tokens_per_forward(self) -> float:
        """Generated tokens per denoising forward (an autoregressive loop gets 1.0)."""
        return self.generation_tokens / self.nfe if self.nfe else 0.0

    @property
    def forwards(self) -> int:
        return self.nfe + self.cache_forwards

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / self.generation_time_s if self.generation_time_s > 0 else 0.0


@dataclass(frozen=True)
class MaskedBlockResponse:
    """One decoded block. `tokens` is everything generated so far, clipped at `max_tokens`
    and after the first EOS; `block_tokens` is what this block added to it. The last
    response of a run carries `finish_reason` ("stop" or "length") and `stats`."""

    block: int  # canvas block index (block b covers positions [b*block_length, (b+1)*block_length))
    tokens: tuple[int, ...]
    block_tokens: tuple[int, ...]
    steps: int  # denoising forwards this block took
    revealed_per_step: tuple[int, ...]
    finish_reason: Optional[str] = None
    stats: Optional[MaskedDiffusionStats] = None


def transfer_floors(masked: int, steps: int, min_transfer: int = 1) -> list[int]:
    """Per-step minimum number of positions to unmask for a block with `masked` masked
    positions: the even split of `masked` over `steps` (earlier steps take the remainder, as
    LLaDA's `get_num_transfer_tokens`), never below `min_transfer`."""
    base, rem = divmod(masked, steps)
    return [max(min_transfer, base + (1 if i < rem else 0)) for i in range(steps)]


def _check_args(prompt: list[int], *, mask_token_id, max_tokens, block_length, steps, threshold,
                min_transfer, temperature, seed) -> None:
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    def fail(name, value, why):
        raise DiffusionArgumentError(f"{name} = {value!r}: {why}")

    if not prompt:
        fail("prompt_ids", prompt, "need at least one prompt token")
    for name, value in (("max_tokens", max_tokens), ("block_length", block_length),
                        ("steps", steps), ("min_transfer", min_transfer)):
        if not is_int(value) or value < 1:
            fail(name, value, "must be a positive integer")
    if not is_int(mask_token_id) or mask_token_id < 0:
        fail("mask_token_id", mask_token_id, "must be a token id")
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or math.isnan(threshold):
        fail("threshold", threshold, "must be a number (a probability; above 1 means floor only)")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not math.isfinite(temperature) or temperature < 0:
        fail("temperature", temperature, "must be a finite number >= 0")
    if seed is not None and (not is_int(seed) or seed < 0):
        fail("seed", seed, "must be None or a non-negative integer")


def _check_vocab(vocab: int, prompt: list[int], mask_token_id: int) -> None:
    if mask_token_id >= vocab:
        raise DiffusionArgumentError(f"mask_token_id = {mask_token_id}: outside the model's "
                                     f"vocabulary (size {vocab})")
    check_token_ids(prompt, vocab, "prompt_ids", DiffusionArgumentError)


def _config_vocab(model: Any) -> Optional[int]:
    """The vocabulary a model's config declares (None: no config, e.g. a scripted test model)."""
    return vocab_size_of(model) if getattr(model, "config", None) is not None else None


def _eos_set(eos_token_ids: Any) -> frozenset[int]:
    if eos_token_ids is None:
        return frozenset()
    if isinstance(eos_token_ids, int) and not isinstance(eos_token_ids, bool):
        return frozenset((eos_token_ids,))
    ids = tuple(eos_token_ids) if isinstance(eos_token_ids, Iterable) else (eos_token_ids,)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise DiffusionArgumentError(f"eos_token_ids = {eos_token_ids!r}: must be token ids")
    return frozenset(ids)


class _Sampler:
    """Token and confidence per position, as mlx-vlm's `_sample_with_temperature_topk_topp`
    (no top-k / top-p): greedy at temperature 0, else categorical on logits / temperature;
    the confidence is the chosen token's probability (precise float32 softmax)."""

    def __init__(self, temperature: float, seed: Optional[int]):
        self.temperature = float(temperature)
        self.key = mx.random.key(seed) if seed is not None else None

    def _next_key(self) -> Optional[mx.array]:
        # mlx's global generator: state, draw = split(state) -- replicated on our own key
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub

    def __call__(self, logits: mx.array) -> tuple[mx.array, mx.array]:
        if self.temperature == 0.0:
            token = mx.argmax(logits, axis=-1)
        else:
            if self.temperature != 1.0:
                logits = logits / self.temperature
            token = mx.random.categorical(logits.astype(mx.float32), axis=-1, key=self._next_key())
        probs = mx.softmax(logits.astype(mx.float32), axis=-1, precise=True)
        return token, mx.take_along_axis(probs, token[..., None], axis=-1)[..., 0]


def _transfer(block: mx.array, x0: mx.array, conf: mx.array, *, mask_token_id: int,
              threshold: float, floor: int) -> mx.array:
    """The block after one step: masked positions whose confidence exceeds `threshold`, and
    the `floor` most confident masked positions, take their proposed token."""
    active = block == mask_token_id
    confidence = mx.where(active, conf, -mx.inf)
    # threshold compares in float32, as mlx-vlm's `confidence > step_threshold`
    transfer = (confidence > threshold) & active
    k = min(floor, block.shape[-1])
    top = mx.argsort(-confidence, axis=-1)[..., :k]
    positions = mx.arange(block.shape[-1])
    best = (positions[None, None, :] == top[..., None]).any(axis=1) & active
    return mx.where(transfer | best, x0, block)


def _require_model(model: Any) -> None:
    if getattr(model, "bidirectional", False) is not True:
        raise UnsupportedModelError(
            f"{type(model).__name__}: masked diffusion needs a model whose attention is "
            f"bidirectional (a masked-diffusion LM such as llada2_moe; it declares "
            f"`bidirectional = True`); a causal LM would see no masked position's right context")
    for name in ("make_cache", "__call__"):
        if not callable(getattr(model, name, None)):
            raise UnsupportedModelError(f"{type(model).__name__}: has no {name}()")


def _clip(generated: Sequence[int], eos: frozenset[int]) -> list[int]:
    end = next((i + 1 for i, t in enumerate(generated) if t in eos), len(generated))
    return list(generated[:end])


def masked_diffusion_generate(
    model: Any,
    prompt_ids: Sequence[int] | mx.array,
    *,
    mask_token_id: int,
    max_tokens: int,
    block_length: int = 32,
    steps: int = 32,
    threshold: float = 0.95,
    min_transfer: int = 1,
    temperature: float = 0.0,
    eos_token_ids: Iterable[int] | int | None = None,
    seed: Optional[int] = None,
) -> Iterator[MaskedBlockResponse]:
    """Decode up to `max_tokens` after `prompt_ids` block by block; yield one
    `MaskedBlockResponse` per decoded block, the last one with `finish_reason` and `stats`.

    `steps` bounds the denoising forwards per block; `threshold` is the confidence a masked
    position must exceed to be unmasked early; `min_transfer` is the least number of positions
    unmasked per step (the even split of the block over `steps` raises it where needed).
    `temperature` 0 is greedy; above 0, tokens are sampled (from `seed`'s key when given).
    """
    prompt = [int(t) for t in (prompt_ids.reshape(-1).tolist() if isinstance(prompt_ids, mx.array)
                               else prompt_ids)]
    _check_args(prompt, mask_token_id=mask_token_id, max_tokens=max_tokens,
                block_length=block_length, steps=steps, threshold=threshold,
                min_transfer=min_transfer, temperature=temperature, seed=seed)
    eos = _eos_set(eos_token_ids)
    _require_model(model)
    # before any forward: an id past the embedding table would be read out of bounds (a model
    # without a config is checked against its logits' width at the first forward)
    vocab = _config_vocab(model)
    if vocab is None:
        check_token_ids(prompt, None, "prompt_ids", DiffusionArgumentError)
    else:
        _check_vocab(vocab, prompt, mask_token_id)
    return _generate(model, prompt, mask_token_id=mask_token_id, max_tokens=max_tokens,
                     block_length=block_length, steps=steps, threshold=float(threshold),
                     min_transfer=min_transfer, sampler=_Sampler(temperature, seed), eos=eos)


def _generate(model, prompt: list[int], *, mask_token_id: int, max_tokens: int, block_length: int,
              steps: int, threshold: float, min_transfer: int, sampler: _Sampler,
              eos: frozenset[int]) -> Iterator[MaskedBlockResponse]:
    tic = time.perf_counter()
    P = len(prompt)
    num_blocks = (P + max_tokens + block_length - 1) // block_length
    canvas = prompt + [mask_token_id] * (num_blocks * block_length - P)
    forward_hidden = getattr(model, "forward_hidden", model)
    cache = model.make_cache()
    if not all(c.is_trimmable() for c in cache):
        raise UnsupportedModelError(f"{type(model).__name__}: masked diffusion needs trimmable caches")

    def commit(b: int) -> None:  # the block's final keys/values into the cache
        ids = mx.array([canvas[b * block_length:(b + 1) * block_length]], dtype=mx.int32)
        mx.eval(forward_hidden(ids, cache=cache))

    prefill_blocks = P // block_length
    for b in range(prefill_blocks):
        commit(b)
    prompt_time = time.perf_counter() - tic

    nfe, cache_forwards = 0, prefill_blocks
    reveal_step = [0] * max_tokens
    reveal_nfe = [0] * max_tokens
    per_block: list[tuple[int, ...]] = []
    for b in range(prefill_blocks, num_blocks):
        b0, b1 = b * block_length, (b + 1) * block_length
        block = mx.array([canvas[b0:b1]], dtype=mx.int32)
        masked = sum(1 for t in canvas[b0:b1] if t == mask_token_id)
        floors = transfer_floors(masked, steps, min_transfer)
        revealed: list[int] = []
        for step in range(steps):
            active = block == mask_token_id
            if not active.any().item():
                break
            logits = model(block, cache=cache)
            for c in cache:  # the cache keeps committed blocks only
                c.trim(block_length)
            if nfe == 0:
                _check_vocab(logits.shape[-1], prompt, mask_token_id)
            x0, conf = sampler(logits)
            new = _transfer(block, x0, conf, mask_token_id=mask_token_id, threshold=threshold,
                            floor=floors[step])
            nfe += 1
            now = (active & (new != mask_token_id))[0].tolist()
            revealed.append(sum(now))
            for i, hit in enumerate(now):
                g = b0 + i - P
                if hit and 0 <= g < max_tokens:
                    reveal_step[g], reveal_nfe[g] = step + 1, nfe
            block = new
        canvas[b0:b1] = block[0].tolist()
        per_block.append(tuple(revealed))
        prev = len(_clip(canvas[P:min(b0, P + max_tokens)], eos)) if b0 > P else 0
        # stop after the last block, or once every generated position so far is unmasked
        # and one of them is an EOS (mlx-vlm's eos_early_stop)
        done = b == num_blocks - 1 or (mask_token_id not in canvas[P:b1]
                                        and any(t in eos for t in canvas[P:b1]))
        if not done:
            commit(b)  # (the last block's commit would feed nothing: skipped)
            cache_forwards += 1
            tokens = _clip(canvas[P:min(b1, P + max_tokens)], eos)
            yield MaskedBlockResponse(b, tuple(tokens), tuple(tokens[prev:]), len(revealed),
                                      tuple(revealed))
            continue
        final = _clip(canvas[P:P + max_tokens], eos)
        reason = "stop" if final and final[-1] in eos else "length"
        n = len(final)
        stats = MaskedDiffusionStats(
            prompt_tokens=P, generation_tokens=n, blocks=len(per_block), nfe=nfe,
            cache_forwards=cache_forwards, revealed_per_step=tuple(per_block),
            reveal_step=tuple(reveal_step[:n]), reveal_nfe=tuple(reveal_nfe[:n]),
            unrevealed=sum(1 for t in final if t == mask_token_id), finish_reason=reason,
            prompt_time_s=prompt_time, generation_time_s=time.perf_counter() - tic - prompt_time)
        yield MaskedBlockResponse(b, tuple(final), tuple(final[prev:]), len(revealed),
                                  tuple(revealed), reason, stats)
        return


def masked_diffusion(model: Any, prompt_ids, **kwargs) -> tuple[list[int], MaskedDiffusionStats]:
    """Run `masked_diffusion_generate` to the end: (generated ids, stats)."""
    last = None
    for last in masked_diffusion_generate(model, prompt_ids, **kwargs):
        pass
    return list(last.tokens), last.stats
