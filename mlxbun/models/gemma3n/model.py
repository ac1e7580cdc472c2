"""Gemma3nModel: gemma3n's language model (mlx-lm 0.32.2 `models/gemma3n.py`) as a RuntimeModel.

The module tree is mlx-lm's (`model.language_model.*`), so parameter paths, checkpoint keys and
tap paths are the same. What the backbone does around the layers:

- per-layer inputs: a second embedding (`embed_tokens_per_layer`, ids at or past
  `vocab_size_per_layer_input` read row 0) plus a projection of the embedded tokens, normed and
  averaged; layer i gets slice i;
- AltUp streams: the embedding and `altup_num_inputs - 1` projections of it, rescaled to its
  magnitude, stacked; at the end unembedded, rescaled and averaged;
- the cache list holds one cache per layer BEFORE the KV-shared ones (`make_cache`); a shared
  layer is handed its owner's cache (`Gemma3nArgs.cache_idx`), so every cache kind, a mixed
  per-layer plan (indexed by cache), prompt caches and speculative rollback see only owner
  caches and the sharing holds by construction;
- one rope offset for the whole forward (cache 0's before any layer runs) and the two masks
  taken from the first full / sliding layer's cache, as mlx-lm does.

`Gemma3nModel.shard(group)` splits it across a tensor-parallel group (mlx-lm's gemma3n has none):
every layer's attention by heads and MLP by hidden units (`layers.py` says how, the sparse MLPs'
statistics too), every split checked before any weight moves; the embeddings (the per-layer ones
too), the per-layer input projection, the AltUp projections, norms and the tied head stay whole on
every rank. Each rank's caches hold its own KV heads, which its KV-shared layers read.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models.base import create_attention_mask
from mlxbun.models.gemma3n.config import FULL, MODEL_TYPE, Gemma3nArgs
from mlxbun.models.gemma3n.layers import Gemma3nDecoderLayer, logit_softcap
from mlxbun.models.sharding import ShardingError
from mlxbun.models.taps import capture
from mlxbun.models.universal.media import refuse_media

__all__ = ["Gemma3nModel", "LanguageModel"]


class LanguageModel(nn.Module):
    """mlx-lm's `LanguageModel` (Model.model.language_model): the parameters and the layer loop."""

    def __init__(self, a: Gemma3nArgs):
        super().__init__()
        self.args = a
        n, hidden, per_layer = a.num_hidden_layers, a.hidden_size, a.hidden_size_per_layer_input
        self.embed_tokens = nn.Embedding(a.vocab_size, hidden)
        self.layers = [Gemma3nDecoderLayer(a, i, i >= a.first_kv_shared) for i in range(n)]
        self.embed_tokens_per_layer = nn.Embedding(a.vocab_size_per_layer_input, n * per_layer)
        self.per_layer_model_projection = nn.Linear(hidden, n * per_layer, bias=False)
        self.per_layer_projection_norm = nn.RMSNorm(dims=per_layer, eps=a.rms_norm_eps)
        self.altup_projections = [nn.Linear(hidden, hidden, bias=False) for _ in range(1, a.altup_num_inputs)]
        self.altup_unembed_projections = [nn.Linear(hidden, hidden, bias=False)
                                          for _ in range(1, a.altup_num_inputs)]
        self.norm = nn.RMSNorm(hidden, eps=a.rms_norm_eps)

    def get_per_layer_inputs(self, input_ids: mx.array) -> mx.array:
        a = self.args
        per_layer_inputs_mask = input_ids < a.vocab_size_per_layer_input
        tokens = mx.where(per_layer_inputs_mask, input_ids, mx.zeros_like(input_ids))
        result = self.embed_tokens_per_layer(tokens) * (a.hidden_size_per_layer_input**0.5)
        return result.reshape(*input_ids.shape, a.num_hidden_layers, a.hidden_size_per_layer_input)

    def project_per_layer_inputs(self, inputs_embeds: mx.array, per_layer_inputs: mx.array) -> mx.array:
        a = self.args
        per_layer_projection = self.per_layer_model_projection(inputs_embeds) * (a.hidden_size**-0.5)
        per_layer_projection = per_layer_projection.reshape(
            *inputs_embeds.shape[:-1], a.num_hidden_layers, a.hidden_size_per_layer_input)
        per_layer_projection = self.per_layer_projection_norm(per_layer_projection)
        return (per_layer_projection + per_layer_inputs) * (2.0**-0.5)

    def hidden(self, inputs: mx.array, cache: Optional[list] = None,
               input_embeddings: Optional[mx.array] = None, shared_offset_after: bool = False) -> mx.array:
        """The final-normed hidden state (mlx-lm's `__call__` up to `self.norm`). `input_embeddings`
        [B, L, D]: the rows to run instead of the ids' scaled embeddings (mlx-vlm's `inputs_embeds`:
        the per-layer inputs still come from the ids). `shared_offset_after`: mlx-vlm 0.7.10's
        gemma3n composition, where a KV-shared layer ropes its queries at its owner cache's offset
        read after the owner wrote this forward's keys (mlx-lm: the offset before the forward)."""
        a = self.args
        h = self.embed_tokens(inputs) * (a.hidden_size**0.5) if input_embeddings is None else input_embeddings
        per_layer_inputs = self.get_per_layer_inputs(inputs)
        per_layer_inputs = self.project_per_layer_inputs(h, per_layer_inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        global_mask = create_attention_mask(h, cache[a.first_full_idx])
        sliding_window_mask = create_attention_mask(h, cache[a.first_sliding_idx], window_size=a.sliding_window)
        h0 = h
        target_magnitude = mx.mean(h0**2, axis=-1, keepdims=True) ** 0.5
        h_list = [h0]
        h_list.extend([proj(h0) for proj in self.altup_projections])
        h = mx.stack(h_list, axis=0)
        mags = mx.mean(h[1:] ** 2, axis=-1, keepdims=True) ** 0.5
        h[1:] = h[1:] * (target_magnitude / mx.maximum(mags, mx.finfo(h0.dtype).min))
        # one position offset for the whole forward: a shared layer must not see its owner's
        # cache advanced before it ropes its queries
        offset = cache[0].offset if cache[0] is not None else 0
        for i, layer in enumerate(self.layers):
            mask = global_mask if a.layer_types[i] == FULL else sliding_window_mask
            c = cache[a.cache_idx[i]]
            at = c.offset if shared_offset_after and c is not None and i >= a.first_kv_shared else offset
            h = layer(h, mask, c, per_layer_inputs[:, :, i, :], offset=at)

        target_magnitude = mx.mean(h[0] ** 2, axis=-1, keepdims=True) ** 0.5
        for i, proj in enumerate(self.altup_unembed_projections):
            h[i + 1] = proj(h[i + 1])
        mags = mx.mean(h[1:] ** 2, axis=-1, keepdims=True) ** 0.5
        h[1:] = h[1:] * (target_magnitude / mx.maximum(mags, mx.finfo(h0.dtype).min))
        h = mx.mean(h, axis=0)
        return self.norm(h)

    def logits(self, h: mx.array) -> mx.array:
        out = self.embed_tokens.as_linear(h)
        if self.args.final_logit_softcapping is not None:
            out = logit_softcap(self.args.final_logit_softcapping, out)
        return out


class Gemma3nModel(nn.Module):
    """The RuntimeModel: `model.language_model` as in mlx-lm's `Model.model` (`Gemma3n`)."""

    _tensor_group = None  # set by shard()

    def __init__(self, args: Gemma3nArgs, config: Any = None, raw_config: Optional[Mapping] = None):
        super().__init__()
        self.args = args
        self.config = config
        self.raw_config = MappingProxyType(dict(raw_config or {}))
        self.profile = None
        self.model = nn.Module()
        self.model.language_model = LanguageModel(args)

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def language_model(self) -> LanguageModel:
        return self.model.language_model

    @property
    def layers(self) -> list:
        return self.language_model.layers

    @property
    def tied(self) -> bool:
        return True

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    @property
    def cache_layers(self) -> list[int]:
        """The model layer each entry of `make_cache()`'s list belongs to: the layers before the
        KV-shared ones (the shared layers read these)."""
        return list(range(self.args.first_kv_shared))

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's gemma3n make_cache: full layers a KVCache, sliding ones a RotatingKVCache of
        the window (keep 0), for the non-shared layers only. `max_kv_size` bounds the full layers
        too (a ring keeping 4, as mlx-lm's make_prompt_cache would)."""
        if kv_options:
            raise MlxbunError(f"{MODEL_TYPE}: cache options not supported by make_cache: "
                              f"{', '.join(sorted(kv_options))}")
        a = self.args

        def full():
            return RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache()

        return [full() if kind == FULL else RotatingKVCache(max_size=a.sliding_window, keep=0)
                for kind in a.layer_types[: a.first_kv_shared]]

    @property
    def tensor_group(self):
        """The `mx.distributed` group the graph is split across (None: not split)."""
        return self._tensor_group

    def shard(self, group) -> None:
        """Split every layer across `group` (the module docstring says what splits): every
        layer's split is checked first, so a refused one (ShardingError naming the module path and
        sizes) leaves the whole model as it was. A group of one changes nothing."""
        if self.tensor_group is not None:
            raise ShardingError(f"{MODEL_TYPE}: already split across {self.tensor_group.size()} ranks")
        if group.size() == 1:
            return
        plans = [layer.shard_plan(group, f"model.language_model.layers.{i}") for i, layer in enumerate(self.layers)]
        for plan in plans:
            plan()
        self._tensor_group = group

    def layers_tap(self, paths: Any = None):
        return capture(self, paths)

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None,
                       input_embeddings: Optional[mx.array] = None, shared_offset_after: bool = False) -> mx.array:
        return self.language_model.hidden(ids, cache, input_embeddings, shared_offset_after)

    def embed_tokens(self, ids: mx.array) -> mx.array:
        """The ids' rows of the embedding, unscaled (what mlx-vlm's gemma3n merges media into)."""
        return self.language_model.embed_tokens(ids)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        return self.language_model.logits(h)

    def __call__(self, ids: mx.array, cache: Optional[list] = None, **media: Any) -> mx.array:
        if media:  # the towers are not this graph's (mlxbun.multimodal runs them): their inputs are refused by name
            refuse_media(MODEL_TYPE, "language_model", media)
        return self.logits_from_hidden(self.forward_hidden(ids, cache))
