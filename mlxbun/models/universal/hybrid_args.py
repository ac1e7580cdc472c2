"""The hybrid knobs applied to a config: which mixer each layer runs (`mixer_layers`), and the
ModelArgs `__post_init__` steps and sizes of the hybrid rows (resolve.py calls them)."""

from __future__ import annotations

import math
from typing import Any

from mlxbun.models.universal.fields import fail
from mlxbun.models.universal.kinds_hybrid import (
    MixerKind,
    MixerLayers,
)

__all__ = ["ffn_layers", "full_attn_idxs", "lfm2_ff_dim", "lfm2_intermediate", "mamba2_state",
           "mixer_layers", "nemotron_pattern", "olmo_hybrid_args", "qwen3_5_rope"]


def mixer_layers(d: Any, a: dict, n: int) -> list[MixerKind]:
    """Per layer: ATTENTION, or the row's recurrent mixer (d: the ArchDescriptor)."""
    h = d.hybrid
    if h is None:
        return [MixerKind.ATTENTION] * n
    mt = d.model_type
    if h.layers is MixerLayers.ALL:
        return [h.mixer] * n
    value = a[h.field]
    if h.layers is MixerLayers.PATTERN:
        ops = _pattern(value, h.field, n, mt)
        kinds = [h.mixer if c == "M" else MixerKind.ATTENTION for c in ops]
        if h.mixer not in kinds:  # mlx-lm takes the recurrent mask from the first such layer
            raise fail(mt, f"'{h.field}' = {value!r} has no M (mixer) layer")
        return kinds
    if h.layers is MixerLayers.LAYER_TYPES:
        if not isinstance(value, (list, tuple)) or len(value) < n or not all(
                t in (*h.layer_types, "attention") for t in value[:n]):
            raise fail(mt, f"'{h.field}' must give each of the {n} layers one of "
                           f"{', '.join(map(repr, (*h.layer_types, 'attention')))}; got {value!r}")
        kinds = [h.mixer if t in h.layer_types else MixerKind.ATTENTION for t in value[:n]]
        if h.mixer not in kinds:  # mlx-lm takes the recurrent mask from the first such layer
            raise fail(mt, f"'{h.field}' = {value!r} leaves no {h.mixer.value} layer")
        return kinds
    if h.layers is MixerLayers.INDEX_LIST:
        if not isinstance(value, (list, tuple)) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in value):
            raise fail(mt, f"'{h.field}' must list the attention layers' indices, got {value!r}")
        attends = set(value)
        if not attends & set(range(n)):  # mlx-lm takes the attention mask from the first
            raise fail(mt, f"'{h.field}' = {value!r} names no layer in 0..{n - 1}; mlx-lm needs one")
    elif h.layers is MixerLayers.TYPE_LIST:  # mlx-lm builds one layer per entry
        if not isinstance(value, (list, tuple)) or not all(isinstance(t, str) for t in value):
            raise fail(mt, f"'{h.field}' must list every layer's kind name, got {value!r}")
        if len(value) != n:
            raise fail(mt, f"'{h.field}' has {len(value)} entries for {n} layers; mlx-lm builds "
                           f"the layers from '{h.field}'")
        attends = {i for i, t in enumerate(value) if t not in h.layer_types}
    else:  # MixerLayers.INTERVAL
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise fail(mt, f"'{h.field}' must be a positive integer, got {value!r}")
        attends = {i for i in range(n) if (i + 1) % value == 0}
    kinds = [MixerKind.ATTENTION if i in attends else h.mixer for i in range(n)]
    if h.mixer not in kinds:  # mlx-lm takes the recurrent mask from the first such layer
        raise fail(mt, f"'{h.field}' = {value!r} leaves no {h.mixer.value} layer")
    return kinds


def ffn_layers(d: Any, a: dict, n: int) -> list[bool]:
    """Per layer: whether its one op is the MLP or the MoE block (block 'single', the pattern's
    '-' and 'E' layers)."""
    h = d.hybrid
    if h is None or h.layers is not MixerLayers.PATTERN:
        return [False] * n
    return [c in "-E" for c in _pattern(a[h.field], h.field, n, d.model_type)]


def _pattern(value: Any, key: str, n: int, mt: str) -> list[str]:
    if not isinstance(value, (str, list, tuple)) or len(value) != n or not all(
            isinstance(c, str) and c in "M*-E" and len(c) == 1 for c in value):
        raise fail(mt, f"'{key}' must give each of the {n} layers one of M, *, -, E; got {value!r}")
    return list(value)


