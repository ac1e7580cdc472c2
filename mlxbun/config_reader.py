"""Reading checkpoint config JSON: files, read-only values, typed keys with their aliases.

The shared ground of `mlxbun.config`, `mlxbun.layer_facts` and `mlxbun.quant`: every error
names the file and the key (`ConfigError`), and values come back read-only (`FrozenDict`,
tuples) so a normalized config cannot be changed behind its fingerprint.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mlxbun.errors import ConfigError

# Canonical field -> accepted keys, in priority order (surveyed from mlx-lm ModelArgs).
ALIASES = {
    "vocab_size": ("vocab_size", "n_vocab", "padded_vocab_size", "num_vocab"),
    "hidden_size": ("hidden_size", "n_embd", "d_model", "model_dim", "hidden_dim"),
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


# ---------------------------------------------------------------- JSON values


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def json_type(v: Any) -> str:
    """How an error message names a JSON value's type ("an object", "a string", ...)."""
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number", type(None): "null"}.get(type(v), type(v).__name__)


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


def freeze(value: Any) -> Any:
    """Mappings to FrozenDicts and lists to tuples, all the way down."""
    if isinstance(value, Mapping):
        return FrozenDict({k: freeze(v) for k, v in value.items()})
    if isinstance(value, (list, tuple)):
        return tuple(freeze(v) for v in value)
    return value


def json_safe(obj: Any) -> Any:
    """`obj` with every non-finite float as None: strict JSON has no NaN or Infinity."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def thaw(value: Any) -> Any:
    """The inverse of `freeze`: plain dicts and lists again."""
    if isinstance(value, Mapping):
        return {k: thaw(x) for k, x in value.items()}
    if isinstance(value, (list, tuple)):
        return [thaw(x) for x in value]
    return value


# ---------------------------------------------------------------- files

# transformers tags non-finite floats so config.json stays valid JSON (as mlx-lm undoes it).
_FLOAT_TAGS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def decode_tagged_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: decode_tagged_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode_tagged_floats(v) for v in obj]
    return obj


def read_json(file: Path, *, required: bool, expect=dict) -> Any:
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
        raise ConfigError(f"{file}: expected {want} at the top level, got {json_type(data)}")
    return decode_tagged_floats(data)


# ---------------------------------------------------------------- typed keys


class ConfigReader:
    """Typed access to the text-level config dict; errors name the file and the key.

    `nested` is the checkpoint's `text_config` (None without one): keys found there are
    named `text_config.<key>` in errors, as the user wrote them.
    """

    def __init__(self, raw: dict, label: str, nested: dict | None):
        self.raw, self.label, self.nested = raw, label, nested or {}

    def key_name(self, key: str) -> str:
        return f"text_config.{key}" if key.split(".")[0] in self.nested else key

    def fail(self, key: str, what: str, value: Any) -> ConfigError:
        return ConfigError(f"{self.label}: key '{self.key_name(key)}' must be {what}, "
                           f"got {json_type(value)} {value!r}"[:400])

    def find(self, canonical: str) -> tuple[str | None, Any]:
        for key in ALIASES.get(canonical, (canonical,)):
            if self.raw.get(key) is not None:
                return key, self.raw[key]
        return None, None

    def int_(self, canonical: str, *, required: bool = False) -> int | None:
        key, v = self.find(canonical)
        if key is None:
            if required:
                names = ", ".join(ALIASES.get(canonical, (canonical,)))
                raise ConfigError(f"{self.label}: required key '{canonical}' is missing "
                                  f"(looked for: {names})")
            return None
        if not is_int(v):
            raise self.fail(key, "an integer", v)
        return v

    def float_(self, canonical: str) -> float | None:
        key, v = self.find(canonical)
        if key is None:
            return None
        if not is_number(v):
            raise self.fail(key, "a number", v)
        return float(v)

    def bool_(self, key: str) -> bool | None:
        v = self.raw.get(key)
        if v is not None and not isinstance(v, bool):
            raise self.fail(key, "a boolean", v)
        return v
