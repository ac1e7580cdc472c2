"""DiffusionGemma (text): mlx-vlm 0.7.10's `models/diffusion_gemma` graph, op for op (L2).

The model is an encoder-decoder that shares one stack of layers:
- the ENCODER runs causally over the prompt (and, later, over each finished canvas) and
  writes keys/values into per-layer caches (a `KVCache` for full layers, a
  `RotatingKVCache(sliding_window)` for sliding layers), scaling each layer's output by the
  encoder's own `layer_scalar`;
- the DECODER runs bidirectionally over a fixed-length canvas of token ids, attending to the
  encoder's cached keys/values (read, never written) plus the canvas itself, with RoPE
  positions starting at the encoder length, and its own `layer_scalar`s.
Each layer: q/k/v norms (v without scale), attention scale 1.0, full layers reuse K as V,
then a dense GeGLU MLP and a top-k MoE in parallel, summed through their norms. The head is
the tied embedding with a compiled float32 tanh softcap. A self-conditioning MLP mixes the
previous step's soft embeddings into the canvas embeddings.

Everything numeric is transcribed from mlx-vlm (same ops, casts, python-float constants, the
same `mx.compile`d activations), so single encoder and decoder forwards are bit-identical.
The methods the diffusion engine drives keep mlx-vlm's names (`diffusion_prefill_cache`,
`diffusion_decoder_logits`, ...), so `mlxbun.diffusion` runs this graph or mlx-vlm's model.

Text only: a checkpoint's vision tower is dropped at load with its reason. Not ported:
padded batches (`attention_mask`), static prefix caches, quantized checkpoints.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import ConfigError, LoadError, UnsupportedModelError
from mlxbun.models.base import create_attention_mask, scaled_dot_product_attention
from mlxbun.models.rope import initialize_rope
from mlxbun.models.switch_layers import SwitchLinear, gather_sort, scatter_unsort

__all__ = [
    "DiffusionGemmaConfig",
    "DiffusionGemmaModel",
    "DiffusionGemmaTextConfig",
    "MODEL_TYPE",
    "TEXT_MODEL_TYPE",
    "config_from_dict",
    "load_config",
    "load_diffusion_gemma",
]

MODEL_TYPE = "diffusion_gemma"
TEXT_MODEL_TYPE = "diffusion_gemma_text"
FULL, SLIDING = "full_attention", "sliding_attention"


# ----------------------------------------------------------------------------- config


def _default_rope_parameters() -> dict:
    return {
        SLIDING: {"rope_type": "default", "rope_theta": 10000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
    }


@dataclass
class DiffusionGemmaTextConfig:
    """mlx-vlm's `TextConfig` (same fields and defaults: google/diffusiongemma-26B-A4B)."""

    model_type: str = TEXT_MODEL_TYPE
    vocab_size: int = 262144
    hidden_size: int = 2816
    intermediate_size: int = 2112
    moe_intermediate_size: int = 704
    num_hidden_layers: int = 30
    num_attention_heads: int = 16
    num_key_value_heads: int = 8
    num_global_key_value_heads: Optional[int] = 2
    head_dim: int = 256
    global_head_dim: int = 512
    hidden_activation: str = "gelu_pytorch_tanh"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    pad_token_id: int = 0
    eos_token_id: Any = 1
    bos_token_id: Optional[int] = 2
    tie_word_embeddings: bool = True
    rope_parameters: Optional[dict] = None
    attention_bias: bool = False
    attention_dropout: float = 0.0
    sliding_window: int = 1024
    layer_types: Optional[list] = None
    final_logit_softcapping: float = 30.0
    use_bidirectional_attention: Optional[str] = "vision"
    num_experts: int = 128
    top_k_experts: int = 8

    def __post_init__(self):
        # mlx-vlm's defaults: 5 sliding : 1 full, the last layer forced full (only when the
        # pattern is defaulted: an explicit layer_types list is taken as given).
        if self.layer_types is None:
            pattern = [SLIDING] * 5 + [FULL]
            self.layer_types = (pattern * (self.num_hidden_layers // len(pattern) + 1))[
                : self.num_hidden_layers
            ]
            if self.layer_types[-1] != FULL:
                self.layer_types[-1] = FULL
        if self.rope_parameters is None:
            self.rope_parameters = _default_rope_parameters()


@dataclass
class DiffusionGemmaConfig:
    """mlx-vlm's `ModelConfig` as its loader fills it (generation_config.json merged in)."""

    text_config: DiffusionGemmaTextConfig = field(default_factory=DiffusionGemmaTextConfig)
    vision_config: Optional[dict] = None  # kept raw: the text-only graph never builds it
    model_type: str = MODEL_TYPE
    boi_token_id: Optional[int] = 255999
    eoi_token_id: Optional[int] = 258882
    image_token_id: Optional[int] = 258880
    video_token_id: Optional[int] = None
    initializer_range: float = 0.02
    canvas_length: int = 256
    eos_token_id: Any = None
    generation_config: Optional[dict] = None
    dtype: Optional[str] = None


_TEXT_FIELDS = tuple(DiffusionGemmaTextConfig.__dataclass_fields__)
_TOP_FIELDS = tuple(f for f in DiffusionGemmaConfig.__dataclass_fields__ if f != "text_config")
_INT_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "global_head_dim",
    "max_position_embeddings", "sliding_window", "num_experts", "top_k_experts",
)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_text(t: DiffusionGemmaTextConfig, where: str) -> None:
    def bad(key, what):
        return ConfigError(f"{where}: text_config.{key} {what}, got {getattr(t, key)!r}")

    if t.model_type != TEXT_MODEL_TYPE:
        raise UnsupportedModelError(
            f"{where}: text_config.model_type is {t.model_type!r}; the DiffusionGemma graph "
            f"implements {TEXT_MODEL_TYPE!r}"
        )
    for key in _INT_KEYS:
        if not _is_int(getattr(t, key)) or getattr(t, key) <= 0:
            raise bad(key, "must be a positive integer")
    if t.num_global_key_value_heads is not None and (
        not _is_int(t.num_global_key_value_heads) or t.num_global_key_value_heads <= 0
    ):
        raise bad("num_global_key_value_heads", "must be a positive integer or null")
    if not 0 < t.top_k_experts <= t.num_experts:
        raise bad("top_k_experts", f"must be in 1..num_experts ({t.num_experts})")
    if not isinstance(t.layer_types, list) or len(t.layer_types) != t.num_hidden_layers:
        raise bad("layer_types", f"must list {t.num_hidden_layers} layer kinds")
    unknown = sorted({k for k in t.layer_types if k not in (FULL, SLIDING)})
    if unknown:
        raise bad("layer_types", f"may hold only {FULL!r} / {SLIDING!r} (unknown: {unknown})")
    # mlx-vlm computes tanh-GELU whatever the config says; refuse rather than diverge silently.
    if t.hidden_activation not in ("gelu_pytorch_tanh",):
        raise UnsupportedModelError(
            f"{where}: text_config.hidden_activation {t.hidden_activation!r} is not supported "
            "(DiffusionGemma uses 'gelu_pytorch_tanh')"
        )
    sc = t.final_logit_softcapping
    if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not math.isfinite(sc) or sc <= 0:
        raise bad("final_logit_softcapping", "must be a positive number")
    if not isinstance(t.rope_parameters, dict):
        raise bad("rope_parameters", "must be an object keyed by layer kind")
    for kind in set(t.layer_types):
        rp = t.rope_parameters.get(kind, {})
        rtype = (rp.get("type") or rp.get("rope_type", "default")) if isinstance(rp, dict) else rp
        if rtype not in ("default", "linear", "proportional"):
            raise UnsupportedModelError(
                f"{where}: text_config.rope_parameters.{kind} rope type {rtype!r} is not supported "
                "(default, linear, proportional)"
            )


