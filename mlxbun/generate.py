"""Text generation over any RuntimeModel: `stream_generate` / `generate`.

The token stream is mlx-lm 0.32.2's (`mlx_lm/generate.py`: `generate_step`, `stream_generate`)
op for op: the same prefill chunking (all but the last prompt token in `prefill_step_size`
chunks, evaluating the cache after each), the same one-step-ahead pipelining with `async_eval`,
the same KV-quantization points (after every prefill chunk and after every decode step's model
call), the same log-softmax (`logits - logsumexp`), the same sampler and logits-processor
composition (`mlxbun.sampling`), and the same random draws after `mx.random.seed(seed)`. So with
the same settings and seed it yields the tokens, and bit for bit the log-probabilities, that
mlx-lm yields.

What mlxbun adds, none of it changing the stream:
- the model may be an mlxbun graph or an mlx-lm model (through `models.mlxlm.ensure_runtime`);
  the caches are always mlxbun's (`mlxbun.cache`), also under an mlx-lm model;
- `max_kv_size` is honoured for every arch: mlx-lm ignores it when the model file defines its
  own `make_cache` (llama, gemma3_text, cohere2, ...); here every full-attention layer then gets
  a `RotatingKVCache(max_kv_size, keep=4)` (sliding-window layers keep their window cache), which
  is exactly mlx-lm's choice for the archs where it does apply the option;
- the KV options of `mlxbun.cache`: affine quantization (`kv_bits`, mlx-lm's rule and timing),
  TurboQuant (`kv_scheme="turboquant"`, mlx-vlm's rule; `kv_key_bits` / `kv_value_bits` choose
  its key/value split, see `mlxbun.names`), a per-layer plan (`kv_config`, optiq's
  kv_config.json, applied at the same points with the same `quantized_kv_start` rule; by default
  the checkpoint's own, when it ships one and no other KV option is given), saved prompt caches;
- stop strings, EOS ids from the tokenizer and the model config, option checking; token ids
  outside the model's vocabulary are refused (`check_token_ids`) before any forward.
"""

from __future__ import annotations

import contextlib
import math
import operator
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Generator, Iterable, List, Optional, Sequence, Union

import mlx.core as mx

from mlxbun.errors import GenerationError
from mlxbun.fast import CompileGap, FastPath, enable_fast
from mlxbun.fast.decoders import fast_decoder
from mlxbun.generation_caches import (
    attention_routing,
    check_kv_options,
    check_plan_options,
    converts_while_decoding,
    kv_quantizer,
    load_kv_plan,
    load_prompt_cache_for,
    make_generation_cache,
    resolve_kv_config,
)
from mlxbun.models.mlxlm import ensure_runtime
from mlxbun.names import is_int
from mlxbun.sampling import (
    LogitsProcessor,
    Sampler,
    make_logits_processors,
    make_sampler,
)

__all__ = [
    "GenerationResponse",
    "StopText",
    "check_generation_options",
    "check_token_ids",
    "eos_token_ids",
    "generate",
    "generate_step",
    "generation_stream",
    "make_detokenizer",
    "prepare_prompt",
    "stream_generate",
    "vocab_size_of",
    "wired_limit",
]


# A stream just for generation, as mlx-lm has (`generation_stream`).
generation_stream = mx.new_thread_local_stream(mx.default_device())
UNBOUNDED_ROOM = 4096  # static-cache room of a fast decode without max_tokens (then it goes eager)


@dataclass
class GenerationResponse:
    """One generated token (mlx-lm's `GenerationResponse`, without `from_draft` first).

    text: the text this token completes (may be empty; never includes EOS or a stop string);
    logprobs: log-probabilities over the vocabulary [V] this token was drawn from;
    finish_reason: None while generating, "stop" (EOS or stop string) or "length" on the last;
    peak_memory: mx.get_peak_memory() so far, in GB.
    """

    text: str
    token: int
    logprobs: mx.array
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: float
    finish_reason: Optional[str] = None
    from_draft: bool = False


# ----------------------------------------------------------------------------- options


