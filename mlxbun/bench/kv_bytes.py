"""KV bytes per token: what one layer's cache holds per token, in closed form from a config and
measured from the caches a model actually builds.

Three layouts of a multi-head latent attention (MLA) config (`mla_layouts`):
  - `latent`   deepseek_v3's absorbed cache: one "head" holding the normed KV latent
               (kv_lora_rank) as keys and the rope key shared by all heads (qk_rope_head_dim)
               as values;
  - `expanded` deepseek_v2's cache: per head the full key [k_nope | k_pe] (nope + rope) and the
               value (v_head_dim), as mlx-lm computes it;
  - `mha`      the "equivalent MHA/GQA": the same head dims cached as ordinary K/V over the
               config's num_key_value_heads (equal to num_attention_heads in every MLA config
               here, so byte for byte the expanded cache).

`layout_bytes(layout, scheme)` is the closed form of one token of one layer (batch 1);
`measured_bytes(config, model_type, scheme)` builds the universal model of a config, prefills N
tokens through mlxbun's generation caches (quantized at mlx-lm's points: `kv_quantizer`) and
divides the caches' bytes by N and by the layers. Schemes: `16bit` (float16/bfloat16: 2 bytes a
value), `q8` / `q4` (mlx-lm's affine QuantizedKVCache, group 64: packed uint32 codes + a 16-bit
scale and bias per group) and `turboquant3.5` (3-bit keys, 4-bit values, one float16 norm per
vector; `turboquant3.5,keys=4` and the other `turboquant:` options of the KV grammar choose the
key/value split: `turboquant_scheme`), and `q8-latent` / `q4-latent`: the opt-in affine quantization of a latent cache
beyond mlx-lm (`mlxbun.cache.latent_quant`; the same packed bytes as q8 / q4). A scheme a cache
cannot take is `Refused(reason)` in both.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Mapping

import mlx.core as mx

from mlxbun.cache.latent_quant import quantize_latent_caches
from mlxbun.cache.turboquant import TurboQuantKVCache
from mlxbun.cache.turboquant_codec import resolve_kv_bits
from mlxbun.errors import MlxbunError
from mlxbun.names import KVSettings, parse_kv

__all__ = ["LATENT_REFUSAL", "SCHEMES", "KVLayout", "Refused", "layout_bytes", "measured_bytes", "mla_layouts",
           "scheme_settings", "total_bytes", "turboquant_scheme"]

SCHEMES = ("16bit", "q8", "q4", "turboquant3.5", "q8-latent", "q4-latent")
GROUP_SIZE = 64  # mlx-lm's default kv_group_size
FLOAT_BYTES = 2  # float16 / bfloat16, the dtype real checkpoints run in

LATENT_REFUSAL = ("refused: the latent cache's rope key is read as an array (mlx-lm fails with an "
                  "AttributeError on a packed tuple; mlxbun refuses before the prefill)")


@dataclass(frozen=True)
class KVLayout:
    """What one layer's cache holds per token: `heads` x (`key_dim` + `value_dim`) values."""

    name: str  # latent / expanded / mha
    heads: int
    key_dim: int
    value_dim: int

    @property
    def values_per_token(self) -> int:
        return self.heads * (self.key_dim + self.value_dim)


@dataclass(frozen=True)
class Refused:
    """A scheme the cache cannot hold, and why."""

    reason: str


def _positive_int(config: Mapping, key: str) -> int:
    v = config.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise MlxbunError(f"config key {key!r} must be a positive integer (got {v!r})")
    return v


def mla_layouts(config: Mapping) -> dict[str, KVLayout]:
    """The latent / expanded / mha layouts of an MLA config (transformers' keys). A missing
    v_head_dim is hidden_size // num_attention_heads (MiniCPM3's rule, in mlx-lm and
    transformers); a missing num_key_value_heads is num_attention_heads."""
    heads = _positive_int(config, "num_attention_heads")
    kv_heads = config.get("num_key_value_heads")
    kv_heads = heads if kv_heads is None else _positive_int(config, "num_key_value_heads")
    nope, rope = _positive_int(config, "qk_nope_head_dim"), _positive_int(config, "qk_rope_head_dim")
    latent = _positive_int(config, "kv_lora_rank")
    v = config.get("v_head_dim")
    v = _positive_int(config, "hidden_size") // heads if v is None else _positive_int(config, "v_head_dim")
    return {"latent": KVLayout("latent", 1, latent, rope),
            "expanded": KVLayout("expanded", heads, nope + rope, v),
            "mha": KVLayout("mha", kv_heads, nope + rope, v)}


def _affine_vector_bytes(dim: int, bits: int, group: int) -> int:
    """mlx.quantize of one vector: dim * bits / 32 uint32 words, a scale and a bias per group."""
    return dim * bits // 8 + 2 * (dim // group) * FLOAT_BYTES


def turboquant_scheme(scheme: str) -> KVSettings:
    """The TurboQuant setting of a bench scheme `turboquant<BITS>[,keys=K][,values=V]` (e.g.
    `turboquant3.5`, mlx-vlm's split; `turboquant3.5,keys=4`): the KV grammar's `turboquant:` options
    (`mlxbun.names.parse_kv`; a `:` after the scheme name is accepted)."""
    return parse_kv("turboquant:" + scheme[len("turboquant"):].removeprefix(":"))


def split_schemes(text: str) -> list[str]:
    """A comma-separated list of bench schemes, where a TurboQuant scheme's own `keys=` / `values=`
    options stay with it: "fp16,turboquant3.5,keys=4,q4" -> fp16, turboquant3.5,keys=4, q4."""
    out: list[str] = []
    for part in (p.strip() for p in text.split(",")):
        if part.startswith(("keys=", "values=")) and out and out[-1].startswith("turboquant"):
            out[-1] += "," + part
        elif part:
            out.append(part)
    return out


