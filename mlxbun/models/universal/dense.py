"""UniversalDense: one config-driven module for every arch in the descriptor table.

(The name predates the MoE rows: a row with `moe` knobs runs `moe.py`'s MoEBlock in
place of the dense MLP on the layers its rule picks; everything else is shared.)

Each branch is a transcription of the mlx-lm 0.32.2 file of the arch that takes
it (same ops, order, casts, python-float constants, compiled kernels, mask and
attention dispatch), and the module tree uses that file's attribute names, so
parameter paths, safetensors keys and tap paths are identical to mlx-lm's.
The descriptor (`schema.ArchDescriptor`, a row of `table.py`) selects branches,
as enums the row checked when it was built; `resolve.resolve_args` supplies the
numbers.

`forward_hidden` returns the final-normed hidden state (what feeds the head);
`logits_from_hidden` applies the head and its post-processing, so
`model(ids) == logits_from_hidden(forward_hidden(ids))` bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.cache_list import CacheList
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import MlxbunError
from mlxbun.models import layers as L
from mlxbun.models import rope as R
from mlxbun.models.base import create_attention_mask, create_ssm_mask
from mlxbun.models.sharding import ALL_TO_SHARDED, ShardingError, gather_last_axis, shard_linear
from mlxbun.models.taps import capture
from mlxbun.models.universal.attention import Attention
from mlxbun.models.universal.fields import get
from mlxbun.models.universal.kinds import (
    BLOCK_SLOTS,
    EmbedScale,
    FinalSoftcap,
    MakeCache,
    NormKind,
    NormSlot,
    ParallelMlpNorm,
    ParallelSum,
    PostOp,
    Residual,
    TiedOp,
    exhaustive,
)
from mlxbun.models.universal.kinds_hybrid import (
    HybridBlock,
    MixerKind,
)
from mlxbun.models.universal.kinds_mla import MlaKind
from mlxbun.models.universal.media import refuse_media
from mlxbun.models.universal.mixers import MIXERS
from mlxbun.models.universal.mla import mla_attention
from mlxbun.models.universal.mlp import MLP
from mlxbun.models.universal.moe import MoEBlock
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, UniversalArgs

__all__ = ["UniversalDense"]


# a norm module, or None for the parameter-free functional RMSNorm
_NORMS = exhaustive(NormKind, {
    NormKind.RMS: lambda dims, eps, bias: nn.RMSNorm(dims, eps=eps),
    NormKind.GEMMA_RMS: lambda dims, eps, bias: L.GemmaRMSNorm(dims, eps=eps),
    NormKind.LAYERNORM: lambda dims, eps, bias: nn.LayerNorm(dims, eps=eps, bias=bias),
    NormKind.LAYERNORM1P: lambda dims, eps, bias: L.NemotronLayerNorm1P(dims, eps=eps),
    NormKind.FUNCTIONAL_RMS: lambda dims, eps, bias: None,
    NormKind.OFFSET_RMS: lambda dims, eps, bias: L.OffsetRMSNorm(dims, eps=eps),  # offset: _norm_module
})


def _norm_module(d: ArchDescriptor, a: UniversalArgs, where: str, eps: float | None = None):
    """The row's norm for a block slot (a NormSlot value) or "final"; offset_rms takes its offset,
    a slot_eps slot its own eps, the final norm final_kind when set."""
    kind = d.norm.final_kind if where == "final" and d.norm.final_kind else d.norm.kind
    if eps is None:
        eps = a.fields[d.norm.slot_eps[where]] if where in d.norm.slot_eps else a.eps
    norm = _NORMS[kind](a.hidden, eps, a.norm_bias)
    if d.norm.kind is NormKind.OFFSET_RMS:
        norm.offset = d.norm.offsets.get(where, 1.0)
    return norm

# a block's norms stay whole on every rank (they see the full hidden state)
_NORM_CLASSES = (nn.RMSNorm, nn.LayerNorm, L.GemmaRMSNorm, L.OffsetRMSNorm)

_RESIDUAL = exhaustive(Residual, {
    Residual.PLAIN: lambda x, r, s: x + r,
    Residual.SCALED: lambda x, r, s: x + r * s,
    Residual.CLIP_F16: lambda x, r, s: L.clip_residual(x, r),
})


class Holder(nn.Module):
    """A module that only holds the block's op one level down, as mlx-lm's does (exaone's
    `attn.attention`: `names.attn` dotted); it is never called, and its tensor-parallel split is
    its child's."""

    def shard(self, group, where: str) -> None:
        for name, module in self.children().items():
            module.shard(group, where=f"{where}.{name}")


