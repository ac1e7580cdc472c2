"""gemma4_text's graph (mlx-lm 0.32.2 `models/gemma4_text.py`, op for op), a universal row whose
forward does not fit the shared blocks: `Gemma4Text` is a `UniversalDense` (the row's loader,
sanitize, quantization, audit, coverage, taps and port all apply) with its own module tree.

What differs from the universal blocks:
- per-layer inputs: a second embedding (`embed_tokens_per_layer`, one slice per layer) plus a
  projection of the scaled embeddings, normed, summed and scaled by 2**-0.5; each layer gates its
  slice into the residual (`per_layer_input_gate`, gelu_approx, `per_layer_projection`, norm);
- KV sharing: the last `num_kv_shared_layers` layers have no k / v projections; each takes the
  keys, values and rope offset its type's last projecting layer computed in the same forward
  (mlx-lm's `previous_kvs` / `intermediates`). mlx-lm's cache list holds the projecting layers
  only, and a shared layer attends with no cache (the fused kernel over the arrays handed on, as
  mlx-lm); where those are packed quantized groups (uniform / per-layer quantized KV, on which
  mlx-lm's shared layers fail) it attends through the producer's cache (`models/kv_sharing.py`),
  i.e. the quantized attention of the producer's bits and group;
- full layers: `global_head_dim`, proportional rope on a partial rotary fraction, and with
  `attention_k_eq_v` the values are the key projection (`num_global_key_value_heads` heads);
  values RMS-normed without a scale; attention scale 1.0;
- the MLP doubled in width on the KV-shared layers (`use_double_wide_mlp`); with
  `enable_moe_block` a routed expert block beside it (its own router norm and scales, three
  more norms); a `layer_scalar` on every layer's output; the final softcap compiled.

Tensor parallel (`DecoderLayer.shard`; mlx-lm's gemma4 has none): attention by heads (KV heads
fewer than the ranks repeated, so a k = v full layer's one head is on every rank), and a KV-shared
layer's query heads on a rank read the keys / values its producer's heads on that rank computed
(the same heads they read unsplit); the MLP by hidden units; the experts by their hidden units
(every rank routes alike with the whole router, the experts' partial sums all-summed before their
norm); the per-layer input gate by its features (gate all-to-sharded, the rank's slice of the
layer's per-layer input, per_layer_projection sharded-to-all). Embeddings (the per-layer ones
too), the per-layer input projection, norms and head stay whole on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from types import MappingProxyType
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models import rope as R
from mlxbun.models.base import create_attention_mask, create_causal_mask, scaled_dot_product_attention
from mlxbun.models.kv_sharing import shared_attention_cache
from mlxbun.models.sharding import (
    ALL_TO_SHARDED,
    SHARDED_TO_ALL,
    shard_inplace_all,
    shard_linear,
    split_heads_plan,
)
from mlxbun.models.switch_layers import SwitchGLU
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.gemma4_args import FULL, SLIDING, Gemma4Layer, first_kv_shared, gemma4_layers
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import UniversalArgs

__all__ = ["Gemma4Text"]


@partial(mx.compile, shapeless=True)
def logit_softcap(softcap, x):
    return mx.tanh(x / softcap) * softcap


@partial(mx.compile, shapeless=True)
def geglu(gate, x):
    return nn.gelu_approx(gate) * x


class RMSNormNoScale(nn.Module):
    """RMSNorm without a learnable scale (the values' norm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, None, self.eps)


class Attention(nn.Module):
    def __init__(self, a: Mapping, spec: Gemma4Layer):
        super().__init__()
        dim, hd, H, KV = a["hidden_size"], spec.head_dim, a["num_attention_heads"], spec.n_kv_heads
        self._spec, self.n_heads, self.n_kv_heads, self.head_dim = spec, H, KV, hd
        eps = a["rms_norm_eps"]
        self.scale = 1.0
        self.q_proj = nn.Linear(dim, H * hd, bias=False)
        if spec.has_kv:
            self.k_proj = nn.Linear(dim, KV * hd, bias=False)
            if not spec.k_eq_v:
                self.v_proj = nn.Linear(dim, KV * hd, bias=False)
        self.o_proj = nn.Linear(H * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=eps)
        if spec.has_kv:
            self.k_norm = nn.RMSNorm(hd, eps=eps)
            self.v_norm = RMSNormNoScale(hd, eps=eps)
        self.rope = R.initialize_rope(hd, spec.rope.get("rope_theta", 10000.0), a["rope_traditional"],
                                      spec.rope, a["max_position_embeddings"])

    def shard(self, group, where: str) -> None:
        """Split the heads across `group` (checked first): q / k / v all-to-sharded, o
        sharded-to-all, KV heads fewer than the ranks repeated to one per rank."""
        split_heads_plan(self, group, where)()

    def __call__(self, x, mask=None, cache=None, shared_kv=None, offset=None, producer_cache=None):
        B, L, _ = x.shape
        queries = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        if shared_kv is not None:
            keys, values = shared_kv
        elif not self._spec.has_kv:
            raise MlxbunError(f"gemma4_text: layer {self._spec.index} is KV-shared but received no "
                              f"keys / values from layer {self._spec.previous_kv}")
        else:
            keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            values = keys
            if not self._spec.k_eq_v:
                values = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            offset = mx.array(cache.offset) if cache is not None else 0
            keys = self.rope(self.k_norm(keys).transpose(0, 2, 1, 3), offset=offset)
            values = self.v_norm(values).transpose(0, 2, 1, 3)
        queries = self.rope(queries.transpose(0, 2, 1, 3), offset=offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        attend = cache if cache is not None else shared_attention_cache(keys, producer_cache)
        output = scaled_dot_product_attention(queries, keys, values, cache=attend, scale=self.scale, mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output), (keys, values), offset


class MLP(nn.Module):
    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)

    def shard(self, group, where: str) -> None:
        layers = {name: shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
                  for name in ("gate_proj", "up_proj")}
        layers["down_proj"] = shard_linear(self.down_proj, SHARDED_TO_ALL, group, where=f"{where}.down_proj")
        for name, module in layers.items():
            setattr(self, name, module)

    def __call__(self, x):
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    """norm (its own scale times hidden**-0.5) -> project -> top-k -> softmax -> per-expert scale."""

    def __init__(self, a: Mapping):
        super().__init__()
        self._eps, self._k = a["rms_norm_eps"], a["top_k_experts"]
        self.proj = nn.Linear(a["hidden_size"], a["num_experts"], bias=False)
        self.scale = mx.ones((a["hidden_size"],))
        self.per_expert_scale = mx.ones((a["num_experts"],))
        self._root_size = a["hidden_size"] ** -0.5

    def __call__(self, x):
        x = mx.fast.rms_norm(x, self.scale * self._root_size, self._eps)
        expert_scores = self.proj(x)
        top_k_indices = mx.argpartition(expert_scores, kth=-self._k, axis=-1)
        top_k_indices = mx.stop_gradient(top_k_indices[..., -self._k:])
        top_k_weights = mx.take_along_axis(expert_scores, top_k_indices, axis=-1)
        top_k_weights = mx.softmax(top_k_weights, axis=-1)
        top_k_weights = top_k_weights * self.per_expert_scale[top_k_indices]
        return top_k_indices, top_k_weights


class GeGLU(nn.Module):
    def __call__(self, x, gate):
        return geglu(gate, x)


class Experts(nn.Module):
    def __init__(self, a: Mapping):
        super().__init__()
        self.switch_glu = SwitchGLU(a["hidden_size"], a["moe_intermediate_size"], a["num_experts"],
                                    bias=False, activation=GeGLU())
        self._group = None  # set by shard(): the partial sums are all-summed

    def shard(self, group, where: str) -> None:
        """Split every expert's hidden units in place (SwitchGLU.split_pieces), every piece
        checked before any moves."""
        glu = self.switch_glu
        shard_inplace_all([(f"{where}.switch_glu.{child}", glu[child], sharding, segments)
                           for child, sharding, segments in glu.split_pieces()], group)
        object.__setattr__(self, "_group", group)

    def __call__(self, x, top_k_indices, top_k_weights):
        w = mx.expand_dims(top_k_weights, -1)
        out = (w * self.switch_glu(x, top_k_indices)).sum(-2)
        return out if self._group is None else mx.distributed.all_sum(out, group=self._group)


class DecoderLayer(nn.Module):
    def __init__(self, a: Mapping, spec: Gemma4Layer):
        super().__init__()
        D, eps = a["hidden_size"], a["rms_norm_eps"]
        self.layer_type = spec.layer_type
        self.use_sliding = spec.sliding
        self.self_attn = Attention(a, spec)
        self.mlp = MLP(D, spec.mlp_width)
        self.input_layernorm = nn.RMSNorm(D, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(D, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(D, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(D, eps=eps)
        self._moe = bool(a["enable_moe_block"])
        if self._moe:
            self.router = Router(a)
            self.experts = Experts(a)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(D, eps=eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(D, eps=eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(D, eps=eps)
        self._ple = bool(a["hidden_size_per_layer_input"])
        if self._ple:
            P = a["hidden_size_per_layer_input"]
            self.per_layer_input_gate = nn.Linear(D, P, bias=False)
            self.per_layer_projection = nn.Linear(P, D, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(D, eps=eps)
        self.layer_scalar = mx.ones((1,))
        self._ple_part = None  # set by shard(): this rank's slice of the per-layer input

    def shard(self, group, where: str) -> None:
        """Split the layer across `group` (the module docstring says how); the router stays whole."""
        ple = {}
        if self._ple:  # checked before anything changes
            ple = {"per_layer_input_gate": shard_linear(self.per_layer_input_gate, ALL_TO_SHARDED, group,
                                                        where=f"{where}.per_layer_input_gate"),
                   "per_layer_projection": shard_linear(self.per_layer_projection, SHARDED_TO_ALL, group,
                                                        where=f"{where}.per_layer_projection")}
        self.self_attn.shard(group, f"{where}.self_attn")
        self.mlp.shard(group, f"{where}.mlp")
        if self._moe:
            self.experts.shard(group, f"{where}.experts")
        for name, module in ple.items():
            setattr(self, name, module)
        if ple:
            part = self.per_layer_input_gate.weight.shape[0]
            object.__setattr__(self, "_ple_part", slice(group.rank() * part, (group.rank() + 1) * part))

    def __call__(self, x, mask=None, cache=None, per_layer_input=None, shared_kv=None, offset=None,
                 producer_cache=None):
        h, shared_kv, offset = self.self_attn(self.input_layernorm(x), mask, cache, shared_kv=shared_kv,
                                              offset=offset, producer_cache=producer_cache)
        h = x + self.post_attention_layernorm(h)
        residual = h
        if self._moe:
            h1 = self.post_feedforward_layernorm_1(self.mlp(self.pre_feedforward_layernorm(h)))
            top_k_indices, top_k_weights = self.router(h)
            h2 = self.experts(self.pre_feedforward_layernorm_2(h), top_k_indices, top_k_weights)
            h = h1 + self.post_feedforward_layernorm_2(h2)
        else:
            h = self.mlp(self.pre_feedforward_layernorm(h))
        h = residual + self.post_feedforward_layernorm(h)
        if self._ple and per_layer_input is not None:
            residual = h
            if self._ple_part is not None:
                per_layer_input = per_layer_input[..., self._ple_part]
            gate = nn.gelu_approx(self.per_layer_input_gate(h))
            gate = self.per_layer_projection(mx.multiply(gate, per_layer_input))
            h = residual + self.post_per_layer_input_norm(gate)
        return h * self.layer_scalar, shared_kv, offset


class Backbone(nn.Module):
    """mlx-lm's Gemma4TextModel: embeddings (+ the per-layer ones), layers, final norm."""

    def __init__(self, a: Mapping, specs: tuple[Gemma4Layer, ...]):
        super().__init__()
        D, eps, n = a["hidden_size"], a["rms_norm_eps"], a["num_hidden_layers"]
        self.embed_tokens = nn.Embedding(a["vocab_size"], D)
        self.layers = [DecoderLayer(a, s) for s in specs]
        self.norm = nn.RMSNorm(D, eps=eps)
        P = a["hidden_size_per_layer_input"]
        if P:
            self.embed_tokens_per_layer = nn.Embedding(a["vocab_size_per_layer_input"], n * P)
            self.per_layer_model_projection = nn.Linear(D, n * P, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(P, eps=eps)


class Gemma4Text(UniversalDense):
    """gemma4_text (and the gemma4 wrapper's text model): parameter tree == mlx-lm's."""

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        nn.Module.__init__(self)
        d, n, a = descriptor, descriptor.names, args.fields
        self.descriptor, self.args, self.config = d, args, config
        self.raw_config = MappingProxyType(dict(raw_config or {}))
        self.profile = None
        self._tied = args.tie
        self._specs = gemma4_layers(a)
        self._first_shared = first_kv_shared(a)
        self._producer = [s.previous_kv for s in self._specs]
        if n.wrapper is not None:  # gemma4: Model.language_model holds model and lm_head
            setattr(self, n.wrapper, nn.Module())
        self.text_model[n.root] = Backbone(a, self._specs)
        if not args.tie:
            self.text_model[n.head] = nn.Linear(args.hidden, args.vocab, bias=False)
        types = [s.layer_type for s in self._specs]
        self._mask_idx = {t: types.index(t) for t in (FULL, SLIDING) if t in types}
        P = a["hidden_size_per_layer_input"]
        self._ple = (a["num_hidden_layers"], P, P**0.5, 2.0**-0.5, a["hidden_size"] ** -0.5) if P else None

    @property
    def cache_layers(self) -> list[int]:
        """The projecting layers: mlx-lm's make_cache leaves the KV-shared ones out."""
        return list(range(self._first_shared))

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's make_cache: KVCache per full, RotatingKVCache(sliding_window) per sliding
        projecting layer (mlxbun: `max_kv_size` bounds the full layers too)."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        w = self.args.fields["sliding_window"]

        def full():
            return RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache()
        return [RotatingKVCache(max_size=w, keep=0) if s.sliding else full()
                for s in self._specs[: self._first_shared]]

    def _per_layer_inputs(self, ids, h):
        root = self.backbone
        n, P, emb_scale, input_scale, proj_scale = self._ple
        result = root.embed_tokens_per_layer(ids) * emb_scale
        per_layer = mx.unflatten(result, -1, (n, P))
        proj = root.per_layer_model_projection(h) * proj_scale
        proj = root.per_layer_projection_norm(mx.unflatten(proj, -1, (n, P)))
        return (proj + per_layer) * input_scale

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None, input_embeddings: Optional[mx.array] = None,
                       media_ids: tuple = (), vision_blocks: Optional[mx.array] = None,
                       keep_last: bool = False) -> mx.array:
        """`input_embeddings` [B, L, H]: the rows to run as they are (mlx-vlm's gemma4 inputs_embeds:
        the ids' scaled rows with the media's soft tokens in place); with them, the ids in `media_ids`
        take their per-layer inputs at id 0 (mlx-vlm's get_input_embeddings). `vision_blocks` [B, L]:
        each position's image block (-1: none); a call over more than one position then runs
        array masks in which an image's tokens also see each other (mlx-vlm's bidirectional vision
        overlay, where its mask is square). `keep_last`: mlx-vlm's logits_to_keep=1, the hidden
        state [B, 1, H] of the last position only, cut before the first KV-shared layer (those
        layers then run its row alone, their masks and per-layer inputs cut to it)."""
        root, a = self.backbone, self.args.fields
        if input_embeddings is None:
            h = root.embed_tokens(ids)
            h = h * (a["hidden_size"] ** 0.5)
        else:
            h = input_embeddings
            for m in media_ids:
                ids = mx.where(ids == m, mx.zeros_like(ids), ids)
        blocks = root.layers
        if self._ple is not None:
            ple = self._per_layer_inputs(ids, h)
            per_layer = [ple[:, :, i, :] for i in range(len(blocks))]
        else:
            per_layer = [None] * len(blocks)
        cache = [None] * len(blocks) if cache is None else list(cache) + [None] * (len(blocks) - len(cache))
        masks = {FULL: None, SLIDING: None}
        overlay = vision_blocks is not None and h.shape[1] > 1
        if FULL in self._mask_idx:
            masks[FULL] = create_attention_mask(h, cache[self._mask_idx[FULL]], return_array=overlay)
        if SLIDING in self._mask_idx:
            masks[SLIDING] = create_attention_mask(h, cache[self._mask_idx[SLIDING]],
                                                   window_size=a["sliding_window"], return_array=overlay)
        if overlay:
            for kind in masks:
                if isinstance(masks[kind], str):
                    masks[kind] = create_causal_mask(h.shape[1], window_size=a["sliding_window"] if kind == SLIDING
                                                     else None)
                m = masks[kind]
                if isinstance(m, mx.array) and m.shape[-1] == m.shape[-2] == vision_blocks.shape[1]:
                    q, k = mx.expand_dims(vision_blocks, -1), mx.expand_dims(vision_blocks, -2)
                    masks[kind] = m | mx.expand_dims((q != -1) & (q == k), 1)
        intermediates = [(None, None)] * len(blocks)
        trimmed = 0
        for i, (layer, spec) in enumerate(zip(blocks, self._specs)):
            if keep_last and i == self._first_shared and h.shape[1] > 1:
                trimmed, h = h.shape[1] - 1, h[:, -1:, :]
            pli, m = per_layer[i], masks[spec.layer_type]
            if trimmed:
                pli = None if pli is None else pli[:, -h.shape[1]:, :]
                m = m[..., -h.shape[1]:, :] if isinstance(m, mx.array) and m.shape[-2] != h.shape[1] else m
            kvs, offset = intermediates[self._producer[i]]
            if trimmed:
                offset = offset + trimmed
            out = layer(h, m, cache[i], per_layer_input=pli, shared_kv=kvs,
                        offset=offset, producer_cache=cache[self._producer[i]])
            if not isinstance(out, tuple):  # a block the layer-skip drafter skips: h alone
                h = out
                continue
            h, kvs, offset = out
            intermediates[i] = (kvs, offset)
        return root.norm(h)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        if self._tied:
            out = self.backbone.embed_tokens.as_linear(h)
        else:
            out = self.text_model[self.descriptor.names.head](h)
        cap = self.args.fields["final_logit_softcapping"]
        return out if cap is None else logit_softcap(cap, out)
