"""The caches generation runs with: built from KV options, quantized at mlx-lm's points, and
saved / loaded as prompt caches for a given model.

`make_generation_cache` is what `stream_generate` (and speculative decoding) builds; the
quantize hook (`kv_quantizer`) runs where mlx-lm's `quantize_cache_fn` runs (after every prefill
chunk and after every decode step's model call); `attention_routing` lets TurboQuant decode from
its packed codes inside mlx-lm models too.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.cache_list import CacheList
from mlxbun.cache.convert import maybe_quantize_kv_cache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.mixed import KVPlan
from mlxbun.cache.prompt_cache import load_prompt_cache, model_identity
from mlxbun.cache.quantized import KV_QUANT_GROUP_SIZES
from mlxbun.cache.turboquant import TurboQuantKVCache, patch_mlxlm_attention
from mlxbun.config import TextConfig, checkpoint_kv_config, kv_config_entries
from mlxbun.errors import GenerationError, MlxbunError
from mlxbun.models.mlxlm import ensure_runtime
from mlxbun.names import KVSettings, is_int

__all__ = [
    "KVCoverage", "KVHeadDimError", "KVQuantizer", "NO_KV_CONFIG", "ROTATING_KEEP", "attention_routing",
    "check_kv_config_file", "check_kv_options",
    "check_plan_options", "checkpoint_kv_plan", "converts_while_decoding", "kv_layers", "kv_quantizer", "load_kv_plan",
    "load_prompt_cache_for", "make_generation_cache", "maybe_turboquant_kv_cache", "model_identity_of",
    "resolve_kv_config", "turboquant_layers",
]

ROTATING_KEEP = 4  # mlx-lm's make_prompt_cache keeps the first 4 tokens (attention sinks)
NO_KV_CONFIG = "none"  # kv_config: no per-layer plan, not even the checkpoint's own


class KVHeadDimError(GenerationError):
    """A layer's head dim is not a multiple of its KV group size (`head_dim`, `group_size`)."""

    def __init__(self, message: str, head_dim: int, group_size: int):
        super().__init__(message)
        self.head_dim, self.group_size = head_dim, group_size


def check_kv_options(
    *,
    kv_bits=None,
    kv_group_size: int = 64,
    quantized_kv_start: int = 0,
    kv_scheme: str = "uniform",
    max_kv_size: Optional[int] = None,
    kv_key_bits: Optional[int] = None,
    kv_value_bits: Optional[int] = None,
) -> KVSettings:
    """Refuse KV options that no cache here supports, naming the option (`GenerationError`);
    return them as `KVSettings` (the one place KV options are validated: `mlxbun.names`).
    `kv_key_bits` / `kv_value_bits`: TurboQuant's key/value split (`KVSettings.key_bits`); the
    settings hold it whole (both sides, and their mean as `bits`, also where kv_bits was not given)."""
    if max_kv_size is not None and (not is_int(max_kv_size) or max_kv_size < 1):
        raise GenerationError(f"max_kv_size must be a positive integer, got {max_kv_size!r}")
    settings = KVSettings.from_flags(kv_bits=kv_bits, kv_group_size=kv_group_size, kv_scheme=kv_scheme,
                                     quantized_kv_start=quantized_kv_start, kv_key_bits=kv_key_bits,
                                     kv_value_bits=kv_value_bits)
    if settings.quantized and max_kv_size is not None:
        # mlx-lm: RotatingKVCache.to_quantized is not implemented
        raise GenerationError("kv_bits and max_kv_size cannot be combined: rotating KV caches are not quantizable")
    return settings


def _as_mlxbun_cache(c):
    """An empty mlx-lm KVCache / RotatingKVCache / ArraysCache becomes mlxbun's (same layout and
    maths; mlxbun's carry the spec-round contract and save as prompt caches), and a CacheList of
    those mlxbun's CacheList; other kinds stay."""
    from mlx_lm.models import cache as mc  # mlx-lm's own classes, to recognise them

    if isinstance(c, (KVCache, RotatingKVCache, ArraysCache, CacheList)):
        return c
    if type(c) is mc.KVCache and c.keys is None:
        return KVCache()
    if type(c) is mc.RotatingKVCache and c.keys is None:
        return RotatingKVCache(max_size=c.max_size, keep=c.keep)
    if type(c) is mc.ArraysCache and c.empty() and c.left_padding is None and c.lengths is None:
        return ArraysCache(len(c.cache))
    if type(c) is mc.CacheList:
        children = [_as_mlxbun_cache(x) for x in c.caches]
        if all(type(x).__module__.startswith("mlxbun.") for x in children):
            return CacheList(*children)
    return c


