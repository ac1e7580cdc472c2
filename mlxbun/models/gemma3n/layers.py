"""gemma3n's decoder layer and its parts, op for op as mlx-lm 0.32.2 `models/gemma3n.py` runs them
(same ops, order, casts, python-float constants and compiled kernels; the module tree uses its
attribute names, so parameter paths and tap paths equal mlx-lm's).

- LAuReL (`Gemma3nLaurelBlock`): x + norm(right(left(x))), a low-rank residual branch.
- AltUp (`Gemma3nAltUp`): the hidden state is `altup_num_inputs` streams; each layer predicts all
  streams from a router over the active one (float32 coefficients, clipped), runs the block on
  the active stream, then corrects every stream by the innovation.
- Activation sparsity (`MLP` on layers whose `activation_sparsity_pattern` entry is > 0): gelu of
  the gate minus a per-row cutoff mean + std * sqrt(2) * erfinv(2p - 1) (a gaussian top-k), in
  mlx-lm's compiled kernel.
- KV sharing (`Gemma3nAttention`): a layer at or past `first_kv_shared` projects only queries and
  attends over `cache.keys_and_values()` of the cache it is handed (its owner's, picked by the
  backbone), so whatever kind that cache is (plain, rotating, quantized, TurboQuant) the shared
  layer sees exactly what the owner holds, and the attention dispatch asks that cache.

Tensor parallel (`Gemma3nDecoderLayer.shard_plan`; mlx-lm's gemma3n has no `shard()`): attention
by heads (q / k / v all-to-sharded, o sharded-to-all, KV heads fewer than the ranks repeated to one
per rank), so a rank's cache holds its own KV heads and a KV-shared layer's query heads on a rank
read, from the owner's cache on that rank, the heads they read unsplit; the MLP by hidden units
(gate / up all-to-sharded, down sharded-to-all). A sparse MLP's cutoff is a statistic over ALL the
hidden units of a row, so split it is `gelu_topk_over_ranks`: each rank's float32 row sums are
all-summed into the mean, then each rank's float32 squared deviations from it into the variance
(two small all-sums per sparse layer). AltUp, LAuReL, the per-layer input gate and projection and
the norms stay whole on every rank (the gate is a few percent of a layer; splitting it would cost
one more all-sum per layer). Every split is planned and checked before any weight moves.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from mlxbun.models import layers as L
from mlxbun.models import rope as R
from mlxbun.models.base import scaled_dot_product_attention
from mlxbun.models.gemma3n.config import SLIDING, Gemma3nArgs
from mlxbun.models.sharding import (
    ALL_TO_SHARDED,
    SHARDED_TO_ALL,
    shard_linear,
    split_heads_plan,
)

__all__ = ["Gemma3nAltUp", "Gemma3nAttention", "Gemma3nDecoderLayer", "Gemma3nLaurelBlock", "MLP",
           "RMSNoScale", "gelu_topk", "gelu_topk_over_ranks", "logit_softcap", "row_sum", "row_square_sum"]


class RMSNoScale(nn.Module):
    """mlx-lm gemma3n's v_norm: RMS norm without a weight."""

    def __init__(self, eps: float = 1e-5):
        super().__init__()
        self.eps = eps

    def __call__(self, x):
        return mx.fast.rms_norm(x, None, self.eps)


@partial(mx.compile, shapeless=True)
def gelu_topk(inputs, std_multiplier):
    """mlx-lm gemma3n's compiled gaussian top-k gelu (activation sparsity)."""
    inputs_mean = mx.mean(inputs, axis=-1, keepdims=True)
    inputs_std = mx.std(inputs, axis=-1, keepdims=True)
    cutoff_x = inputs_mean + inputs_std * std_multiplier.astype(inputs_std.dtype)
    return nn.gelu_approx(mx.maximum(0, inputs - cutoff_x))


@partial(mx.compile, shapeless=True)
def row_sum(x):
    """A rank's part of a row's sum over the split hidden units, in float32."""
    return x.astype(mx.float32).sum(-1, keepdims=True)


