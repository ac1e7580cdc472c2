"""One immutable, normalized view of a checkpoint's configuration.

`load_model_config(dir)` reads `config.json` (+ optional `generation_config.json`,
`tokenizer_config.json`, optiq `kv_config.json`) and returns a `TextConfig`:
sizes under their canonical names, one attention kind and one rope flag per
layer, rope parameters per layer kind, the EOS union, quantization with its
per-module overrides, and the VLM-wrapper facts (text-level dict, weight
prefix). The raw dicts are kept, read-only.

Semantics follow the pinned mlx-lm (how wrappers unwrap `text_config`, the
model_type remapping, quantization overrides) and transformers where mlx-lm
is silent (default layer patterns). Values the checkpoint does not declare
and that differ per architecture (rope_theta, softcaps) stay None here: the
descriptor table owns architecture defaults.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbun.errors import ConfigError

__all__ = [
    "ConfigError",
    "FrozenDict",
    "KVLayerSpec",
    "MODEL_ARCHITECTURE_REMAPPING",
    "MODEL_REMAPPING",
    "QuantSpec",
    "TextConfig",
    "config_from_dict",
    "load_model_config",
]

# Vendored from mlx_lm/utils.py (mlx-lm 0.32.2); tests assert it still equals the source.
MODEL_REMAPPING = {
    "mistral": "llama",
    "llava": "mistral3",
    "phi-msft": "phixtral",
    "falcon_mamba": "mamba",
    "joyai_llm_flash": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "qwen2_5_vl": "qwen2_vl",
    "minimax_m2": "minimax",
    "iquestcoder": "llama",
    "xverse": "llama",
    "gemma4_unified": "gemma4",
    "deepseek_v41_text": "deepseek_v41",
}
MODEL_ARCHITECTURE_REMAPPING = {
    ("bailing_hybrid", "BailingMoeV3ForCausalLM"): "bailing_moe_v3",
}

FULL, SLIDING = "full_attention", "sliding_attention"

# Where each mlx-lm wrapper nests its language model (module path == saved weight prefix).
_WRAPPER_PREFIX = {
    **dict.fromkeys(
        ["gemma3", "gemma4", "mistral3", "pixtral", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe",
         "qwen3_5", "qwen3_5_moe", "kimi_vl", "kimi_k25", "kimi_k3", "llama4",
         "minimax_m3_vl", "lfm2-vl", "lfm2_vl"],
        "language_model.",
    ),
    "gemma3n": "model.language_model.",
    "muse_spark": "model.language_model.",
}

# Layer patterns and windows the families use when the config leaves them out
# (mlx-lm ModelArgs defaults; gemma2's alternation is transformers', mlx-lm has none).
_DEFAULT_SLIDING_PATTERN = {"gemma3_text": 6, "gemma4_text": 5, "cohere2": 4, "olmo3": 4, "gemma2": 2}
_DEFAULT_SLIDING_WINDOW = {"gemma3_text": 512, "gemma4_text": 512, "cohere2": 4096}
_DEFAULT_NO_ROPE_INTERVAL = {"smollm3": 4, "llama4": 4, "llama4_text": 4}
# Text-model defaults that released checkpoints rely on: Gemma 3 VLM configs ship a
# sparse text_config (no head_dim, eps, rope bases), so mlx-lm's gemma3_text ModelArgs
# defaults apply. Without them head_dim would fall back to hidden/heads (wrong: 320 vs 256).
_TEXT_DEFAULTS = {
    "gemma3_text": {"head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0},
}

# Canonical field -> accepted keys, in priority order (surveyed from mlx-lm ModelArgs).
_ALIASES = {
    "vocab_size": ("vocab_size", "n_vocab", "padded_vocab_size"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "model_dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers",
                          "num_transformer_layers"),
    "num_attention_heads": ("num_attention_heads", "n_head", "n_heads", "num_heads"),
    "num_key_value_heads": ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "kv_n_heads"),
    "head_dim": ("head_dim",),
    "intermediate_size": ("intermediate_size", "n_inner", "ffn_hidden_size", "ffn_dim"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len",
                                "seq_length", "max_sequence_length"),
    "norm_eps": ("rms_norm_eps", "layer_norm_eps", "norm_eps", "layer_norm_epsilon",
                 "norm_epsilon", "layernorm_epsilon", "rms_norm_epsilon"),
    "rope_theta": ("rope_theta", "rotary_emb_base"),
    "attn_logit_softcap": ("attn_logit_softcapping", "attn_logit_softcap"),
    "final_logit_softcap": ("final_logit_softcapping", "final_logit_softcap", "logits_soft_cap"),
    "partial_rotary_factor": ("partial_rotary_factor", "rotary_pct", "rope_pct"),
}


# ---------------------------------------------------------------- read-only containers


class FrozenDict(dict):
    """A dict that refuses mutation: read-only, yet `json.dumps` and `dict()` still work."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("this config mapping is read-only")

    __setitem__ = __delitem__ = __ior__ = _refuse
    clear = pop = popitem = setdefault = update = _refuse

    def __reduce__(self):
        return (FrozenDict, (dict(self),))

    def __repr__(self) -> str:
        return f"FrozenDict({dict.__repr__(self)})"


