"""One immutable, normalized view of a checkpoint's configuration.

`load_model_config(dir)` reads `config.json` (+ optional `generation_config.json`,
`tokenizer_config.json`, optiq `kv_config.json`) and returns a `TextConfig`: sizes under
their canonical names, the per-layer facts the config declares (`TextConfig.layers`, a
`mlxbun.layer_facts.LayerFacts`), the EOS union and special-token ids, quantization with
its per-module overrides (parsed by `mlxbun.quant`), and the VLM-wrapper facts (text-level
dict, weight prefix). The raw dicts are kept, read-only; `fingerprint()` is the structural
identity profiles are guarded by.

Semantics follow the pinned mlx-lm (how wrappers unwrap `text_config`, the model_type
remapping, quantization overrides) and transformers where mlx-lm is silent (default layer
patterns). Values the checkpoint does not declare and that differ per architecture
(rope_theta, softcaps) stay None here: the descriptor table owns architecture defaults.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxbun.config_reader import (
    ConfigReader,
    FrozenDict,
    decode_tagged_floats,
    freeze,
    is_int,
    is_number,
    json_type,
    read_json,
    thaw,
)
from mlxbun.errors import ConfigError
from mlxbun.layer_facts import LayerFacts, block_pattern, layer_facts
from mlxbun.quant import QuantSpec, module_spec, parse_quantization

__all__ = [
    "ConfigError",
    "KVLayerSpec",
    "KV_CONFIG_FORMS",
    "MODEL_ARCHITECTURE_REMAPPING",
    "MODEL_REMAPPING",
    "TextConfig",
    "checkpoint_kv_config",
    "config_from_dict",
    "kv_config_entries",
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

# Text-model defaults that released checkpoints rely on: Gemma 3 VLM configs ship a
# sparse text_config (no head_dim, eps, rope bases), so mlx-lm's gemma3_text ModelArgs
# defaults apply. Without them head_dim would fall back to hidden/heads (wrong: 320 vs 256).
_TEXT_DEFAULTS = {
    "gemma3_text": {"head_dim": 256, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0},
}


# ---------------------------------------------------------------- value types


@dataclass(frozen=True)
class KVLayerSpec:
    """One optiq kv_config.json entry: the KV-cache precision of one cache index."""

    layer_idx: int
    bits: int | float  # 0 = full precision (optiq convention)
    group_size: int = 64


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
    layers: LayerFacts  # per-layer facts as declared (kinds, window, rope, softcaps)
    eos_token_ids: tuple[int, ...]
    unresolved_eos_tokens: tuple[str, ...]
    bos_token_id: int | None
    pad_token_id: int | None
    quantization: QuantSpec | None
    quant_overrides: Mapping[str, QuantSpec | None]
    quant_method: str | None
    kv_config: tuple[KVLayerSpec, ...] | None
    kv_config_file: Path | None  # where kv_config was read (for messages)
    is_vlm: bool
    weight_prefix: str
    has_vision: bool
    has_audio: bool
    vision_sidecar: Path | None
    generation_config: Mapping[str, Any] = field(default_factory=lambda: FrozenDict())
    tokenizer_config: Mapping[str, Any] = field(default_factory=lambda: FrozenDict())

    def quant_for(self, path: str) -> QuantSpec | None:
        """The packing of the module at `path` (mlx-lm module path), None if unquantized;
        a per-module override wins, with or without the VLM weight prefix (see
        `mlxbun.quant.module_spec`)."""
        return module_spec(path, self.quantization, self.quant_overrides, self.weight_prefix)

    def fingerprint(self) -> str:
        """Stable sha256 of the structural fields (a profile's structural guard)."""
        return _fingerprint(self)

    def __hash__(self) -> int:
        return hash((self.path, self.fingerprint()))


def _fingerprint(c: TextConfig) -> str:
    def q(spec: QuantSpec | None):
        return None if spec is None else [spec.bits, spec.group_size, spec.mode]

    layers = c.layers
    # Keys and values as before LayerFacts existed, so fingerprints stay comparable.
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
        "layer_types": layers.types,
        "sliding_window": layers.sliding_window,
        "use_rope": layers.use_rope,
        "attn_logit_softcap": layers.attn_logit_softcap,
        "final_logit_softcap": layers.final_logit_softcap,
        "partial_rotary_factor": layers.partial_rotary_factor,
        "rope": layers.rope,
        "quantization": q(c.quantization),
        "quant_overrides": {k: q(v) for k, v in c.quant_overrides.items()},
        "quant_method": c.quant_method,
        "weight_prefix": c.weight_prefix,
    }
    payload = json.dumps(structure, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- file reading


def load_model_config(path: str | Path) -> TextConfig:
    """Load and normalize a checkpoint directory (or its config.json)."""
    path = Path(path).expanduser()
    if path.is_file() and path.name == "config.json":
        path = path.parent
    if not path.is_dir():
        raise ConfigError(f"{path / 'config.json'}: file not found (no such checkpoint directory)")
    config = read_json(path / "config.json", required=True)
    generation = read_json(path / "generation_config.json", required=False)
    tokenizer = read_json(path / "tokenizer_config.json", required=False)
    return _build(config, path=path, generation_config=generation, tokenizer_config=tokenizer,
                  kv_config=_find_kv_config(path))


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
        raise ConfigError(f"{label}: expected a JSON object at the top level, got {json_type(d)}")
    for name, extra in (("generation_config.json", generation_config),
                        ("tokenizer_config.json", tokenizer_config)):
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"{name}: expected a JSON object at the top level, got {json_type(extra)}")
    kv = None
    if kv_config is not None:
        kv = (kv_config, (path / "kv_config.json") if path else Path("kv_config.json"))
    return _build(decode_tagged_floats(thaw(d)), path=path,
                  generation_config=thaw(generation_config), tokenizer_config=thaw(tokenizer_config),
                  kv_config=kv)


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
        raise ConfigError(f"{label}: key 'text_config' must be an object, got {json_type(text)}")
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


