"""A descriptor row applied to one config: mlx-lm's `ModelArgs` emulated, then every number.

`model_args(descriptor, config)` reproduces `ModelArgs.from_dict` (+ its
`__post_init__`, as the row's named steps); `resolve_args` turns the row into
concrete numbers (`UniversalArgs`). Every value mlx-lm computes in python
(scales, multipliers, rope bases) is computed here with the same python
expression, so the float is the same bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from mlxbun.config import MODEL_REMAPPING
from mlxbun.config_reader import thaw  # config mappings are read-only; mlx-lm sees plain json
from mlxbun.errors import UnsupportedModelError
from mlxbun.models.universal.fields import fail as _fail
from mlxbun.models.universal.fields import get as _get
from mlxbun.models.universal.fields import int_field as _int_field
from mlxbun.models.universal.hybrid_args import (
    ffn_layers,
    lfm2_intermediate,
    mixer_layers,
)
from mlxbun.models.universal.kinds import (
    POST_OVER,
    AttnKind,
    AttnScale,
    EmbedScale,
    FinalSoftcap,
    HeadDim,
    KVShare,
    LayerKinds,
    MakeCache,
    MlpSize,
    NopeRule,
    NormKind,
    PostOp,
    PreDivide,
    QueryScale,
    ResidualScale,
    RopeKind,
    TieRule,
    exhaustive,
)
from mlxbun.models.universal.moe_args import moe_layers, resolve_moe
from mlxbun.models.universal.mup import tied_ratio
from mlxbun.models.universal.not_covered import NOT_COVERED
from mlxbun.models.universal.post_init import POST_INIT
from mlxbun.models.universal.schema import REQUIRED, ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, RopeSpec, UniversalArgs
from mlxbun.models.universal.table import DESCRIPTORS

__all__ = ["descriptor_for", "layer_kinds", "model_args", "resolve_args", "text_config", "thaw"]


def descriptor_for(model_type: str, config: Mapping[str, Any] | None = None) -> ArchDescriptor:
    """The descriptor row of a model_type (after mlx-lm's remapping), or a refusal; given the
    config, a wrapper's row for its text_config.model_type (`text_rows`: mistral3's ministral3)."""
    mt = MODEL_REMAPPING.get(model_type, model_type)
    d = DESCRIPTORS.get(mt)
    if d is not None:
        text = config.get("text_config") if config is not None and d.text_rows else None
        if isinstance(text, Mapping) and text.get("model_type") in d.text_rows:
            return d.text_rows[text["model_type"]]
        return d
    supported = ", ".join(sorted(DESCRIPTORS))
    why = f" ({NOT_COVERED[mt]})" if mt in NOT_COVERED else ""
    shown = model_type if mt == model_type else f"{model_type} (mlx-lm: {mt})"
    raise UnsupportedModelError(
        f"model_type '{shown}' is not supported by the universal graph{why}; "
        f"supported: {supported}"
    )


# ----------------------------------------------------------------- ModelArgs emulation


def _kv_proj(d: ArchDescriptor, a: dict, n: int) -> list[bool]:
    """Per layer: does it project its own keys / values (KVShare.CLA: hunyuan's kv_proj)."""
    if d.layers.kv_share is not KVShare.CLA or not a["use_cla"]:
        return [True] * n
    factor = a["cla_share_factor"]
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise _fail(d.model_type, f"'cla_share_factor' must be a positive integer, got {factor!r}")
    return [i % factor == 0 for i in range(n)]


def text_config(d: ArchDescriptor, config: Mapping[str, Any]) -> Mapping[str, Any]:
    """What a wrapper row's ModelArgs read: text_config (required where the wrapper's ModelArgs
    require it), else the whole config (qwen3_5's `ModelArgs.from_dict`), with the wrapper's own fields written over it (gemma3's
    `__post_init__`: the top-level vocab_size, else its default) and the values it sets
    (pixtral's untied head); a row without a wrapper reads the whole config."""
    if d.text_config_merge and config.get("text_config") is not None:  # muse_glimmer's from_dict
        if not isinstance(config["text_config"], Mapping):
            raise _fail(d.model_type, f"'text_config' must be an object, got {config['text_config']!r}"[:200])
        return {**{k: v for k, v in config.items() if k != "text_config"}, **config["text_config"]}
    text = config.get("text_config") if d.names.wrapper else None
    if text is None and d.text_config_required:
        raise _fail(d.model_type, "missing required key 'text_config' (mlx-lm's wrapper ModelArgs "
                                  "require it: the text model's args)")
    if text is None:
        return config
    if not isinstance(text, Mapping):
        raise _fail(d.model_type, f"'text_config' must be an object, got {text!r}"[:200])
    if d.wrapper_fields or d.wrapper_sets:
        return {**text, **{k: config.get(k, v) for k, v in d.wrapper_fields.items()}, **d.wrapper_sets}
    return text


def model_args(d: ArchDescriptor, config: Mapping[str, Any]) -> dict[str, Any]:
    """`ModelArgs.from_dict(config)` + `__post_init__`: only the fields, defaults filled."""
    config = text_config(d, config)
    missing = [k for k, v in d.fields.items() if v is REQUIRED and k not in config]
    if missing:
        raise _fail(d.model_type, f"missing required key(s) {', '.join(missing)}")
    a = {k: thaw(config[k]) if k in config else thaw(v) for k, v in d.fields.items()}
    for step in d.post_init:
        POST_INIT[step](a, d.model_type)
    return a


# ----------------------------------------------------------------- resolution


def layer_kinds(d: ArchDescriptor, a: dict, n: int) -> list[bool]:
    """Per layer: sliding (True) or global (False), as mlx-lm derives it."""
    kind = d.layers.kinds
    if kind is LayerKinds.ALL_FULL:
        return [False] * n
    if kind is LayerKinds.LAYER_TYPES:
        return [lt == "sliding_attention" for lt in a["layer_types"]]
    if kind is LayerKinds.LAYER_TYPES_OLMO3:
        return [lt != "full_attention" for lt in a["layer_types"]]
    if kind is LayerKinds.LAYER_TYPES_OR_EVEN:  # step3p5's attention reads layer_types[i]
        lt = a["layer_types"] or []
        if lt and len(lt) < n:
            raise _fail(d.model_type, f"layer_types lists {len(lt)} kinds for {n} layers")
        return [lt[i] == "sliding_attention" if lt else i % 2 == 0 for i in range(n)]
    if kind is LayerKinds.HYBRID_PATTERN:  # mimo_v2_flash: .index(1) and .index(0) of it
        hp = a["hybrid_layer_pattern"]
        if not isinstance(hp, list) or len(hp) < n or 0 not in hp[:n] or 1 not in hp[:n]:
            raise _fail(d.model_type, f"'hybrid_layer_pattern' must list {n} layers of 0 (full) and 1 "
                        f"(sliding), holding both, got {hp!r}")
        return [hp[i] == 1 for i in range(n)]
    pattern = a[d.layers.period]
    if kind is LayerKinds.PERIOD:
        if not isinstance(pattern, int) or isinstance(pattern, bool) or not 0 < pattern <= n:
            # mlx-lm takes the global mask from cache[p - 1]
            raise _fail(d.model_type, f"'{d.layers.period}' must be an integer in 1..{n}, "
                                      f"got {pattern!r}")
        return [(i + 1) % pattern != 0 for i in range(n)]
    # LayerKinds.EXAONE: a string of L (local) and G (global), repeated
    if pattern and (not isinstance(pattern, str) or "L" not in pattern or "G" not in pattern):
        raise _fail(d.model_type, f"'{d.layers.period}' must be a string of L and G holding "
                                  f"both, got {pattern!r}")
    return [pattern[i % len(pattern)] == "L" if pattern else False for i in range(n)]


def _layer_type_rope(a: dict, i: int, head_dim: int) -> RopeSpec:  # mellum._rope_for
    params = a["rope_parameters"][a["layer_types"][i]]
    base = params["rope_theta"]
    rope_type = params.get("rope_type", "default")
    if rope_type in ("default", "linear"):
        return RopeSpec(RopeKind.LAYER_TYPE_PARAMS, head_dim, base, False)
    scaling_config = dict(params)
    scaling_config["type"] = rope_type
    return RopeSpec(RopeKind.LAYER_TYPE_PARAMS, head_dim, base, False, scaling_config,
                    a["max_position_embeddings"])


def _layer_type_partial_rope(a: dict, i: int, head_dim: int) -> RopeSpec:  # laguna._layer_rope
    rope_params = (a["rope_parameters"] or {}).get(a["layer_types"][i]) or {}
    base = rope_params.get("rope_theta", 10000.0)
    partial = rope_params.get(
        "partial_rotary_factor",
        a["partial_rotary_factor"] if a["partial_rotary_factor"] is not None else 1.0)
    dims = int(head_dim * partial)
    scaling_config = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    if "rope_type" not in scaling_config and "type" not in scaling_config:
        scaling_config["rope_type"] = "default"
    return RopeSpec(RopeKind.LAYER_TYPE_PARTIAL, dims, base, False, scaling_config,
                    a["max_position_embeddings"])


def _per_layer_lists_rope(a: dict, i: int, head_dim: int, mt: str) -> RopeSpec:  # step3p5
    rope_theta = a["rope_theta"]
    if isinstance(rope_theta, list):
        if i >= len(rope_theta):
            raise _fail(mt, f"rope_theta lists {len(rope_theta)} bases, none for layer {i}")
        rope_theta = rope_theta[i]
    partial_rotary_factor = 1.0
    if a["partial_rotary_factors"] and i < len(a["partial_rotary_factors"]):
        partial_rotary_factor = a["partial_rotary_factors"][i]
    rope_dims = int(head_dim * partial_rotary_factor)
    yarn_only_types = a["yarn_only_types"] or []
    layer_types = a["layer_types"] or []
    layer_type = layer_types[i] if layer_types else "full_attention"
    rope_scaling = None if yarn_only_types and layer_type not in yarn_only_types else a["rope_scaling"]
    return RopeSpec(RopeKind.PER_LAYER_LISTS, rope_dims, rope_theta, False, rope_scaling,
                    a["max_position_embeddings"])


def _rope_for(d: ArchDescriptor, a: dict, i: int, sliding: bool, head_dim: int,
              any_sliding: bool) -> RopeSpec | None:
    r, mt = d.rope, d.model_type
    if r.kind is RopeKind.LAYER_TYPE_PARAMS:
        return _layer_type_rope(a, i, head_dim)
    if r.kind is RopeKind.PER_LAYER_LISTS:
        return _per_layer_lists_rope(a, i, head_dim, mt)
    if r.kind is RopeKind.LAYER_TYPE_PARTIAL:
        return _layer_type_partial_rope(a, i, head_dim)
    if r.kind is RopeKind.LAYER_TYPE_PLAIN:  # spark2_5._make_rope
        params = a["rope_parameters"][a["layer_types"][i]]
        return RopeSpec(r.kind, int(head_dim * float(params.get("partial_rotary_factor", 1.0))),
                        float(params.get("rope_theta", 10000.0)), False)
    if r.nope is NopeRule.ALL or (r.nope is NopeRule.NO_ROPE_LAYERS and not a["no_rope_layers"][i]):
        return None
    if r.nope is NopeRule.NOPE_TYPE and a["position_embedding_type"] == "nope":
        return None
    if r.nope is NopeRule.ZERO_THETA and not a["layer_rope_theta"][i]:
        return None
    if r.nope is NopeRule.SLIDING_OR_ALL and any_sliding and not sliding:
        return None
    if r.nope is NopeRule.GLOBAL_LAYERS:
        if d.layers.kinds is LayerKinds.EXAONE and not a[d.layers.period]:
            pass  # exaone4 without a pattern: every layer ropes
        elif not sliding:
            return None
    dims = int(head_dim * _get(a, r.partial, mt)) if r.partial else head_dim
    if r.rotary_dim and a[r.rotary_dim] is not None:  # bailing_moe: rotary_dim wins
        dims = _int_field(a, r.rotary_dim, mt)
    base = _get(a, r.theta, mt)
    if r.kind is RopeKind.INITIALIZE:
        traditional = _get(a, r.traditional, mt)
        if sliding and r.sliding_theta:
            return RopeSpec(r.kind, dims, _get(a, r.sliding_theta, mt), traditional)
        scaling = _get(a, r.scaling, mt) if r.scaling else None
        max_pos = _get(a, r.max_positions, mt) if r.max_positions else None
        return RopeSpec(r.kind, dims, base, traditional, scaling, max_pos)
    if r.kind is RopeKind.PHI3:
        return RopeSpec(r.kind, dims, base, a["rope_traditional"], a["rope_scaling"],
                        a["max_position_embeddings"], a["original_max_position_embeddings"])
    if r.kind is RopeKind.SU_SCALED:
        return RopeSpec(r.kind, dims, base, False, a["rope_scaling"], a["max_position_embeddings"],
                        a["original_max_position_embeddings"])
    if r.kind is RopeKind.NEMOTRON:
        rs = a["rope_scaling"]
        scale = 1 / rs["factor"] if rs and rs["type"] == "linear" else 1.0
        return RopeSpec(r.kind, dims, base, scale=scale)
    if r.kind is RopeKind.HUNYUAN_ALPHA:
        rs = a["rope_scaling"]
        alpha = rs["alpha"] if rs and "alpha" in rs else 1.0
        return RopeSpec(r.kind, dims, base, alpha=alpha)
    return RopeSpec(r.kind, dims, base)  # RopeKind.NANOCHAT


_ATTN_SCALES: Mapping[AttnScale, Callable[[dict, int], float]] = exhaustive(AttnScale, {
    AttnScale.HEAD_DIM: lambda a, head_dim: head_dim**-0.5,
    AttnScale.QPAS_INV_SQRT: lambda a, head_dim: 1.0 / (a["query_pre_attn_scalar"] ** 0.5),
    AttnScale.QPAS_POW: lambda a, head_dim: a["query_pre_attn_scalar"] ** -0.5,
    AttnScale.SQRT_INV: lambda a, head_dim: math.sqrt(1 / head_dim),
    AttnScale.ATTENTION_MULTIPLIER: lambda a, head_dim: a["attention_multiplier"],
    AttnScale.INV_SQRT: lambda a, head_dim: 1 / math.sqrt(head_dim),
})


def _sliding_heads(d: ArchDescriptor, a: dict) -> tuple[int, int] | None:
    """step3p5: a sliding layer's (heads, kv heads) from attention_other_setting, when set."""
    other = a[d.layers.sliding_heads] if d.layers.sliding_heads else None
    if not other:
        return None
    if not isinstance(other, Mapping):
        raise _fail(d.model_type, f"'{d.layers.sliding_heads}' must be an object, got {other!r}")
    keys = ("num_attention_heads", "num_attention_groups")
    missing = [k for k in keys if k not in other]
    if missing:
        raise _fail(d.model_type, f"'{d.layers.sliding_heads}' lacks {', '.join(missing)}")
    return tuple(_int_field(other, k, d.model_type) for k in keys)


def _make_divisible_width(a: dict, hidden: int, i: int, mt: str) -> int:
    """openelm's MLP width of layer i: int(make_divisible(ffn_multipliers[i] * hidden, divisor))."""
    mults, divisor = a["ffn_multipliers"], _int_field(a, "ffn_dim_divisor", mt)
    if not isinstance(mults, (list, tuple)) or i >= len(mults) or isinstance(mults[i], bool) \
            or not isinstance(mults[i], (int, float)):
        raise _fail(mt, f"'ffn_multipliers' must list a number for layer {i}, got {mults!r}")
    v = mults[i] * hidden  # make_divisible(v, divisor), min_value = divisor
    new_v = max(divisor, int(v + divisor / 2) // divisor * divisor)
    if new_v < 0.9 * v:
        new_v += divisor
    return int(new_v)


def _per_layer_heads(d: ArchDescriptor, a: dict, i: int) -> tuple[int, int]:
    """Layer i's (heads, KV heads) from the per-layer lists (KV: the row's n_kv_heads unless listed)."""
    mt, lk, out = d.model_type, d.layers, []
    for name in (lk.heads_per_layer, lk.kv_heads_per_layer):
        if name is None:
            out.append(_int_field(a, d.n_kv_heads, mt))
            continue
        values = a[name]
        h = values[i] if isinstance(values, (list, tuple)) and i < len(values) else None
        if not isinstance(h, int) or isinstance(h, bool) or h <= 0:
            raise _fail(mt, f"'{name}'[{i}] must be a positive integer, got {h!r}")
        out.append(h)
    return out[0], out[1]


def _layer_attn(d: ArchDescriptor, a: dict, i: int, sliding: bool, head_dim: int) -> dict[str, Any]:
    """A layer's own attention shape, as LayerSpec fields: heads, dims, scale, sinks."""
    mt, sa = d.model_type, d.layers.sliding_attn
    sinks = d.sinks and (d.sinks_when is None or bool(a[d.sinks_when[sliding]]))
    if sliding and sa is not None:  # mimo_v2_flash's swa_* fields
        hd = _int_field(a, sa.head_dim, mt)
        return dict(heads=(_int_field(a, sa.heads, mt), _int_field(a, sa.kv_heads, mt)), sinks=sinks,
                    dims=(hd, _int_field(a, sa.v_head_dim, mt)), scale=_ATTN_SCALES[d.attn_scale](a, hd))
    if sliding and d.layers.sliding_heads:  # step3p5
        return dict(heads=_sliding_heads(d, a), sinks=sinks)
    if d.layers.heads_per_layer:  # laguna, openelm
        return dict(heads=_per_layer_heads(d, a, i), sinks=sinks)
    return dict(dims=(head_dim, _int_field(a, d.v_head_dim, mt)) if d.v_head_dim else None, sinks=sinks)


def _swiglu_limits(d: ArchDescriptor, a: dict, i: int) -> tuple[float, float]:
    """step3p5: layer i's (routed, shared / dense) SwiGLU limits; 0 = unclamped."""
    if d.swiglu_clamp is None:
        return (0, 0)
    out = []
    for key in ("swiglu_limits", "swiglu_limits_shared"):
        limits = a[key]
        limit = (limits[i] or 0) if limits and i < len(limits) else 0
        if isinstance(limit, bool) or not isinstance(limit, (int, float)):
            raise _fail(d.model_type, f"'{key}'[{i}] must be a number or null, got {limit!r}")
        out.append(limit)
    return tuple(out)


def resolve_args(d: ArchDescriptor, config: Mapping[str, Any]) -> UniversalArgs:
    """Apply a descriptor to a config dict (the whole config.json, as mlx-lm reads it)."""
    mt = d.model_type
    a = model_args(d, config)
    hidden = _int_field(a, d.hidden, mt)
    n_layers = _int_field(a, d.n_layers, mt)
    if d.n_heads is None and not d.layers.kv_heads_per_layer:  # mamba: no layer attends
        n_heads = n_kv = 1  # (placeholders: no attention is built)
    elif d.n_heads is None:  # openelm: every layer its own counts; the model-wide ones are layer 0's
        n_heads, n_kv = _per_layer_heads(d, a, 0)
    else:
        n_heads = _int_field(a, d.n_heads, mt)
        n_kv = _int_field(a, d.n_kv_heads, mt) if d.n_kv_heads else n_heads
    if d.kv_tile:  # plamo: ceil(heads / n_shared_head), tiled back to the heads
        shared = _int_field(a, d.kv_tile, mt)
        n_kv = -(-n_heads // shared)
        if n_kv * shared != n_heads:
            raise _fail(mt, f"{n_heads} heads tile from {n_kv} KV heads x {d.kv_tile} {shared} = "
                            f"{n_kv * shared}, not the heads: mlx-lm's attention cannot run it")
    vocab = _int_field(a, d.vocab, mt)
    if d.head_dim is HeadDim.SPLIT:
        head_dim = hidden // n_heads
    elif d.head_dim is HeadDim.FIELD:
        head_dim = _int_field(a, "head_dim", mt)
    else:
        head_dim = a.get("head_dim") or hidden // n_heads
    if d.mlp.intermediate is MlpSize.FOUR_X_HIDDEN:
        inter = 4 * hidden
    elif d.mlp.intermediate is MlpSize.LILLE:
        inter = 256 * round(int(8 * hidden / 3) / 256)
    elif d.mlp.intermediate is MlpSize.HALF_INTERMEDIATE:
        inter = _int_field(a, "intermediate_size", mt) // 2
    elif d.mlp.intermediate is MlpSize.SCALED_HIDDEN:
        inter = int(hidden * a["hidden_dim_scale_factor"])
    elif d.mlp.intermediate is MlpSize.MAKE_DIVISIBLE:
        inter = _make_divisible_width(a, hidden, 0, mt)
    elif d.mlp.intermediate is MlpSize.LFM2:
        inter = lfm2_intermediate(a, mt)
    else:
        inter = _int_field(a, d.mlp.intermediate, mt)

    kinds = layer_kinds(d, a, n_layers)
    if len(kinds) != n_layers:
        raise _fail(mt, f"{len(kinds)} layer kinds for {n_layers} layers")
    routed = moe_layers(d, a, n_layers)
    mixers = mixer_layers(d, a, n_layers)
    ffn = ffn_layers(d, a, n_layers)
    kv_proj = _kv_proj(d, a, n_layers)
    attn = [_layer_attn(d, a, i, s, head_dim) for i, s in enumerate(kinds)]
    per_layer_width = d.mlp.intermediate is MlpSize.MAKE_DIVISIBLE
    layers = tuple(LayerSpec(i, s, _rope_for(d, a, i, s, (at.get("dims") or (head_dim,))[0], any(kinds)),
                             routed[i], kv_proj[i], swiglu_limits=_swiglu_limits(d, a, i),
                             mixer=mixers[i], ffn_only=ffn[i],
                             width=_make_divisible_width(a, hidden, i, mt) if per_layer_width else None, **at)
                   for i, (s, at) in enumerate(zip(kinds, attn)))
    window = a[d.layers.sliding_window] if d.layers.sliding_window else None
    if any(kinds) and d.layers.make_cache is MakeCache.ROTATING_SLIDING:
        if not isinstance(window, int) or window <= 0:
            raise _fail(mt, f"sliding layers need a positive integer sliding_window, got {window!r}")

    tie = False if d.head.tie is TieRule.CHECKPOINT else bool(_get(a, d.head.tie, mt))
    b = d.block
    if b.residual_scale is ResidualScale.MINICPM_DEPTH:
        residual_scale = a["scale_depth"] / a["num_hidden_layers"] ** 0.5
    else:
        residual_scale = _get(a, b.residual_scale, mt)
    embed_scale = d.embed_scale
    if embed_scale is not None and not isinstance(embed_scale, EmbedScale):
        embed_scale = a[embed_scale]
    pre_divide = (a["hidden_size"] / a["dim_model_base"]
                  if d.head.pre_divide is PreDivide.WIDTH_RATIO else None)
    post = (d.head.post.op, a[d.head.post.by]) if d.head.post else None
    if post is not None and post[0] is PostOp.TIED_MUL_RATIO:  # falcon_h1: tied heads only
        post = (PostOp.MUL, tied_ratio(a, d.head.post.by, POST_OVER[post[0]], mt)) if tie else None
    softcap = d.head.softcap
    softcap_value = a["final_logit_softcapping"] if softcap is FinalSoftcap.FIELD else None
    llama4 = None
    if d.query_scale is QueryScale.LLAMA4:
        rp = a["rope_parameters"]
        llama4 = (rp["llama_4_scaling_beta"], rp["original_max_position_embeddings"])

    return UniversalArgs(
        model_type=mt, fields=MappingProxyType(a), hidden=hidden, n_layers=n_layers,
        n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, vocab=vocab, intermediate=inter,
        eps=(_get(a, d.norm.eps, mt) if d.norm.kind is not NormKind.FUNCTIONAL_RMS or d.norm.eps in a
             else 1e-5),  # (functional: nanochat's hard-coded 1e-5; talkie's rms_norm_eps field)
        attn_bias=bool(_get(a, d.attn_bias, mt)), out_bias=bool(_get(a, d.out_bias, mt)),
        mlp_bias=bool(_get(a, d.mlp.bias, mt)), norm_bias=bool(_get(a, d.norm.bias, mt)),
        qk_norm=bool(d.qk_norm and _get(a, d.qk_norm.enabled, mt)),
        attn_scale=_ATTN_SCALES[d.attn_scale](a, head_dim),
        attn_softcap=a["attn_logit_softcapping"] if d.attention is AttnKind.SOFTCAP else None,
        layers=layers, sliding_window=window, tie=tie, embed_scale=embed_scale,
        residual_scale=residual_scale, head_pre_divide=pre_divide, head_post=post,
        final_softcap=softcap, final_softcap_value=softcap_value, llama4=llama4,
        parallel=bool(_get(a, b.parallel, mt)), moe=resolve_moe(d, a, routed),
    )