def _freeze(value: Any) -> Any:
    if isinstance(value, Mapping):
        return FrozenDict({k: _freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(_freeze(v) for v in value)
    return value


# ---------------------------------------------------------------- value types


@dataclass(frozen=True)
class QuantSpec:
    """How one module's weights are packed (mlx `nn.quantize` parameters)."""

    bits: int
    group_size: int
    mode: str = "affine"


@dataclass(frozen=True)
class KVLayerSpec:
    """One optiq kv_config.json entry: the KV-cache precision of one cache index."""

    layer_idx: int
    bits: int | float  # 0 = full precision (optiq convention)
    group_size: int = 64


# Defaults `nn.QuantizedLinear` applies when an override omits group_size/bits.
_MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}


@dataclass(frozen=True, eq=True)
class TextConfig:
    """The normalized text-model configuration of a checkpoint (immutable)."""

    path: Path | None
    raw_full: Mapping[str, Any]
    raw: Mapping[str, Any]
    source_model_type: str
    model_type: str
    text_model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int | tuple[int, ...] | None
    num_hidden_layers: int
    num_attention_heads: int | None
    num_key_value_heads: int | None
    head_dim: int | None
    norm_eps: float | None
    tie_word_embeddings: bool
    tie_word_embeddings_raw: bool | None
    max_position_embeddings: int | None
    dtype: str | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    use_rope: tuple[bool, ...]
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    partial_rotary_factor: float
    rope: Mapping[str, Mapping[str, Any]]
    eos_token_ids: tuple[int, ...]
    unresolved_eos_tokens: tuple[str, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    quantization: QuantSpec | None
    quant_overrides: Mapping[str, QuantSpec | None]
    quant_method: str | None
    kv_config: tuple[KVLayerSpec, ...] | None
    is_vlm: bool
    weight_prefix: str
    has_vision: bool
    has_audio: bool
    vision_sidecar: Path | None
    generation_config: Mapping[str, Any] = field(default_factory=lambda: FrozenDict())
    tokenizer_config: Mapping[str, Any] = field(default_factory=lambda: FrozenDict())

    def rope_for(self, layer_type: str) -> Mapping[str, Any]:
        """The rope parameters of one layer kind ("full_attention", "sliding_attention", ...)."""
        try:
            return self.rope[layer_type]
        except KeyError:
            raise ConfigError(
                f"{self._label()}: no rope parameters for layer type '{layer_type}' "
                f"(declared: {sorted(self.rope)})"
            ) from None

    def quant_for(self, path: str) -> QuantSpec | None:
        """The packing of the module at `path` (mlx-lm module path), None if unquantized.

        A per-module override wins (False -> None); else the global spec. Paths are
        tried as given and with the VLM weight prefix added or removed, so both
        "model.layers.0.mlp.down_proj" and "language_model.model.layers.0..." resolve.
        """
        for candidate in self._path_candidates(path):
            if candidate in self.quant_overrides:
                return self.quant_overrides[candidate]
        return self.quantization

    def fingerprint(self) -> str:
        """Stable sha256 of the structural fields (a profile's structural guard)."""
        return _fingerprint(self)

    def __hash__(self) -> int:
        return hash((self.path, self.fingerprint()))

    def _path_candidates(self, path: str) -> list[str]:
        out = [path]
        prefix = self.weight_prefix
        if prefix:
            out.append(path[len(prefix):] if path.startswith(prefix) else prefix + path)
        return out

    def _label(self) -> str:
        return str(self.path / "config.json") if self.path else "config.json"


def _fingerprint(c: TextConfig) -> str:
    def q(spec: QuantSpec | None):
        return None if spec is None else [spec.bits, spec.group_size, spec.mode]

    structure = {
        "model_type": c.model_type,
        "text_model_type": c.text_model_type,
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "norm_eps": c.norm_eps,
        "tie_word_embeddings": c.tie_word_embeddings,
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": c.layer_types,
        "sliding_window": c.sliding_window,
        "use_rope": c.use_rope,
        "attn_logit_softcap": c.attn_logit_softcap,
        "final_logit_softcap": c.final_logit_softcap,
        "partial_rotary_factor": c.partial_rotary_factor,
        "rope": c.rope,
        "quantization": q(c.quantization),
        "quant_overrides": {k: q(v) for k, v in c.quant_overrides.items()},
        "quant_method": c.quant_method,
        "weight_prefix": c.weight_prefix,
    }
    payload = json.dumps(structure, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- file reading

# transformers tags non-finite floats so config.json stays valid JSON (as mlx-lm undoes it).
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _decode_tagged_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: _decode_tagged_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_tagged_floats(v) for v in obj]
    return obj


def _read_json(file: Path, *, required: bool, expect=dict) -> Any:
    """Parse one JSON file; None when optional and absent. Errors name the file."""
    if not file.is_file():
        if required:
            raise ConfigError(f"{file}: file not found (a checkpoint directory needs config.json)")
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{file}: not valid JSON ({e})") from None
    except OSError as e:
        raise ConfigError(f"{file}: cannot be read ({e})") from None
    if not isinstance(data, expect):
        want = " or ".join(t.__name__ for t in (expect if isinstance(expect, tuple) else (expect,)))
        want = want.replace("dict", "a JSON object").replace("list", "a JSON list")
        raise ConfigError(f"{file}: expected {want} at the top level, got {_json_type(data)}")
    return _decode_tagged_floats(data)


def _json_type(v: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


def load_model_config(path: str | Path) -> TextConfig:
    """Load and normalize a checkpoint directory (or its config.json)."""
    path = Path(path).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise ConfigError(f"{path / 'config.json'}: file not found (no such checkpoint directory)")
    config = _read_json(path / "config.json", required=True)
    generation = _read_json(path / "generation_config.json", required=False)
    tokenizer = _read_json(path / "tokenizer_config.json", required=False)
    kv = None
    for kv_file in (path / "kv_config.json", path / "optiq" / "kv_config.json"):
        if kv_file.is_file():
            kv = (_read_json(kv_file, required=True, expect=(list, dict)), kv_file)
            break
    return _build(config, path=path, generation_config=generation, tokenizer_config=tokenizer,
                  kv_config=kv)


def config_from_dict(
    d: Mapping[str, Any],
    *,
    path: str | Path | None = None,
    generation_config: Mapping[str, Any] | None = None,
    tokenizer_config: Mapping[str, Any] | None = None,
    kv_config: Any = None,
) -> TextConfig:
    """Normalize an in-memory config.json dict (`path`, if given, is used for
    error messages, tokenizer.json look-ups and sidecar detection)."""
    path = Path(path) if path is not None else None
    label = str(path / "config.json") if path else "config.json"
    if not isinstance(d, Mapping):
        raise ConfigError(f"{label}: expected a JSON object at the top level, got {_json_type(d)}")
    for name, extra in (("generation_config.json", generation_config),
                        ("tokenizer_config.json", tokenizer_config)):
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"{name}: expected a JSON object at the top level, got {_json_type(extra)}")
    kv = None
    if kv_config is not None:
        kv = (kv_config, (path / "kv_config.json") if path else Path("kv_config.json"))
    return _build(_decode_tagged_floats(_thaw(d)), path=path,
                  generation_config=_thaw(generation_config), tokenizer_config=_thaw(tokenizer_config),
                  kv_config=kv)


def _thaw(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {k: _thaw(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_thaw(x) for x in v]
    return v


# ---------------------------------------------------------------- typed getters


class _Reader:
    """Typed access to the text-level dict; errors name the file and the key."""

    def __init__(self, raw: dict, label: str, nested: dict | None):
        self.raw, self.label, self.nested = raw, label, nested or {}

    def key_name(self, key: str) -> str:
        return f"text_config.{key}" if key.split(".")[0] in self.nested else key

    def fail(self, key: str, what: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.label}: key '{self.key_name(key)}' must be {what}, "
                           f"got {_json_type(value)} {value!r}"[:400])

    def find(self, canonical: str) -> tuple[str | None, Any]:
        for key in _ALIASES.get(canonical, (canonical,)):
            if self.raw.get(key) is not None:
                return key, self.raw[key]
        return None, None

    def int_(self, canonical: str, *, required: bool = False) -> int | None:
        key, v = self.find(canonical)
        if key is None:
            if required:
                names = ", ".join(_ALIASES.get(canonical, (canonical,)))
                raise ConfigError(f"{self.label}: required key '{canonical}' is missing "
                                  f"(looked for: {names})")
            return None
        if not _is_int(v):
            raise self.fail(key, "an integer", v)
        return v

    def float_(self, canonical: str) -> float | None:
        key, v = self.find(canonical)
        if key is None:
            return None
        if not _is_number(v):
            raise self.fail(key, "a number", v)
        return float(v)

    def bool_(self, key: str) -> bool | None:
        v = self.raw.get(key)
        if v is not None and not isinstance(v, bool):
            raise self.fail(key, "a boolean", v)
        return v


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# ---------------------------------------------------------------- normalization


def _remap(model_type: str, architectures: Any) -> str:
    """mlx-lm's `_get_classes` remapping: architecture pairs first, then MODEL_REMAPPING."""
    if isinstance(architectures, str):
        architectures = (architectures,)
    for arch in architectures or ():
        if (hit := MODEL_ARCHITECTURE_REMAPPING.get((model_type, arch))) is not None:
            return hit
    return MODEL_REMAPPING.get(model_type, model_type)


def _text_level(full: dict, model_type: str, label: str) -> tuple[dict, dict | None]:
    """The dict mlx-lm hands the language model: text_config over the top level,
    plus the per-wrapper defaults each mlx-lm wrapper injects."""
    text = full.get("text_config")
    if text is None:
        return dict(full), None
    if not isinstance(text, Mapping):
        raise ConfigError(f"{label}: key 'text_config' must be an object, got {_json_type(text)}")
    text = dict(text)
    raw = {k: v for k, v in full.items() if k not in ("text_config", "vision_config", "audio_config")}
    raw.update(text)
    if model_type in ("gemma3", "gemma4"):  # gemma3.py / gemma4.py __post_init__
        raw["vocab_size"] = full.get("vocab_size", 262208 if model_type == "gemma3" else 262144)
        if "num_attention_heads" not in text:
            raw["num_attention_heads"] = 8
        if "num_key_value_heads" not in text:
            raw["num_key_value_heads"] = 4 if model_type == "gemma3" else 1
    elif model_type == "mistral3" and "tie_word_embeddings" not in text:
        raw["tie_word_embeddings"] = False
    elif model_type == "pixtral":
        raw["tie_word_embeddings"] = False
        if "num_attention_heads" not in text:
            raw["num_attention_heads"] = 32
    elif model_type in ("lfm2-vl", "lfm2_vl"):
        raw["tie_word_embeddings"] = False
    return raw, text


def _layer_types(r: _Reader, family: str, n: int, use_rope: tuple[bool, ...]) -> tuple[tuple[str, ...], int | None]:
    """One attention kind per layer, and the window sliding layers use."""
    raw = r.raw
    window = raw.get("sliding_window")
    if window is not None and not _is_int(window):
        raise r.fail("sliding_window", "an integer or null", window)
    if window is None and "sliding_window" not in raw:
        window = _DEFAULT_SLIDING_WINDOW.get(family)

    declared = raw.get("layer_types")
    if declared is not None:
        if not isinstance(declared, (list, tuple)) or not all(isinstance(t, str) for t in declared):
            raise r.fail("layer_types", "a list of strings", declared)
        if len(declared) < n:
            raise ConfigError(f"{r.label}: key '{r.key_name('layer_types')}' has {len(declared)} "
                              f"entries for {n} layers")
        types = tuple(declared[:n])  # mlx-lm zips layers with layer_types
    elif (blocks := _block_pattern(r)) is not None:  # hybrid stacks: kinds as given
        if len(blocks) < n:
            raise ConfigError(f"{r.label}: the layer block pattern has {len(blocks)} entries for {n} layers")
        types = tuple(blocks[:n])
    elif family == "smollm3":  # transformers SmolLM3: sliding only on NoPE layers
        swa = bool(r.bool_("use_sliding_window")) and window is not None
        types = tuple(SLIDING if swa and not use_rope[i] else FULL for i in range(n))
    elif (pattern := raw.get("sliding_window_pattern", _DEFAULT_SLIDING_PATTERN.get(family))) is not None:
        if isinstance(pattern, str):  # exaone4 "LLLG": layer i is local iff pattern[i % len] == "L"
            if not pattern or set(pattern) - {"L", "G"}:
                raise r.fail("sliding_window_pattern", "an integer or an L/G string", pattern)
            local = [pattern[i % len(pattern)] == "L" for i in range(n)]
        elif _is_int(pattern):  # every pattern-th layer is global
            local = [pattern > 0 and (i + 1) % pattern != 0 for i in range(n)]
        else:
            raise r.fail("sliding_window_pattern", "an integer or an L/G string", pattern)
        types = tuple(SLIDING if lo and window is not None else FULL for lo in local)
    elif r.bool_("use_sliding_window") and window is not None:  # qwen2: layers >= max_window_layers
        start = raw.get("max_window_layers", 28)
        if not _is_int(start):
            raise r.fail("max_window_layers", "an integer", start)
        types = tuple(SLIDING if i >= start else FULL for i in range(n))
    else:
        types = (FULL,) * n
    return types, (window if SLIDING in types else None)


# nemotron_h's one-character block codes, named as transformers 5 names them.
_BLOCK_CHARS = {"*": FULL, "M": "linear_attention", "E": "moe", "-": "mlp"}


def _block_pattern(r: _Reader) -> list[str] | None:
    """Per-layer block kinds of hybrid stacks (nemotron_h), or None."""
    blocks = r.raw.get("layers_block_type")
    if blocks is not None:
        if not isinstance(blocks, (list, tuple)) or not all(isinstance(b, str) for b in blocks):
            raise r.fail("layers_block_type", "a list of strings", blocks)
        return list(blocks)
    pattern = r.raw.get("hybrid_override_pattern")
    if pattern is None:
        return None
    if not all(isinstance(c, str) and c in _BLOCK_CHARS for c in pattern):
        raise r.fail("hybrid_override_pattern", f"a string of {''.join(_BLOCK_CHARS)} codes", pattern)
    return [_BLOCK_CHARS[c] for c in pattern]


def _use_rope(r: _Reader, family: str, n: int) -> tuple[bool, ...]:
    """Per-layer rope flags from no_rope_layers (1 = rope) or no_rope_layer_interval."""
    flags = r.raw.get("no_rope_layers")
    if flags is not None:
        if not isinstance(flags, (list, tuple)) or not all(isinstance(f, (int, bool)) for f in flags):
            raise r.fail("no_rope_layers", "a list of 0/1 flags", flags)
        if len(flags) < n:
            raise ConfigError(f"{r.label}: key '{r.key_name('no_rope_layers')}' has {len(flags)} "
                              f"entries for {n} layers")
        return tuple(bool(f) for f in flags[:n])
    interval = r.raw.get("no_rope_layer_interval", _DEFAULT_NO_ROPE_INTERVAL.get(family))
    if interval is not None:
        if not _is_int(interval) or interval <= 0:
            raise r.fail("no_rope_layer_interval", "a positive integer", interval)
        return tuple((i + 1) % interval != 0 for i in range(n))
    return (True,) * n


def _rope_entry(r: _Reader, where: str, d: Any, theta: float | None) -> dict:
    """Normalize one rope dict: rope_type ("type" wins, as in mlx-lm), rope_theta, scaling keys."""
    if d is None:
        d = {}
    if not isinstance(d, Mapping):
        raise r.fail(where, "an object", d)
    out = {k: v for k, v in d.items() if k not in ("type", "rope_type")}
    rope_type = d.get("type") or d.get("rope_type") or "default"
    if not isinstance(rope_type, str):
        raise r.fail(f"{where}.rope_type", "a string", rope_type)
    out["rope_type"] = rope_type
    if theta is None:
        theta = d.get("rope_theta")
    if theta is not None and not _is_number(theta):
        raise r.fail(f"{where}.rope_theta", "a number", theta)
    out["rope_theta"] = None if theta is None else float(theta)
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim", "attention_factor", "partial_rotary_factor"):
        if out.get(key) is not None and not _is_number(out[key]):
            raise r.fail(f"{where}.{key}", "a number", out[key])
    omp = out.get("original_max_position_embeddings")
    if omp is not None and not _is_int(omp):
        raise r.fail(f"{where}.original_max_position_embeddings", "an integer", omp)
    for key in ("short_factor", "long_factor"):
        v = out.get(key)
        if v is not None and not (_is_number(v) or (isinstance(v, (list, tuple)) and all(map(_is_number, v)))):
            raise r.fail(f"{where}.{key}", "a number or a list of numbers", v)
    # Phi-3 keeps original_max_position_embeddings at the top level (phi3.py reads it there).
    if rope_type != "default" and "original_max_position_embeddings" not in out:
        top = r.raw.get("original_max_position_embeddings")
        if _is_int(top):
            out["original_max_position_embeddings"] = top
    return out


def _is_per_type(rp: Any) -> bool:
    return isinstance(rp, Mapping) and bool(rp) and all(isinstance(v, Mapping) for v in rp.values())


def _rope(r: _Reader, family: str, layer_types: tuple[str, ...]) -> dict[str, dict]:
    raw = r.raw
    rp = raw.get("rope_parameters")
    if _is_per_type(rp):  # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
        return {lt: _rope_entry(r, f"rope_parameters.{lt}", d, None) for lt, d in rp.items()}
    theta = r.float_("rope_theta")
    scaling, where = raw.get("rope_scaling"), "rope_scaling"
    if scaling is None and rp is not None:  # flat rope_parameters (mlx-lm qwen3 precedence)
        scaling, where = rp, "rope_parameters"
    entry = _rope_entry(r, where, scaling, theta)
    rope = {lt: entry for lt in dict.fromkeys(layer_types)}
    # gemma3-style per-kind base: sliding layers use rope_local_base_freq and no scaling.
    local = raw.get("rope_local_base_freq")
    if SLIDING in rope and (local is not None or family in ("gemma3_text", "gemma3n_text", "gemma3n")):
        if local is not None and not _is_number(local):
            raise r.fail("rope_local_base_freq", "a number", local)
        rope[SLIDING] = {"rope_type": "default", "rope_theta": None if local is None else float(local)}
    return rope


def _partial_rotary_factor(r: _Reader, head_dim: int | None) -> float:
    v = r.float_("partial_rotary_factor")
    if v is not None:
        return v
    rp = r.raw.get("rope_parameters")
    if isinstance(rp, Mapping) and not _is_per_type(rp) and rp.get("partial_rotary_factor") is not None:
        prf = rp["partial_rotary_factor"]
        if not _is_number(prf):
            raise r.fail("rope_parameters.partial_rotary_factor", "a number", prf)
        return float(prf)
    rotary_dim = r.raw.get("rotary_dim")
    if _is_int(rotary_dim) and head_dim:
        return rotary_dim / head_dim
    return 1.0


# ---------------------------------------------------------------- token ids


def _token_ids(value: Any, where: str, key: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    for v in items:
        if not _is_int(v):
            raise ConfigError(f"{where}: key '{key}' must be an integer or a list of integers, "
                              f"got {_json_type(value)} {value!r}"[:400])
    return list(items)


class _TokenResolver:
    """Token string -> id through tokenizer_config's added_tokens_decoder, then tokenizer.json."""

    def __init__(self, tokenizer_config: dict, label: str, directory: Path | None):
        self.label, self.directory = label, directory
        self.table: dict[str, int] = {}
        decoder = tokenizer_config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping):
            raise ConfigError(f"{label}: key 'added_tokens_decoder' must be an object, got {_json_type(decoder)}")
        for idx, tok in decoder.items():
            content = tok.get("content") if isinstance(tok, Mapping) else tok
            if isinstance(content, str) and str(idx).isdigit():
                self.table.setdefault(content, int(idx))
        self._loaded_tokenizer_json = False

    def _load_tokenizer_json(self) -> None:
        self._loaded_tokenizer_json = True
        if self.directory is None:
            return
        file = self.directory / "tokenizer.json"
        data = _read_json(file, required=False)
        if data is None:
            return
        for tok in data.get("added_tokens") or ():
            if isinstance(tok, Mapping) and _is_int(tok.get("id")) and isinstance(tok.get("content"), str):
                self.table.setdefault(tok["content"], tok["id"])
        vocab = (data.get("model") or {}).get("vocab") if isinstance(data.get("model"), Mapping) else None
        if isinstance(vocab, Mapping):  # BPE / WordPiece: token -> id
            for tok, idx in vocab.items():
                if _is_int(idx):
                    self.table.setdefault(tok, idx)
        elif isinstance(vocab, list):  # Unigram: [[token, score], ...], id = position
            for idx, item in enumerate(vocab):
                if isinstance(item, (list, tuple)) and item and isinstance(item[0], str):
                    self.table.setdefault(item[0], idx)

    def resolve(self, key: str, token: Any) -> tuple[int | None, str | None]:
        """(id, None) when resolved, (None, content) when not, (None, None) when absent."""
        if token is None:
            return None, None
        content = token.get("content") if isinstance(token, Mapping) else token
        if not isinstance(content, str):
            raise ConfigError(f"{self.label}: key '{key}' must be a string or an AddedToken object, "
                              f"got {_json_type(token)} {token!r}"[:400])
        if content not in self.table and not self._loaded_tokenizer_json:
            self._load_tokenizer_json()
        if content in self.table:
            return self.table[content], None
        return None, content


# ---------------------------------------------------------------- quantization


def _quant_spec(where: str, block: Mapping, *, label: str, defaults: tuple[int, int] | None) -> QuantSpec:
    mode = block.get("mode", "affine")
    if not isinstance(mode, str):
        raise ConfigError(f"{label}: key '{where}.mode' must be a string, got {_json_type(mode)} {mode!r}")
    if defaults is None:
        defaults = _MODE_DEFAULTS.get(mode, (None, None))
    values = {}
    for key, default in (("group_size", defaults[0]), ("bits", defaults[1])):
        v = block.get(key)
        if v is None:
            v = default
        if not _is_int(v):
            what = "missing" if v is None else f"{_json_type(v)} {v!r}"
            raise ConfigError(f"{label}: key '{where}.{key}' must be an integer, got {what}")
        values[key] = v
    return QuantSpec(bits=values["bits"], group_size=values["group_size"], mode=mode)


def _quantization(full: dict, label: str, directory: Path | None):
    """(global spec, per-module overrides, quant_method) as mlx-lm's load_model reads them."""
    block, where = full.get("quantization"), "quantization"
    if block is None:
        text = full.get("text_config") if isinstance(full.get("text_config"), Mapping) else {}
        block, where = full.get("quantization_config"), "quantization_config"
        if block is None and "quantization_config" in text:
            block, where = text["quantization_config"], "text_config.quantization_config"
        if block is None and directory is not None:  # NVIDIA ModelOpt keeps it in a sidecar
            sidecar = directory / "hf_quant_config.json"
            if sidecar.is_file():
                block, label = _read_json(sidecar, required=True), str(sidecar)
    if not block:
        return None, {}, None
    if not isinstance(block, Mapping):
        raise ConfigError(f"{label}: key '{where}' must be an object, got {_json_type(block)}")
    method = block.get("quant_method")
    if where != "quantization" and method is not None:
        return (*_legacy_quantization(block, method, where, label), method)
    spec = _quant_spec(where, block, label=label, defaults=(None, None))
    overrides: dict[str, QuantSpec | None] = {}
    for key, v in block.items():
        if isinstance(v, bool):  # class_predicate: False = leave unquantized, True = global params
            overrides[key] = spec if v else None
        elif isinstance(v, Mapping):  # to_quantized(**v): missing keys take the mode's defaults
            overrides[key] = _quant_spec(f"{where}.{key}", v, label=label, defaults=None)
    return spec, overrides, method


def _legacy_quantization(qc: Mapping, method: str, where: str, label: str):
    """mlx-lm's mapping of HF quantization_config methods onto mlx packing."""
    spec = None
    if method == "mxfp4":
        spec = QuantSpec(4, 32, "mxfp4")
    elif method == "mxfp8":
        spec = QuantSpec(8, 32, "mxfp8")
    elif method == "fp8":  # ue8m0 32x32 blocks stay packed as mxfp8; other fp8 dequantizes
        if qc.get("scale_fmt") == "ue8m0" and list(qc.get("weight_block_size", ())) == [32, 32]:
            spec = QuantSpec(8, 32, "mxfp8")
    elif method == "compressed-tensors":
        fmt = qc.get("format")
        spec = {"nvfp4-pack-quantized": QuantSpec(4, 16, "nvfp4"),
                "mxfp4-pack-quantized": QuantSpec(4, 32, "mxfp4"),
                "pack-quantized": QuantSpec(4, 32, "affine")}.get(fmt)
        if spec is None:
            raise ConfigError(f"{label}: key '{where}.format' is {fmt!r}, an unsupported "
                              "compressed-tensors format (dequantize to bf16 before converting)")
    elif method == "modelopt":
        settings = qc.get("quantization", qc)
        algo = settings.get("quant_algo") if isinstance(settings, Mapping) else None
        if algo != "NVFP4":
            raise ConfigError(f"{label}: key '{where}.quant_algo' is {algo!r}; only NVFP4 is supported")
        group = settings.get("group_size", 16)
        if not _is_int(group):
            raise ConfigError(f"{label}: key '{where}.group_size' must be an integer, got {group!r}")
        spec = QuantSpec(4, group, "nvfp4")
    elif method in ("awq", "gptq"):
        spec = _quant_spec(where, qc, label=label, defaults=(128, 4))
        if spec.bits != 4:
            raise ConfigError(f"{label}: key '{where}.bits' is {spec.bits}; only 4-bit {method} is supported")
        spec = QuantSpec(spec.bits, spec.group_size, "affine")
    return spec, {}


# ---------------------------------------------------------------- kv_config


def _kv_config(data: Any, file: Path) -> tuple[KVLayerSpec, ...]:
    entries = data.get("layers") if isinstance(data, Mapping) else data
    if not isinstance(entries, list):
        raise ConfigError(f"{file}: expected a JSON list of layer entries (or an object with a "
                          f"'layers' list), got {_json_type(entries)}")
    out, seen = [], set()
    for i, e in enumerate(entries):
        where = f"{file}: entry {i}"
        if not isinstance(e, Mapping):
            raise ConfigError(f"{where} must be an object, got {_json_type(e)}")
        idx, bits, group = e.get("layer_idx"), e.get("bits"), e.get("group_size", 64)
        if not _is_int(idx) or idx < 0:
            raise ConfigError(f"{where}: key 'layer_idx' must be a non-negative integer, got {idx!r}")
        if not _is_number(bits) or bits < 0:
            raise ConfigError(f"{where}: key 'bits' must be a non-negative number, got {bits!r}")
        if not _is_int(group) or group <= 0:
            raise ConfigError(f"{where}: key 'group_size' must be a positive integer, got {group!r}")
        if idx in seen:
            raise ConfigError(f"{where}: key 'layer_idx' {idx} appears twice")
        seen.add(idx)
        out.append(KVLayerSpec(layer_idx=idx, bits=bits, group_size=group))
    return tuple(out)


# ---------------------------------------------------------------- assembly


def _build(full: dict, *, path: Path | None, generation_config: dict | None,
           tokenizer_config: dict | None, kv_config: tuple[Any, Path] | None) -> TextConfig:
    label = str(path / "config.json") if path else "config.json"
    gen_label = str(path / "generation_config.json") if path else "generation_config.json"
    tok_label = str(path / "tokenizer_config.json") if path else "tokenizer_config.json"
    generation_config = generation_config or {}
    tokenizer_config = tokenizer_config or {}

    source = full.get("model_type")
    if source is None:
        raise ConfigError(f"{label}: required key 'model_type' is missing")
    if not isinstance(source, str):
        raise ConfigError(f"{label}: key 'model_type' must be a string, got {_json_type(source)} {source!r}")
    model_type = _remap(source, full.get("architectures"))
    raw, nested = _text_level(full, model_type, label)
    r = _Reader(raw, label, nested)
    text_type = raw.get("model_type") if isinstance(raw.get("model_type"), str) else source
    family = MODEL_REMAPPING.get(text_type, text_type)
    for key, value in _TEXT_DEFAULTS.get(family, {}).items():
        if key.startswith("rope_") and "rope_parameters" in raw:
            continue  # transformers-5 configs carry the bases inside rope_parameters
        if raw.get(key) is None:
            raw[key] = value

    vocab = r.int_("vocab_size", required=True)
    hidden = r.int_("hidden_size", required=True)
    blocks = _block_pattern(r)
    layers = r.int_("num_hidden_layers", required=blocks is None)
    if layers is None:  # nemotron_h: the block pattern is the layer stack
        layers = len(blocks)
    heads = r.int_("num_attention_heads")
    kv_heads = r.int_("num_key_value_heads") or heads
    head_dim = r.int_("head_dim") or (hidden // heads if heads else None)

    key, inter = r.find("intermediate_size")
    if isinstance(inter, list) and all(map(_is_int, inter)):  # per-layer widths (gemma3n)
        inter = tuple(inter)
    elif inter is not None and not _is_int(inter):
        raise r.fail(key, "an integer or a list of integers", inter)

    tie_raw = r.bool_("tie_word_embeddings")
    dtype = None
    for src in (raw, full):
        for k in ("dtype", "torch_dtype"):
            if dtype is None and src.get(k) is not None:
                dtype = src[k]
                if not isinstance(dtype, str):
                    raise r.fail(k, "a string", dtype)

    use_rope = _use_rope(r, family, layers)
    layer_types, window = _layer_types(r, family, layers, use_rope)
    if "no_rope_layers" not in raw and "no_rope_layer_interval" not in raw:
        if family == "cohere2":  # rope only on sliding layers (cohere2.py)
            use_rope = tuple(t == SLIDING for t in layer_types)
        elif family == "exaone4" and SLIDING in layer_types:  # global layers are NoPE (exaone4.py)
            use_rope = tuple(t == SLIDING for t in layer_types)

    # EOS: union over config.json (top level and text_config), generation_config, tokenizer_config.
    eos = _token_ids(full.get("eos_token_id"), label, "eos_token_id")
    if nested is not None:
        eos += _token_ids(nested.get("eos_token_id"), label, "text_config.eos_token_id")
    eos += _token_ids(generation_config.get("eos_token_id"), gen_label, "eos_token_id")
    resolver = _TokenResolver(tokenizer_config, tok_label, path)
    tok_eos, unresolved = resolver.resolve("eos_token", tokenizer_config.get("eos_token"))
    eos += [tok_eos] if tok_eos is not None else []

    def special(name: str) -> int | None:
        for src, where, k in ((nested or {}, label, f"text_config.{name}_token_id"),
                              (full, label, f"{name}_token_id"),
                              (generation_config, gen_label, f"{name}_token_id")):
            ids = _token_ids(src.get(f"{name}_token_id"), where, k)
            if ids:
                return ids[0]
        return resolver.resolve(f"{name}_token", tokenizer_config.get(f"{name}_token"))[0]

    quant, overrides, method = _quantization(full, label, path)

    kv = None
    if kv_config is not None:
        kv = _kv_config(kv_config[0], kv_config[1])

    sidecar = None
    if path is not None:
        sidecar = next((p for p in (path / "optiq" / "optiq_vision.safetensors",
                                    path / "optiq_vision.safetensors") if p.is_file()), None)

    rope = _rope(r, family, layer_types)
    return TextConfig(
        path=path,
        raw_full=_freeze(full),
        raw=_freeze(raw),
        source_model_type=source,
        model_type=model_type,
        text_model_type=text_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=r.float_("norm_eps"),
        tie_word_embeddings=True if tie_raw is None else tie_raw,
        tie_word_embeddings_raw=tie_raw,
        max_position_embeddings=r.int_("max_position_embeddings"),
        dtype=dtype,
        layer_types=layer_types,
        sliding_window=window,
        use_rope=use_rope,
        attn_logit_softcap=r.float_("attn_logit_softcap"),
        final_logit_softcap=r.float_("final_logit_softcap"),
        partial_rotary_factor=_partial_rotary_factor(r, head_dim),
        rope=_freeze(rope),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        unresolved_eos_tokens=(unresolved,) if unresolved else (),
        bos_token_id=special("bos"),
        pad_token_id=special("pad"),
        quantization=quant,
        quant_overrides=FrozenDict(overrides),
        quant_method=method,
        kv_config=kv,
        is_vlm=full.get("text_config") is not None or full.get("vision_config") is not None,
        weight_prefix=_WRAPPER_PREFIX.get(model_type, ""),
        has_vision=full.get("vision_config") is not None or sidecar is not None,
        has_audio=full.get("audio_config") is not None,
        vision_sidecar=sidecar,
        generation_config=_freeze(generation_config),
        tokenizer_config=_freeze(tokenizer_config),
    )
