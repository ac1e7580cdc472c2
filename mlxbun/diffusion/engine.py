"""The semi-autoregressive block-diffusion loop: mlx-vlm 0.7.10 `stream_diffusion_generate`.

    encode prompt -> [ random canvas -> denoise (up to `steps` decoder forwards)
                      -> emit the canvas (EOS / max_tokens stop) -> encode the canvas ]*

Each denoising step: decoder logits (with the previous step's soft embeddings fed back as
self-conditioning), DIVIDED by the linear schedule temperature, argmax (or a categorical draw
when `temperature` > 0), then the sampler decides which positions to keep; every other
position is re-drawn uniformly at random. The last step only takes the argmax. The random
draws are the reference's, call for call, so after `mx.random.seed(seed)` the ids match
mlx-vlm's.

The loop drives a model through mlx-vlm's method names (`diffusion_prefill_cache`,
`diffusion_decoder_logits`, ...), so it runs mlxbun's DiffusionGemma graph or an mlx-vlm
DiffusionGemma model alike. Not ported: batch > 1, padded prompts, images, static prefix
caches, automatic prefix caching.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Generator, Iterable, List, Optional

import mlx.core as mx

from mlxbun.diffusion import samplers
from mlxbun.diffusion.schedule import block_canvas_length, linear_temperature, resolve_settings
from mlxbun.diffusion.stats import BlockStats, DiffusionStats, reveal_steps
from mlxbun.generate import check_token_ids, prepare_prompt, vocab_size_of
from mlxbun.sampling import GenerationError

__all__ = ["DiffusionBlock", "StepEvent", "collect", "diffusion_generate", "stop_token_ids"]


@dataclass
class DiffusionBlock:
    """One finished canvas. `tokens` are the ids it emitted (the stopping EOS excluded);
    `finish_reason` and `stats` are set on the last block only."""

    index: int
    tokens: List[int]
    text: str
    stats: BlockStats
    finish_reason: Optional[str] = None
    run: Optional[DiffusionStats] = None


@dataclass
class StepEvent:
    """One denoising step, handed to `on_step` (for live views and plots)."""

    block: int
    step: int  # 1-based
    total_steps: int
    draft: List[int]  # the draft canvas ids (argmax for entropy-bound, revealed ids otherwise)
    revealed: List[bool]
    accepted: int


def stop_token_ids(model, tokenizer=None, extra: Optional[Iterable[int]] = None) -> frozenset[int]:
    """EOS ids: the tokenizer's, the model config's and its generation_config's, plus `extra`
    (the reference's StoppingCriteria union)."""
    ids = set()

    def add(src):
        if isinstance(src, bool):
            return
        if isinstance(src, int):
            ids.add(src)
        elif isinstance(src, (list, tuple, set, frozenset)):
            ids.update(int(i) for i in src if isinstance(i, int) and not isinstance(i, bool))

    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_ids", None))
        add(getattr(tokenizer, "eos_token_id", None))
    config = getattr(model, "config", None)
    add(getattr(config, "eos_token_id", None))
    add(_generation_config(model).get("eos_token_id"))
    add(list(extra) if extra is not None else None)
    return frozenset(ids)


def _generation_config(model) -> dict:
    gc = getattr(getattr(model, "config", None), "generation_config", None)
    return gc if isinstance(gc, dict) else {}


def _eval_cache(cache) -> None:
    mx.eval([a for c in cache for a in (c.keys, c.values) if a is not None])


def make_detokenizer(tokenizer):
    # no text without a streaming detokenizer (ids only, e.g. a bare HF tokenizer)
    if tokenizer is None or getattr(tokenizer, "detokenizer", None) is None:
        return None
    from mlxbun.generate import make_detokenizer as make

    return make(tokenizer)


def _decoder_fns(model, kv_cache, mask_mapping, compile_graph: bool):
    def without_self_conditioning(canvas):
        return model.diffusion_decoder_logits(canvas, cache=kv_cache, self_conditioning=None,
                                              decoder_attention_mask=mask_mapping)

    def with_self_conditioning(canvas, self_conditioning):
        return model.diffusion_decoder_logits(canvas, cache=kv_cache, self_conditioning=self_conditioning,
                                              decoder_attention_mask=mask_mapping)

    if compile_graph:
        return mx.compile(without_self_conditioning), mx.compile(with_self_conditioning)
    return without_self_conditioning, with_self_conditioning


def diffusion_generate(
    model,
    tokenizer,
    prompt,
    *,
    max_tokens: Optional[int] = None,
    seed: Optional[int] = None,
    temperature: float = 0.0,
    steps: Optional[int] = None,
    sampler: str = "confidence-threshold",
    threshold: Optional[float] = None,
    entropy_bound: Optional[float] = None,
    t_min: Optional[float] = None,
    t_max: Optional[float] = None,
    stability_stop: Optional[bool] = None,
    stability_threshold: Optional[int] = None,
    stability_confidence: Optional[float] = None,
    full_canvas: bool = False,
    min_canvas_length: Optional[int] = None,
    max_canvas_length: Optional[int] = None,
    prefill_step_size: Optional[int] = None,
    decoder_input_ids=None,
    eos_token_ids: Optional[Iterable[int]] = None,
    compile: bool = False,
    show_unmasking: bool = False,
    on_step: Optional[Callable[[StepEvent], None]] = None,
) -> Generator[DiffusionBlock, None, DiffusionStats]:
    """Stream a block-diffusion generation, one `DiffusionBlock` per finished canvas; the last
    block carries `finish_reason` and the run's `DiffusionStats` (also the generator's return
    value). Names map onto mlx-vlm's `stream_diffusion_generate`: steps = max_denoising_steps,
    sampler = diffusion_sampler, threshold = diffusion_threshold, full_canvas / min_ / max_
    canvas_length = diffusion_*, compile = diffusion_compile, show_unmasking =
    diffusion_show_unmasking (which also makes the last step sample, as there). t_min / t_max /
    entropy_bound / stability_* override the checkpoint's generation_config; None keeps it.
    """
    model_canvas_length = int(model.config.canvas_length)
    settings = resolve_settings(
        _generation_config(model), model_canvas_length,
        max_tokens=max_tokens, steps=steps, sampler=sampler, threshold=threshold,
        entropy_bound=entropy_bound, t_min=t_min, t_max=t_max, temperature=temperature,
        stability_stop=stability_stop, stability_threshold=stability_threshold,
        stability_confidence=stability_confidence, full_canvas=full_canvas,
        min_canvas_length=min_canvas_length, max_canvas_length=max_canvas_length,
    )
    if prefill_step_size is not None and (
        isinstance(prefill_step_size, bool) or not isinstance(prefill_step_size, int) or prefill_step_size <= 0
    ):
        raise GenerationError(f"prefill_step_size must be a positive integer, got {prefill_step_size!r}")
    vocab = vocab_size_of(model)
    input_ids = prepare_prompt(tokenizer, prompt, vocab)[None]
    if decoder_input_ids is not None:
        decoder_input_ids = mx.array(decoder_input_ids)
        if decoder_input_ids.ndim == 1:
            decoder_input_ids = decoder_input_ids[None]
        if decoder_input_ids.ndim != 2 or decoder_input_ids.shape[0] != 1:
            raise GenerationError(
                f"decoder_input_ids must be [length] or [1, length], got {tuple(decoder_input_ids.shape)}"
            )
        check_token_ids(decoder_input_ids, vocab, "decoder_input_ids")
        decoder_input_ids = decoder_input_ids.astype(input_ids.dtype)
    stops = stop_token_ids(model, tokenizer, eos_token_ids)
    return _run(model, tokenizer, input_ids, settings, seed, stops, prefill_step_size,
                decoder_input_ids, compile, show_unmasking, on_step)


def _run(model, tokenizer, input_ids, s, seed, stops, prefill_step_size, decoder_input_ids,
         compile_graph, show_unmasking, on_step):
    if seed is not None:
        mx.random.seed(seed)
    dtype = input_ids.dtype
    batch_size, prompt_length = input_ids.shape
    vocab_size = int(model.config.text_config.vocab_size)
    detokenizer = make_detokenizer(tokenizer)
    stats = DiffusionStats(prompt_tokens=prompt_length)

    tic = time.perf_counter()
    chunk = (prefill_step_size is not None and prompt_length > prefill_step_size
             and bool(getattr(model, "chunked_prefill_policy", lambda **_: True)()))
    kv_cache = model.diffusion_prefill_cache(input_ids[:, 0:prompt_length], cache=model.make_cache(),
                                             prefill_step_size=prefill_step_size, chunk_prefill=chunk)
    stats.encoder_passes += 1
    _eval_cache(kv_cache)
    stats.prompt_time = time.perf_counter() - tic
    generation_tic = time.perf_counter()

    self_conditioning_context = model.diffusion_prepare_self_conditioning()
    generated = 0
    stopped, stop_reason = False, "length"
    canvas_index = 0
    current_canvas = None

    while generated < s.max_new_tokens:
        canvas_index += 1
        if current_canvas is not None:
            kv_cache = model.diffusion_update_cache(current_canvas, cache=kv_cache)
            stats.encoder_passes += 1
        canvas_length = block_canvas_length(
            s.max_new_tokens - generated, s.model_canvas_length, full_canvas=s.full_canvas,
            min_canvas_length=s.min_canvas_length, max_canvas_length=s.max_canvas_length,
        )
        current_canvas = samplers.initial_canvas(decoder_input_ids, generated, batch_size,
                                                 canvas_length, vocab_size, dtype)
        block = _denoise(model, kv_cache, current_canvas, s, canvas_index, self_conditioning_context,
                         compile_graph, show_unmasking, on_step)
        current_canvas, block_stats = block
        stats.blocks.append(block_stats)
        mx.eval(current_canvas)

        tokens, text, counted = [], "", 0
        for token_id in current_canvas[0].tolist():
            generated += 1
            counted += 1
            if token_id in stops:
                stopped, stop_reason = True, "stop"
                stats.stop_token = token_id
                break
            tokens.append(token_id)
            if detokenizer is not None:
                detokenizer.add_token(token_id)
                text += detokenizer.last_segment
            if generated >= s.max_new_tokens:
                stopped, stop_reason = True, "length"
                break
        block_stats.emitted = counted
        stats.tokens.extend(tokens)
        stats.generation_tokens = generated
        if stopped:
            stats.finish_reason = stop_reason
            if detokenizer is not None:
                detokenizer.finalize()
                text += detokenizer.last_segment
            stats.generation_time = time.perf_counter() - generation_tic
            yield DiffusionBlock(canvas_index, tokens, text, block_stats, stats.finish_reason, stats)
            return stats
        yield DiffusionBlock(canvas_index, tokens, text, block_stats)
        mx.clear_cache()
    return stats  # pragma: no cover - max_new_tokens >= 1 always ends inside the loop


def _denoise(model, kv_cache, current_canvas, s, canvas_index, self_conditioning_context,
             compile_graph, show_unmasking, on_step):
    """Denoise one canvas; returns (the emitted canvas: last forward's argmax, BlockStats)."""
    batch_size, canvas_length = current_canvas.shape
    dtype = current_canvas.dtype
    vocab_size = int(model.config.text_config.vocab_size)
    draft_reveal_mask = mx.zeros(current_canvas.shape, dtype=mx.bool_)
    draft_canvas = current_canvas
    argmax_canvas = current_canvas
    self_conditioning = None
    mask_mapping = model.diffusion_decoder_masks(current_canvas, kv_cache, None)
    logits_plain, logits_sc = _decoder_fns(model, kv_cache, mask_mapping, compile_graph)
    history: List[mx.array] = []
    masks: List[mx.array] = []  # per sampling step: the sampler's reveal (or acceptance) mask
    accepted: List[mx.array] = []
    n_steps = 0
    stopped_early = None

    for cur_step in reversed(range(1, s.steps + 1)):
        n_steps += 1
        if self_conditioning is None:
            processed_logits = logits_plain(current_canvas)
        else:
            processed_logits = logits_sc(current_canvas, self_conditioning)
        processed_logits = processed_logits / linear_temperature(cur_step, s.steps, s.t_min, s.t_max)
        argmax_canvas = mx.argmax(processed_logits, axis=-1).astype(dtype)
        if cur_step == 1 and not show_unmasking:
            break

        denoiser_canvas = (
            argmax_canvas if s.temperature <= 0
            else samplers.sample_canvas(processed_logits, dtype, s.temperature)
        )
        next_self_conditioning = None
        if s.sampler == "entropy-bound":
            token_entropy = samplers.token_entropy(processed_logits)
            if cur_step > 1:
                next_self_conditioning = model.diffusion_self_conditioning(processed_logits,
                                                                           self_conditioning_context)
            acceptance_mask = samplers.entropy_transfer_mask(token_entropy, s.entropy_bound)
            accepted_canvas = mx.where(acceptance_mask, denoiser_canvas, current_canvas)
            current_canvas = mx.where(
                acceptance_mask, accepted_canvas,
                samplers.random_canvas(batch_size, canvas_length, vocab_size, dtype),
            )
            draft_reveal_mask = acceptance_mask
            draft_canvas = argmax_canvas
            masks.append(acceptance_mask)
        else:
            unrevealed_mask = ~draft_reveal_mask
            confidence = samplers.token_probability(processed_logits, denoiser_canvas)
            acceptance_mask = samplers.confidence_transfer_mask(confidence, unrevealed_mask, s.threshold,
                                                                force_all=cur_step == 1)
            accepted_canvas = mx.where(acceptance_mask, denoiser_canvas, draft_canvas)
            current_canvas = mx.where(
                draft_reveal_mask | acceptance_mask, accepted_canvas,
                samplers.random_canvas(batch_size, canvas_length, vocab_size, dtype),
            )
            draft_reveal_mask = draft_reveal_mask | acceptance_mask
            draft_canvas = mx.where(acceptance_mask, accepted_canvas, draft_canvas)
            masks.append(draft_reveal_mask)
        accepted.append(mx.sum(acceptance_mask))

        if on_step is not None:
            mx.eval(draft_canvas, draft_reveal_mask)
            on_step(StepEvent(canvas_index, s.steps - cur_step + 1, s.steps, draft_canvas[0].tolist(),
                              draft_reveal_mask[0].tolist(), int(accepted[-1].item())))

        if s.sampler == "confidence-threshold" and bool(mx.all(draft_reveal_mask).item()):
            stopped_early = "all-revealed"
            break
        if samplers.stable_and_confident(argmax_canvas, processed_logits, history,
                                         s.stability_threshold, s.stability_confidence):
            stopped_early = "stable"
            break
        if cur_step > 1:
            if next_self_conditioning is None:
                next_self_conditioning = model.diffusion_self_conditioning(processed_logits,
                                                                           self_conditioning_context)
            self_conditioning = next_self_conditioning

    # what was revealed when: evaluated once per block (no effect on the ids)
    mx.eval(argmax_canvas, masks, accepted)
    mask_rows = [m[0].tolist() for m in masks]
    block = BlockStats(
        index=canvas_index,
        canvas_length=canvas_length,
        steps=n_steps,
        accepted_per_step=[int(a.item()) for a in accepted],
        reveal_step=reveal_steps(mask_rows, n_steps, canvas_length),
        emitted=0,
        stopped_early=stopped_early,
    )
    return argmax_canvas, block


def collect(blocks: Generator[DiffusionBlock, None, DiffusionStats]) -> tuple[list[int], DiffusionStats]:
    """Run a `diffusion_generate` stream to the end: (emitted ids, stats)."""
    stats = None
    for b in blocks:
        if b.run is not None:
            stats = b.run
    return list(stats.tokens), stats