def check_generation_options(max_tokens, prefill_step_size, stop) -> tuple[str, ...]:
    if max_tokens is not None and (not is_int(max_tokens) or max_tokens < 1):
        raise GenerationError(f"max_tokens must be a positive integer (or None for no limit), got {max_tokens!r}")
    if not is_int(prefill_step_size) or prefill_step_size < 1:
        raise GenerationError(f"prefill_step_size must be a positive integer, got {prefill_step_size!r}")
    if stop is None:
        return ()
    stops = (stop,) if isinstance(stop, str) else tuple(stop)
    for s in stops:
        if not isinstance(s, str) or not s:
            raise GenerationError(f"stop strings must be non-empty strings, got {s!r}")
    return stops


# ----------------------------------------------------------------------------- prompt, EOS

# Token ids are int32 in every graph: a larger one cannot be an id whatever the vocabulary.
_MAX_IDS = 2**31


def vocab_size_of(model) -> int:
    """How many token ids `model` embeds and scores: its config's `vocab_size` (the text
    config's, for a wrapper), else the width of its logits for one token."""
    config = getattr(model, "config", None)
    for c in (config, getattr(config, "text_config", None),
              config.get("text_config") if isinstance(config, Mapping) else None):
        n = c.get("vocab_size") if isinstance(c, Mapping) else getattr(c, "vocab_size", None)
        if is_int(n) and n > 0:
            return n
    return int(model(mx.array([[0]], dtype=mx.int32)).shape[-1])


def check_token_ids(ids, vocab_size: Optional[int], what: str = "prompt", error: type = GenerationError) -> None:
    """Refuse an id outside [0, vocab_size) (an out-of-range id would read past the embedding
    table), naming the id, its position and the valid range; `vocab_size` None: only ids that
    no vocabulary holds (negative, or past int32)."""
    values = ids.reshape(-1).tolist() if isinstance(ids, mx.array) else ids
    bound = _MAX_IDS if vocab_size is None else vocab_size
    for pos, t in enumerate(values):
        if not 0 <= t < bound:
            if vocab_size is None:
                raise error(f"{what}: token {t} at position {pos} is not a token id (ids are 0..{bound - 1})")
            raise error(f"{what}: token {t} at position {pos} is outside the model's vocabulary "
                        f"(valid ids: 0..{bound - 1})")


def prepare_prompt(tokenizer, prompt, vocab_size: Optional[int] = None) -> mx.array:
    """The prompt as a 1-D id array: text is encoded with the tokenizer's BOS policy
    (`encode_prompt`: special tokens unless the text already starts with BOS, as mlx-lm does);
    a list or array of ids is used as given. Every id must lie in [0, vocab_size) (see
    `check_token_ids`; `vocab_size_of(model)` gives a model's)."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise GenerationError("a text prompt needs a tokenizer")
        if hasattr(tokenizer, "encode_prompt"):
            ids = tokenizer.encode_prompt(prompt)
        else:  # an mlx-lm / HF tokenizer: mlx-lm's rule
            bos = getattr(tokenizer, "bos_token", None)
            ids = tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
        check_token_ids(ids, vocab_size)
        arr = mx.array(ids)
    elif isinstance(prompt, mx.array):
        arr = prompt
    else:
        try:
            ids = [operator.index(i) for i in prompt]  # ints (numpy ints too); not floats
        except TypeError:
            raise GenerationError(
                f"prompt must be text or a sequence of integer token ids, got {prompt!r:.80}"
            ) from None
        if any(isinstance(i, bool) for i in prompt):
            raise GenerationError("prompt token ids must be integers, not booleans")
        check_token_ids(ids, vocab_size)
        arr = mx.array(ids, dtype=mx.int32)
    if arr.ndim == 2 and arr.shape[0] == 1:
        arr = arr[0]
    if arr.ndim != 1:
        raise GenerationError(f"prompt ids must be 1-D (or [1, L]), got shape {tuple(arr.shape)}")
    if arr.size == 0:
        raise GenerationError("the prompt is empty: at least one token is needed")
    if not mx.issubdtype(arr.dtype, mx.integer):
        raise GenerationError(f"prompt ids must be integers, got dtype {arr.dtype}")
    if isinstance(prompt, mx.array):
        check_token_ids(arr, vocab_size)
    return arr


def eos_token_ids(tokenizer, model=None) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS ids and the model config's."""
    ids = set(int(i) for i in (getattr(tokenizer, "eos_token_ids", None) or ()))
    single = getattr(tokenizer, "eos_token_id", None)
    if single is not None and not ids:
        ids.add(int(single))
    config = getattr(model, "config", None)
    if config is not None:
        cfg_ids = getattr(config, "eos_token_ids", None)
        if cfg_ids is None and isinstance(config, dict):
            cfg_ids = config.get("eos_token_id")
        if isinstance(cfg_ids, int):
            cfg_ids = [cfg_ids]
        ids.update(int(i) for i in (cfg_ids or ()))
    return frozenset(ids)


