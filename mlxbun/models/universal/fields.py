"""Reading a knob's value out of the emulated `ModelArgs` (shared by resolve.py and moe_args.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlxbun.errors import ConfigError

__all__ = ["NOT", "fail", "get", "int_field"]

NOT = "not "  # a bool knob spelled "not FIELD" reads the field negated


def fail(model_type: str, msg: str) -> ConfigError:
    return ConfigError(f"config.json ({model_type}): {msg}")


def get(a: Mapping[str, Any], spec: bool | str | None, mt: str) -> Any:
    """A knob value: a literal, a (dotted) ModelArgs field, or "not FIELD" (qwen: not no_bias)."""
    if not isinstance(spec, str):
        return spec
    if spec.startswith(NOT):
        return not get(a, spec[len(NOT):], mt)
    head, _, rest = spec.partition(".")
    value = a[head]
    if rest:
        if not isinstance(value, Mapping) or rest not in value:
            raise fail(mt, f"'{head}' lacks '{rest}'")
        value = value[rest]
    return value


def int_field(a: Mapping[str, Any], name: str, mt: str) -> int:
    v = a[name]
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise fail(mt, f"'{name}' must be a positive integer, got {v!r}")
    return v