class Block(nn.Module):
    def __getitem__(self, key):
        # a dotted name (names.attn "attn.attention") reads through its Holder
        if isinstance(key, str) and "." in key:
            outer, _, inner = key.partition(".")
            return super().__getitem__(outer)[inner]
        return super().__getitem__(key)

    def __init__(self, a: UniversalArgs, d: ArchDescriptor, spec: LayerSpec):
        super().__init__()
        self._d, self._n = d, d.names
        self._parallel = a.parallel
        self._residual_scale = a.residual_scale
        self._residual = _RESIDUAL[d.block.residual]
        self.use_sliding = spec.sliding  # mlx-lm's llama/ministral3 attribute
        self.mixer_kind = spec.mixer
        self._beside = spec.mixer is not MixerKind.ATTENTION and d.hybrid.block is HybridBlock.PARALLEL
        if spec.mixer is MixerKind.ATTENTION:
            self._mixer_name = d.names.attn
            attn = (Attention(a, d, spec) if d.mla is None else
                    mla_attention(a.fields, d.mla, a.model_type, a.hidden, a.n_heads, a.attn_bias))
            outer, _, inner = d.names.attn.partition(".")
            if inner:  # exaone: the attention one level down, in a Holder
                setattr(self, outer, Holder())
                setattr(self[outer], inner, attn)
            else:
                setattr(self, outer, attn)
        else:  # a hybrid's recurrent layer: the row's mixer, called with the ssm mask
            self._mixer_name = d.hybrid.name
            setattr(self, d.hybrid.name, MIXERS[spec.mixer](a, d.hybrid.mixer_knobs(), spec.index))
            if self._beside:  # falcon_h1: attention beside the mixer
                setattr(self, d.names.attn, Attention(a, d, spec))
        # the MoE block on the layers the row's moe rule picks, else the dense MLP
        self._mlp_name = (d.moe.names.block or d.names.mlp) if spec.moe else d.names.mlp
        setattr(self, self._mlp_name, MoEBlock(a, d, spec.index, spec.swiglu_limits) if spec.moe
                else MLP(a, d, width=spec.width, limit=spec.swiglu_limits[1]))
        self._cla = d.layers.kv_share is not None
        slots = d.block.norm_slots(a.parallel)
        self._norm_names = d.names.norms
        if spec.mixer is not MixerKind.ATTENTION and d.hybrid.mixer_block is not None:
            # the mixer layers' own norms (olmo_hybrid: pre-norm, the attention layers post-norm)
            slots, self._norm_names = BLOCK_SLOTS[d.hybrid.mixer_block], d.hybrid.mixer_norms
        self._slots = frozenset(slots)  # a tuple would join the module tree
        for slot in slots:
            norm = _norm_module(d, a, slot.value)
            if norm is not None:
                setattr(self, self._norm_names.of(slot), norm)

    def _norm(self, slot: NormSlot, x):
        if slot not in self._slots:
            return x
        if self._d.norm.kind is NormKind.FUNCTIONAL_RMS:
            return L.rms_norm_no_weight(x)
        return self[self._norm_names.of(slot)](x)

    def _add(self, x, r):
        return self._residual(x, r, self._residual_scale)

    def __call__(self, x, mask=None, cache=None, attn_scale=None, kv_states=None):
        attn, mlp = self[self._mixer_name], self[self._mlp_name]
        if self._beside:
            # HybridBlock.PARALLEL: mask (ssm, attention), cache a CacheList(mixer's, attention's)
            h = self._norm(NormSlot.PRE_ATTN, x)
            mc, ac = (None, None) if cache is None else (cache[0], cache[1])
            h = x + attn(h, mask[0], mc) + self[self._n.attn](h, mask[1], ac, attn_scale)
            return self._add_mlp(h, mlp)
        if self.mixer_kind is not MixerKind.ATTENTION:
            r = attn(self._norm(NormSlot.PRE_ATTN, x), mask, cache)
            return self._add_mlp(self._add(x, self._norm(NormSlot.POST_ATTN, r)), mlp)
        if self._parallel:
            b = self._d.block
            h = self._norm(NormSlot.PRE_ATTN, x)
            attn_h = attn(h, mask, cache, attn_scale)
            ff_h = mlp(h if b.parallel_mlp_norm is ParallelMlpNorm.SHARED
                       else self._norm(NormSlot.PRE_MLP, x))
            if b.parallel_sum is ParallelSum.ATTN_FF_X:
                return attn_h + ff_h + x
            return x + attn_h + ff_h
        if self._cla:  # hunyuan: the block hands the k / v projections on, as mlx-lm's does
            r, kv_states = attn(self._norm(NormSlot.PRE_ATTN, x), mask, cache, attn_scale, kv_states)
        else:  # (an MLA row's attn_scale: the llama-4 query scale of mistral4, else None)
            r = attn(self._norm(NormSlot.PRE_ATTN, x), mask, cache, attn_scale)
        r = self._norm(NormSlot.POST_ATTN, r)
        out = self._add_mlp(self._add(x, r), mlp)
        return (out, kv_states) if self._cla else out

    def _add_mlp(self, h, mlp):
        r = mlp(self._norm(NormSlot.PRE_MLP, h))
        return self._add(h, self._norm(NormSlot.POST_MLP, r))


