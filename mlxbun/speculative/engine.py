"""The speculative round loop over any RuntimeModel, and `speculative_generate`.

A round: the drafter proposes up to k tokens; the target runs once over [last token, drafts]
with its caches inside a spec round (`spec_begin`); verification accepts n drafts (greedy
exact match, or rejection sampling); the caches keep the n + 1 tokens the target has now seen
(`commit_spec_round(cache, n + 1)`); the drafter is told n; the n accepted drafts and the target's
own next token are emitted. A recurrent state (ArraysCache: conv, SSM, DeltaNet) cannot be
trimmed: when the target rejected a draft, the recurrent caches go back to the round's start and
the n + 1 kept tokens are replayed (`SpecStats.replayed_tokens`, `replay_s`), through the
recurrent mixers alone (`rollback="mixers"`) or the whole target (`"model"`); see
`speculative/replay.py`. A round that accepted every draft keeps the state as verified.
Plain, rotating (sliding-window), quantized (kv_bits or a kv_config plan) and TurboQuant caches
all roll back through the spec-round contract; rings that keep attention sinks (`max_kv_size`)
are seen through `ring.sink_exact` while verifying, so k+1 tokens attend as k+1 one-token steps
would.

Exactness (greedy): every emitted token is the target's argmax after the tokens before it, as in
plain decoding, so the stream equals `mlxbun.generate.stream_generate`'s token for token whenever
the target's batched forward ranks the tokens as its one-token forward does (the tests hold
this on zoo checkpoints). What is kept identical to plain decoding on purpose:
- the target's prefill (all but the last prompt token, `prefill_step_size` chunks, the KV
  quantize hook after each chunk);
- KV quantization points: while the quantize hook has not converted the caches yet
  (`offset < quantized_kv_start`, or nothing fed at all), a round never feeds a token past
  `quantized_kv_start - 1`, and the hook runs after each commit, so every token is computed
  against the same (full-precision or quantized) cache contents as in plain decoding;
- logits processors see the same token history per position; the greedy pick is the argmax of
  `logits - logsumexp(logits)`, as mlx-lm's sampler takes it.
Sampling preserves the target's processed distribution exactly (see `verify.py`), with the
randomness threaded through `mx.random` keys from `seed`.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Generator, Iterable, Optional, Sequence, Union

import mlx.core as mx

from mlxbun.cache.arrays import commit_spec_round
from mlxbun.errors import MlxbunError
from mlxbun.fast import CompileGap, FastPath, enable_fast
from mlxbun.generate import (
    UNBOUNDED_ROOM,
    GenerationResponse,
    StopText,
    check_generation_options,
    eos_token_ids,
    generation_stream,
    make_detokenizer,
    prepare_prompt,
    vocab_size_of,
    wired_limit,
)
from mlxbun.generation_caches import (
    attention_routing,
    check_kv_options,
    check_plan_options,
    converts_while_decoding,
    make_generation_cache,
    resolve_kv_config,
)
from mlxbun.models.mlxlm import ensure_runtime
from mlxbun.names import is_int
from mlxbun.sampling import GenerationError, LogitsProcessor, make_logits_processors
from mlxbun.speculative.adaptive import AdaptiveDraftLength
from mlxbun.speculative.drafters import (
    Draft,
    DraftModelDrafter,
    Drafter,
    DraftSession,
    LayerSkipDrafter,
    _check_contract,
    logits_width,
    make_drafter,
    model_blocks,
)
from mlxbun.speculative.fast_verify import start_fast_verify
from mlxbun.speculative.kv import quantize_hook
from mlxbun.speculative.replay import Rollback, mixer_replay, parse_rollback
from mlxbun.speculative.ring import sink_exact
from mlxbun.speculative.stats import SpecStats
from mlxbun.speculative.verify import Sampling, verify_greedy, verify_sampled

__all__ = ["SpecResponse", "speculative_generate", "speculative_generate_step", "speculative_text"]

MAX_DRAFT = 64


@dataclass
class SpecResponse(GenerationResponse):
    """A `GenerationResponse` (`from_draft`: this token was a draft token the target accepted)
    plus the request's `SpecStats` (the same object on every response; complete on the last,
    the one with a `finish_reason`)."""

    stats: Optional[SpecStats] = None


def _offset(cache: Sequence[Any]) -> Optional[int]:
    """The attention caches' length; None when the model has none (nothing there quantizes)."""
    offsets = [int(c.offset) for c in cache if c is not None and hasattr(c, "offset")]
    return max(offsets) if offsets else None