_BLOCK_CHARS = {"full_attention": "*", "linear_attention": "M", "moe": "E", "mlp": "-",
                "attention": "*", "mamba": "M", "conv": "M"}  # nemotron_h's _block_type_to_char


def nemotron_pattern(a: dict, mt: str) -> None:  # nemotron_h's __post_init__
    if a["time_step_limit"] is None:
        a["time_step_limit"] = (0.0, float("inf"))
    block_types = a["layers_block_type"] or a["layer_types"]
    if a["hybrid_override_pattern"] is None and block_types is not None:
        unknown = sorted(set(block_types) - _BLOCK_CHARS.keys())
        if unknown:
            raise fail(mt, f"unsupported layers_block_type {unknown}, expected any of "
                           f"{sorted(_BLOCK_CHARS)}")
        a["hybrid_override_pattern"] = [_BLOCK_CHARS[t] for t in block_types]
    if a["hybrid_override_pattern"] is None:
        raise fail(mt, "needs layers_block_type or hybrid_override_pattern to describe the layers")
    a["num_hidden_layers"] = len(a["hybrid_override_pattern"])


def mamba2_state(a: dict, mt: str) -> None:  # mamba2's __post_init__
    if a["time_step_rank"] == "auto":
        a["time_step_rank"] = math.ceil(a["hidden_size"] / 16)
    if a["ssm_state_size"] is None:
        a["ssm_state_size"] = a["state_size"]


def lfm2_ff_dim(a: dict, mt: str) -> None:  # lfm2's __post_init__, first step
    if a["block_ff_dim"] is None:
        if a["intermediate_size"] is None:
            raise fail(mt, "Config must specify either 'block_ff_dim' or 'intermediate_size'")
        a["block_ff_dim"] = a["intermediate_size"]


def full_attn_idxs(a: dict, mt: str) -> None:  # lfm2's __post_init__, last step
    if a["full_attn_idxs"] is None:
        lt = a["layer_types"]
        if not isinstance(lt, (list, tuple)):
            raise fail(mt, f"needs 'full_attn_idxs' or a 'layer_types' list, got layer_types={lt!r}")
        a["full_attn_idxs"] = [i for i, t in enumerate(lt) if t == "full_attention"]


def lfm2_intermediate(a: dict, mt: str) -> int:
    """lfm2.MLP's width: block_ff_dim, auto-adjusted as its constructor does."""
    ff_dim = a["block_ff_dim"]
    if not isinstance(ff_dim, int) or isinstance(ff_dim, bool) or ff_dim <= 0:
        raise fail(mt, f"'block_ff_dim' must be a positive integer, got {ff_dim!r}")
    if a["block_auto_adjust_ff_dim"]:
        multiple_of = a["block_multiple_of"]
        if not isinstance(multiple_of, int) or isinstance(multiple_of, bool) or multiple_of <= 0:
            raise fail(mt, f"'block_multiple_of' must be a positive integer, got {multiple_of!r}")
        ff_dim = int(2 * ff_dim / 3)
        if a["block_ffn_dim_multiplier"] is not None:
            ff_dim = int(a["block_ffn_dim_multiplier"] * ff_dim)
        ff_dim = multiple_of * ((ff_dim + multiple_of - 1) // multiple_of)
    return ff_dim


def qwen3_5_rope(a: dict, mt: str) -> None:  # qwen3_5's TextModelArgs.__post_init__, rope part
    rp = a["rope_parameters"]
    if rp:
        if not isinstance(rp, dict):
            raise fail(mt, f"'rope_parameters' must be an object, got {rp!r}")
        if "type" not in rp and "rope_type" in rp:
            rp["type"] = rp.pop("rope_type")
        a["partial_rotary_factor"] = rp.get("partial_rotary_factor", 0.25)
        a["rope_theta"] = rp.get("rope_theta", 100000.0)
        a["rope_scaling"] = rp


def olmo_hybrid_args(a: dict, mt: str) -> None:  # olmo_hybrid's __post_init__, after the kv heads
    rp = a["rope_parameters"]
    if rp is not None:
        if not isinstance(rp, dict):
            raise fail(mt, f"'rope_parameters' must be an object, got {rp!r}")
        a["rope_theta"] = rp.get("rope_theta", 10000.0)
    if a["rope_theta"] is None:
        raise fail(mt, "'rope_theta' is null: mlx-lm's olmo_hybrid then runs without rope, "
                       "which the universal graph does not")
    if a["layer_types"] is None:
        a["layer_types"] = ["full_attention" if (i % 4 == 3) else "linear_attention"
                            for i in range(a["num_hidden_layers"])]
