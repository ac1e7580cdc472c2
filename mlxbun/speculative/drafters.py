"""Drafters: what proposes the tokens the target verifies.

One interface (`Drafter`):
  bind(session)                 the engine hands over the target, the sampling and KV settings
  propose(context_ids, k, key=) -> Draft   up to k token ids (a list) + their distributions q
  observe(accepted_ids, n)      the target accepted the first n proposed tokens
  reset()                       forget everything (a new request)

- `DraftModelDrafter`: any RuntimeModel sharing the target's vocabulary (an mlxbun graph or an
  mlx-lm model through `ensure_runtime`); its own cache, rolled back through the spec-round
  contract. The token feeding is mlx-lm 0.32.2's `speculative_generate_step`: the prompt is
  prefilled all but its last token, each round feeds the 1 or 2 tokens the draft has not seen
  (the target's token, preceded by the last draft token when all were accepted), then each
  draft token but the last. A recurrent draft cache (ArraysCache) marks its state after each of
  those one-token steps (`spec_mark`), so a rejection restores the state after the accepted
  drafts exactly, with no replay (memory: up to k - 2 copies of the recurrent state).
- `NGramDrafter` (prompt lookup): the longest suffix n-gram (max_n down to min_n) that occurred
  before in the prompt or the generated text; proposes what followed its most recent occurrence.
- `LayerSkipDrafter` (self-draft): the target's first L blocks, then its own final norm and head,
  sharing every weight; only the cache of those L layers is extra memory (the caches those blocks
  use, found by a one-token probe: a hybrid may give some blocks none, as nemotron_h's MLP blocks).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx

from mlxbun.cache.arrays import commit_spec_round
from mlxbun.errors import GenerationError, MlxbunError, UnsupportedModelError
from mlxbun.generation_caches import make_generation_cache
from mlxbun.names import DrafterSpec, parse_drafter
from mlxbun.speculative.kv import quantize_hook
from mlxbun.speculative.verify import Sampling

__all__ = [
    "Draft",
    "DraftModelDrafter",
    "DraftSession",
    "Drafter",
    "LayerSkipDrafter",
    "NGramDrafter",
    "VocabularyMismatchError",
    "logits_width",
    "make_drafter",
    "model_blocks",
]


class VocabularyMismatchError(MlxbunError):
    """The draft model's logits are not over the target's vocabulary."""


class Draft(list):
    """Proposed token ids (a plain list) plus `q`, the draft distributions [len, V] they were
    drawn from (None: a deterministic proposal, scored as one-hot)."""

    def __init__(self, tokens: Sequence[int] = (), q: Optional[mx.array] = None):
        super().__init__(int(t) for t in tokens)
        self.q = q


@dataclass
class DraftSession:
    """What the engine tells a drafter at the start of a request."""

    target: Any
    vocab_size: int  # the target's logit width
    sampling: Sampling = field(default_factory=Sampling)
    logits_processors: tuple = ()
    kv: dict = field(default_factory=dict)  # make_generation_cache options of the target
    prefill_step_size: int = 2048
    stream: Any = None


class Drafter:
    """Base class: a drafter proposes, the engine verifies, the drafter observes."""

    name = "drafter"

    def __init__(self):
        self.session: Optional[DraftSession] = None

    def bind(self, session: DraftSession) -> None:
        self.session = session
        self.reset()

    def reset(self) -> None:
        pass

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """Process the prompt before the first round (the engine calls it inside its prefill, so
        the time counts as prompt processing, as mlx-lm counts its draft model's). Optional: a
        drafter that skips it does the same work in its first `propose`."""

    def propose(self, context_ids: Sequence[int], k: int, *, key: Optional[mx.array] = None) -> Draft:
        raise NotImplementedError

    def observe(self, accepted_ids: Sequence[int], n_accepted: int) -> None:
        pass

    def params(self) -> dict:
        """This drafter's settings, for results rows."""
        return {"drafter": self.name}


# ----------------------------------------------------------------------------- helpers


def logits_width(model) -> int:
    """The width of `model`'s logits (one token, no cache): the vocabulary it scores."""
    return int(model(mx.array([[0]], dtype=mx.int32)).shape[-1])


def model_blocks(model) -> list:
    """The decoder blocks of a RuntimeModel: `model.layers` (mlxbun graphs, mlx-lm models) or
    the adapter's inner model's `layers`."""
    for owner in (model, getattr(model, "inner", None), getattr(model, "module", None)):
        layers = getattr(owner, "layers", None) if owner is not None else None
        if isinstance(layers, list) and layers:
            return layers
    raise UnsupportedModelError(f"{type(model).__name__}: no decoder blocks ('layers') to self-draft from")


_SKIP_CLASSES: dict = {}


def _skip_class(cls):
    """A subclass of a block class whose call returns its input hidden state unchanged."""
    sub = _SKIP_CLASSES.get(cls)
    if sub is None:
        def __call__(self, *args, **kwargs):
            if args:
                return args[0]
            for name in ("x", "h", "hidden_states"):
                if name in kwargs:
                    return kwargs[name]
            raise MlxbunError(f"{cls.__name__}: cannot skip a block called without its hidden state")

        sub = type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                          "__qualname__": cls.__qualname__})
        _SKIP_CLASSES[cls] = sub
    return sub


