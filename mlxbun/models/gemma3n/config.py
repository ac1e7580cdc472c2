"""gemma3n's text config as mlx-lm 0.32.2 reads it (`models/gemma3n.py` `TextConfig`, built from
`text_config` alone), checked so a config mlx-lm could not run is refused naming the key, and
the config-key coverage `mlxbun port` reports (every key understood, harmless, ignored as mlx-lm
ignores it, or refused).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Optional

from mlxbun.config_reader import thaw
from mlxbun.errors import ConfigError, UnsupportedModelError
from mlxbun.models.universal.coverage import HARMLESS_KEYS, CoverageReport

__all__ = ["Gemma3nArgs", "MODEL_TYPE", "check_coverage", "gemma3n_args", "require_coverage"]

MODEL_TYPE = "gemma3n"
FULL, SLIDING = "full_attention", "sliding_attention"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass(frozen=True)
class Gemma3nArgs:
    """mlx-lm's gemma3n `TextConfig` (every field but rope_scaling is required there too)."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: Any  # int, or one width per layer
    num_attention_heads: int
    head_dim: int
    rms_norm_eps: float
    vocab_size: int
    num_key_value_heads: int
    num_kv_shared_layers: int
    vocab_size_per_layer_input: int
    sliding_window: int
    max_position_embeddings: int
    rope_local_base_freq: float
    rope_theta: float
    final_logit_softcapping: Optional[float]
    layer_types: tuple
    activation_sparsity_pattern: Optional[tuple]
    hidden_size_per_layer_input: int
    altup_num_inputs: int
    altup_coef_clip: Optional[float]
    altup_correct_scale: bool
    altup_active_idx: int
    laurel_rank: int
    rope_scaling: Optional[Mapping] = None  # read by mlx-lm's TextConfig, never applied

    # ------------------------------------------------------------ derived (mlx-lm's expressions)

    @property
    def first_kv_shared(self) -> int:
        """The first layer that reads another layer's cache (num_hidden_layers - num_kv_shared_layers)."""
        return self.num_hidden_layers - self.num_kv_shared_layers

    @property
    def first_sliding_idx(self) -> int:
        return list(self.layer_types).index(SLIDING)

    @property
    def first_full_idx(self) -> int:
        return list(self.layer_types).index(FULL)

    @property
    def cache_idx(self) -> tuple[int, ...]:
        """mlx-lm's `layer_idx_to_cache_idx`: a layer before the shared ones owns cache i; a shared
        layer reads the cache of the last non-shared layer of its own kind."""
        concrete = list(self.layer_types[: self.first_kv_shared])
        last = {kind: len(concrete) - 1 - concrete[::-1].index(kind) for kind in (FULL, SLIDING)}
        return tuple(i if i < self.first_kv_shared else last[self.layer_types[i]]
                     for i in range(self.num_hidden_layers))

    def intermediate(self, layer: int) -> int:
        s = self.intermediate_size
        return s[layer] if isinstance(s, (list, tuple)) else s

    def sparsity(self, layer: int) -> float:
        p = self.activation_sparsity_pattern
        return 0.0 if p is None else p[layer]


_INTS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "vocab_size",
         "num_key_value_heads", "num_kv_shared_layers", "vocab_size_per_layer_input", "sliding_window",
         "max_position_embeddings", "hidden_size_per_layer_input", "altup_num_inputs",
         "altup_active_idx", "laurel_rank")
_FLOATS = ("rms_norm_eps", "rope_local_base_freq", "rope_theta")
_OPTIONAL_FLOATS = ("final_logit_softcapping", "altup_coef_clip")


def text_config(config: Mapping[str, Any], source: str = "config.json") -> dict:
    """The `text_config` object mlx-lm's gemma3n builds its language model from (alone)."""
    text = config.get("text_config")
    if not isinstance(text, Mapping):
        raise ConfigError(f"{source}: gemma3n needs a 'text_config' object (mlx-lm's ModelArgs reads "
                          f"the language model from it), got {text!r}")
    return thaw(text)


