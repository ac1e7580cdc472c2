"""DiffusionGemma's layers, transcribed from mlx-vlm 0.7.10 (same ops, casts, python-float
constants, the same `mx.compile`d activations): the ops, mlx-vlm's proportional RoPE, the
readers of the encoder caches, and one shared layer (attention, dense GeGLU MLP, top-k MoE).

Each layer: q/k/v norms (v without scale), attention scale 1.0, full layers reuse K as V,
then a dense GeGLU MLP and a top-k MoE in parallel, summed through their norms. Called by
the encoder (causal, writing its cache) or the decoder (bidirectional over the canvas,
reading the encoder's keys/values).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.cache.kv import KVCache
from mlxbun.errors import ConfigError, UnsupportedModelError
from mlxbun.models.base import scaled_dot_product_attention
from mlxbun.models.diffusion_gemma.config import SLIDING, DiffusionGemmaTextConfig
from mlxbun.models.rope import initialize_rope
from mlxbun.models.switch_layers import SwitchLinear, gather_sort, scatter_unsort

__all__ = [
    "Attention",
    "DecoderLayer",
    "SelfConditioning",
    "cache_offset",
    "cache_state",
    "geglu",
    "make_compiled_softcap",
]


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
