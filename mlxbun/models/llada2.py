"""LLaDA2-MoE (`model_type: "llada2_moe"`), a masked-diffusion MoE LM, ported op-for-op from
mlx-vlm 0.7.10 `mlx_vlm/models/llada2_moe/language.py` (the L2 oracle: mlx-lm has no such arch).

What the arch is: a fused `query_key_value` projection split into GQA q/k/v, per-head
QK-RMSNorm, partial RoPE (`rotary_dim` = head_dim * `partial_rotary_factor`), BIDIRECTIONAL
attention (no causal mask: a diffusion LM sees the whole canvas it is given, plus whatever the
cache holds), dense MLP for the first `first_k_dense_replace` layers, then a DeepSeek-V3-style
MoE (sigmoid or softmax scores in float32, expert bias for selection only, group-limited top-k,
normalized and scaled weights) plus shared experts.

Same ops, order and dtypes as mlx-vlm, including its MoE geometry: for 1 < L <= 8 positions
mlx-vlm's SwitchGLU runs each position on its own (`tokenwise`, its decode-equivalent path);
longer inputs go through one gather_mm, sorted by expert once 64+ routes are selected.

The module tree uses the Hugging Face checkpoint names (`model.word_embeddings`,
`model.layers.N.attention.query_key_value`, ..., `lm_head`), so `sanitize` only stacks the
per-expert projections (`mlp.experts.E.*`) into `mlp.switch_mlp.*` as mlx-vlm does; a
checkpoint converted by mlx-vlm (`language_model.` prefix, stacked experts) loads too.
Floating-point weights only: a quantized checkpoint is refused by name.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.cache.kv import KVCache
from mlxbun.errors import ConfigError, LoadError, MlxbunError, UnsupportedModelError
from mlxbun.models.base import scaled_dot_product_attention
from mlxbun.models.layers import swiglu
from mlxbun.models.switch_layers import SwitchLinear, gather_sort, scatter_unsort
from mlxbun.models.taps import capture
from mlxbun.weight_audit import DropRule, WeightAudit
from mlxbun.weights import name_list, read_index

__all__ = ["LLaDA2Args", "LLaDA2Model", "load_llada2", "MODEL_TYPE"]

MODEL_TYPE = "llada2_moe"
DECODE_BLOCK_SIZE = 8  # mlx_vlm/models/linear.py: up to this many positions go tokenwise


# ----------------------------------------------------------------- config

_CHECKS = {
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
}


@dataclass(frozen=True)
class LLaDA2Args:
    """mlx-vlm's `ModelConfig` fields and defaults (the released LLaDA2.0-mini sizes)."""

    vocab_size: int = 157184
    hidden_size: int = 2048
    intermediate_size: int = 5120
    num_hidden_layers: int = 20
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: Optional[int] = None
    use_qkv_bias: bool = False
    use_qk_norm: bool = True
    use_bias: bool = False
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    rope_theta: float = 600000
    partial_rotary_factor: float = 0.5
    rotary_dim: Optional[int] = None
    num_experts: Optional[int] = 256
    num_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 8
    topk_group: int = 4
    routed_scaling_factor: float = 2.5
    moe_intermediate_size: int = 512
    first_k_dense_replace: int = 1
    pad_token_id: int = 156892
    eos_token_id: Any = None  # int or list of ints; defaults to pad_token_id (mlx-vlm)
    mask_token_id: int = 156895
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"

    @classmethod
    def from_config(cls, config: Mapping[str, Any], source: str = "config.json") -> "LLaDA2Args":
        """Read the known keys (mlx-vlm defaults for absent ones), checked, with errors naming
        `source` and the key."""
        if config.get("model_type") != MODEL_TYPE:
            raise UnsupportedModelError(
                f"{source}: model_type {config.get('model_type')!r} is not {MODEL_TYPE!r}")
        for key in ("quantization", "quantization_config"):
            if config.get(key):
                raise UnsupportedModelError(
                    f"{source}: key {key!r}: the mlxbun {MODEL_TYPE} graph loads floating-point "
                    f"weights only")
        if config.get("rope_scaling"):
            raise UnsupportedModelError(
                f"{source}: key 'rope_scaling' = {config['rope_scaling']!r}: {MODEL_TYPE} "
                f"implements plain partial RoPE only")
        if config.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(
                f"{source}: key 'hidden_act' = {config['hidden_act']!r}: {MODEL_TYPE} uses silu")
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in config:
                continue
            v = config[f.name]
            if v is None and (f.type.startswith("Optional[") or f.type == "Any"):
                kw[f.name] = None  # e.g. num_experts null: every layer dense, as mlx-vlm
                continue
            want = f.type.replace("Optional[", "").rstrip("]")  # annotations are strings here
            if not _CHECKS.get(want, lambda _: True)(v):
                raise ConfigError(f"{source}: key {f.name!r} must be {want}, got {type(v).__name__} {v!r}")
            kw[f.name] = v
        args = cls(**kw)
        args._check(source)
        return args

    def _check(self, source: str) -> None:
        def bad(key: str, why: str) -> ConfigError:
            return ConfigError(f"{source}: key {key!r} = {getattr(self, key)!r}: {why}")

        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size"):
            if getattr(self, key) < 1:
                raise bad(key, "must be positive")
        if self.num_attention_heads % self.num_key_value_heads:
            raise bad("num_key_value_heads", "must divide num_attention_heads")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise bad("hidden_size", "must be divisible by num_attention_heads (no head_dim given)")
        if not 0 <= self.rope_dim <= self.dim_per_head:
            raise bad("partial_rotary_factor", f"rotary dim {self.rope_dim} outside 0..head_dim")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise bad("mask_token_id", f"outside the vocabulary (size {self.vocab_size})")
        eos = self.eos_token_ids
        if not eos or not all(_CHECKS["int"](t) and 0 <= t < self.vocab_size for t in eos):
            raise bad("eos_token_id", "must be a token id or a non-empty list of token ids")
        if self.num_experts is None:
            return
        if self.score_function not in ("sigmoid", "softmax"):
            raise UnsupportedModelError(
                f"{source}: key 'score_function' = {self.score_function!r}: sigmoid or softmax")
        if self.num_experts < 1 or self.n_group < 1 or self.num_experts % self.n_group:
            raise bad("n_group", f"must divide num_experts ({self.num_experts})")
        if self.num_experts // self.n_group < 2:
            raise bad("n_group", "each expert group needs 2+ experts (groups are scored by their top 2)")
        if not 1 <= self.topk_group <= self.n_group:
            raise bad("topk_group", f"must be in 1..n_group ({self.n_group})")
        if not 1 <= self.num_experts_per_tok <= self.topk_group * (self.num_experts // self.n_group):
            raise bad("num_experts_per_tok", "must be in 1..(experts in the kept groups)")
        if self.moe_intermediate_size < 1:
            raise bad("moe_intermediate_size", "must be positive")

    @property
    def dim_per_head(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def rope_dim(self) -> int:
        if self.rotary_dim is not None:
            return self.rotary_dim
        return int(self.dim_per_head * self.partial_rotary_factor)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.pad_token_id if self.eos_token_id is None else self.eos_token_id
        return tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)


# ----------------------------------------------------------------- ops (mlx-vlm's)


def _topk(x: mx.array, k: int, axis: int = -1) -> tuple[mx.array, mx.array]:
    """mlx-vlm `_topk`: argpartition, then sort the k values descending."""
    indices = mx.argpartition(-x, kth=k - 1, axis=axis)[..., :k]
    indices = mx.stop_gradient(indices)
    values = mx.take_along_axis(x, indices, axis=axis)
    order = mx.argsort(-values, axis=axis)
    order = mx.stop_gradient(order)
    return mx.take_along_axis(values, order, axis=axis), mx.take_along_axis(indices, order, axis=axis)


def _score(scores: mx.array, func: str) -> mx.array:
    if func == "sigmoid":
        return mx.sigmoid(scores)
    return mx.softmax(scores, axis=-1, precise=True)


# ----------------------------------------------------------------- modules


class MLP(nn.Module):
    """Dense SwiGLU MLP (the first dense layers and the shared experts)."""

    def __init__(self, a: LLaDA2Args, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, a.hidden_size, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


class Gate(nn.Module):
    """Router: float32 logits, scores, group-limited top-k on scores + expert bias."""

    def __init__(self, a: LLaDA2Args):
        super().__init__()
        self.top_k = a.num_experts_per_tok
        self.num_experts = a.num_experts
        self.n_group = a.n_group
        self.topk_group = a.topk_group
        self.routed_scaling_factor = a.routed_scaling_factor
        self.norm_topk_prob = a.norm_topk_prob
        self.score_function = a.score_function
        self.weight = mx.zeros((a.num_experts, a.hidden_size))
        self.expert_bias = mx.zeros((a.num_experts,))

    def _group_limited_topk(self, scores: mx.array):
        group_size = self.num_experts // self.n_group
        group_scores = scores.reshape(*scores.shape[:-1], self.n_group, group_size)
        group_scores = _topk(group_scores, k=2, axis=-1)[0].sum(axis=-1)
        group_idx = _topk(group_scores, k=self.topk_group, axis=-1)[1]
        expert_groups = mx.arange(self.num_experts, dtype=group_idx.dtype) // group_size
        group_mask = (expert_groups[None, :] == group_idx[..., None]).any(axis=-2)
        masked_scores = mx.where(group_mask, scores, mx.finfo(scores.dtype).min)
        return _topk(masked_scores, k=self.top_k, axis=-1)

    def __call__(self, x: mx.array):
        logits = x.astype(mx.float32) @ self.weight.T.astype(mx.float32)
        scores = _score(logits, self.score_function)
        _, topk_idx = self._group_limited_topk(scores + self.expert_bias)
        topk_weight = mx.take_along_axis(scores, topk_idx, axis=-1)
        if self.top_k > 1 and self.norm_topk_prob:
            topk_weight = topk_weight / (topk_weight.sum(axis=-1, keepdims=True) + 1e-20)
        topk_weight = topk_weight * self.routed_scaling_factor
        return topk_idx.astype(mx.int32), topk_weight.astype(x.dtype)


def _tokenwise(operation, x, *args, axis=1):
    """mlx_vlm/models/linear.py `tokenwise`: the same reduction geometry at each position."""

    def at(value, index):
        slices = [slice(None)] * value.ndim
        slices[axis] = slice(index, index + 1)
        return mx.contiguous(value[tuple(slices)])

    outputs = [operation(at(x, i), *(at(a, i) for a in args)) for i in range(x.shape[axis])]
    return mx.concatenate(outputs, axis=axis)


class SwitchGLU(nn.Module):
    """mlx-vlm's SwitchGLU on float weights (its Metal/quantized fast paths do not apply)."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int):
        super().__init__()
        self.gate_proj = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.up_proj = SwitchLinear(input_dims, hidden_dims, num_experts)
        self.down_proj = SwitchLinear(hidden_dims, input_dims, num_experts)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if not self.training and x.ndim == 3 and 1 < x.shape[1] <= DECODE_BLOCK_SIZE:
            return _tokenwise(self, x, indices)
        x = mx.expand_dims(x, (-2, -3))
        do_sort = indices.size >= 64
        idx, inv_order = indices, None
        if do_sort:
            x, idx, inv_order = gather_sort(x, indices)
        if self.training:
            idx = mx.stop_gradient(idx)
        x_up = self.up_proj(x, idx, sorted_indices=do_sort)
        x_gate = self.gate_proj(x, idx, sorted_indices=do_sort)
        x = self.down_proj(swiglu(x_gate, x_up), idx, sorted_indices=do_sort)
        if do_sort:
            x = scatter_unsort(x, inv_order, indices.shape)
        return x.squeeze(-2)


class SparseMoeBlock(nn.Module):
    def __init__(self, a: LLaDA2Args):
        super().__init__()
        self.gate = Gate(a)
        self.switch_mlp = SwitchGLU(a.hidden_size, a.moe_intermediate_size, a.num_experts)
        if a.num_shared_experts:
            self.shared_experts = MLP(a, a.moe_intermediate_size * a.num_shared_experts)

    def __call__(self, x: mx.array) -> mx.array:
        inds, scores = self.gate(x)
        y = self.switch_mlp(x, inds)
        y = (y * scores[..., None]).sum(axis=-2)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


class Attention(nn.Module):
    """Fused QKV, per-head QK-RMSNorm, partial RoPE at the cache offset, no causal mask."""

    def __init__(self, a: LLaDA2Args):
        super().__init__()
        self.num_heads = a.num_attention_heads
        self.num_key_value_heads = a.num_key_value_heads
        self.head_dim = a.dim_per_head
        self.rope_dim = a.rope_dim
        self.rope_theta = a.rope_theta
        self.scale = self.head_dim**-0.5
        self.query_key_value = nn.Linear(
            a.hidden_size, (self.num_heads + 2 * self.num_key_value_heads) * self.head_dim,
            bias=a.use_qkv_bias)
        if a.use_qk_norm:
            self.query_layernorm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
            self.key_layernorm = nn.RMSNorm(self.head_dim, eps=a.rms_norm_eps)
        self.dense = nn.Linear(self.num_heads * self.head_dim, a.hidden_size, bias=a.use_bias)

    def _rope(self, x: mx.array, offset: int) -> mx.array:
        rot = mx.fast.rope(x[..., : self.rope_dim], self.rope_dim, traditional=False,
                           base=self.rope_theta, scale=1.0, offset=offset)
        return mx.concatenate([rot, x[..., self.rope_dim:]], axis=-1)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        B, L, _ = x.shape
        qkv = self.query_key_value(x).reshape(
            B, L, self.num_heads + 2 * self.num_key_value_heads, self.head_dim)
        queries, keys, values = mx.split(
            qkv, [self.num_heads, self.num_heads + self.num_key_value_heads], axis=-2)
        if "query_layernorm" in self:
            queries = self.query_layernorm(queries)
            keys = self.key_layernorm(keys)
        queries = queries.transpose(0, 2, 1, 3)
        keys = keys.transpose(0, 2, 1, 3)
        values = values.transpose(0, 2, 1, 3)
        if self.rope_dim > 0:
            offset = cache.offset if cache is not None else 0
            queries, keys = self._rope(queries, offset), self._rope(keys, offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale,
                                           mask=mask)
        return self.dense(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class DecoderLayer(nn.Module):
    def __init__(self, a: LLaDA2Args, layer_idx: int):
        super().__init__()
        self.attention = Attention(a)
        if a.num_experts is not None and layer_idx >= a.first_k_dense_replace:
            self.mlp = SparseMoeBlock(a)
        else:
            self.mlp = MLP(a, a.intermediate_size)
        self.input_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        h = x + self.attention(self.input_layernorm(x), mask=mask, cache=cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, a: LLaDA2Args):
        super().__init__()
        self.word_embeddings = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = [DecoderLayer(a, i) for i in range(a.num_hidden_layers)]
        self.norm = nn.RMSNorm(a.hidden_size, eps=a.rms_norm_eps)


class LLaDA2Model(nn.Module):
    """The LLaDA2-MoE graph as a RuntimeModel. Attention is bidirectional over the cache and
    the ids given (`bidirectional = True`): what masked-diffusion decoding needs, and what an
    autoregressive loop must not use."""

    bidirectional = True

    def __init__(self, args: LLaDA2Args, raw_config: Optional[Mapping] = None, config: Any = None):
        super().__init__()
        self.args = args
        self.raw_config = MappingProxyType(dict(raw_config or {}))
        self.config = config if config is not None else self.raw_config
        self.profile = None
        self.model = Backbone(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def layers(self) -> list:
        return self.model.layers

    @property
    def mask_token_id(self) -> int:
        return self.args.mask_token_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.args.eos_token_ids

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def make_cache(self, **kv_options: Any) -> list:
        if kv_options:
            raise MlxbunError(f"{MODEL_TYPE}: cache options not supported: "
                              f"{', '.join(sorted(kv_options))}")
        return [KVCache() for _ in self.layers]

    def layers_tap(self, paths: Any = None):
        return capture(self, paths)

    def forward_hidden(self, ids: mx.array, cache: Optional[list] = None, mask=None) -> mx.array:
        h = self.model.word_embeddings(ids)
        if cache is None:
            cache = [None] * len(self.layers)
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask=mask, cache=c)
        return self.model.norm(h)

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.word_embeddings.as_linear(h)
        return self.lm_head(h)

    def __call__(self, ids: mx.array, cache: Optional[list] = None, mask=None) -> mx.array:
        return self.logits_from_hidden(self.forward_hidden(ids, cache, mask))

    # ------------------------------------------------------------- weights

    def sanitize(self, weights: Mapping[str, mx.array]) -> dict[str, mx.array]:
        """HF names -> this tree: drop mlx-vlm's `language_model.` prefix, stack per-expert
        projections into `switch_mlp` (mlx-vlm's sanitize), drop a tied checkpoint's head."""
        a = self.args
        w = {(k[len("language_model."):] if k.startswith("language_model.") else k): v
             for k, v in weights.items()}
        if a.num_experts is not None:
            for i in range(a.first_k_dense_replace, a.num_hidden_layers):
                prefix = f"model.layers.{i}.mlp"
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    names = [f"{prefix}.experts.{e}.{proj}.weight" for e in range(a.num_experts)]
                    if names[0] not in w:
                        continue
                    missing = [n for n in names if n not in w]
                    if missing:
                        raise LoadError(f"{prefix}: expert tensor(s) missing: {name_list(missing)}")
                    w[f"{prefix}.switch_mlp.{proj}.weight"] = mx.stack([w.pop(n) for n in names])
        if a.tie_word_embeddings:
            w.pop("lm_head.weight", None)
        return w


_DROP = (DropRule(r"rotary_emb\.inv_freq$", "rotary frequencies are recomputed"),)


def _read_json(file: Path, required: bool) -> dict:
    if not file.is_file():
        if required:
            raise ConfigError(f"{file}: not found")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def load_llada2(path) -> LLaDA2Model:
    """Load a `llada2_moe` checkpoint directory (config.json + safetensors) as an LLaDA2Model.

    generation_config.json's `eos_token_id` overrides config.json's, as mlx-vlm's loader does.
    Missing, unconsumed or misshapen tensors raise `LoadError` naming them.
    """
    path = Path(path)
    raw = _read_json(path / "config.json", required=True)
    gen = _read_json(path / "generation_config.json", required=False)
    if "eos_token_id" in gen:
        raw["eos_token_id"] = gen["eos_token_id"]
    args = LLaDA2Args.from_config(raw, str(path / "config.json"))
    model = LLaDA2Model(args, raw_config=raw)
    weights = model.sanitize(read_index(path).load())
    audit = WeightAudit(weights, _DROP)
    audit.expect_params(model.parameters(), dtype=False)
    report = audit.check()
    weights = {k: v for k, v in weights.items() if k not in report.dropped}
    wrong = [k for k, v in weights.items() if not mx.issubdtype(v.dtype, mx.floating)]
    if wrong:
        raise LoadError(f"weights in {path}: non-float tensor(s) for float parameters: {name_list(wrong)}")
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    mx.eval(model.parameters())
    model.audit = report
    return model