@partial(mx.compile, shapeless=True)
def row_square_sum(x, mean):
    """A rank's part of a row's squared deviations from the (whole row's) mean, in float32."""
    return mx.square(x.astype(mx.float32) - mean).sum(-1, keepdims=True)


@partial(mx.compile, shapeless=True)
def _gelu_over_cutoff(inputs, mean, var, std_multiplier):
    """gelu_topk's cutoff from the whole row's float32 mean and variance (its ops from there on)."""
    inputs_mean = mean.astype(inputs.dtype)
    inputs_std = mx.sqrt(var).astype(inputs.dtype)
    cutoff_x = inputs_mean + inputs_std * std_multiplier.astype(inputs_std.dtype)
    return nn.gelu_approx(mx.maximum(0, inputs - cutoff_x))


def gelu_topk_over_ranks(inputs, std_multiplier, group, width: int):
    """gelu_topk over hidden units split across `group` (each rank holds `inputs`, its part of the
    `width` units of a row): the mean and the (population) std are the whole row's, from the ranks'
    float32 partial sums all-summed; first the mean, then the squared deviations from it (mx.std's
    two passes; as mx.mean, a sum times 1 / width). Only the order of the summation differs from
    the whole row's."""
    scale = 1.0 / width
    mean = mx.distributed.all_sum(row_sum(inputs), group=group) * scale
    var = mx.distributed.all_sum(row_square_sum(inputs, mean), group=group) * scale
    return _gelu_over_cutoff(inputs, mean, var, std_multiplier)


@partial(mx.compile, shapeless=True)
def logit_softcap(softcap, x):
    """mlx-lm gemma3n's compiled final softcap (note the argument order: cap first)."""
    out = mx.tanh(x / softcap)
    out = out * softcap
    return out


class Gemma3nLaurelBlock(nn.Module):
    """Learned Augmented Residual Layer."""

    def __init__(self, a: Gemma3nArgs):
        super().__init__()
        self.linear_left = nn.Linear(a.hidden_size, a.laurel_rank, bias=False)
        self.linear_right = nn.Linear(a.laurel_rank, a.hidden_size, bias=False)
        self.post_laurel_norm = nn.RMSNorm(dims=a.hidden_size, eps=a.rms_norm_eps)

    def __call__(self, x: mx.array) -> mx.array:
        laurel_x = self.linear_left(x)
        laurel_x = self.linear_right(laurel_x)
        normed_laurel_x = self.post_laurel_norm(laurel_x)
        return x + normed_laurel_x