class SingleOpBlock(nn.Module):
    """A hybrid's one-op layer (HybridBlock.SINGLE: mamba2, nemotron_h): x + op(norm(x)), the op
    the row's mixer, the attention or the MLP, held as the `hybrid.name` attribute."""

    def __init__(self, a: UniversalArgs, d: ArchDescriptor, spec: LayerSpec):
        super().__init__()
        h = d.hybrid
        self.use_sliding = spec.sliding
        self.mixer_kind = spec.mixer
        self._ffn = spec.ffn_only
        self._mixer_name, self._norm_name = h.name, d.names.norms.pre_attn
        eps = a.eps if h.norm_eps is None else h.norm_eps
        setattr(self, self._norm_name, _NORMS[d.norm.kind](a.hidden, eps, a.norm_bias))
        if spec.ffn_only:  # the MoE block where the row's moe rule picks the layer
            op = (MoEBlock(a, d, spec.index, spec.swiglu_limits) if spec.moe
                  else MLP(a, d, limit=spec.swiglu_limits[1]))
        elif spec.mixer is MixerKind.ATTENTION:
            op = Attention(a, d, spec)
        else:
            op = MIXERS[spec.mixer](a, h.mixer_knobs(), spec.index)
        setattr(self, h.name, op)

    def __call__(self, x, mask=None, cache=None, attn_scale=None):
        op, h = self[self._mixer_name], self[self._norm_name](x)
        if self._ffn:
            return x + op(h)
        if self.mixer_kind is MixerKind.ATTENTION:
            return x + op(h, mask, cache, attn_scale)
        return x + op(h, mask, cache)


def _place(owner: nn.Module, name: str, child) -> None:
    """Set `child` at `name`, a dotted name one level down in a module of its own (plamo's
    layers.layers, phixtral's embd.wte)."""
    outer, _, inner = name.partition(".")
    if inner:
        if outer not in owner:
            setattr(owner, outer, nn.Module())
        setattr(owner[outer], inner, child)
    else:
        setattr(owner, outer, child)


