"""DiffusionGemma's config: mlx-vlm 0.7.10's `TextConfig` / `ModelConfig` (same fields and
defaults), validated with errors that name the key, read from config.json (+
generation_config.json, merged as mlx-vlm merges it)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from mlxbun.errors import ConfigError, UnsupportedModelError

__all__ = [
    "FULL",
    "MODEL_TYPE",
    "SLIDING",
    "TEXT_MODEL_TYPE",
    "DiffusionGemmaConfig",
    "DiffusionGemmaTextConfig",
    "config_from_dict",
    "eos_token_ids",
    "load_config",
]

MODEL_TYPE = "diffusion_gemma"
TEXT_MODEL_TYPE = "diffusion_gemma_text"
FULL, SLIDING = "full_attention", "sliding_attention"


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


def eos_token_ids(config: DiffusionGemmaConfig) -> tuple[int, ...]:
    """EOS ids the model declares: config.json / generation_config.json's top-level ones."""
    ids = []
    for src in (config.eos_token_id, (config.generation_config or {}).get("eos_token_id")):
        for i in ([src] if _is_int(src) else (src or ())):
            if _is_int(i) and i not in ids:
                ids.append(i)
    return tuple(ids)