def make_detokenizer(tokenizer):
    """A fresh streaming detokenizer (mlxbun's method, or mlx-lm's TokenizerWrapper property)."""
    det = getattr(tokenizer, "detokenizer", None)
    if det is None:
        raise GenerationError(f"{type(tokenizer).__name__} has no streaming detokenizer")
    if callable(det) and not hasattr(det, "add_token"):
        det = det()
    det.reset()
    return det


# ----------------------------------------------------------------------------- the token loop


def generate_step(
    prompt: mx.array,
    model,
    *,
    prompt_cache: list,
    max_tokens: Optional[int] = 256,
    sampler: Optional[Sampler] = None,
    logits_processors: Optional[List[LogitsProcessor]] = None,
    prefill_step_size: int = 2048,
    quantize_cache: Optional[Callable[[list], None]] = None,
    stream=None,
    fast: Optional[FastPath] = None,
    prefill_whole: bool = False,
) -> Generator[tuple[int, mx.array], None, None]:
    """Yield (token, logprobs [V]) pairs: mlx-lm's `generate_step` (no input embeddings) over a
    RuntimeModel `model` and a ready cache list (updated in place). `max_tokens=None` is no limit.
    `fast`: the model's FastPath (`mlxbun.fast`): its kernels, and decode through the compiled
    step where it applies (the cache list gets the decoded tokens back when the loop ends).
    `prefill_whole`: the whole prompt in the first step's one call, no chunks (mlx-vlm's unchunked
    prefill, which gemma4's bidirectional image attention takes: multimodal.Gemma4ImageModel)."""
    stream = generation_stream if stream is None else stream
    max_tokens = -1 if max_tokens is None else max_tokens
    hook = quantize_cache
    quantize_cache = quantize_cache or (lambda cache: None)
    sampler = sampler or (lambda x: mx.argmax(x, axis=-1))
    tokens = None
    decoder = None
    kernels = fast.on if fast is not None else contextlib.nullcontext

    def _logits(input_tokens: mx.array) -> mx.array:
        nonlocal decoder
        if decoder is not None:
            try:
                return decoder(input_tokens[None])
            except CompileGap as e:
                fast.note(f"compiled decode stopped: {e}; decoding eagerly from here")
                decoder.write_back()
                decoder = None
        return model(input_tokens[None], cache=prompt_cache)[:, -1, :]

    def _step(input_tokens: mx.array):
        nonlocal tokens

        with mx.stream(stream), kernels():
            logits = _logits(input_tokens)

            if logits_processors and len(input_tokens) > 0:
                tokens = mx.concat([tokens, input_tokens]) if tokens is not None else input_tokens
                for processor in logits_processors:
                    logits = processor(tokens, logits)

            quantize_cache(prompt_cache)

            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            sampled = sampler(logprobs)
            return sampled, logprobs.squeeze(0)

    with mx.stream(stream):
        total_prompt_tokens = len(prompt)
        prompt_processed_tokens = 0
        while not prefill_whole and total_prompt_tokens - prompt_processed_tokens > 1:
            remaining = (total_prompt_tokens - prompt_processed_tokens) - 1
            n_to_process = min(prefill_step_size, remaining)
            processed = prompt[:n_to_process]
            model(processed[None], cache=prompt_cache)
            quantize_cache(prompt_cache)
            mx.eval([c.state for c in prompt_cache])
            if logits_processors and len(processed) > 0:
                tokens = mx.concat([tokens, processed]) if tokens is not None else processed
            prompt_processed_tokens += n_to_process
            prompt = prompt[n_to_process:]
            mx.clear_cache()

        if fast is not None and fast.compile_decode:
            converting = converts_while_decoding(hook, prompt_cache)
            decoder = _compiled_decoder(fast, model, prompt_cache, converting, max_tokens)
        y, logprobs = _step(prompt)
        mx.async_eval(y, logprobs)

        n = 0
        while True:
            if n != max_tokens:
                next_y, next_logprobs = _step(y)
                mx.async_eval(next_y, next_logprobs)
            if n == 0:
                mx.eval(y)
            if n == max_tokens:
                break
            try:
                yield y.item(), logprobs
            except GeneratorExit:
                if decoder is not None:
                    decoder.write_back()
                raise
            if n % 256 == 0:
                mx.clear_cache()
            y, logprobs = next_y, next_logprobs
            n += 1
        if decoder is not None:
            decoder.write_back()