@contextmanager
def skipping(blocks: Sequence[Any]) -> Iterator[None]:
    """Within the block, calling any of `blocks` is the identity (their weights untouched)."""
    originals = [b.__class__ for b in blocks]
    try:
        for b, cls in zip(blocks, originals):
            b.__class__ = _skip_class(cls)
        yield
    finally:
        for b, cls in zip(blocks, originals):
            b.__class__ = cls


def _check_contract(caches: Sequence[Any], who: str) -> None:
    for i, c in enumerate(caches):
        if c is not None and not hasattr(c, "spec_begin"):
            raise UnsupportedModelError(
                f"{who}: cache {i} ({type(c).__name__}) has no spec-round contract "
                "(spec_begin/spec_commit/spec_rollback); speculative decoding cannot roll it back")


# ----------------------------------------------------------------------------- model drafters


class _ModelDrafter(Drafter):
    """Autoregressive drafting with a cache: shared by the draft model and the self-draft."""

    def reset(self) -> None:
        self._cache: Optional[list] = None
        self._done = 0  # tokens of the context the cache holds (outside an open round)
        self._round_k = 0  # draft tokens proposed in the open round (0: none open)
        self._prefilled = False

    def prefill(self, prompt_ids: Sequence[int]) -> None:
        """mlx-lm's prefill of the draft's cache: all but the last prompt token, in chunks (once)."""
        s = self.session
        if s is None:
            raise MlxbunError(f"{type(self).__name__}: bind() it to a session before prefill()")
        if self._cache is None:
            self._cache = self._new_cache()
            _check_contract(self._cache, type(self).__name__)
            self._quantize = self._hook() or (lambda cache: None)
        if self._prefilled:
            return
        pending = [int(t) for t in prompt_ids[self._done:]]
        with mx.stream(s.stream or mx.default_stream(mx.default_device())):
            while len(pending) > 1:
                n = min(s.prefill_step_size, len(pending) - 1)
                self._logits(mx.array(pending[:n], dtype=mx.int32)[None])
                self._quantize(self._cache)
                mx.eval([c.state for c in self._cache])
                pending = pending[n:]
                self._done += n
        self._prefilled = True

    # subclasses: a fresh cache list, and logits [1, L, V] for ids [1, L] through it
    def _new_cache(self) -> list:
        raise NotImplementedError

    def _view(self) -> list:
        """The cache as the model sees it: after the prefill, sink-keeping rings attend as in
        one-token decoding (see `mlxbun.speculative.ring`)."""
        from mlxbun.speculative.ring import sink_exact

        return sink_exact(self._cache) if self._prefilled else self._cache

    def _hook(self):
        """The KV quantize hook of the draft's cache (None: nothing quantizes)."""
        raise NotImplementedError

    def _logits(self, ids: mx.array) -> mx.array:
        raise NotImplementedError

    def _row(self, ids: mx.array, history: mx.array) -> mx.array:
        """Log-probabilities [1, V] after `ids`, through the processors (as the target's)."""
        logits = self._logits(ids[None])[:, -1, :]
        for proc in self.session.logits_processors:
            logits = proc(history, logits)
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def propose(self, context_ids: Sequence[int], k: int, *, key: Optional[mx.array] = None) -> Draft:
        s = self.session
        if s is None:
            raise MlxbunError(f"{type(self).__name__}: bind() it to a session before propose()")
        if self._round_k:
            raise MlxbunError(f"{type(self).__name__}: propose() while the previous round is not observed")
        if k <= 0:
            return Draft()
        self.prefill(context_ids)
        pending = [int(t) for t in context_ids[self._done:]]
        if not pending:
            raise MlxbunError(f"{type(self).__name__}: the context did not grow since the last round")
        history = mx.array([int(t) for t in context_ids], dtype=mx.int32) if s.logits_processors else None
        with mx.stream(s.stream or mx.default_stream(mx.default_device())):
            logprobs = self._row(mx.array(pending, dtype=mx.int32), history)
            self._quantize(self._cache)
            self._done = len(context_ids)
            for c in self._cache:
                c.spec_begin()
            marking = [c for c in self._cache if hasattr(c, "spec_mark")]
            self._round_k = k
            keys = None if s.sampling.greedy else mx.random.split(key if key is not None else mx.random.key(0), k)
            ys, qs = [], []
            for i in range(k):
                y = s.sampling.sample(logprobs, None if keys is None else keys[i])
                if keys is not None:
                    qs.append(s.sampling.probs(logprobs))
                mx.async_eval(y)
                ys.append(y)
                if i < k - 1:
                    if history is not None:
                        history = mx.concatenate([history, y.astype(mx.int32)])
                    logprobs = self._row(y.astype(mx.int32), history)
                    if i < k - 2:  # the state after i + 1 drafts (k - 1: the round's end)
                        for c in marking:
                            c.spec_mark()
            tokens = mx.concatenate(ys).tolist()
        return Draft(tokens, mx.concatenate(qs, axis=0) if qs else None)

    def observe(self, accepted_ids: Sequence[int], n_accepted: int) -> None:
        k = self._round_k
        if not k:
            return
        # the cache holds the first k-1 draft tokens (the last one was never fed)
        keep = min(int(n_accepted), k - 1)
        if commit_spec_round(self._cache, keep):  # every position 0..k-1 is kept or marked
            raise MlxbunError(f"{type(self).__name__}: a draft cache asked for a replay of {keep} tokens "
                              "(a recurrent layer that does not report its tokens through advance())")
        self._done += keep
        self._round_k = 0