# ---------------------------------------------------------------- token ids


def _token_ids(value: Any, where: str, key: str) -> list[int]:
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    for v in items:
        if not is_int(v):
            raise ConfigError(f"{where}: key '{key}' must be an integer or a list of integers, "
                              f"got {json_type(value)} {value!r}"[:400])
    return list(items)


class _TokenResolver:
    """Token string -> id through tokenizer_config's added_tokens_decoder, then tokenizer.json."""

    def __init__(self, tokenizer_config: dict, label: str, directory: Path | None):
        self.label, self.directory = label, directory
        self.table: dict[str, int] = {}
        decoder = tokenizer_config.get("added_tokens_decoder") or {}
        if not isinstance(decoder, Mapping):
            raise ConfigError(f"{label}: key 'added_tokens_decoder' must be an object, got {json_type(decoder)}")
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
        data = read_json(file, required=False)
        if data is None:
            return
        for tok in data.get("added_tokens") or ():
            if isinstance(tok, Mapping) and is_int(tok.get("id")) and isinstance(tok.get("content"), str):
                self.table.setdefault(tok["content"], tok["id"])
        vocab = (data.get("model") or {}).get("vocab") if isinstance(data.get("model"), Mapping) else None
        if isinstance(vocab, Mapping):  # BPE / WordPiece: token -> id
            for tok, idx in vocab.items():
                if is_int(idx):
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
                              f"got {json_type(token)} {token!r}"[:400])
        if content not in self.table and not self._loaded_tokenizer_json:
            self._load_tokenizer_json()
        if content in self.table:
            return self.table[content], None
        return None, content


# ---------------------------------------------------------------- kv_config


KV_CONFIG_FORMS = ('a JSON list of layer entries [{"layer_idx": I, "bits": B, "group_size": G}, ...] '
                   '(optiq\'s kv_config.json) or an object {"layers": [...]}')


def kv_config_entries(data: Any, where: str | Path) -> list:
    """The entry list of a per-layer KV plan in either accepted form (KV_CONFIG_FORMS); any
    other shape is refused, showing the forms (a file's plan and a caller's read alike)."""
    entries = data.get("layers") if isinstance(data, Mapping) and "layers" in data else data
    if isinstance(entries, (list, tuple)):
        return list(entries)
    if isinstance(data, Mapping):
        got = (f"an object whose 'layers' is {json_type(entries)}" if "layers" in data
               else f"an object with keys {sorted(map(str, data))}")
    else:
        got = json_type(data)
    raise ConfigError(f"{where}: expected {KV_CONFIG_FORMS}, got {got}")


def _find_kv_config(directory: Path) -> tuple[Any, Path] | None:
    for file in (directory / "kv_config.json", directory / "optiq" / "kv_config.json"):
        if file.is_file():
            return read_json(file, required=True, expect=(list, dict)), file
    return None


def checkpoint_kv_config(directory: str | Path) -> tuple[tuple[KVLayerSpec, ...], Path] | None:
    """A checkpoint directory's own per-layer KV plan (kv_config.json, or optiq/kv_config.json) as
    (entries, file), None when it has none; for a checkpoint whose config.json mlxbun cannot
    normalize (`load_model_config` reads the plan into `TextConfig.kv_config` otherwise). Layer
    indices are checked against the model's caches by whoever applies the plan."""
    found = _find_kv_config(Path(directory).expanduser())
    return None if found is None else (_kv_config(found[0], found[1], None), found[1])


