"""Prompt caches on disk, and reusing a cached prefix.

One safetensors file holds every layer's `state` arrays (tensor `layer.<i>.<path>`)
and, in its string metadata:
  mlxbun.format / mlxbun.format_version   what this file is
  mlxbun.identity   the model it was computed with (model_type, num_layers,
                    num_kv_heads, head_dim, config_fingerprint)
  mlxbun.layers     per layer: cache class, meta_state, and the state's
                    structure with non-array leaves (offsets, sizes) inline
  mlxbun.metadata   the caller's dict[str, str] (cached token ids: "tokens")
Unlike mlx-lm's format (which rebuilds classes by name from its own module),
loading validates everything against what the caller expects and refuses,
naming the file and what differs, instead of handing a model a cache computed
by another model or in another layout.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.cache_list import CacheList
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.quantized import QuantizedKVCache
from mlxbun.errors import MlxbunError, WeightsError
from mlxbun.weights import read_safetensors_header

__all__ = [
    "FORMAT_VERSION",
    "PromptCacheError",
    "cache_layout",
    "cached_tokens",
    "check_save_path",
    "common_prefix_length",
    "load_prompt_cache",
    "model_identity",
    "register_cache_class",
    "reuse_prefix",
    "save_prompt_cache",
]

FORMAT = "mlxbun-prompt-cache"
FORMAT_VERSION = 1
IDENTITY_KEYS = ("model_type", "num_layers", "num_kv_heads", "head_dim", "config_fingerprint")
TOKENS_KEY = "tokens"

CACHE_CLASSES: dict[str, type] = {
    c.__name__: c for c in (KVCache, RotatingKVCache, QuantizedKVCache, ArraysCache, CacheList)
}


class PromptCacheError(MlxbunError):
    """A prompt-cache file is unreadable, or belongs to another model or layout."""


def register_cache_class(cls: type) -> type:
    """Make a cache class loadable: it needs `state`, `meta_state`,
    `from_state(state, meta_state)`, and optionally `layout_params()` (the
    settings a layout check compares, e.g. bits)."""
    CACHE_CLASSES[cls.__name__] = cls
    return cls


def model_identity(config) -> dict[str, str]:
    """Identity of a `mlxbun.config.TextConfig` as stored in / checked against a file."""
    head_dim = config.head_dim
    if head_dim is None and config.num_attention_heads:
        head_dim = config.hidden_size // config.num_attention_heads
    return {
        "model_type": str(config.model_type),
        "num_layers": str(config.num_hidden_layers),
        "num_kv_heads": str(config.num_key_value_heads),
        "head_dim": str(head_dim),
        "config_fingerprint": config.fingerprint(),
    }


def _describe(cls_name: str, params: Mapping[str, Any]) -> str:
    if not params:
        return cls_name
    return f"{cls_name}(" + ", ".join(f"{k}={v}" for k, v in params.items()) + ")"


def _layout_params(c) -> dict[str, Any]:
    # the parameters that make two caches of one class incompatible; another
    # cache class can declare its own through a `layout_params()` method
    if hasattr(c, "layout_params"):
        return dict(c.layout_params())
    if isinstance(c, QuantizedKVCache):
        return {"bits": c.bits, "group_size": c.group_size}
    if isinstance(c, RotatingKVCache):
        return {"max_size": c.max_size, "keep": c.keep}
    if isinstance(c, ArraysCache):
        return {"size": len(c.cache)}
    return {}


def cache_layout(caches: Sequence[Any]) -> list[str]:
    """One description per layer, e.g. "QuantizedKVCache(bits=4, group_size=32)"."""
    return [_describe(type(c).__name__, _layout_params(c)) for c in caches]


# ------------------------------------------------------------------ state <-> JSON + tensors


def _encode(x, tensors: dict, name: str, where: str):
    if isinstance(x, mx.array):
        tensors[name] = x
        return {"t": name}
    if isinstance(x, tuple):
        return {"tuple": [_encode(e, tensors, f"{name}.{i}", where) for i, e in enumerate(x)]}
    if isinstance(x, list):
        return [_encode(e, tensors, f"{name}.{i}", where) for i, e in enumerate(x)]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise PromptCacheError(f"{where}: state item {name} of type {type(x).__name__} cannot be saved")


def _decode(x, arrays: Mapping[str, mx.array], where: str):
    if isinstance(x, dict):
        if set(x) == {"t"}:
            if x["t"] not in arrays:
                raise PromptCacheError(f"{where}: tensor {x['t']!r} is missing")
            return arrays[x["t"]]
        if set(x) == {"tuple"} and isinstance(x["tuple"], list):
            return tuple(_decode(e, arrays, where) for e in x["tuple"])
        raise PromptCacheError(f"{where}: malformed state entry {x!r}")
    if isinstance(x, list):
        return [_decode(e, arrays, where) for e in x]
    return x


def save_prompt_cache(
    path: str | os.PathLike,
    caches: Sequence[Any],
    metadata: Optional[Mapping[str, str]] = None,
    *,
    model_identity: Mapping[str, Any],
    tokens: Optional[Sequence[int]] = None,
) -> None:
    """Write `caches` (one per layer) to a .safetensors file.

    `model_identity`: at least IDENTITY_KEYS (see `model_identity(config)`);
    its num_layers must equal len(caches). `tokens`: the token ids the caches
    hold, stored as metadata["tokens"] for `reuse_prefix`.
    """
    path = check_save_path(path)
    identity = {str(k): str(v) for k, v in dict(model_identity).items()}
    missing = [k for k in IDENTITY_KEYS if k not in identity]
    if missing:
        raise PromptCacheError(f"{path}: model_identity lacks {', '.join(missing)}")
    if identity["num_layers"] != str(len(caches)):
        raise PromptCacheError(f"{path}: model_identity says num_layers={identity['num_layers']} "
                               f"but {len(caches)} caches were given")
    meta = dict(metadata or {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise PromptCacheError(f"{path}: metadata must map strings to strings")
    if tokens is not None:
        if TOKENS_KEY in meta:
            raise PromptCacheError(f"{path}: metadata key {TOKENS_KEY!r} is reserved for `tokens`")
        meta[TOKENS_KEY] = json.dumps([int(t) for t in tokens])

    tensors: dict[str, mx.array] = {}
    layers = []
    for i, c in enumerate(caches):
        cls = type(c).__name__
        where = f"{path}: layer {i} ({cls})"
        if CACHE_CLASSES.get(cls) is not type(c):
            raise PromptCacheError(f"{where}: cache class is not registered for saving "
                                   f"(known: {sorted(CACHE_CLASSES)})")
        layers.append({
            "class": cls,
            "params": _layout_params(c),
            "meta_state": _encode(c.meta_state, {}, "meta", where),
            "state": _encode(c.state, tensors, f"layer.{i}", where),
        })
    file_meta = {
        "mlxbun.format": FORMAT,
        "mlxbun.format_version": str(FORMAT_VERSION),
        "mlxbun.identity": json.dumps(identity, sort_keys=True),
        "mlxbun.layers": json.dumps(layers),
        "mlxbun.metadata": json.dumps(meta, sort_keys=True),
    }
    # mlx appends ".safetensors" to a name without it; write where we were asked
    tmp = path.with_name(path.name + ".tmp.safetensors")
    try:
        mx.save_safetensors(str(tmp), tensors, file_meta)
        os.replace(tmp, path)
    except (OSError, RuntimeError) as e:  # mlx raises RuntimeError when it cannot write
        raise PromptCacheError(f"{path}: cannot write the prompt cache ({e})") from None
    finally:
        if tmp.is_file():  # left behind by a failed write
            tmp.unlink()


def check_save_path(path: str | os.PathLike) -> Path:
    """Where `save_prompt_cache` can write, checked before the work that fills the caches: the
    directory exists and is writable, and the path is not a directory."""
    path = Path(path).expanduser()
    parent = path.parent
    if path.is_dir():
        raise PromptCacheError(f"{path}: is a directory; give a file path (e.g. {path / 'prompt.safetensors'})")
    if not parent.is_dir():
        what = "is not a directory" if parent.exists() else "does not exist"
        raise PromptCacheError(f"{path}: directory {parent} {what}")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PromptCacheError(f"{path}: directory {parent} is not writable")
    return path


def _differences(got: Mapping[str, str], want: Mapping[str, Any]) -> list[str]:
    out = []
    for k, v in want.items():
        if str(v) != got.get(k):
            out.append(f"{k}: file has {got.get(k, '<missing>')!r}, expected {str(v)!r}")
    return out


def _json_meta(file: Path, meta: Mapping[str, str], key: str, expect: type):
    if key not in meta:
        raise PromptCacheError(f"{file}: metadata key {key!r} is missing (corrupt prompt cache?)")
    try:
        value = json.loads(meta[key])
    except ValueError as e:
        raise PromptCacheError(f"{file}: metadata key {key!r} is not valid JSON: {e}") from None
    if not isinstance(value, expect):
        raise PromptCacheError(f"{file}: metadata key {key!r} is a {type(value).__name__}, "
                               f"expected a {expect.__name__}")
    return value


def load_prompt_cache(
    path: str | os.PathLike,
    *,
    expect_identity: Optional[Mapping[str, Any]] = None,
    expect_layout: Optional[Sequence[Any]] = None,
) -> tuple[list, dict[str, str]]:
    """Read a file written by `save_prompt_cache`; return (caches, metadata).

    `expect_identity`: the loading model's identity (any subset of keys); a
    differing key refuses. `expect_layout`: the caches the caller would build
    (cache objects, e.g. `plan.make_caches(model.make_cache())`, or
    `cache_layout` strings); a different layer count, class, quantization or
    window refuses, naming the layer.
    """
    file = Path(path)
    if not file.is_file():
        raise PromptCacheError(f"{file}: no such prompt-cache file")
    try:
        header, meta = read_safetensors_header(file)
    except WeightsError as e:  # its message names the file first, as every error here does
        why = str(e).removeprefix(f"{file}: ")
        raise PromptCacheError(f"{file}: prompt cache unreadable (truncated or corrupt?): {why}") from None
    if meta.get("mlxbun.format") != FORMAT:
        raise PromptCacheError(f"{file}: not an mlxbun prompt cache (no '{FORMAT}' format tag; "
                               "mlx-lm prompt caches are not read)")
    version = meta.get("mlxbun.format_version")
    if version != str(FORMAT_VERSION):
        raise PromptCacheError(f"{file}: prompt-cache format version {version!r}, this mlxbun "
                               f"reads version {FORMAT_VERSION}")
    identity = _json_meta(file, meta, "mlxbun.identity", dict)
    layers = _json_meta(file, meta, "mlxbun.layers", list)
    user_meta = _json_meta(file, meta, "mlxbun.metadata", dict)

    if expect_identity is not None:
        diff = _differences(identity, expect_identity)
        if diff:
            raise PromptCacheError(f"{file}: saved for another model: " + "; ".join(diff))
    try:
        file_layout = [_describe(l["class"], l["params"]) for l in layers]
    except (KeyError, TypeError) as e:
        raise PromptCacheError(f"{file}: malformed layer table ({e!r})") from None
    if str(len(layers)) != identity.get("num_layers"):
        raise PromptCacheError(f"{file}: {len(layers)} layers stored but the identity says "
                               f"num_layers={identity.get('num_layers')!r} (corrupt file)")
    if expect_layout is not None:
        want = [x if isinstance(x, str) else cache_layout([x])[0] for x in expect_layout]
        if len(want) != len(file_layout):
            raise PromptCacheError(f"{file}: holds {len(file_layout)} cache layers, expected "
                                   f"{len(want)}")
        diff = [f"layer {i}: file has {a}, expected {b}"
                for i, (a, b) in enumerate(zip(file_layout, want)) if a != b]
        if diff:
            raise PromptCacheError(f"{file}: different cache layout: " + "; ".join(diff))

    try:
        arrays = mx.load(str(file))
    except Exception as e:  # mlx raises RuntimeError/ValueError for unreadable data
        raise PromptCacheError(f"{file}: cannot read tensors (truncated or corrupt?): {e}") from None
    if set(arrays) != set(header):
        raise PromptCacheError(f"{file}: tensor table differs from the header (corrupt file)")
    caches = []
    for i, l in enumerate(layers):
        where = f"{file}: layer {i} ({l['class']})"
        cls = CACHE_CLASSES.get(l["class"])
        if cls is None:
            raise PromptCacheError(f"{where}: unknown cache class (known: {sorted(CACHE_CLASSES)})")
        state = _decode(l.get("state"), arrays, where)
        meta_state = _decode(l.get("meta_state"), {}, where)
        try:
            c = cls.from_state(state, meta_state)
        except (TypeError, ValueError) as e:
            raise PromptCacheError(f"{where}: state does not fit the class: {e}") from None
        if _layout_params(c) != l["params"]:
            raise PromptCacheError(f"{where}: state disagrees with the layer table (corrupt file)")
        caches.append(c)
    return caches, {str(k): str(v) for k, v in user_meta.items()}


# ------------------------------------------------------------------ prefix reuse


def cached_tokens(metadata: Mapping[str, str]) -> Optional[list[int]]:
    """The token ids saved with the caches (`save_prompt_cache(tokens=...)`), or None."""
    raw = metadata.get(TOKENS_KEY)
    if raw is None:
        return None
    try:
        toks = json.loads(raw)
    except ValueError:
        toks = None
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise PromptCacheError(f"prompt-cache metadata {TOKENS_KEY!r} is not a JSON list of ints")
    return toks


def common_prefix_length(cached_tokens: Sequence[int], new_tokens: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for a, b in zip(cached_tokens, new_tokens):
        if int(a) != int(b):
            break
        n += 1
    return n


def reuse_prefix(caches: Sequence[Any], cached: Sequence[int], new_tokens: Sequence[int]) -> int:
    """Trim `caches` (holding `cached` tokens) in place to the prefix they share with
    `new_tokens`; return how many tokens were kept. Feed `new_tokens[kept:]` next.

    At least one new token is always left to feed (a prompt equal to the cached
    one keeps all but its last token), so the forward yields logits. All caches
    are checked before any is trimmed; a cache that cannot drop the needed tokens
    (a recurrent ArraysCache, a RotatingKVCache past its window) refuses,
    naming the layer: the caller then prefills from scratch.
    """
    cached, new_tokens = list(cached), list(new_tokens)
    if not new_tokens:
        raise PromptCacheError("reuse_prefix: new_tokens is empty")
    for i, c in enumerate(caches):
        off = getattr(c, "offset", None)
        if off is not None and off != len(cached):
            raise PromptCacheError(f"reuse_prefix: layer {i} holds {off} tokens but "
                                   f"{len(cached)} cached token ids were given")
    keep = min(common_prefix_length(cached, new_tokens), len(new_tokens) - 1)
    drop = len(cached) - keep
    if drop:
        for i, c in enumerate(caches):
            if not c.is_trimmable():
                raise PromptCacheError(
                    f"reuse_prefix: layer {i} ({type(c).__name__}) cannot drop its last {drop} "
                    f"tokens (shared prefix {keep} of {len(cached)}); prefill from scratch")
        for c in caches:
            c.trim(drop)
    return keep