class DraftModelDrafter(_ModelDrafter):
    """A separate (smaller) model sharing the target's vocabulary.

    kv: the draft cache's `make_generation_cache` options (default: the target's, without a
    per-layer `kv_config`, which describes the target's layers).
    """

    name = "draft_model"

    def __init__(self, model, *, kv: Optional[dict] = None, label: Optional[str] = None):
        from mlxbun.models.mlxlm import ensure_runtime

        super().__init__()
        self.model = ensure_runtime(model)
        self.kv = None if kv is None else dict(kv)
        self.label = label
        self.reset()

    def bind(self, session: DraftSession) -> None:
        width = logits_width(self.model)
        if width != session.vocab_size:
            raise VocabularyMismatchError(
                f"draft model {self.label or type(self.model).__name__} scores {width} tokens but the target "
                f"scores {session.vocab_size}: a draft model must share the target's vocabulary")
        super().bind(session)

    def _kv_options(self) -> dict:
        if self.kv is not None:
            return self.kv
        return {k: v for k, v in self.session.kv.items() if k != "kv_config"}

    def _new_cache(self) -> list:
        return make_generation_cache(self.model, **self._kv_options())

    def _hook(self):
        return quantize_hook(self._kv_options(), len(self._cache))

    def _logits(self, ids: mx.array) -> mx.array:
        return self.model(ids, cache=self._view())

    def params(self) -> dict:
        return {"drafter": self.name, "draft_model": self.label or repr(self.model)}


class LayerSkipDrafter(_ModelDrafter):
    """Self-draft: the target's first `layers` blocks + its final norm and head (shared weights).

    The remaining blocks are skipped (identity) while drafting; the draft's cache covers the
    first `layers` layers only.
    """

    name = "layer_skip"

    def __init__(self, layers: int = 1):
        super().__init__()
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise MlxbunError(f"layer-skip draft: layers must be a positive integer, got {layers!r}")
        self.layers = layers
        self.reset()

    def bind(self, session: DraftSession) -> None:
        blocks = model_blocks(session.target)
        if self.layers > len(blocks):
            raise MlxbunError(f"layer-skip draft: layers={self.layers} but the target has {len(blocks)} blocks")
        self._blocks = blocks
        super().bind(session)

    def _new_cache(self) -> list:
        full = make_generation_cache(self.session.target, **self.session.kv)
        self._n_caches = len(full)
        self._n_own = self._caches_used()
        return full[: self._n_own]

    def _caches_used(self) -> int:
        """How many caches the first `layers` blocks use: one token through them with a
        throwaway cache list; they must be a prefix of the list (mlx-lm's order)."""
        probe = make_generation_cache(self.session.target, **self.session.kv)
        with skipping(self._blocks[self.layers:]):
            self.session.target(mx.array([[0]], dtype=mx.int32), cache=probe)
        used = [i for i, c in enumerate(probe) if getattr(c, "offset", 0) or getattr(c, "tokens_seen", 0)]
        if used != list(range(len(used))):
            raise UnsupportedModelError(f"layer-skip draft: the first {self.layers} blocks use caches {used}, "
                                        "not the first ones of the model's cache list")
        return len(used)

    def _hook(self):
        return quantize_hook(self.session.kv, self._n_caches, first=self._n_own)

    def _logits(self, ids: mx.array) -> mx.array:
        with skipping(self._blocks[self.layers:]):
            return self.session.target(ids, cache=self._view() + [None] * (self._n_caches - self._n_own))

    def params(self) -> dict:
        return {"drafter": self.name, "draft_layers": self.layers}