class Backbone(nn.Module):
    """mlx-lm's inner model (`model` / `transformer`): embedding, blocks, final norm."""

    def __getitem__(self, key):
        # a dotted name (names.layers "layers.layers": plamo) reads through its holder
        if isinstance(key, str) and "." in key:
            outer, _, inner = key.partition(".")
            return super().__getitem__(outer)[inner]
        return super().__getitem__(key)

    def __init__(self, a: UniversalArgs, d: ArchDescriptor):
        super().__init__()
        n = d.names
        _place(self, n.embed, nn.Embedding(a.vocab, a.hidden))
        if d.positions is not None:  # gpt2's wpe
            setattr(self, d.positions.name, nn.Embedding(a.fields[d.positions.size], a.hidden))
        single = d.hybrid is not None and d.hybrid.block is HybridBlock.SINGLE
        blocks = [(SingleOpBlock if single else Block)(a, d, spec) for spec in a.layers]
        _place(self, n.layers, blocks)  # (plamo: model.layers.layers.N)
        if n.final_norm is not None and not d.head.holds_norm:
            norm = _norm_module(d, a, "final")
            if norm is not None:
                setattr(self, n.final_norm, norm)
        if d.head.in_root:
            setattr(self, n.head, nn.Linear(a.hidden, a.vocab, bias=bool(get(a.fields, d.head.bias, a.model_type))))