def _process_rows(logits: mx.array, history: Optional[mx.array], drafts: Sequence[int],
                  processors: Sequence[LogitsProcessor]) -> mx.array:
    """Log-probabilities [m+1, V] of the target's rows; row i's processors see the history plus
    the first i drafts (what plain decoding would have fed by then)."""
    if processors:
        rows = []
        for i in range(logits.shape[0]):
            hist = history if i == 0 else mx.concatenate([history, mx.array(drafts[:i], dtype=history.dtype)])
            row = logits[i:i + 1]
            for proc in processors:
                row = proc(hist, row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def speculative_generate_step(
    prompt: mx.array,
    target,
    drafter: Drafter,
    *,
    cache: list,
    num_draft: int = 3,
    max_tokens: Optional[int] = 256,
    sampling: Sampling = Sampling(),
    logits_processors: Sequence[LogitsProcessor] = (),
    prefill_step_size: int = 2048,
    quantize=None,
    quantized_kv_start: int = 0,
    key: Optional[mx.array] = None,
    adaptive: Union[bool, AdaptiveDraftLength] = False,
    stats: Optional[SpecStats] = None,
    rollback: Union[str, Rollback] = Rollback.MIXERS,
    stream=None,
    fast: Optional[FastPath] = None,
) -> Generator[tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs [V], from_draft) over a bound `drafter` and a ready target cache
    list (updated in place). The caller binds the drafter; `stats` is filled as rounds run.
    rollback: how a recurrent target goes back after a rejection (`mlxbun.speculative.replay`).
    quantize: the KV quantize hook (`quantize_hook`), None when nothing quantizes; rounds then
    respect `quantized_kv_start` (see the module docstring). fast: the target's FastPath: the
    verify forwards run through its compiled step where it applies (`speculative.fast_verify`)."""

    stream = generation_stream if stream is None else stream
    hook, converting = quantize, quantize is not None
    quantize = quantize or (lambda c: None)
    stats = stats if stats is not None else SpecStats()
    controller = adaptive if isinstance(adaptive, AdaptiveDraftLength) else (
        AdaptiveDraftLength(num_draft) if adaptive else None)
    if not sampling.greedy and key is None:
        key = mx.random.key(0)
    history_ids = [int(t) for t in prompt.tolist()]
    mixers = mixer_replay(target, cache, rollback, model_blocks)
    verify = target if mixers is None else mixers.verify

    tic = time.perf_counter()
    attached = mixers.attach(lambda: make_generation_cache(target)) if mixers is not None else nullcontext()
    with mx.stream(stream), attached:
        y = prompt
        while y.size > 1:  # generate_step's prefill
            n_pre = min(prefill_step_size, y.size - 1)
            target(y[:n_pre][None], cache=cache)
            quantize(cache)
            mx.eval([c.state for c in cache])
            y = y[n_pre:]
            mx.clear_cache()
        drafter.prefill(history_ids)  # the draft's prompt processing counts as prefill, as in mlx-lm
        stats.prefill_s += time.perf_counter() - tic
        pending = int(y.item())
        room = (UNBOUNDED_ROOM if max_tokens is None else max_tokens) + num_draft + 2
        fast_verify = start_fast_verify(fast, target, cache, recurrent=mixers is not None,
                                        converting=converts_while_decoding(hook, cache), room=room)
        ntoks = 0
        try:
            while max_tokens is None or ntoks < max_tokens:
                k = controller.choose() if controller is not None else num_draft
                if max_tokens is not None:
                    k = min(k, max_tokens - ntoks)  # as mlx-lm: never draft past the budget
                offset = _offset(cache)
                if converting and offset is not None and (offset < quantized_kv_start or offset == 0):
                    k = min(k, max(0, quantized_kv_start - 1 - offset))  # the hook has not converted yet
                if key is not None:
                    key, k_draft, k_verify = mx.random.split(key, 3)
                else:
                    k_draft = k_verify = None

                t0 = time.perf_counter()
                draft = drafter.propose(history_ids, k, key=k_draft) if k > 0 else Draft()
                if len(draft) > k:
                    raise MlxbunError(f"{type(drafter).__name__} proposed {len(draft)} tokens, "
                                      f"asked for at most {k}")
                t1 = time.perf_counter()

                m = len(draft)
                ids = mx.array([pending, *draft], dtype=mx.int32)[None]
                logits = None
                if fast_verify is not None:
                    try:
                        logits = fast_verify.verify(ids)
                    except CompileGap as e:
                        fast.note(f"speculative verify through the compiled step stopped: {e}; eager from here")
                        fast_verify.close()
                        fast_verify = None
                if logits is None:
                    for c in cache:
                        c.spec_begin()
                    logits = verify(ids, cache=sink_exact(cache))[0]
                history = mx.array(history_ids, dtype=mx.int32) if logits_processors else None
                logprobs = _process_rows(logits, history, draft, logits_processors)
                if sampling.greedy:
                    verdict = verify_greedy(mx.argmax(logprobs, axis=-1).tolist(), draft)
                else:
                    verdict = verify_sampled(sampling.probs(logprobs), draft, draft.q, k_verify)
                n = verdict.n_accepted
                t2 = time.perf_counter()
                if fast_verify is not None:  # the static buffers go back by their position
                    fast_verify.commit(n + 1, m + 1)
                    replay = 0
                elif mixers is not None:  # the recurrent mixers alone re-run on the kept positions
                    replay = mixers.commit(cache, n + 1, m + 1)
                else:  # a recurrent state went back to the round's start: feed the kept tokens
                    replay = commit_spec_round(cache, n + 1)
                    if replay:
                        target(mx.array([pending, *draft[:n]], dtype=mx.int32)[None], cache=sink_exact(cache))
                if replay:
                    mx.eval([c.state for c in cache])
                t3 = time.perf_counter()
                quantize(cache)

                drafter.observe(list(draft[:n]), n)
                stats.add_round(k, m, n, t1 - t0, t2 - t1)
                if replay:
                    stats.add_replay(replay, t3 - t2)
                if controller is not None:  # a replay is part of what a verify round costs
                    controller.update(k, m, n, t1 - t0, t3 - t1)

                for i, tok in enumerate([*draft[:n], verdict.token]):
                    history_ids.append(tok)
                    ntoks += 1
                    yield tok, logprobs[i], i < n
                    if max_tokens is not None and ntoks == max_tokens:
                        return
                pending = verdict.token
                if stats.rounds % 256 == 0:
                    mx.clear_cache()
        finally:
            if fast_verify is not None:  # the exact caches get the decoded tokens back
                fast_verify.close()


# ----------------------------------------------------------------------------- the user call


def speculative_generate(
    target,
    tokenizer,
    prompt: Union[str, Sequence[int], mx.array],
    *,
    drafter,
    num_draft: int = 3,
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
    kv_bits=None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    kv_scheme: str = "uniform",
    kv_config=None,
    max_kv_size: Optional[int] = None,
    stop: Union[str, Sequence[str], None] = None,
    prefill_step_size: int = 2048,
    adaptive: bool = False,
    rollback: Union[str, Rollback] = Rollback.MIXERS,
    fast: Union[bool, FastPath] = False,
    kv_key_bits: Optional[int] = None,
    kv_value_bits: Optional[int] = None,
) -> Generator[SpecResponse, None, None]:
    """Generate from `prompt` with speculative decoding; one `SpecResponse` per token.

    target: an mlxbun RuntimeModel, an mlx-lm model or the adapter. drafter: a `Drafter`, a
    draft model (same vocabulary), or "ngram" / "self" (see `make_drafter`). num_draft: draft
    tokens per round (the maximum, with `adaptive`). The other options are
    `mlxbun.generate.stream_generate`'s; greedy output equals its output token for token, and
    sampling draws from the same distribution. rollback: "mixers" (default) or "model", how a
    recurrent target goes back after a rejection (`mlxbun.speculative.replay`). fast: the
    target's fast path (True, or its `FastPath`; L2-fast, measured not bit-exact): its kernels and
    the verify forwards through its compiled step (`mlxbun.speculative.fast_verify`); the logits
    are then the fast path's (close to the exact ones, not equal), so greedy tokens can differ from
    the exact path's where two candidates nearly tie. Bad options raise `GenerationError` before
    work.
    """
    if temp is not None:
        if temperature not in (0.0, temp):
            raise GenerationError(f"temperature={temperature!r} and temp={temp!r} disagree; give one")
        temperature = temp
    stops = check_generation_options(max_tokens, prefill_step_size, stop)
    if not is_int(num_draft) or not 1 <= num_draft <= MAX_DRAFT:
        raise GenerationError(f"num_draft must be an integer in [1, {MAX_DRAFT}], got {num_draft!r}")
    if seed is not None and (not is_int(seed) or seed < 0):
        raise GenerationError(f"seed must be a non-negative integer, got {seed!r}")
    settings = check_kv_options(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                                kv_scheme=kv_scheme, max_kv_size=max_kv_size, kv_key_bits=kv_key_bits,
                                kv_value_bits=kv_value_bits)
    kv_bits, kv_key_bits, kv_value_bits = settings.bits, settings.key_bits, settings.value_bits  # a split, whole
    sampling = Sampling(temperature, top_p, top_k, min_p, min_tokens_to_keep)
    processors = tuple(make_logits_processors(repetition_penalty=repetition_penalty,
                                              repetition_context_size=repetition_context_size)
                       + list(logits_processors or ()))
    try:
        rollback = parse_rollback(rollback)
    except MlxbunError as e:
        raise GenerationError(str(e)) from None
    drafter = make_drafter(drafter)

    target = ensure_runtime(target)
    fast_path = (fast if isinstance(fast, FastPath) else enable_fast(target)) if fast else None
    if fast_path is not None and isinstance(drafter, (DraftModelDrafter, LayerSkipDrafter)):
        fast_path.note("the draft model's forwards run eagerly (the compiled step runs the target's verify)")
    prompt_ids = prepare_prompt(tokenizer, prompt, vocab_size_of(target))
    check_plan_options(kv_config, kv_bits, kv_scheme, max_kv_size)
    kv_config = resolve_kv_config(target, kv_config, kv_bits=kv_bits, kv_scheme=kv_scheme, max_kv_size=max_kv_size)
    kv = dict(kv_bits=kv_bits, kv_group_size=kv_group_size, kv_scheme=kv_scheme, kv_config=kv_config,
              max_kv_size=max_kv_size, quantized_kv_start=quantized_kv_start, kv_key_bits=kv_key_bits,
              kv_value_bits=kv_value_bits)
    cache = make_generation_cache(target, **kv)
    _check_contract(cache, "target")
    session = DraftSession(target=target, vocab_size=logits_width(target), sampling=sampling,
                           logits_processors=processors, kv=kv, prefill_step_size=prefill_step_size,
                           stream=generation_stream)
    drafter.bind(session)
    if seed is not None:
        mx.random.seed(seed)
    key = None if sampling.greedy else mx.random.key(
        seed if seed is not None else int(mx.random.randint(0, 2**31 - 1, ()).item()))
    eos = eos_token_ids(tokenizer, target)
    detokenizer = make_detokenizer(tokenizer)
    stats = SpecStats()
    tokens = speculative_generate_step(
        prompt_ids, target, drafter, cache=cache, num_draft=num_draft, max_tokens=max_tokens,
        sampling=sampling, logits_processors=processors, prefill_step_size=prefill_step_size,
        quantize=quantize_hook(kv, len(cache)), quantized_kv_start=quantized_kv_start, key=key,
        adaptive=adaptive, stats=stats, rollback=rollback,
        stream=generation_stream, fast=fast_path)
    turboquant = kv_scheme == "turboquant" and kv_bits is not None
    return _responses(tokens, prompt_ids, detokenizer, eos, stops, max_tokens, stats,
                      StopText, wired_limit([generation_stream]), attention_routing(turboquant))


def _responses(tokens, prompt, detokenizer, eos, stops, max_tokens, stats, stop_text, wired, routing):
    """`mlxbun.generate._responses`' loop (EOS, stop strings, the final response) over spec tokens."""
    cutter = stop_text(stops)

    def response(text, token, logprobs, from_draft, n, finish_reason=None):
        return SpecResponse(
            text=text, token=token, logprobs=logprobs, prompt_tokens=prompt.size, prompt_tps=prompt_tps,
            generation_tokens=n + 1, generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9, finish_reason=finish_reason, from_draft=from_draft,
            stats=stats)

    with wired, routing:
        start = tic = time.perf_counter()
        prompt_tps = math.nan
        n, token, logprobs, from_draft = 0, None, None, False
        for n, (token, logprobs, from_draft) in enumerate(tokens):
            if n == 0:
                prompt_tps = prompt.size / (time.perf_counter() - tic)
                tic = time.perf_counter()
            if token in eos:
                break
            detokenizer.add_token(token)
            if max_tokens is not None and (n + 1) == max_tokens:
                break
            text = cutter.add(detokenizer.last_segment)
            if cutter.stopped:
                _finish(stats, n, start)
                yield response(text, token, logprobs, from_draft, n, "stop")
                return
            yield response(text, token, logprobs, from_draft, n)
        detokenizer.finalize()
        text = cutter.add(detokenizer.last_segment, final=True)
        finish = "stop" if (token in eos or cutter.stopped) else "length"
        _finish(stats, n, start)
        yield response(text, token, logprobs, from_draft, n, finish)


def _finish(stats: SpecStats, n: int, start: float) -> None:
    stats.generated_tokens = n + 1
    stats.wall_s = time.perf_counter() - start


def speculative_text(target, tokenizer, prompt, **kwargs) -> tuple[str, list[int], SpecStats]:
    """The whole text, the token ids and the stats of one `speculative_generate` call."""
    text, ids, last = "", [], None
    for last in speculative_generate(target, tokenizer, prompt, **kwargs):
        text += last.text
        ids.append(last.token)
    return text, ids, last.stats if last is not None else SpecStats()