def _kv_config(data: Any, file: Path, n_layers: int | None) -> tuple[KVLayerSpec, ...]:
    out, seen = [], set()
    for i, e in enumerate(kv_config_entries(data, file)):
        where = f"{file}: entry {i}"
        if not isinstance(e, Mapping):
            raise ConfigError(f"{where} must be an object, got {json_type(e)}")
        idx, bits, group = e.get("layer_idx"), e.get("bits"), e.get("group_size", 64)
        if not is_int(idx) or idx < 0:
            raise ConfigError(f"{where}: key 'layer_idx' must be a non-negative integer, got {idx!r}")
        if n_layers is not None and idx >= n_layers:
            raise ConfigError(f"{where}: key 'layer_idx' {idx} is not a layer of this model "
                              f"(num_hidden_layers {n_layers}: layers 0..{n_layers - 1})")
        if not is_number(bits) or bits < 0:
            raise ConfigError(f"{where}: key 'bits' must be a non-negative number, got {bits!r}")
        if not is_int(group) or group <= 0:
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
        raise ConfigError(f"{label}: key 'model_type' must be a string, got {json_type(source)} {source!r}")
    model_type = _remap(source, full.get("architectures"))
    raw, nested = _text_level(full, model_type, label)
    r = ConfigReader(raw, label, nested)
    text_type = raw.get("model_type") if isinstance(raw.get("model_type"), str) else source
    family = MODEL_REMAPPING.get(text_type, text_type)
    for key, value in _TEXT_DEFAULTS.get(family, {}).items():
        if key.startswith("rope_") and "rope_parameters" in raw:
            continue  # transformers-5 configs carry the bases inside rope_parameters
        if raw.get(key) is None:
            raw[key] = value

    vocab = r.int_("vocab_size", required=True)
    hidden = r.int_("hidden_size", required=True)
    blocks = block_pattern(r)
    n_layers = r.int_("num_hidden_layers", required=blocks is None)
    if n_layers is None:  # nemotron_h: the block pattern is the layer stack
        n_layers = len(blocks)
    heads = r.int_("num_attention_heads")
    _, kv_list = r.find("num_key_value_heads")
    if isinstance(kv_list, list) and kv_list and all(map(is_int, kv_list)):
        kv_heads = None  # one count per layer (openelm's num_kv_heads): the graph reads the list
    else:
        kv_heads = r.int_("num_key_value_heads") or heads
    head_dim = r.int_("head_dim") or (hidden // heads if heads else None)

    key, inter = r.find("intermediate_size")
    if isinstance(inter, list) and all(map(is_int, inter)):  # per-layer widths (gemma3n)
        inter = tuple(inter)
    elif inter is not None and not is_int(inter):
        raise r.fail(key, "an integer or a list of integers", inter)

    tie_raw = r.bool_("tie_word_embeddings")
    dtype = None
    for src in (raw, full):
        for k in ("dtype", "torch_dtype"):
            if dtype is None and src.get(k) is not None:
                dtype = src[k]
                if not isinstance(dtype, str):
                    raise r.fail(k, "a string", dtype)

    facts = layer_facts(r, family, n_layers, head_dim)

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

    quant, overrides, method = parse_quantization(full, label, path)

    kv = kv_file = None
    if kv_config is not None:
        kv, kv_file = _kv_config(kv_config[0], kv_config[1], n_layers), kv_config[1]

    sidecar = None
    if path is not None:
        sidecar = next((p for p in (path / "optiq" / "optiq_vision.safetensors",
                                    path / "optiq_vision.safetensors") if p.is_file()), None)

    return TextConfig(
        path=path,
        raw_full=freeze(full),
        raw=freeze(raw),
        source_model_type=source,
        model_type=model_type,
        text_model_type=text_type,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        norm_eps=r.float_("norm_eps"),
        tie_word_embeddings=True if tie_raw is None else tie_raw,
        tie_word_embeddings_raw=tie_raw,
        max_position_embeddings=r.int_("max_position_embeddings"),
        dtype=dtype,
        layers=facts,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        unresolved_eos_tokens=(unresolved,) if unresolved else (),
        bos_token_id=special("bos"),
        pad_token_id=special("pad"),
        quantization=quant,
        quant_overrides=FrozenDict(overrides),
        quant_method=method,
        kv_config=kv,
        kv_config_file=kv_file,
        is_vlm=full.get("text_config") is not None or full.get("vision_config") is not None,
        weight_prefix=_WRAPPER_PREFIX.get(model_type, ""),
        has_vision=full.get("vision_config") is not None or sidecar is not None,
        has_audio=full.get("audio_config") is not None,
        vision_sidecar=sidecar,
        generation_config=freeze(generation_config),
        tokenizer_config=freeze(tokenizer_config),
    )