def _compiled_decoder(fast: FastPath, model, cache: list, converting: bool, max_tokens: int):
    """The compiled decode step for this generation, or None (the reason goes to the notes)."""
    if converting:
        fast.note("compiled decode off: KV quantization converts the caches while decoding")
        return None
    room = (max_tokens if max_tokens >= 0 else UNBOUNDED_ROOM) + 2
    return fast_decoder(fast, cache, room)


@contextlib.contextmanager
def wired_limit(streams):
    """mlx-lm's `wired_limit`: on Metal, wire the recommended working set while generating."""
    from mlx_lm.utils import maybe_set_recommended_wired_limit

    old_limit = maybe_set_recommended_wired_limit()
    try:
        yield
    finally:
        if old_limit is not None:
            for s in streams:
                mx.synchronize(s)
            mx.set_wired_limit(old_limit)


class StopText:
    """Cuts the streamed text before the first stop string, holding back any tail that could be
    the start of one (so a stop string is never streamed, even in part)."""

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def add(self, piece: str, final: bool = False) -> str:
        self.text += piece
        if self.stops:
            lookback = max(0, self.emitted - max(map(len, self.stops)) + 1)
            hits = [i for i in (self.text.find(s, lookback) for s in self.stops) if i >= 0]
            if hits:
                self.stopped = True
                return self._emit(min(hits))
            if not final:
                return self._emit(len(self.text) - self._held_tail())
        return self._emit(len(self.text))

    def _held_tail(self) -> int:
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), longest, -1):
                if self.text.endswith(s[:k]):
                    longest = k
                    break
        return longest

    def _emit(self, end: int) -> str:
        end = max(end, self.emitted)
        out, self.emitted = self.text[self.emitted:end], end
        return out