# ----------------------------------------------------------------------------- n-gram lookup


class NGramDrafter(Drafter):
    """Prompt lookup: match the last n tokens (n = max_n down to min_n) against every earlier
    position of the prompt and the generated text; propose up to k tokens that followed the most
    recent match. An index of n-gram -> latest start keeps each round O(new tokens)."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        super().__init__()
        for what, v in (("max_n", max_n), ("min_n", min_n)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise MlxbunError(f"n-gram draft: {what} must be a positive integer, got {v!r}")
        if min_n > max_n:
            raise MlxbunError(f"n-gram draft: min_n={min_n} is above max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.reset()

    def reset(self) -> None:
        self._tokens: list[int] = []
        self._index: dict[int, dict[tuple, int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}

    def _extend(self, context_ids: Sequence[int]) -> None:
        ctx = context_ids if isinstance(context_ids, list) else [int(t) for t in context_ids]
        old = len(self._tokens)
        if len(ctx) < old or ctx[:old] != self._tokens:
            self.reset()  # not a continuation of what was indexed: start over
            old = 0
        self._tokens.extend(int(t) for t in ctx[old:])
        toks, end = self._tokens, len(self._tokens)
        for n, index in self._index.items():
            # n-grams with a token after them: starts s with s + n <= end - 1
            for s in range(max(0, old - n), end - n):
                index[tuple(toks[s:s + n])] = s

    def propose(self, context_ids: Sequence[int], k: int, *, key: Optional[mx.array] = None) -> Draft:
        self._extend(context_ids)
        toks = self._tokens
        if k <= 0:
            return Draft()
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(toks) <= n:
                continue
            s = self._index[n].get(tuple(toks[-n:]))
            if s is not None:
                return Draft(toks[s + n: s + n + k])
        return Draft()

    def params(self) -> dict:
        return {"drafter": self.name, "ngram_max": self.max_n, "ngram_min": self.min_n}


# ----------------------------------------------------------------------------- from a name


def make_drafter(drafter, *, engine: str = "mlxbun", **options) -> Drafter:
    """A Drafter from a Drafter (as is), a draft model (a RuntimeModel or an mlx-lm model), or a
    drafter name (`mlxbun.names.parse_drafter`: "ngram[:N]", "self[:L]", "model:MODEL"; a draft
    model named there is opened with `engine`). `options` go to the drafter's constructor
    (e.g. min_n for n-gram lookup, kv or label for a draft model)."""
    if isinstance(drafter, Drafter):
        if options:
            raise GenerationError(f"drafter options {sorted(options)} apply to a drafter name, not an instance")
        return drafter
    if isinstance(drafter, (str, DrafterSpec)):
        spec = parse_drafter(drafter)
        if spec.kind == "ngram":
            return NGramDrafter(**{"max_n": spec.n, **options})
        if spec.kind == "self":
            return LayerSkipDrafter(**{"layers": spec.n, **options})
        from mlxbun.locate import open_runtime

        try:
            model = open_runtime(spec.model, engine)
        except MlxbunError as e:
            shown = drafter if isinstance(drafter, str) else str(spec.model)
            raise GenerationError(f"unknown drafter {shown!r}: not ngram[:N] or self[:L], and the draft "
                                  f"model cannot be opened ({e})") from None
        return DraftModelDrafter(model, **{"label": str(spec.model), **options})
    if callable(drafter):
        return DraftModelDrafter(drafter, **options)
    raise GenerationError(f"drafter must be a Drafter, a model or a drafter name, got {type(drafter).__name__}")