class Gemma3nAttention(nn.Module):
    def __init__(self, a: Gemma3nArgs, layer_idx: int, is_kv_shared_layer: bool):
        super().__init__()
        self.is_sliding = a.layer_types[layer_idx] == SLIDING
        dim, self.head_dim = a.hidden_size, a.head_dim
        self.n_heads, self.n_kv_heads = a.num_attention_heads, a.num_key_value_heads
        self.layer_idx = layer_idx
        self.scale = 1.0
        self.q_proj = nn.Linear(dim, self.n_heads * a.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * a.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * a.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * a.head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(dims=a.head_dim, eps=a.rms_norm_eps)
        self.k_norm = nn.RMSNorm(dims=a.head_dim, eps=a.rms_norm_eps)
        self.v_norm = RMSNoScale(eps=a.rms_norm_eps)
        self.is_kv_shared_layer = is_kv_shared_layer
        base = a.rope_local_base_freq if self.is_sliding else a.rope_theta
        self.rope = R.initialize_rope(a.head_dim, base, False)  # plain rope (mlx-lm: nn.RoPE)

    def shard_plan(self, group, where: str) -> Callable[[], None]:
        """Check the split of the heads across `group` and return what makes it (`split_heads_plan`).
        A KV-shared layer splits its k / v too: it projects its own when run with no cache."""
        return split_heads_plan(self, group, where)

    def __call__(self, x: mx.array, mask=None, cache: Optional[Any] = None, offset: int = 0) -> mx.array:
        B, L_, _ = x.shape
        queries = self.q_proj(x).reshape(B, L_, -1, self.head_dim)
        queries = self.q_norm(queries)
        if self.is_kv_shared_layer and cache is not None:
            # the owner layer already wrote this forward's keys / values into this cache
            keys, values = cache.keys_and_values()
        else:
            keys = self.k_proj(x).reshape(B, L_, -1, self.head_dim)
            keys = self.k_norm(keys)
            keys = keys.transpose(0, 2, 1, 3)
            keys = self.rope(keys, offset=offset)
            values = self.v_proj(x).reshape(B, L_, -1, self.head_dim)
            values = self.v_norm(values)
            values = values.transpose(0, 2, 1, 3)
            if cache is not None:
                keys, values = cache.update_and_fetch(keys, values)
        queries = queries.transpose(0, 2, 1, 3)
        queries = self.rope(queries, offset=offset)
        output = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        output = output.transpose(0, 2, 1, 3).reshape(B, L_, -1)
        return self.o_proj(output)


class MLP(nn.Module):
    def __init__(self, a: Gemma3nArgs, layer_idx: int = 0):
        super().__init__()
        width = a.intermediate(layer_idx)
        self.gate_proj = nn.Linear(a.hidden_size, width, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, width, bias=False)
        self.down_proj = nn.Linear(width, a.hidden_size, bias=False)
        self.activation_sparsity = a.sparsity(layer_idx)
        if self.activation_sparsity > 0:  # "_": not a parameter (as in mlx-lm)
            self._std_multiplier = math.sqrt(2.0) * mx.erfinv(2 * self.activation_sparsity - 1)
        self._width = width
        self._group = None  # set by shard_plan(): a sparse row's statistics are all-summed over it

    def shard_plan(self, group, where: str) -> Callable[[], None]:
        """Check the split of the hidden units across `group` and return what makes it: gate / up
        all-to-sharded, down sharded-to-all; a sparse MLP's statistics then span the ranks."""
        layers = {name: shard_linear(self[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
                  for name in ("gate_proj", "up_proj")}
        layers["down_proj"] = shard_linear(self.down_proj, SHARDED_TO_ALL, group, where=f"{where}.down_proj")

        def apply() -> None:
            for name, module in layers.items():
                setattr(self, name, module)
            object.__setattr__(self, "_group", group)

        return apply

    def __call__(self, x: mx.array):
        gate_proj = self.gate_proj(x)
        if self.activation_sparsity > 0.0 and self._group is not None:
            activations = gelu_topk_over_ranks(gate_proj, self._std_multiplier, self._group, self._width)
        elif self.activation_sparsity > 0.0:
            activations = gelu_topk(gate_proj, self._std_multiplier)
        else:
            activations = L.gelu_approx(gate_proj)
        up_proj = self.up_proj(x)
        return self.down_proj(activations * up_proj)


def _clipped_f32(weight: mx.array, clip: Optional[float]) -> mx.array:
    """mlx-lm casts the coefficient weight to float32 and clips it, writing it back into the module
    on every call; the value is the same every call (the cast and the clip are idempotent), so it
    is computed here without mutating the parameter."""
    w = weight.astype(mx.float32)
    return w if clip is None else mx.clip(w, -clip, clip)


class Gemma3nAltUp(nn.Module):
    """Alternating Updates (AltUp)."""

    def __init__(self, a: Gemma3nArgs):
        super().__init__()
        self.args = a
        n = a.altup_num_inputs
        self.correct_output_scale = mx.zeros((a.hidden_size,))
        self.correction_coefs = nn.Linear(n, n, bias=False)
        self.prediction_coefs = nn.Linear(n, n**2, bias=False)
        self.modality_router = nn.Linear(a.hidden_size, n, bias=False)
        self.router_norm = nn.RMSNorm(dims=a.hidden_size, eps=a.rms_norm_eps)

    def compute_router_modalities(self, x: mx.array) -> mx.array:
        router_inputs = self.router_norm(x) * (self.args.hidden_size**-1.0)
        routed = self.modality_router(router_inputs).astype(mx.float32)
        return mx.tanh(routed)

    def predict(self, x: mx.array) -> mx.array:
        a = self.args
        modalities = self.compute_router_modalities(x[a.altup_active_idx])
        w = _clipped_f32(self.prediction_coefs.weight, a.altup_coef_clip)
        all_coefs = (
            (modalities @ w.T)  # nn.Linear without bias
            .reshape(*modalities.shape[:-1], a.altup_num_inputs, a.altup_num_inputs)
            .transpose(0, 1, 3, 2)
        )
        x_up = x.astype(mx.float32)
        x_permuted = x_up.transpose(1, 2, 3, 0)
        predictions = mx.matmul(x_permuted, all_coefs)
        predictions = predictions.transpose(3, 0, 1, 2)
        predictions += x_up
        return predictions.astype(x.dtype)

    def correct(self, predictions: mx.array, activated: mx.array):
        a = self.args
        modalities = self.compute_router_modalities(activated)
        w = _clipped_f32(self.correction_coefs.weight, a.altup_coef_clip)
        all_coefs = (modalities @ w.T) + 1.0
        active_x = predictions[a.altup_active_idx]
        innovation = activated - active_x
        all_coefs = all_coefs.moveaxis(2, 0)
        corrected = innovation[None] * all_coefs[..., None]
        corrected += predictions
        return corrected.astype(activated.dtype)


class Gemma3nDecoderLayer(nn.Module):
    def __init__(self, a: Gemma3nArgs, layer_idx: int, is_kv_shared_layer: bool):
        super().__init__()
        self.args = a
        self.layer_idx = layer_idx
        hidden, eps = a.hidden_size, a.rms_norm_eps
        self.self_attn = Gemma3nAttention(a, layer_idx, is_kv_shared_layer)
        self.mlp = MLP(a, layer_idx=layer_idx)
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_feedforward_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.is_sliding = self.self_attn.is_sliding
        self.altup = Gemma3nAltUp(a)
        self.laurel = Gemma3nLaurelBlock(a)
        self.per_layer_input_gate = nn.Linear(hidden, a.hidden_size_per_layer_input, bias=False)
        self.per_layer_projection = nn.Linear(a.hidden_size_per_layer_input, hidden, bias=False)
        self.post_per_layer_input_norm = nn.RMSNorm(hidden, eps=eps)

    def shard_plan(self, group, where: str) -> Callable[[], None]:
        """Check the layer's split across `group` (attention by heads, the MLP by hidden units;
        the rest stays whole) and return what makes it."""
        plans = [self.self_attn.shard_plan(group, f"{where}.self_attn"),
                 self.mlp.shard_plan(group, f"{where}.mlp")]

        def apply() -> None:
            for plan in plans:
                plan()

        return apply

    def shard(self, group, where: str) -> None:
        """Split the layer across `group` (checked first: a refused split changes nothing)."""
        self.shard_plan(group, where)()

    def __call__(self, x: mx.array, mask=None, cache: Optional[Any] = None,
                 per_layer_input: Optional[mx.array] = None, offset: int = 0):
        active = self.args.altup_active_idx
        predictions = self.altup.predict(x)
        active_prediction = predictions[active]
        active_prediction_normed = self.input_layernorm(active_prediction)
        laurel_output = self.laurel(active_prediction_normed)
        attn = self.self_attn(active_prediction_normed, mask, cache, offset=offset)
        attn = self.post_attention_layernorm(attn)
        attn_gated = active_prediction + attn
        attn_laurel = (attn_gated + laurel_output) * (2.0**-0.5)
        attn_norm = self.pre_feedforward_layernorm(attn_laurel)
        attn_ffw = self.mlp(attn_norm)
        attn_ffw_norm = self.post_feedforward_layernorm(attn_ffw)
        attn_ffw_laurel_gated = attn_laurel + attn_ffw_norm
        corrected_predictions = self.altup.correct(predictions, attn_ffw_laurel_gated)

        first_prediction = corrected_predictions[active]
        if self.args.altup_correct_scale:
            first_prediction = first_prediction * self.altup.correct_output_scale
        first_prediction = self.per_layer_input_gate(first_prediction)
        first_prediction = L.gelu_approx(first_prediction)
        first_prediction = mx.multiply(first_prediction, per_layer_input)
        first_prediction = self.per_layer_projection(first_prediction)
        first_prediction = self.post_per_layer_input_norm(first_prediction)
        corrected_predictions[1:] = corrected_predictions[1:] + first_prediction
        return corrected_predictions