class UniversalDense(nn.Module):
    """A dense decoder for any descriptor in `table.DESCRIPTORS`, parameter tree == mlx-lm's."""

    _tensor_group = None  # set by shard()
    _vocab_group = None  # set by shard() where the head splits its vocabulary (HeadKnobs.split)

    def __init__(self, args: UniversalArgs, descriptor: ArchDescriptor,
                 config: Any = None, raw_config: Optional[Mapping] = None):
        super().__init__()
        d, n = descriptor, descriptor.names
        self.descriptor = d
        self.args = args
        self.config = config  # mlxbun.config.TextConfig when known
        self.raw_config = MappingProxyType(dict(raw_config or {}))
        self.profile = None
        self._tied = args.tie
        if n.wrapper is not None:  # a VLM wrapper (qwen3_5): Model.<wrapper> holds root and head
            setattr(self, n.wrapper, nn.Module())
        self.text_model[n.root] = Backbone(args, d)  # an item: mamba2's root is named like the property
        if not d.head.in_root and (not args.tie or d.head.always):
            head_bias = bool(get(args.fields, d.head.bias, args.model_type))
            linear = nn.Linear(args.hidden, args.vocab, bias=head_bias)
            if d.head.holds_norm:  # phixtral: Model.lm_head holds the final norm and the linear
                setattr(self.text_model, n.head, nn.Module())
                setattr(self.text_model[n.head], n.final_norm, _norm_module(d, args, "final"))
                setattr(self.text_model[n.head], d.head.holds_norm, linear)
            else:
                setattr(self.text_model, n.head, linear)
        # mlx-lm's cache list leaves out the one-op MLP / MoE layers (nemotron_h's - and E): layer
        # i's cache is cache[_cache_idx[i]]; mlx-lm takes each mask from the cache of the first
        # layer of its kind
        cached = [s for s in args.layers if not s.ffn_only]
        slots = iter(range(len(cached)))
        self._cache_idx = None if len(cached) == len(args.layers) else [
            None if s.ffn_only else next(slots) for s in args.layers]
        attends = [s.sliding if s.mixer is MixerKind.ATTENTION else None for s in cached]
        self._full_idx = attends.index(False) if False in attends else None
        self._swa_idx = attends.index(True) if True in attends else None
        recurrent = [s.mixer is not MixerKind.ATTENTION for s in cached]
        self._ssm_idx = recurrent.index(True) if any(recurrent) else None
        self._parallel_hybrid = d.hybrid is not None and d.hybrid.block is HybridBlock.PARALLEL
        self._indexed = d.mla is not None and d.mla.kind is MlaKind.ABSORBED_INDEXED

    def _own_tree(self, args: UniversalArgs, descriptor: ArchDescriptor, config: Any,
                  raw_config: Optional[Mapping], *, tied: bool, ssm_idx: Optional[int] = None) -> None:
        """The start of a subclass that builds its own module tree (loader._GRAPHS): nn.Module's init
        and this class's bookkeeping: one cache per layer, the full-attention mask from cache[0] (from
        cache[ssm_idx] instead for an all-recurrent row), no wrapper; the subclass adjusts the rest."""
        nn.Module.__init__(self)
        self.descriptor, self.args, self.config = descriptor, args, config
        self.raw_config = MappingProxyType(dict(raw_config or {}))
        self.profile = None
        self._tied = tied
        self._cache_idx, self._swa_idx, self._ssm_idx = None, None, ssm_idx
        self._full_idx = 0 if ssm_idx is None else None
        self._parallel_hybrid = self._indexed = False

    # ------------------------------------------------------------- structure

    @property
    def model_type(self) -> str:
        return self.descriptor.model_type

    @property
    def text_model(self) -> nn.Module:
        """The module holding root and head: the wrapper's (qwen3_5: language_model), else self."""
        wrapper = self.descriptor.names.wrapper
        return self if wrapper is None else self[wrapper]

    @property
    def backbone(self) -> Backbone:
        return self.text_model[self.descriptor.names.root]

    @property
    def layers(self) -> list:
        return self.backbone[self.descriptor.names.layers]

    @property
    def attention_sinks(self) -> bool:
        """Whether attention adds per-head sink logits (generation refuses quantized KV for them)."""
        return self.descriptor.sinks

    @property
    def latent_kv(self) -> bool:
        """Whether the cache holds an MLA latent and rope key (deepseek_v3): its attention reads the
        rope key as an array, so uniform quantized KV cannot run (nor in mlx-lm)."""
        return self.descriptor.mla is not None and self.descriptor.mla.kind is not MlaKind.EXPANDED

    @property
    def tied(self) -> bool:
        return self._tied

    def tie_to_embedding(self) -> None:
        """gemma3_text: no lm_head in the checkpoint means a tied head (mlx-lm's sanitize)."""
        if self.descriptor.names.head in self.text_model:
            self.text_model.pop(self.descriptor.names.head)
        self._tied = True

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    @property
    def cache_layers(self) -> list[int]:
        """The model layer each entry of `make_cache()`'s list belongs to (nemotron_h's list skips
        its MLP / MoE layers, as mlx-lm's does; elsewhere entry i is layer i)."""
        if self._cache_idx is None:
            return list(range(len(self.args.layers)))
        return [i for i, j in enumerate(self._cache_idx) if j is not None]

    def make_cache(self, max_kv_size: Optional[int] = None, **kv_options: Any) -> list:
        """mlx-lm's caches: the file's own make_cache, else make_prompt_cache's default."""
        if kv_options:
            raise MlxbunError(f"{self.model_type}: cache options not supported by the universal "
                              f"graph: {', '.join(sorted(kv_options))}")
        if self.descriptor.layers.make_cache is MakeCache.ROTATING_SLIDING:
            # mlx-lm's file ignores max_kv_size here; mlxbun bounds the full-attention layers too.
            w = self.args.sliding_window
            full = (lambda: RotatingKVCache(max_size=max_kv_size, keep=4)) if max_kv_size else KVCache
            return [RotatingKVCache(max_size=w) if s.sliding else full() for s in self.args.layers]
        if self._ssm_idx is not None:  # a hybrid: mlx-lm's make_cache (max_kv_size bounds attention)
            def attn():
                return RotatingKVCache(max_size=max_kv_size, keep=4) if max_kv_size else KVCache()
            if self._parallel_hybrid:  # falcon_h1: CacheList(ArraysCache, KVCache) per layer
                return [CacheList(ArraysCache(size=layer[layer._mixer_name].cache_slots), attn())
                        for layer in self.layers]
            return [ArraysCache(size=layer[layer._mixer_name].cache_slots)
                    if spec.mixer is not MixerKind.ATTENTION else attn()
                    for layer, spec in zip(self.layers, self.args.layers) if not spec.ffn_only]
        if self._indexed:  # deepseek_v32's make_cache: the latent's and the indexer's caches
            if max_kv_size is not None:
                raise MlxbunError(f"{self.model_type}: max_kv_size is not supported (the indexer's top-k "
                                  "addresses the whole cache; mlx-lm's make_cache ignores max_kv_size)")
            return [CacheList(KVCache(), KVCache()) for _ in self.args.layers]
        if max_kv_size is not None:
            return [RotatingKVCache(max_size=max_kv_size, keep=4) for _ in self.args.layers]
        return [KVCache() for _ in self.args.layers]

    # ------------------------------------------------------------- tensor parallelism

    @property
    def tensor_group(self):
        """The `mx.distributed` group the graph is split across (None: not split)."""
        return self._tensor_group

    def shard(self, group) -> None:
        """Split every layer's attention / mixer and MLP / MoE across `group`, as mlx-lm's
        Model.shard does (embedding and norms replicated; the head too, but where the row's
        `head.split` splits an untied one by vocabulary, as mlx-lm's qwen3_5); each op module
        splits itself (`shard(group, where)`), as does a block with its own `shard` (gemma4's),
        and one that cannot raises ShardingError naming its path. A group of one changes
        nothing. A failed split leaves the graph partly split: discard it."""
        if self.tensor_group is not None:
            raise ShardingError(f"{self.model_type}: already split across {self.tensor_group.size()} ranks")
        if group.size() == 1:
            return
        n = self.descriptor.names
        prefix = f"{n.wrapper}.{n.root}" if n.wrapper else n.root
        head = None
        if self.descriptor.head.split and n.head in self.text_model:  # checked before any layer splits
            where = f"{n.wrapper}.{n.head}" if n.wrapper else n.head
            head = shard_linear(self.text_model[n.head], ALL_TO_SHARDED, group, where=where)
        for i, layer in enumerate(self.layers):
            if hasattr(layer, "shard"):
                layer.shard(group, where=f"{prefix}.{n.layers}.{i}")
                continue
            for name, module in layer.children().items():
                if not isinstance(module, nn.Module) or isinstance(module, _NORM_CLASSES):
                    continue
                where = f"{prefix}.{n.layers}.{i}.{name}"
                if not hasattr(module, "shard"):
                    raise ShardingError(f"{self.model_type}: {where} ({type(module).__name__}) has no "
                                        "tensor-parallel split in mlxbun")
                module.shard(group, where=where)
        if head is not None:
            self.text_model[n.head] = head
            self._vocab_group = group
        self._tensor_group = group

    def layers_tap(self, paths: Any = None):
        return capture(self, paths)

    # ------------------------------------------------------------- forward

    def embed_tokens(self, ids: mx.array) -> mx.array:
        """The ids' rows of the embedding table (before any embed scale)."""
        return self.backbone[self.descriptor.names.embed](ids)

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None,
                       input_embeddings: Optional[mx.array] = None) -> mx.array:
        """The final-normed hidden state [B, L, H] that feeds the head. `input_embeddings`
        [B, L, H]: the rows to run instead of the ids' embeddings (a VLM's merged soft tokens,
        mlxbun.towers), scaled as the embeddings would be (mlx-lm's input_embeddings)."""
        d, a, n, root = self.descriptor, self.args, self.descriptor.names, self.backbone
        h = root[n.embed](ids) if input_embeddings is None else input_embeddings
        if d.positions is not None:  # gpt2's: arange(L) + the first cache's offset, as an array
            c0 = None if cache is None else cache[0]
            offset = mx.array(0 if c0 is None else c0.offset)
            h = h + root[d.positions.name](mx.arange(ids.shape[1]) + offset[..., None])
        es = d.embed_scale
        if es is EmbedScale.SQRT_HIDDEN:
            h = h * (a.fields["hidden_size"] ** 0.5)
        elif es is EmbedScale.SQRT_HIDDEN_BF16:
            h = h * mx.array(a.fields["hidden_size"] ** 0.5, mx.bfloat16).astype(h.dtype)
        elif es is EmbedScale.SQRT_HIDDEN_MUP:
            if a.fields["mup_enabled"]:
                h = h * math.sqrt(a.fields["hidden_size"])
        elif es is not None:
            h = h * a.embed_scale
        if d.embed_norm:  # True: nanochat's 1e-5; a field: its eps (muse_glimmer)
            h = L.rms_norm_no_weight(h) if d.embed_norm is True else L.rms_norm_no_weight(h, a.fields[d.embed_norm])

        blocks = root[n.layers]
        attn_scale = None
        if a.llama4 is not None:
            offset = 0 if cache is None else cache[0].offset
            attn_scale = R.llama4_attn_scale(ids.shape[1], offset, *a.llama4).astype(h.dtype)
        if cache is None:
            cache = [None] * len(blocks)
        fa_mask = swa_mask = None
        if self._full_idx is not None:
            c = cache[self._full_idx]
            if self._indexed and c is not None:  # deepseek_v32: the mask from the latent's cache
                c = c[0]
            fa_mask = create_attention_mask(h, c, return_array=d.layers.mask_array)
        if self._swa_idx is not None:
            swa_mask = create_attention_mask(h, cache[self._swa_idx],
                                             window_size=a.sliding_window + d.layers.mask_window_extra)
        if self._parallel_hybrid:  # falcon_h1: both masks from layer 0's CacheList children
            c = (None, None) if cache[0] is None else cache[0]
            ssm_mask = (create_ssm_mask(h, c[0]),
                        create_attention_mask(h, c[1], return_array=d.layers.mask_array))
        else:
            ssm_mask = None if self._ssm_idx is None else create_ssm_mask(h, cache[self._ssm_idx])
        if self._cache_idx is not None:  # layer by layer (the one-op MLP / MoE layers hold none)
            cache = [None if j is None else cache[j] for j in self._cache_idx]
        shared_kv = None
        for layer, spec, c in zip(blocks, a.layers, cache):
            mask = ssm_mask if spec.mixer is not MixerKind.ATTENTION else (
                swa_mask if layer.use_sliding else fa_mask)
            if d.layers.kv_share is None:
                h = layer(h, mask, c, attn_scale)
                continue
            if spec.kv_proj:  # KVShare.CLA: a projecting layer starts a new sharing group
                shared_kv = None
            out = layer(h, mask, c, attn_scale, shared_kv)
            # a block the layer-skip drafter skips is the identity: h alone (the skipped blocks
            # are the last ones, so no later layer reads the k / v they would have passed on)
            h, shared_kv = out if isinstance(out, tuple) else (out, shared_kv)

        if d.norm.kind is NormKind.FUNCTIONAL_RMS:
            return L.rms_norm_no_weight(h)
        if d.head.holds_norm:  # phixtral: the head module's own norm
            return self.text_model[n.head][n.final_norm](h)
        return root[n.final_norm](h)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        d, a, n = self.descriptor, self.args, self.descriptor.names
        if d.head.in_root:
            out = self.backbone[n.head](h)
        elif self._tied:
            embed = self.backbone[n.embed]
            out = embed.as_linear(h) if d.head.tied_op is TiedOp.AS_LINEAR else h @ embed.weight.T
        else:
            if a.head_pre_divide is not None:
                h = h / a.head_pre_divide
            head = self.text_model[n.head]
            out = (head[d.head.holds_norm] if d.head.holds_norm else head)(h)
            if self._vocab_group is not None:  # each rank's slice of the vocabulary, gathered
                out = gather_last_axis(out, self._vocab_group)
        if a.head_post is not None:
            op, value = a.head_post
            out = out / value if op is PostOp.DIV else out * value
        if a.final_softcap is FinalSoftcap.COMPILED:
            out = L.softcap_compiled(out)
        elif a.final_softcap_value is not None:
            out = L.logit_softcap(out, a.final_softcap_value)
        return out

    def __call__(self, ids: mx.array, cache: Optional[list] = None, **media: Any) -> mx.array:
        if media:  # a VLM's image / audio inputs: refused by name (media.py)
            refuse_media(self.model_type, self.descriptor.names.wrapper, media)
        return self.logits_from_hidden(self.forward_hidden(ids, cache))