def gemma3n_args(config: Mapping[str, Any], source: str = "config.json") -> Gemma3nArgs:
    """The checked args of a gemma3n config.json dict (the wrapper level, holding text_config)."""
    text = text_config(config, source)
    where = f"{source}: text_config"
    kw: dict[str, Any] = {}
    for f in fields(Gemma3nArgs):
        if f.name == "rope_scaling":
            kw[f.name] = text.get(f.name)
            continue
        if f.name not in text:
            raise ConfigError(f"{where}: required key {f.name!r} is missing (mlx-lm's gemma3n TextConfig "
                              "has no default for it)")
        kw[f.name] = text[f.name]
    a = kw
    bad = next((k for k in _INTS if not _is_int(a[k])), None) or next(
        (k for k in _FLOATS if not _is_num(a[k])), None) or next(
        (k for k in _OPTIONAL_FLOATS if a[k] is not None and not _is_num(a[k])), None)
    if bad:
        raise ConfigError(f"{where}: key {bad!r} = {a[bad]!r} is not a number of the expected kind")
    if not isinstance(a["altup_correct_scale"], bool):
        raise ConfigError(f"{where}: key 'altup_correct_scale' must be a bool, got {a['altup_correct_scale']!r}")
    for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "vocab_size", "vocab_size_per_layer_input", "hidden_size_per_layer_input", "altup_num_inputs",
              "laurel_rank", "sliding_window"):
        if a[k] < 1:
            raise ConfigError(f"{where}: key {k!r} = {a[k]!r} must be positive")
    n = a["num_hidden_layers"]
    if a["num_attention_heads"] % a["num_key_value_heads"]:
        raise ConfigError(f"{where}: key 'num_key_value_heads' = {a['num_key_value_heads']!r} must divide "
                          f"num_attention_heads = {a['num_attention_heads']!r}")
    if not 0 <= a["altup_active_idx"] < a["altup_num_inputs"]:
        raise ConfigError(f"{where}: key 'altup_active_idx' = {a['altup_active_idx']!r} is outside "
                          f"0..altup_num_inputs-1 ({a['altup_num_inputs']})")
    inter = a["intermediate_size"]
    if isinstance(inter, (list, tuple)):
        if len(inter) < n or not all(_is_int(x) and x > 0 for x in inter):
            raise ConfigError(f"{where}: key 'intermediate_size' must be a positive int or one per layer "
                              f"({n}), got {inter!r}")
        a["intermediate_size"] = tuple(inter)
    elif not (_is_int(inter) and inter > 0):
        raise ConfigError(f"{where}: key 'intermediate_size' must be a positive int, got {inter!r}")
    lt = a["layer_types"]
    if not isinstance(lt, (list, tuple)) or len(lt) < n:
        raise ConfigError(f"{where}: key 'layer_types' must list one kind per layer ({n}), got {lt!r}")
    odd = sorted({t for t in lt[:n] if t not in (FULL, SLIDING)}, key=str)
    if odd:
        raise UnsupportedModelError(f"{where}: key 'layer_types': layer kind(s) {', '.join(map(repr, odd))} "
                                    f"are not supported (mlx-lm's gemma3n runs {FULL!r} and {SLIDING!r})")
    a["layer_types"] = tuple(lt)
    shared = a["num_kv_shared_layers"]
    if not 0 <= shared < n:
        raise ConfigError(f"{where}: key 'num_kv_shared_layers' = {shared!r} must be in 0..{n - 1}")
    concrete = lt[: n - shared]
    if FULL not in concrete or SLIDING not in concrete:
        raise UnsupportedModelError(
            f"{where}: key 'layer_types': the layers before the {shared} KV-shared ones must hold both a "
            f"{FULL!r} and a {SLIDING!r} layer (mlx-lm's gemma3n looks both up), got {list(concrete)}")
    sp = a["activation_sparsity_pattern"]
    if sp is not None:
        if not isinstance(sp, (list, tuple)) or len(sp) < n or not all(_is_num(x) and 0 <= x < 1 for x in sp):
            raise ConfigError(f"{where}: key 'activation_sparsity_pattern' must be null or one fraction in "
                              f"[0, 1) per layer ({n}), got {sp!r}")
        a["activation_sparsity_pattern"] = tuple(sp)
    return Gemma3nArgs(**a)