def stream_generate(
    model,
    tokenizer,
    prompt: Union[str, Sequence[int], mx.array],
    *,
    max_tokens: Optional[int] = 256,
    temperature: float = 0.0,
    temp: Optional[float] = None,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    min_tokens_to_keep: int = 1,
    seed: Optional[int] = None,
    repetition_penalty: Optional[float] = None,
    repetition_context_size: int = 20,
    logits_processors: Optional[Iterable[LogitsProcessor]] = None,
    sampler: Optional[Sampler] = None,
    kv_bits=None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    kv_scheme: str = "uniform",
    kv_config=None,
    max_kv_size: Optional[int] = None,
    prompt_cache=None,
    stop: Union[str, Sequence[str], None] = None,
    prefill_step_size: int = 2048,
    fast: Union[bool, FastPath] = False,
    kv_key_bits: Optional[int] = None,
    kv_value_bits: Optional[int] = None,
    prefill_whole: bool = False,
) -> Generator[GenerationResponse, None, None]:
    """Generate from `prompt`, one `GenerationResponse` per token (see module docstring).

    model: an mlxbun RuntimeModel, an mlx-lm model, or an `MlxLmRuntimeModel`.
    tokenizer: an `mlxbun.tokenizer.Tokenizer` (or an mlx-lm `TokenizerWrapper`).
    prompt: text (encoded with the BOS policy) or token ids.
    sampler: a ready sampler, instead of temperature/top_p/top_k/min_p.
    logits_processors: run after the repetition penalty's processor.
    prompt_cache: a cache list (already holding the prompt's prefix; updated in place) or the
        path of a saved prompt cache; the prompt is then the tokens after that prefix.
    fast: the fast path (`mlxbun.fast`, fidelity L2-fast: measured, not bit-exact): mlxbun's
        GEMV kernel for quantized layers and a compiled decode step where they apply; True
        enables it on `model` (a FastPath is taken as given; its `notes` say what did not apply).
    kv_config: a per-layer KV plan (`mlxbun.cache.mixed.KVPlan`, or a path/dict it reads);
        by default the checkpoint's own kv_config.json when the model has one and no other KV
        option is given; "none": no plan.
    kv_key_bits / kv_value_bits: TurboQuant's key/value split (whole widths; one fixes the other,
        they add up to 2 x kv_bits; both may stand without kv_bits). None: mlx-vlm's split of
        kv_bits (3.5 = 3-bit keys, 4-bit values); `kv_bits=3.5, kv_key_bits=4` puts the extra bit
        on the keys, which drifts less at the same bytes (lab/tq_bits).
    Raises `GenerationError` (an `MlxbunError`) for a bad option, before any work.
    """
    if temp is not None:
        if temperature not in (0.0, temp):
            raise GenerationError(f"temperature={temperature!r} and temp={temp!r} disagree; give one")
        temperature = temp
    stops = check_generation_options(max_tokens, prefill_step_size, stop)
    if seed is not None and (not is_int(seed) or seed < 0):
        raise GenerationError(f"seed must be a non-negative integer, got {seed!r}")
    kv = check_kv_options(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                          kv_scheme=kv_scheme, max_kv_size=max_kv_size, kv_key_bits=kv_key_bits,
                          kv_value_bits=kv_value_bits)
    kv_bits, kv_key_bits, kv_value_bits = kv.bits, kv.key_bits, kv.value_bits  # a split: whole, with its mean
    if sampler is None:
        sampler = make_sampler(temperature, top_p, min_p, min_tokens_to_keep, top_k=top_k)
    elif (temperature, top_p, top_k, min_p) != (0.0, 1.0, 0, 0.0):
        raise GenerationError("give either a sampler or temperature/top_p/top_k/min_p, not both")
    processors = make_logits_processors(
        repetition_penalty=repetition_penalty, repetition_context_size=repetition_context_size
    ) + list(logits_processors or ())

    model = ensure_runtime(model)
    fast_path = (fast if isinstance(fast, FastPath) else enable_fast(model)) if fast else None
    prompt_ids = prepare_prompt(tokenizer, prompt, vocab_size_of(model))
    check_plan_options(kv_config, kv_bits, kv_scheme, max_kv_size)
    kv_config = resolve_kv_config(model, kv_config, kv_bits=kv_bits, kv_scheme=kv_scheme, max_kv_size=max_kv_size)
    if prompt_cache is None:
        cache = make_generation_cache(model, kv_bits=kv_bits, kv_group_size=kv_group_size,
                                      kv_scheme=kv_scheme, kv_config=kv_config, max_kv_size=max_kv_size,
                                      quantized_kv_start=quantized_kv_start, kv_key_bits=kv_key_bits,
                                      kv_value_bits=kv_value_bits)
    else:
        if max_kv_size is not None:
            raise GenerationError("prompt_cache brings its own caches; max_kv_size cannot change them")
        cache = load_prompt_cache_for(model, prompt_cache)[0] if isinstance(prompt_cache, (str, Path)) else prompt_cache
        if not isinstance(cache, list):
            raise GenerationError(f"prompt_cache must be a list of caches or a file path, got {type(cache).__name__}")
    plan = None if kv_config is None else load_kv_plan(kv_config, len(cache))
    quantize = (kv_quantizer(kv_scheme, kv_bits, kv_group_size, quantized_kv_start, plan,
                             key_bits=kv_key_bits, value_bits=kv_value_bits)
                if plan is not None or kv_bits is not None else None)
    eos = eos_token_ids(tokenizer, model)
    detokenizer = make_detokenizer(tokenizer)

    return _responses(model, prompt_ids, cache, detokenizer, eos, stops, seed=seed, max_tokens=max_tokens,
                      sampler=sampler, logits_processors=processors, quantize=quantize,
                      prefill_step_size=prefill_step_size, turboquant=kv_scheme == "turboquant"
                      or any(type(c).__name__ == "TurboQuantKVCache" for c in cache), fast=fast_path,
                      prefill_whole=prefill_whole)