def layout_bytes(layout: KVLayout, scheme: str, group_size: int = GROUP_SIZE) -> int | Refused:
    """Bytes one token takes in one layer's cache of `layout` under `scheme` (closed form)."""
    if scheme == "16bit":
        return layout.values_per_token * FLOAT_BYTES
    if scheme in ("q8", "q4", "q8-latent", "q4-latent"):
        if scheme.endswith("-latent") and layout.name != "latent":
            return Refused(f"n/a: {layout.name} caches take {scheme[:2]} directly")
        if scheme in ("q8", "q4") and layout.name == "latent":
            return Refused(LATENT_REFUSAL)
        bad = [d for d in (layout.key_dim, layout.value_dim) if d % group_size]
        if bad:
            return Refused(f"refused: head dim {bad[0]} is not a multiple of the group size {group_size}")
        bits = int(scheme[1])
        return layout.heads * (_affine_vector_bytes(layout.key_dim, bits, group_size)
                               + _affine_vector_bytes(layout.value_dim, bits, group_size))
    if scheme.startswith("turboquant"):
        tq = turboquant_scheme(scheme)
        _, kb, vb = resolve_kv_bits(tq.bits, tq.key_bits, tq.value_bits)
        return TurboQuantKVCache.bytes_per_token(layout.heads, layout.key_dim, layout.value_dim, kb, vb)
    raise MlxbunError(f"unknown KV scheme {scheme!r}; choose from {', '.join(SCHEMES)}")


def total_bytes(layout: KVLayout, scheme: str, layers: int, group_size: int = GROUP_SIZE) -> int | Refused:
    """Bytes one token takes over `layers` layers of `layout` (every layer MLA): TurboQuant keeps
    the last layer at 16 bits when there are more than 2 (mlx-vlm's rule, `turboquant_layers`)."""
    per_layer = layout_bytes(layout, scheme, group_size)
    if isinstance(per_layer, Refused):
        return per_layer
    if scheme.startswith("turboquant") and layers > 2:
        return (layers - 1) * per_layer + layout_bytes(layout, "16bit")
    return layers * per_layer


def scheme_settings(scheme: str, group_size: int = GROUP_SIZE) -> dict:
    """`make_generation_cache` / `kv_quantizer` keyword arguments of a scheme."""
    if scheme == "16bit":
        return dict(kv_bits=None, kv_group_size=group_size, kv_scheme="uniform")
    if scheme in ("q8", "q4"):
        return dict(kv_bits=int(scheme[1:]), kv_group_size=group_size, kv_scheme="uniform")
    if scheme in ("q8-latent", "q4-latent"):  # plain caches, converted by quantize_latent_caches
        return dict(kv_bits=None, kv_group_size=group_size, kv_scheme="uniform")
    if scheme.startswith("turboquant"):
        tq = turboquant_scheme(scheme)
        return dict(kv_bits=tq.bits, kv_group_size=group_size, kv_scheme="turboquant", kv_key_bits=tq.key_bits,
                    kv_value_bits=tq.value_bits)
    raise MlxbunError(f"unknown KV scheme {scheme!r}; choose from {', '.join(SCHEMES)}")


def measured_bytes(config: Mapping, scheme: str, tokens: int = 256, group_size: int = GROUP_SIZE,
                   seed: int = 0) -> int | Refused:
    """Bytes per token per layer of the caches mlxbun's generation builds for `config` (a
    config.json dict; its model_type picks the row) after a prefill of `tokens` tokens:
    sum(cache.nbytes) / tokens / layers. Weights are seeded noise (bytes do not depend on them),
    float16. Use 2 layers or fewer for TurboQuant (mlx-vlm's rule keeps the last of more layers
    at full precision) and a multiple of 256 tokens (the caches grow in steps of 256)."""
    from mlx.utils import tree_map

    from mlxbun.generation_caches import kv_quantizer, make_generation_cache
    from mlxbun.models.universal.loader import build_model

    if tokens < 1 or tokens % 256:
        raise MlxbunError(f"tokens must be a positive multiple of 256 (the caches' growth step), got {tokens}")
    kv = scheme_settings(scheme, group_size)
    model = build_model(config)
    if scheme.endswith("-latent") and not model.latent_kv:
        return Refused(f"n/a: {model.model_type}'s caches take {scheme[:2]} directly")
    mx.random.seed(seed)
    model.update(tree_map(lambda p: (mx.random.normal(p.shape) * 0.02).astype(mx.float16), model.parameters()))
    try:
        cache = make_generation_cache(model, **kv)
        quantize = kv_quantizer(kv["kv_scheme"], kv["kv_bits"], group_size, 0, key_bits=kv.get("kv_key_bits"),
                                value_bits=kv.get("kv_value_bits"))
        if scheme.endswith("-latent"):
            quantize = functools.partial(quantize_latent_caches, bits=int(scheme[1]), group_size=group_size)
        prompt = mx.random.randint(0, model.args.vocab, (1, tokens), key=mx.random.key(seed))
        model(prompt, cache=cache)
        quantize(cache)
    except MlxbunError as e:
        return Refused(f"refused: {e}")
    mx.eval([c.state for c in cache])
    total = sum(c.nbytes for c in cache)
    if total % (tokens * len(cache)):
        raise MlxbunError(f"{total} cache bytes do not split evenly over {tokens} tokens x {len(cache)} layers")
    return total // (tokens * len(cache))