# ----------------------------------------------------------------- coverage

# text_config keys mlx-lm's gemma3n does not read, and why that is harmless here
_IGNORED = {
    "tie_word_embeddings": "mlx-lm's gemma3n always runs the head as embed_tokens.as_linear",
    "rope_scaling": "mlx-lm's gemma3n reads it into TextConfig but builds plain nn.RoPE (never applies it)",
    "attention_dropout": None,
    "query_pre_attn_scalar": "mlx-lm's gemma3n attends with scale 1.0 (the q/k norms set the scale)",
    "altup_lr_multiplier": "a training-time learning-rate multiplier (Gemma 3n hub configs carry 1.0)",
}
_ACCEPTED = {"hidden_activation": ("gelu_pytorch_tanh",), "hidden_act": ("gelu_pytorch_tanh",),
             "attention_bias": (False,)}


def check_coverage(config: Mapping[str, Any], source: str = "config.json") -> CoverageReport:
    """Sort a gemma3n config.json's keys (text_config's, prefixed, and the wrapper's own)."""
    config = thaw(config)
    a = gemma3n_args(config, source)
    text = text_config(config, source)
    understood, harmless, unknown = [], [], []
    ignored: dict[str, str] = {k: "outside text_config (mlx-lm's gemma3n reads only text_config; the "
                               "vision and audio towers are not built)" for k in config
                               if k not in ("text_config", "model_type") and k not in HARMLESS_KEYS}
    harmless += [k for k in config if k in HARMLESS_KEYS]
    understood.append("model_type")
    offending: dict[str, str] = {}
    names = {f.name for f in fields(Gemma3nArgs)} - {"rope_scaling"}
    for key, value in text.items():
        k = f"text_config.{key}"
        if key in _ACCEPTED and value is not None:
            if value in _ACCEPTED[key]:
                understood.append(k)
            else:
                offending[k] = f"value {value!r}; gemma3n runs only {', '.join(map(repr, _ACCEPTED[key]))}"
        elif key in names:
            understood.append(k)
        elif key == "rope_parameters" and value is not None:
            problem = _rope_parameters_problem(a, value)
            if problem:
                offending[k] = f"disagrees with the rope keys mlx-lm reads: {problem}"
            else:
                understood.append(k)
        elif key in _IGNORED:
            ignored[k] = _IGNORED[key] or "not read by mlx-lm's gemma3n"
        elif key in HARMLESS_KEYS:
            harmless.append(k)
        elif value is None or value is False or value in (0, "", [], {}):
            unknown.append(k)
        else:
            offending[k] = f"unknown key with value {value!r} could change numerics"
    return CoverageReport(MODEL_TYPE, tuple(understood), tuple(harmless), ignored, tuple(unknown), offending)


def _rope_parameters_problem(a: Gemma3nArgs, rp: Any) -> str | None:
    """transformers 5's per-kind rope_parameters must say what mlx-lm runs: default rope with
    rope_theta on full layers, rope_local_base_freq on sliding ones."""
    if not isinstance(rp, Mapping):
        return f"expected an object, got {rp!r}"
    want = {FULL: a.rope_theta, SLIDING: a.rope_local_base_freq}
    problems = []
    for kind, p in rp.items():
        if kind not in want or not isinstance(p, Mapping):
            problems.append(f"{kind!r}: expected {FULL!r} / {SLIDING!r} objects")
            continue
        if p.get("rope_type", p.get("type", "default")) != "default":
            problems.append(f"{kind} rope type {p.get('rope_type', p.get('type'))!r} (mlx-lm runs default rope)")
        if "rope_theta" in p and p["rope_theta"] != want[kind]:
            problems.append(f"{kind} rope_theta {p['rope_theta']!r} vs {want[kind]!r}")
    return "; ".join(problems) or None


def require_coverage(config: Mapping[str, Any], source: str = "config.json") -> CoverageReport:
    report = check_coverage(config, source)
    if not report.ok:
        bad = "; ".join(f"'{k}' ({why})" for k, why in report.offending.items())
        raise UnsupportedModelError(f"{MODEL_TYPE}: config key(s) the gemma3n graph does not support: {bad}")
    return report