def _responses(model, prompt, cache, detokenizer, eos, stops, *, seed, max_tokens, sampler,
               logits_processors, quantize, prefill_step_size, turboquant=False, fast=None,
               prefill_whole=False):
    """mlx-lm's `stream_generate` loop, plus stop strings."""
    if seed is not None:
        mx.random.seed(seed)
    token_generator = generate_step(
        prompt, model, prompt_cache=cache, max_tokens=max_tokens, sampler=sampler,
        logits_processors=logits_processors, prefill_step_size=prefill_step_size,
        quantize_cache=quantize, fast=fast, prefill_whole=prefill_whole,
    )
    cutter = StopText(stops)

    def response(text, token, logprobs, n, finish_reason=None):
        return GenerationResponse(
            text=text,
            token=token,
            logprobs=logprobs,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
        )

    with wired_limit([generation_stream]), attention_routing(turboquant):
        tic = time.perf_counter()
        prompt_tps = math.nan
        for n, (token, logprobs) in enumerate(token_generator):
            if n == 0:
                prompt_time = time.perf_counter() - tic
                prompt_tps = prompt.size / prompt_time
                if mx.any(mx.isnan(logprobs)).item():  # NaN weights: every token after this is noise
                    raise GenerationError("the model's first logits are NaN: its weights are not finite "
                                          "(`mlxbun port CHECKPOINT --check-values` names the tensors)")
                tic = time.perf_counter()
            if token in eos:
                break

            detokenizer.add_token(token)
            if max_tokens is not None and (n + 1) == max_tokens:
                break  # this token's text goes out with the final response

            text = cutter.add(detokenizer.last_segment)
            if cutter.stopped:
                yield response(text, token, logprobs, n, "stop")
                return
            yield response(text, token, logprobs, n)

        detokenizer.finalize()
        text = cutter.add(detokenizer.last_segment, final=True)
        finish = "stop" if (token in eos or cutter.stopped) else "length"
        yield response(text, token, logprobs, n, finish)


def generate(model, tokenizer, prompt, *, verbose: bool = False, **kwargs) -> str:
    """The whole generated text (`stream_generate`'s segments joined). With `verbose`, stream it
    to stdout and print prompt / generation speed and peak memory, as mlx-lm does."""
    if verbose:
        print("=" * 10)
    text = ""
    response = None
    for response in stream_generate(model, tokenizer, prompt, **kwargs):
        if verbose:
            print(response.text, end="", flush=True)
        text += response.text
    if verbose:
        print()
        print("=" * 10)
        if not text:
            print("No text generated for this prompt")
        if response is not None:
            print(f"Prompt: {response.prompt_tokens} tokens, {response.prompt_tps:.3f} tokens-per-sec")
            print(f"Generation: {response.generation_tokens} tokens, {response.generation_tps:.3f} tokens-per-sec")
            print(f"Peak memory: {response.peak_memory:.3f} GB")
    return text