def config_from_dict(raw: dict, where: str = "config.json",
                     generation_config: Optional[dict] = None) -> DiffusionGemmaConfig:
    """The config mlx-vlm's loader builds from config.json (+ generation_config.json)."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    model_type = raw.get("model_type")
    if model_type != MODEL_TYPE:
        raise UnsupportedModelError(
            f"{where}: model_type is {model_type!r}; the DiffusionGemma graph implements {MODEL_TYPE!r}"
        )
    raw = dict(raw)
    if isinstance(generation_config, dict) and generation_config:
        # mlx-vlm's _merge_generation_config + apply_generation_config_defaults (eos only matters)
        raw["generation_config"] = generation_config
        if "eos_token_id" in generation_config:
            raw["eos_token_id"] = generation_config["eos_token_id"]
    text = raw.get("text_config", {})
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config must be an object")
    try:
        tc = DiffusionGemmaTextConfig(**{k: v for k, v in text.items() if k in _TEXT_FIELDS})
    except TypeError as e:  # e.g. a list where an int belongs, in __post_init__
        raise ConfigError(f"{where}: bad text_config: {e}") from None
    _check_text(tc, where)
    cfg = DiffusionGemmaConfig(text_config=tc, **{k: v for k, v in raw.items() if k in _TOP_FIELDS})
    if not _is_int(cfg.canvas_length) or cfg.canvas_length <= 0:
        raise ConfigError(f"{where}: canvas_length must be a positive integer, got {cfg.canvas_length!r}")
    if cfg.generation_config is not None and not isinstance(cfg.generation_config, dict):
        raise ConfigError(f"{where}: generation_config must be an object")
    return cfg


def _read_json(path: Path, required: bool):
    if not path.is_file():
        if required:
            raise ConfigError(f"{path}: file not found")
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: malformed JSON ({e})") from None


def load_config(path) -> DiffusionGemmaConfig:
    """config.json (+ generation_config.json, merged as mlx-vlm's `load_config` merges it)."""
    root = Path(path)
    raw = _read_json(root / "config.json", required=True)
    gen = _read_json(root / "generation_config.json", required=False)
    if gen is not None and not isinstance(gen, dict):
        raise ConfigError(f"{root / 'generation_config.json'}: expected a JSON object")
    return config_from_dict(raw, str(root / "config.json"), gen)


# ----------------------------------------------------------------------------- ops


@partial(mx.compile, shapeless=True)
def geglu(gate, x):
    """mlx-vlm's compiled `geglu` (a compiled kernel, not the eager gelu_approx * x)."""
    return nn.gelu_approx(gate) * x


def make_compiled_softcap(softcap: float):
    """Fused fp32 upcast + tanh softcap, compiled with the cap as a constant (as mlx-vlm)."""

    def _softcap(x):
        return mx.tanh(x.astype(mx.float32) / softcap) * softcap

    return mx.compile(_softcap, shapeless=True)


def rms_norm_no_scale(x, eps: float):
    """gemma4 `RMSNormNoScale`: fast rms_norm without a weight."""
    return mx.fast.rms_norm(x, None, eps)


class ProportionalRoPE(nn.Module):
    """mlx-vlm `rope_utils.ProportionalRoPE` (its rotated-dims rounding and freq table)."""

    def __init__(self, dims: int, traditional: bool = False, base: float = 10000.0,
                 scaling_config: Optional[dict] = None):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        scaling_config = scaling_config or {}
        factor = scaling_config.get("factor", 1.0)
        rotated_dims = 2 * int(scaling_config.get("partial_rotary_factor", 1.0) * dims // 2)
        if rotated_dims > dims:
            raise ConfigError("rope: partial_rotary_factor rotates more dims than the head has")
        self.rope_angles = rotated_dims // 2
        nope_angles = dims // 2 - self.rope_angles
        if self.rope_angles > 0:
            exponents = mx.arange(0, 2 * self.rope_angles, 2, dtype=mx.float32) / dims
            freqs = factor * mx.power(base, exponents)
            if nope_angles > 0:
                freqs = mx.concatenate([freqs, mx.full((nope_angles,), mx.inf, dtype=mx.float32)])
            self._freqs = freqs
        else:
            self._freqs = mx.full((dims // 2,), mx.inf, dtype=mx.float32)
        mx.eval(self._freqs)

    def __call__(self, x, offset=0):
        if self.rope_angles <= 0:
            return x
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=None, scale=1.0,
                            offset=offset, freqs=self._freqs)


def _make_rope(dims: int, params: dict, max_position_embeddings: int):
    rope_type = params.get("type") or params.get("rope_type", "default")
    base = params.get("rope_theta", 10000.0)
    if rope_type == "proportional":
        return ProportionalRoPE(dims, traditional=False, base=base, scaling_config=params)
    # default / linear: nn.RoPE, exactly as both mlx-lm's and mlx-vlm's initialize_rope build it
    return initialize_rope(dims, base, False, params, max_position_embeddings)


def cache_offset(cache) -> int:
    """Tokens the encoder has written into `cache` (0 for none / empty)."""
    if cache is None or getattr(cache, "keys", None) is None:
        return 0
    offset = getattr(cache, "offset", 0)
    if isinstance(offset, mx.array):
        return int(mx.max(offset).item())
    return int(offset)


def cache_state(cache):
    """The encoder keys/values the decoder reads, in temporal order (mlx-vlm `_cache_state`).

    mlxbun caches' `state` carries bookkeeping beyond (keys, values), so the arrays are taken
    the way mlx-vlm's caches expose them: a KVCache's filled prefix, a rotating cache's ring
    rearranged into temporal order.
    """
    if cache is None or getattr(cache, "keys", None) is None:
        return None
    if hasattr(cache, "decoder_state"):
        return cache.decoder_state
    if hasattr(cache, "_temporal_order"):
        return cache._temporal_order(cache.keys), cache._temporal_order(cache.values)
    if isinstance(cache, KVCache):
        if cache.offset == cache.keys.shape[2]:
            return cache.keys, cache.values
        return cache.keys[..., : cache.offset, :], cache.values[..., : cache.offset, :]
    raise UnsupportedModelError(
        f"DiffusionGemma decoder cannot read encoder keys/values from a {type(cache).__name__}"
    )


# ----------------------------------------------------------------------------- modules


class MLP(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, x):
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig):
        super().__init__()
        self.top_k = c.top_k_experts
        self.eps = c.rms_norm_eps
        self.proj = nn.Linear(c.hidden_size, c.num_experts, bias=False)
        self.scale = mx.ones((c.hidden_size,))
        self.per_expert_scale = mx.ones((c.num_experts,))
        self._root_size = c.hidden_size**-0.5

    def __call__(self, x):
        x = mx.fast.rms_norm(x, None, self.eps)
        x = x * self.scale * self._root_size
        scores = self.proj(x)
        top_k = self.top_k
        indices = mx.argpartition(scores, kth=-top_k, axis=-1)[..., -top_k:]
        weights = mx.take_along_axis(scores, indices, axis=-1)
        weights = mx.softmax(weights, axis=-1, precise=True)
        weights = weights * self.per_expert_scale[indices]
        return indices, weights


class Experts(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig):
        super().__init__()
        self.hidden_dims = c.moe_intermediate_size
        self.gate_up_proj = SwitchLinear(c.hidden_size, 2 * c.moe_intermediate_size, c.num_experts)
        self.down_proj = SwitchLinear(c.moe_intermediate_size, c.hidden_size, c.num_experts)

    def __call__(self, x, top_k_indices):
        x = mx.expand_dims(x, (-2, -3))
        # mlx-vlm sorts tokens by expert from 64 (token, expert) pairs on: a different
        # gather_mm call, so the same threshold is kept.
        do_sort = top_k_indices.size >= 64
        indices = top_k_indices
        inv_order = None
        if do_sort:
            x, indices, inv_order = gather_sort(x, top_k_indices)
        gate_up = self.gate_up_proj(x, indices, sorted_indices=do_sort)
        gate = gate_up[..., : self.hidden_dims]
        up = gate_up[..., self.hidden_dims :]
        y = self.down_proj(geglu(gate, up), indices, sorted_indices=do_sort)
        if do_sort:
            y = scatter_unsort(y, inv_order, top_k_indices.shape)
        return y.squeeze(-2)


class Attention(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig, layer_idx: int):
        super().__init__()
        self.layer_type = c.layer_types[layer_idx]
        self.is_sliding = self.layer_type == SLIDING
        self.sliding_window = c.sliding_window
        self.head_dim = c.global_head_dim if not self.is_sliding and c.global_head_dim else c.head_dim
        self.n_heads = c.num_attention_heads
        self.n_kv_heads = (
            c.num_global_key_value_heads
            if not self.is_sliding and c.num_global_key_value_heads is not None
            else c.num_key_value_heads
        )
        self.scale = 1.0
        self.eps = c.rms_norm_eps
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        # full-attention layers have no v_proj: values are the (un-normed) keys
        if self.is_sliding:
            self.v_proj = nn.Linear(c.hidden_size, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=c.rms_norm_eps)
        rope_params = c.rope_parameters.get(self.layer_type, {})
        self.rope = _make_rope(self.head_dim, rope_params, c.max_position_embeddings)

    def __call__(self, x, mask=None, cache=None, *, decoder: bool = False, offset=None):
        B, L, _ = x.shape
        if offset is None:
            offset = cache_offset(cache)

        queries = self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim)
        queries = self.q_norm(queries).transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=offset)

        keys = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        values = (
            self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
            if "v_proj" in self
            else keys
        )
        keys = self.k_norm(keys).transpose(0, 2, 1, 3)
        keys = self.rope(keys, offset=offset)
        values = rms_norm_no_scale(values, self.eps).transpose(0, 2, 1, 3)

        if decoder:
            state = cache_state(cache)
            if state is not None:
                encoder_keys, encoder_values = state
                if self.is_sliding:
                    # Only the last `sliding_window - 1` encoder positions are visible (the
                    # mask says so); mlx-vlm also slices the rest off before SDPA, which
                    # changes the SDPA call, so the slice is kept.
                    window = max(self.sliding_window - 1, 0)
                    encoder_len = encoder_keys.shape[2]
                    if window and encoder_len > window and offset >= encoder_len:
                        encoder_keys = encoder_keys[:, :, -window:, :]
                        encoder_values = encoder_values[:, :, -window:, :]
                        if mask is not None and not isinstance(mask, str):
                            mask = mask[..., -(window + L):]
                keys = mx.concatenate([encoder_keys, keys], axis=2)
                values = mx.concatenate([encoder_values, values], axis=2)
            attn_cache = None
        else:
            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)
            attn_cache = cache

        output = scaled_dot_product_attention(queries, keys, values, cache=attn_cache,
                                              scale=self.scale, mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(output)


class DecoderLayer(nn.Module):
    """One shared layer; the encoder calls it with its own `layer_scalar`."""

    def __init__(self, c: DiffusionGemmaTextConfig, layer_idx: int):
        super().__init__()
        self.layer_type = c.layer_types[layer_idx]
        self.self_attn = Attention(c, layer_idx)
        self.mlp = MLP(c)
        eps = c.rms_norm_eps
        self.input_layernorm = nn.RMSNorm(c.hidden_size, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(c.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(c.hidden_size, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(c.hidden_size, eps=eps)
        self.router = Router(c)
        self.experts = Experts(c)
        self.post_feedforward_layernorm_1 = nn.RMSNorm(c.hidden_size, eps=eps)
        self.post_feedforward_layernorm_2 = nn.RMSNorm(c.hidden_size, eps=eps)
        self.pre_feedforward_layernorm_2 = nn.RMSNorm(c.hidden_size, eps=eps)
        self.layer_scalar = mx.ones((1,))

    def __call__(self, x, mask=None, cache=None, *, decoder: bool = False, offset=None,
                 layer_scalar=None):
        residual = x
        h = self.input_layernorm(x)
        h = self.self_attn(h, mask, cache, decoder=decoder, offset=offset)
        h = self.post_attention_layernorm(h)
        h = residual + h

        residual = h
        h1 = self.pre_feedforward_layernorm(h)
        h1 = self.mlp(h1)
        h1 = self.post_feedforward_layernorm_1(h1)

        flat = residual.reshape(-1, residual.shape[-1])
        top_k_indices, top_k_weights = self.router(flat)
        h2 = self.pre_feedforward_layernorm_2(flat)
        h2 = self.experts(h2, top_k_indices)
        h2 = (h2 * top_k_weights[..., None]).sum(axis=-2)
        h2 = h2.reshape(residual.shape)
        h2 = self.post_feedforward_layernorm_2(h2)

        h = self.post_feedforward_layernorm(h1 + h2)
        h = residual + h
        return h * (self.layer_scalar if layer_scalar is None else layer_scalar)


class SelfConditioning(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig):
        super().__init__()
        self.eps = c.rms_norm_eps
        self.pre_norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def __call__(self, inputs_embeds, self_conditioning_signal):
        normed = self.pre_norm(self_conditioning_signal)
        signal = self.down_proj(geglu(self.gate_proj(normed), self.up_proj(normed)))
        return rms_norm_no_scale(inputs_embeds + signal, self.eps)


class _ScalarOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_scalar = mx.ones((1,))


class EncoderLanguageModel(nn.Module):
    """The encoder's own parameters: one `layer_scalar` per layer (the rest is the decoder's)."""

    def __init__(self, num_layers: int):
        super().__init__()
        self.layers = [_ScalarOnly() for _ in range(num_layers)]


class Encoder(nn.Module):
    def __init__(self, num_layers: int):
        super().__init__()
        self.language_model = EncoderLanguageModel(num_layers)


class Decoder(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_scale = c.hidden_size**0.5
        self.layers = [DecoderLayer(c, i) for i in range(c.num_hidden_layers)]
        self.norm = nn.RMSNorm(c.hidden_size, eps=c.rms_norm_eps)
        self.self_conditioning = SelfConditioning(c)

    def embed_canvas(self, canvas_ids, self_conditioning_embeddings=None):
        inputs_embeds = self.embed_tokens(canvas_ids) * self.embed_scale
        if self_conditioning_embeddings is not None:
            soft_embeddings = self_conditioning_embeddings.astype(inputs_embeds.dtype)
        else:
            soft_embeddings = mx.zeros_like(inputs_embeds)
        return self.self_conditioning(inputs_embeds, soft_embeddings)

    def make_masks(self, canvas_length: int, batch: int, caches):
        """mlx-vlm `_make_decoder_masks` without a padding mask: per layer kind, None (all
        visible) or a bool row [B, 1, canvas, encoder + canvas] hiding out-of-window keys."""
        masks = {}
        for layer_type in set(self.config.layer_types):
            cache = next((c for c, layer in zip(caches or [], self.layers)
                          if layer.layer_type == layer_type), None)
            state = cache_state(cache)
            encoder_len = state[0].shape[2] if state is not None else 0
            valid_encoder_len = min(cache_offset(cache), encoder_len)
            key_len = encoder_len + canvas_length
            if layer_type == FULL:
                if encoder_len == valid_encoder_len:
                    masks[layer_type] = None
                else:
                    row = mx.concatenate([mx.arange(encoder_len) < valid_encoder_len,
                                          mx.ones((canvas_length,), dtype=mx.bool_)], axis=0)
                    masks[layer_type] = mx.broadcast_to(row[None, None, None, :],
                                                        (batch, 1, canvas_length, key_len))
                continue
            window_prefix = max(self.config.sliding_window - 1, 0)
            if encoder_len == valid_encoder_len and encoder_len <= window_prefix:
                masks[layer_type] = None
                continue
            start = max(0, valid_encoder_len - window_prefix)
            positions = mx.arange(encoder_len)
            encoder_mask = (positions >= start) & (positions < valid_encoder_len)
            canvas_mask = mx.ones((canvas_length,), dtype=mx.bool_)
            row = mx.concatenate([encoder_mask, canvas_mask], axis=0)
            masks[layer_type] = mx.broadcast_to(row[None, None, None, :],
                                                (batch, 1, canvas_length, key_len))
        return masks

    def __call__(self, canvas_ids, cache=None, self_conditioning_embeddings=None, masks=None):
        h = self.embed_canvas(canvas_ids, self_conditioning_embeddings)
        cache = cache or [None] * len(self.layers)
        if masks is None:
            masks = self.make_masks(h.shape[1], h.shape[0], cache)
        offset = cache_offset(cache[0]) if cache else 0
        for layer, c in zip(self.layers, cache):
            h = layer(h, masks.get(layer.layer_type), c, decoder=True, offset=offset)
        return self.norm(h)


class Backbone(nn.Module):
    def __init__(self, c: DiffusionGemmaTextConfig):
        super().__init__()
        self.decoder = Decoder(c)
        self.encoder = Encoder(c.num_hidden_layers)


# ----------------------------------------------------------------------------- the model


class DiffusionGemmaModel(nn.Module):
    """The DiffusionGemma text graph. Parameter paths are mlx-vlm's (after its sanitize).

    Engine surface (mlx-vlm's names): `make_cache`, `diffusion_prefill_cache`,
    `diffusion_update_cache`, `diffusion_decoder_masks`, `diffusion_decoder_logits`,
    `diffusion_prepare_self_conditioning`, `diffusion_self_conditioning`.
    """

    def __init__(self, config: DiffusionGemmaConfig):
        super().__init__()
        self.config = config
        self.profile = None
        tc = config.text_config
        self.model = Backbone(tc)
        self._softcap = make_compiled_softcap(float(tc.final_logit_softcapping))

    # -- identity

    @property
    def model_type(self) -> str:
        return MODEL_TYPE

    @property
    def layers(self):
        return self.model.decoder.layers

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids the model declares: config.json / generation_config.json's top-level ones."""
        ids = []
        for src in (self.config.eos_token_id, (self.config.generation_config or {}).get("eos_token_id")):
            for i in ([src] if _is_int(src) else (src or ())):
                if _is_int(i) and i not in ids:
                    ids.append(i)
        return tuple(ids)

    def make_cache(self, **kv_options) -> list:
        """One cache per layer: KVCache for full layers, RotatingKVCache(window) for sliding.
        (The decoder reads these caches' raw keys/values: no quantized or bounded variants.)"""
        if any(v is not None for v in kv_options.values()):
            raise UnsupportedModelError(
                f"DiffusionGemma: KV cache options are not supported ({', '.join(sorted(kv_options))})"
            )
        tc = self.config.text_config
        return [KVCache() if t == FULL else RotatingKVCache(max_size=tc.sliding_window)
                for t in tc.layer_types]

    # -- encoder

    def _embed_inputs(self, input_ids):
        cfg, dec = self.config, self.model.decoder
        image_mask = (input_ids == cfg.image_token_id if cfg.image_token_id is not None
                      else mx.zeros(input_ids.shape, dtype=mx.bool_))
        video_mask = (input_ids == cfg.video_token_id if cfg.video_token_id is not None
                      else mx.zeros(input_ids.shape, dtype=mx.bool_))
        # mlx-vlm replaces media placeholder ids by the pad id before the embedding
        llm_input_ids = mx.where(image_mask | video_mask, cfg.text_config.pad_token_id, input_ids)
        return dec.embed_tokens(llm_input_ids) * dec.embed_scale

    def encode(self, input_ids, cache=None):
        """Causal encoder pass: writes every layer's keys/values into `cache`; returns
        (final-norm hidden states, cache)."""
        tc = self.config.text_config
        h = self._embed_inputs(input_ids)
        if cache is None:
            cache = self.make_cache()
        dec = self.model.decoder
        masks = [
            create_attention_mask(h, c, window_size=tc.sliding_window if layer.layer_type == SLIDING else None)
            for layer, c in zip(dec.layers, cache)
        ]
        scalars = self.model.encoder.language_model.layers
        for layer, c, mask, s in zip(dec.layers, cache, masks, scalars):
            h = layer(h, mask, c, decoder=False, layer_scalar=s.layer_scalar)
        return dec.norm(h), cache

    def diffusion_prefill_cache(self, input_ids, *, cache=None, prefill_step_size: Optional[int] = None,
                                chunk_prefill: bool = False, **unsupported):
        """Encode the prompt into `cache` (in `prefill_step_size` chunks when `chunk_prefill`)."""
        _refuse_media(unsupported)
        if not chunk_prefill:
            _, cache = self.encode(input_ids, cache)
            return cache
        for start in range(0, input_ids.shape[1], prefill_step_size):
            end = min(start + prefill_step_size, input_ids.shape[1])
            _, cache = self.encode(input_ids[:, start:end], cache)
            mx.eval([a for c in cache for a in (c.keys, c.values)])
            mx.clear_cache()
        return cache

    def diffusion_update_cache(self, input_ids, *, cache):
        """Feed a finished canvas through the encoder (appends it to the caches)."""
        _, cache = self.encode(input_ids, cache)
        return cache

    def chunked_prefill_policy(self, **_):
        return True  # text-only, unpadded: mlx-vlm's policy allows chunking

    # -- decoder

    @property
    def prefers_logits_self_conditioning(self) -> bool:
        return False  # only for a quantized embedding (not ported)

    def diffusion_prepare_self_conditioning(self):
        return self.model.decoder.embed_tokens.weight

    def diffusion_self_conditioning(self, processed_logits, embedding_weight):
        """Soft embeddings of the processed logits, stored in the embedding dtype (as HF)."""
        dec = self.model.decoder
        probs = mx.softmax(processed_logits.astype(embedding_weight.dtype), axis=-1, precise=True)
        return (probs.astype(embedding_weight.dtype) @ embedding_weight).astype(
            embedding_weight.dtype
        ) * dec.embed_scale

    def diffusion_decoder_masks(self, canvas_ids, cache, decoder_attention_mask=None):
        if decoder_attention_mask is not None:
            raise UnsupportedModelError("DiffusionGemma: padded prompts (decoder_attention_mask) are not ported")
        return self.model.decoder.make_masks(canvas_ids.shape[1], canvas_ids.shape[0], cache)

    def decode_hidden(self, canvas_ids, cache=None, self_conditioning=None, masks=None):
        """Decoder pass over the canvas (reads, never writes, `cache`): final hidden states."""
        return self.model.decoder(canvas_ids, cache=cache, self_conditioning_embeddings=self_conditioning,
                                  masks=masks)

    def logits_from_hidden(self, h):
        return self._softcap(self.model.decoder.embed_tokens.as_linear(h))

    def diffusion_decoder_logits(self, canvas_ids, cache=None, self_conditioning=None,
                                 decoder_attention_mask=None):
        """Decoder logits [B, canvas, V] (float32, softcapped). `decoder_attention_mask` is
        mlx-vlm's slot, which carries the precomputed per-kind mask dict."""
        masks = decoder_attention_mask
        if masks is not None and not isinstance(masks, dict):
            raise UnsupportedModelError("DiffusionGemma: padded prompts (decoder_attention_mask) are not ported")
        return self.logits_from_hidden(self.decode_hidden(canvas_ids, cache, self_conditioning, masks))

    def __call__(self, input_ids=None, cache=None, canvas_ids=None, self_conditioning_embeddings=None):
        """mlx-vlm `Model.__call__` (text): optional encoder pass, then decoder logits. A
        missing canvas is drawn uniformly at random, as mlx-vlm draws it."""
        if input_ids is not None:
            _, cache = self.encode(input_ids, cache)
        elif cache is None:
            raise ValueError("DiffusionGemma: give input_ids or an encoder cache")
        if canvas_ids is None:
            canvas_ids = mx.random.randint(0, self.config.text_config.vocab_size,
                                           (input_ids.shape[0], self.config.canvas_length))
        h = self.model.decoder(canvas_ids, cache=cache,
                               self_conditioning_embeddings=self_conditioning_embeddings)
        return self.logits_from_hidden(h)

    def layers_tap(self, paths=None):
        from mlxbun.parity.taps import capture

        return capture(self, paths)


def _refuse_media(kwargs: dict) -> None:
    for key in ("pixel_values", "mm_token_type_ids", "attention_mask"):
        if kwargs.pop(key, None) is not None:
            raise UnsupportedModelError(f"DiffusionGemma (text graph): {key} is not supported")
    if kwargs:
        raise TypeError(f"unexpected arguments: {', '.join(sorted(kwargs))}")


# ----------------------------------------------------------------------------- loading

# checkpoint name -> module path: HF stores the fused expert tensors without ".weight"
_EXPERT_HF = re.compile(r"^(model\.decoder\.layers\.\d+\.experts\.(?:gate_up_proj|down_proj))$")


def checkpoint_name(param: str, present) -> str:
    """The checkpoint tensor that fills module parameter `param` (HF or mlx-converted name)."""
    if param.endswith(".weight") and _EXPERT_HF.match(param[: -len(".weight")]):
        hf = param[: -len(".weight")]
        return param if param in present and hf not in present else hf
    return param


def drop_rules():
    """Tensors a DiffusionGemma checkpoint carries that the text graph reads elsewhere or not at all."""
    from mlxbun.weight_audit import DropRule

    return [
        DropRule(r"^lm_head\.weight$", "the head is tied to model.decoder.embed_tokens (as mlx-vlm)"),
        DropRule(r"rotary_emb", "precomputed RoPE tables; the graph computes RoPE itself"),
        DropRule(lambda n: n.startswith("model.encoder.language_model.") and not n.endswith(".layer_scalar"),
                 "encoder text weights are tied to the decoder's (only encoder layer_scalars are its own)"),
        DropRule(r"^model\.encoder\.(vision_tower|embed_vision)\.",
                 "the vision tower: this text-only graph does not take image input"),
    ]


def load_diffusion_gemma(path, *, lazy: bool = False) -> DiffusionGemmaModel:
    """Load a DiffusionGemma checkpoint directory (HF or mlx-vlm-converted layout), audited."""
    from mlxbun.weight_audit import WeightAudit
    from mlxbun.weights import read_index

    root = Path(path)
    config = load_config(root)
    index = read_index(root)
    quantized = [n for n in index.tensors if n.endswith(".scales")]
    if quantized:
        raise UnsupportedModelError(
            f"{root}: quantized DiffusionGemma checkpoints are not ported (e.g. {quantized[0]})"
        )
    model = DiffusionGemmaModel(config)
    params = dict(tree_flatten(model.parameters()))
    audit = WeightAudit(index, drop_rules())
    names = {}
    for p, a in params.items():
        name = checkpoint_name(p, index.tensors)
        names[name] = p
        audit.expect(name, a.shape)  # shapes only: the checkpoint's dtype is kept (as mlx-vlm)
    audit.check()
    arrays = index.load(list(names))
    try:
        model.load_weights([(names[n], a) for n, a in arrays.items()], strict=True)
    except ValueError as e:  # the audit should have caught it; never let mlx's error escape raw
        raise LoadError(f"{root}: {e}") from None
    if not lazy:
        mx.eval(model.parameters())
    model.eval()
    return model