def _base_caches(model, max_kv_size: Optional[int]) -> list:
    caches = [_as_mlxbun_cache(c) for c in model.make_cache()]
    if max_kv_size is None:
        return caches
    # Full-attention layers (plain KVCache) get a bounded ring; window caches are bounded already.
    return [
        RotatingKVCache(max_size=max_kv_size, keep=ROTATING_KEEP) if isinstance(c, KVCache) else c
        for c in caches
    ]


def check_kv_config_file(path, what: str = "kv_config") -> Path:
    """A kv_config path that names a file (`what`: the option, in errors): a directory or a missing
    path is refused, saying which."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise GenerationError(f"{what} {path}: is a directory; give a kv_config JSON file "
                              f"(e.g. {path / 'kv_config.json'})")
    if not path.is_file():
        raise GenerationError(f"{what} {path}: no such file")
    return path


def load_kv_plan(kv_config, num_layers: int):
    """A `KVPlan` from a plan, a kv_config.json path or the parsed JSON, in either form
    (`mlxbun.config.KV_CONFIG_FORMS`: optiq's list of {layer_idx, bits, group_size} entries, or an
    object with a "layers" list; the forms a checkpoint's own kv_config.json is read in)."""
    if isinstance(kv_config, KVPlan):
        return kv_config
    source = "kv_config"
    if isinstance(kv_config, (str, Path)):
        path = check_kv_config_file(kv_config)
        try:
            kv_config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise GenerationError(f"kv_config {path}: not a readable JSON file ({e})") from None
        source = str(path)
    return KVPlan.from_kv_config(kv_config_entries(kv_config, source), num_layers, source=source)


def checkpoint_kv_plan(model) -> Optional[KVPlan]:
    """The per-layer plan a checkpoint ships (its kv_config.json: `TextConfig.kv_config`, or read
    from the model's directory when mlxbun could not normalize its config, as under an mlx-lm
    model), checked against the model's cache layers; None when it ships none."""
    model = ensure_runtime(model)
    config = getattr(model, "config", None)
    if isinstance(config, TextConfig):
        entries, file = config.kv_config, config.kv_config_file
    else:
        path = getattr(model, "path", None)
        entries, file = (checkpoint_kv_config(path) if path is not None else None) or (None, None)
    if not entries:
        return None
    return KVPlan.from_kv_config(entries, len(model.make_cache()), source=str(file))


def resolve_kv_config(model, kv_config=None, *, kv_bits=None, kv_scheme: str = "uniform",
                      max_kv_size: Optional[int] = None):
    """The per-layer plan a run uses: `kv_config` as given; `NO_KV_CONFIG` ("none"): no plan; by
    default (None) the checkpoint's own (`checkpoint_kv_plan`) unless another KV option is given
    (kv_bits, a kv_scheme other than uniform, max_kv_size)."""
    if kv_config is None and kv_bits is None and kv_scheme == "uniform" and max_kv_size is None:
        return checkpoint_kv_plan(model)
    return None if _no_plan(kv_config) else kv_config


def make_generation_cache(
    model,
    *,
    kv_bits=None,
    kv_group_size: int = 64,
    kv_scheme: str = "uniform",
    kv_config=None,
    max_kv_size: Optional[int] = None,
    quantized_kv_start: int = 0,
    kv_key_bits: Optional[int] = None,
    kv_value_bits: Optional[int] = None,
) -> list:
    """A fresh per-layer cache list for `model` as `stream_generate` would build it (pass it as
    `prompt_cache` to keep a handle on it, e.g. to save it afterwards). A per-layer plan
    (`kv_config`; None or "none": no plan) only leaves its layers at full precision until the
    quantization points, so it is checked here, not applied; so are TurboQuant's widths (its
    caches are made by the quantize hook, `kv_quantizer`)."""
    model = ensure_runtime(model)
    check_kv_options(kv_bits=kv_bits, kv_group_size=kv_group_size, quantized_kv_start=quantized_kv_start,
                     kv_scheme=kv_scheme, max_kv_size=max_kv_size, kv_key_bits=kv_key_bits,
                     kv_value_bits=kv_value_bits)
    check_plan_options(kv_config, kv_bits, kv_scheme, max_kv_size)
    if getattr(model, "attention_sinks", False) and (
            (kv_bits is not None and kv_scheme == "uniform") or not _no_plan(kv_config)):
        # refused before the prefill rather than at the first quantized attention
        raise GenerationError(
            f"{getattr(model, 'model_type', 'this model')}: its attention sinks are not supported by "
            "quantized-KV attention (nor by mlx-lm's quantized SDPA); use plain KV or TurboQuant "
            "(kv_scheme='turboquant', --kv turboquant:BITS)")
    if getattr(model, "latent_kv", False) and (
            (kv_bits is not None and kv_scheme == "uniform") or not _no_plan(kv_config)):
        raise GenerationError(
            f"{getattr(model, 'model_type', 'this model')}: its cache holds the MLA latent and rope key, "
            "which its attention reads as arrays: uniform quantized KV cannot run (nor in mlx-lm); use "
            "plain KV or TurboQuant (kv_scheme='turboquant', --kv turboquant:BITS)")
    caches = _base_caches(model, max_kv_size)
    if not _no_plan(kv_config):
        # Refuse a plan that names a missing, sliding-window or recurrent layer now, not mid-run.
        # The caches stay full precision until the quantization points (as with kv_bits).
        load_kv_plan(kv_config, len(caches)).make_caches(_base_caches(model, None))
    return caches


def check_plan_options(kv_config, kv_bits, kv_scheme, max_kv_size) -> None:
    """A per-layer plan sets each layer's precision: refuse uniform options next to it."""
    if not _no_plan(kv_config) and (kv_bits is not None or max_kv_size is not None or kv_scheme != "uniform"):
        raise GenerationError("kv_config sets each layer's KV precision; do not combine it with "
                              "kv_bits, kv_scheme or max_kv_size")


def _no_plan(kv_config) -> bool:
    return kv_config is None or (isinstance(kv_config, str) and kv_config == NO_KV_CONFIG)


def model_identity_of(model) -> Optional[dict]:
    """The identity a saved prompt cache records (`prompt_cache.model_identity`), when the model
    has an mlxbun config (an mlx-lm model without one has none to check against)."""
    config = getattr(model, "config", None)
    if not isinstance(config, TextConfig):
        return None
    # one saved cache per entry of the model's cache list, which may skip layers (nemotron_h's
    # MLP and MoE layers hold none, as in mlx-lm)
    return {**model_identity(config), "num_layers": str(len(model.make_cache()))}


def load_prompt_cache_for(model, path) -> tuple[list, dict]:
    """(caches, metadata) of a saved prompt cache, refused unless it was made by this model."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise GenerationError(f"{p}: prompt cache file not found")
    return load_prompt_cache(p, expect_identity=model_identity_of(model))


class KVQuantizer:
    """The KV quantize hook generation runs at mlx-lm's `quantize_cache_fn` points: `hook(cache)`
    converts layers in place; `pending(cache)` says whether a later call may still convert one (a
    layer of a kind it converts is left: the start is not reached yet, or nothing was fed), i.e.
    whether the caches may change kind while decoding. Its first call with a filled cache refuses
    a head dim the group size does not divide (`group_of(i)`: a layer's group, None: unchecked)."""

    def __init__(self, convert: Callable[[list], None], convertible: Callable[[list], list],
                 group_of: Optional[Callable[[int], Optional[int]]] = None, where=None):
        self._convert, self._convertible = convert, convertible
        self._group_of, self._where = group_of, where
        self._checked = group_of is None

    def __call__(self, cache: list) -> None:
        if not self._checked:
            _check_head_dims(cache, self._group_of, self._where)
            self._checked = True
        self._convert(cache)

    def pending(self, cache: list) -> bool:
        return bool(self._convertible(cache))


def converts_while_decoding(hook, cache: list) -> bool:
    """Whether a KV quantize hook (None: there is none) may still convert a layer of `cache` while
    decoding; a hook that cannot say (not a `KVQuantizer`) is taken to. The compiled decode step
    holds the caches' kinds as they are when it starts, and the hook would no longer see its tokens."""
    if hook is None:
        return False
    pending = getattr(hook, "pending", None)
    return pending is None or pending(cache)


def _uniform_convertible(cache: list) -> list:
    """The layers mlx-lm's uniform hook converts (or refuses) once they hold the start's tokens."""
    return [i for i, c in enumerate(cache)
            if isinstance(c, (KVCache, RotatingKVCache)) or hasattr(c, "to_quantized")]


def kv_quantizer(kv_scheme, kv_bits, kv_group_size, quantized_kv_start, plan=None, *,
                 key_bits: Optional[int] = None, value_bits: Optional[int] = None) -> KVQuantizer:
    """The `KVQuantizer` of these KV settings (a plan, uniform or TurboQuant widths, or none).
    `key_bits` / `value_bits`: TurboQuant's key/value split (None: mlx-vlm's split of kv_bits)."""
    if plan is not None:  # optiq's per-layer hook: same points, same start rule
        def group_of(i):
            return plan.layers[i][1] if i in plan.layers else None

        return KVQuantizer(lambda cache: plan.maybe_quantize(cache, quantized_kv_start),
                           lambda cache: [i for i in plan.layers if isinstance(cache[i], KVCache)],
                           group_of, lambda i: f"{plan.source}: layer {i}")
    if kv_bits is None:
        if key_bits is not None or value_bits is not None:  # KVSettings.bits holds a split's mean
            raise GenerationError(f"key_bits={key_bits}, value_bits={value_bits} without kv_bits: give the "
                                  "settings' resolved widths (`check_kv_options(...).bits`)")
        return KVQuantizer(lambda cache: None, lambda cache: [])
    if kv_scheme == "uniform":
        if key_bits is not None or value_bits is not None:
            raise GenerationError(f"key_bits={key_bits}, value_bits={value_bits}: a key/value split is "
                                  "TurboQuant's; uniform KV quantization has one width")
        fn = functools.partial(maybe_quantize_kv_cache, quantized_kv_start=quantized_kv_start,
                               kv_group_size=kv_group_size, kv_bits=kv_bits)
        where = f"cannot quantize the KV cache with kv_bits={kv_bits}, kv_group_size={kv_group_size}"
    else:
        fn = functools.partial(maybe_turboquant_kv_cache, quantized_kv_start=quantized_kv_start,
                               kv_group_size=kv_group_size, kv_bits=kv_bits, key_bits=key_bits,
                               value_bits=value_bits)
        split = "" if key_bits is None and value_bits is None else f", key_bits={key_bits}, value_bits={value_bits}"
        where = f"cannot quantize the KV cache with TurboQuant kv_bits={kv_bits}{split}"

    def quantize(cache):
        try:
            fn(cache)
        except (ValueError, MlxbunError) as e:  # a window cache, ...
            raise GenerationError(f"{where}: {e}") from None

    if kv_scheme != "uniform":  # TurboQuant has no groups
        return KVQuantizer(quantize, turboquant_layers)
    return KVQuantizer(quantize, _uniform_convertible, lambda i: kv_group_size, lambda i: f"{where}: layer {i}")


def _check_head_dims(cache: list, group_of, where) -> None:
    """Refuse (`KVHeadDimError`) a filled KVCache whose key or value head dim is not a multiple of
    its layer's group size (`group_of(i)`, None: not quantized), saying which group size would do."""
    for i, c in enumerate(cache):
        group = group_of(i)
        if group is None or not isinstance(c, KVCache) or c.keys is None:
            continue
        for dim in dict.fromkeys((c.keys.shape[-1], c.values.shape[-1])):
            if dim % group:
                raise KVHeadDimError(f"{where(i)}: head dim {dim} is not a multiple of the group size "
                                     f"{group}; {_group_advice(dim)}", dim, group)


def _group_advice(dim: int) -> str:
    sizes = KV_QUANT_GROUP_SIZES
    fits = [g for g in sizes if dim % g == 0]
    if fits:
        return f"use a group size that divides it: {' or '.join(map(str, fits))} (kv_group_size, --kv-group-size)"
    why = "below every" if dim < min(sizes) else "not a multiple of any"
    return (f"it is {why} KV group size ({', '.join(map(str, sizes))}), so uniform KV quantization cannot "
            "run on this model; TurboQuant has no groups (kv_scheme='turboquant', --kv turboquant:BITS)")


def maybe_turboquant_kv_cache(prompt_cache: list, quantized_kv_start: int, kv_group_size: int, kv_bits,
                              key_bits: Optional[int] = None, value_bits: Optional[int] = None) -> None:
    """mlx-vlm 0.7.10's `maybe_quantize_kv_cache` for the TurboQuant scheme: every full-attention
    KVCache becomes a `TurboQuantKVCache` (an empty one at once, so it quantizes on the fly; a
    filled one once it holds `quantized_kv_start` tokens); window caches stay; and, as mlx-vlm
    does, the last layer stays full precision when the model has more than 2 layers.
    `kv_group_size` is unused (TurboQuant has no groups). `key_bits` / `value_bits`: a chosen
    key/value split (`TurboQuantKVCache`'s overrides; None: mlx-vlm's split of kv_bits)."""
    widths = dict(bits=kv_bits, key_bits=key_bits, value_bits=value_bits)
    for i in turboquant_layers(prompt_cache):
        c = prompt_cache[i]
        if c.offset == 0:
            prompt_cache[i] = TurboQuantKVCache(**widths)
        elif c.offset >= quantized_kv_start:
            prompt_cache[i] = TurboQuantKVCache.from_cache(c, **widths)


def turboquant_layers(caches: list) -> list[int]:
    """The cache layers mlx-vlm's TurboQuant rule converts: full-attention KVCaches, except the
    last layer of a model with more than 2 (window caches and the last layer stay full precision)."""
    last = len(caches) - 1 if len(caches) > 2 else -1
    return [i for i, c in enumerate(caches) if i != last and isinstance(c, KVCache)]


@dataclass(frozen=True)
class KVCoverage:
    """Which cache layers KV settings quantize (`layers` of `total`), and what the others keep."""

    layers: tuple[int, ...]
    total: int
    others: str = ""  # why the other layers stay full precision ("" when there are none)

    def describe(self) -> str:
        runs: list[list[int]] = []
        for i in self.layers:
            if runs and i == runs[-1][-1] + 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        where = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs) or "none"
        return f"{len(self.layers)} layer(s) {where} of {self.total}" + (f"; {self.others}" if self.others else "")


def kv_layers(model, *, kv_bits=None, kv_scheme: str = "uniform", plan: Optional[KVPlan] = None) -> KVCoverage:
    """The cache layers these KV settings quantize: e.g. TurboQuant on Gemma-3 touches only its
    full-attention layers, and not the last one."""
    caches = _base_caches(ensure_runtime(model), None)
    n = len(caches)
    if plan is not None:
        return KVCoverage(tuple(sorted(plan.layers)), n, "the others full precision (the per-layer plan)")
    if kv_bits is None:
        return KVCoverage((), n, "no KV quantization")
    if kv_scheme == "turboquant":
        windows = sum(isinstance(c, RotatingKVCache) for c in caches)
        kept = [f"{windows} sliding-window layers"] if windows else []
        kept += [f"layer {n - 1} (mlx-vlm keeps the last)"] if n > 2 and isinstance(caches[-1], KVCache) else []
        return KVCoverage(tuple(turboquant_layers(caches)), n,
                          f"full precision: {', '.join(kept)}" if kept else "")
    layers = tuple(i for i, c in enumerate(caches) if isinstance(c, KVCache))  # mlx-lm's rule: every KVCache
    return KVCoverage(layers, n, f"{n - len(layers)} other caches stay as they are" if len(layers) < n else "")


def attention_routing(turboquant: bool):
    """TurboQuant decode runs attention in the rotated space straight from the packed codes (as
    mlx-vlm does) while generating; without the routing it would dequantize the whole cache."""
    if not turboquant:
        return contextlib.nullcontext()
    return patch_mlxlm_attention()
