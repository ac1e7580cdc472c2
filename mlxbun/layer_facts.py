"""The per-layer facts a checkpoint's config DECLARES, normalized once: `LayerFacts`.

One attention kind and one rope flag per layer, the sliding window, the rope parameters of
each layer kind, the partial-rotary factor and the attention / final-logit softcaps, read
from the text-level config dict with transformers semantics (its default layer patterns,
where mlx-lm is silent). `TextConfig.layers` holds them.

These are what the checkpoint declares, not what mlx-lm runs: the universal graph's per-layer
behaviour comes from its descriptor (`mlxbun.models.universal`), and mlx-lm runs some families
differently from their declaration (gemma2, qwen2, qwen3, phi3 and starcoder2 with every layer
global although the config declares a sliding window; see each descriptor's `ignored_keys`). Values the config does not declare and that
differ per architecture (rope_theta, softcaps) stay None here; the descriptor owns those
defaults.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlxbun.config_reader import ConfigReader, freeze, is_int, is_number
from mlxbun.errors import ConfigError

FULL, SLIDING = "full_attention", "sliding_attention"

# Layer patterns and windows the families use when the config leaves them out
# (mlx-lm ModelArgs defaults; gemma2's alternation is transformers', mlx-lm has none).
_DEFAULT_SLIDING_PATTERN = {"gemma3_text": 6, "gemma4_text": 5, "cohere2": 4, "olmo3": 4, "gemma2": 2}
_DEFAULT_SLIDING_WINDOW = {"gemma3_text": 512, "gemma4_text": 512, "cohere2": 4096}
_DEFAULT_NO_ROPE_INTERVAL = {"smollm3": 4, "llama4": 4, "llama4_text": 4}

# nemotron_h's one-character block codes, named as transformers 5 names them.
_BLOCK_CHARS = {"*": FULL, "M": "linear_attention", "E": "moe", "-": "mlp"}


@dataclass(frozen=True)
class LayerFacts:
    """Per-layer facts as the config declares them (see the module docstring)."""

    types: tuple[str, ...]  # one kind per layer: "full_attention", "sliding_attention", ...
    sliding_window: int | None  # None unless some layer slides
    use_rope: tuple[bool, ...]  # per layer: False = NoPE
    rope: Mapping[str, Mapping[str, Any]]  # layer kind -> normalized rope parameters
    partial_rotary_factor: float
    attn_logit_softcap: float | None
    final_logit_softcap: float | None
    source: str = field(default="config.json", compare=False, repr=False)  # for error messages

    def rope_for(self, layer_type: str) -> Mapping[str, Any]:
        """The rope parameters of one layer kind ("full_attention", "sliding_attention", ...)."""
        try:
            return self.rope[layer_type]
        except KeyError:
            raise ConfigError(
                f"{self.source}: no rope parameters for layer type '{layer_type}' "
                f"(declared: {sorted(self.rope)})"
            ) from None


def layer_facts(r: ConfigReader, family: str, n: int, head_dim: int | None) -> LayerFacts:
    """The facts of `n` layers of `family` (the remapped text model_type) from `r.raw`."""
    use_rope = _use_rope(r, family, n)
    types, window = _layer_types(r, family, n, use_rope)
    if "no_rope_layers" not in r.raw and "no_rope_layer_interval" not in r.raw:
        if family == "cohere2":  # rope only on sliding layers (cohere2.py)
            use_rope = tuple(t == SLIDING for t in types)
        elif family == "exaone4" and SLIDING in types:  # global layers are NoPE (exaone4.py)
            use_rope = tuple(t == SLIDING for t in types)
    return LayerFacts(
        types=types,
        sliding_window=window,
        use_rope=use_rope,
        rope=freeze(_rope(r, family, types)),
        partial_rotary_factor=_partial_rotary_factor(r, head_dim),
        attn_logit_softcap=r.float_("attn_logit_softcap"),
        final_logit_softcap=r.float_("final_logit_softcap"),
        source=r.label,
    )


def block_pattern(r: ConfigReader) -> list[str] | None:
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


def _layer_types(r: ConfigReader, family: str, n: int,
                 use_rope: tuple[bool, ...]) -> tuple[tuple[str, ...], int | None]:
    """One attention kind per layer, and the window sliding layers use."""
    raw = r.raw
    window = raw.get("sliding_window")
    if window is not None and not is_int(window):
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
    elif (blocks := block_pattern(r)) is not None:  # hybrid stacks: kinds as given
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
        elif is_int(pattern):  # every pattern-th layer is global
            local = [pattern > 0 and (i + 1) % pattern != 0 for i in range(n)]
        else:
            raise r.fail("sliding_window_pattern", "an integer or an L/G string", pattern)
        types = tuple(SLIDING if lo and window is not None else FULL for lo in local)
    elif r.bool_("use_sliding_window") and window is not None:  # qwen2: layers >= max_window_layers
        start = raw.get("max_window_layers", 28)
        if not is_int(start):
            raise r.fail("max_window_layers", "an integer", start)
        types = tuple(SLIDING if i >= start else FULL for i in range(n))
    else:
        types = (FULL,) * n
    return types, (window if SLIDING in types else None)


def _use_rope(r: ConfigReader, family: str, n: int) -> tuple[bool, ...]:
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
        if not is_int(interval) or interval <= 0:
            raise r.fail("no_rope_layer_interval", "a positive integer", interval)
        return tuple((i + 1) % interval != 0 for i in range(n))
    return (True,) * n


def _rope_entry(r: ConfigReader, where: str, d: Any, theta: float | None) -> dict:
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
    if theta is not None and not is_number(theta):
        raise r.fail(f"{where}.rope_theta", "a number", theta)
    out["rope_theta"] = None if theta is None else float(theta)
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim", "attention_factor", "partial_rotary_factor"):
        if out.get(key) is not None and not is_number(out[key]):
            raise r.fail(f"{where}.{key}", "a number", out[key])
    omp = out.get("original_max_position_embeddings")
    if omp is not None and not is_int(omp):
        raise r.fail(f"{where}.original_max_position_embeddings", "an integer", omp)
    for key in ("short_factor", "long_factor"):
        v = out.get(key)
        if v is not None and not (is_number(v) or (isinstance(v, (list, tuple)) and all(map(is_number, v)))):
            raise r.fail(f"{where}.{key}", "a number or a list of numbers", v)
    # Phi-3 keeps original_max_position_embeddings at the top level (phi3.py reads it there).
    if rope_type != "default" and "original_max_position_embeddings" not in out:
        top = r.raw.get("original_max_position_embeddings")
        if is_int(top):
            out["original_max_position_embeddings"] = top
    return out


def _is_per_type(rp: Any) -> bool:
    return isinstance(rp, Mapping) and bool(rp) and all(isinstance(v, Mapping) for v in rp.values())


def _rope(r: ConfigReader, family: str, layer_types: tuple[str, ...]) -> dict[str, dict]:
    raw = r.raw
    rp = raw.get("rope_parameters")
    if _is_per_type(rp):  # transformers 5: {"full_attention": {...}, "sliding_attention": {...}}
        return {lt: _rope_entry(r, f"rope_parameters.{lt}", d, None) for lt, d in rp.items()}
    per_layer = raw.get("rope_theta")
    if isinstance(per_layer, list) and per_layer and all(is_number(t) for t in per_layer):
        theta = None  # step3p5: one base per layer, which its descriptor reads
    else:
        theta = r.float_("rope_theta")
    scaling, where = raw.get("rope_scaling"), "rope_scaling"
    if scaling is None and rp is not None:  # flat rope_parameters (mlx-lm qwen3 precedence)
        scaling, where = rp, "rope_parameters"
    entry = _rope_entry(r, where, scaling, theta)
    rope = {lt: entry for lt in dict.fromkeys(layer_types)}
    # gemma3-style per-kind base: sliding layers use rope_local_base_freq and no scaling.
    local = raw.get("rope_local_base_freq")
    if SLIDING in rope and (local is not None or family in ("gemma3_text", "gemma3n_text", "gemma3n")):
        if local is not None and not is_number(local):
            raise r.fail("rope_local_base_freq", "a number", local)
        rope[SLIDING] = {"rope_type": "default", "rope_theta": None if local is None else float(local)}
    return rope


def _partial_rotary_factor(r: ConfigReader, head_dim: int | None) -> float:
    v = r.float_("partial_rotary_factor")
    if v is not None:
        return v
    rp = r.raw.get("rope_parameters")
    if isinstance(rp, Mapping) and not _is_per_type(rp) and rp.get("partial_rotary_factor") is not None:
        prf = rp["partial_rotary_factor"]
        if not is_number(prf):
            raise r.fail("rope_parameters.partial_rotary_factor", "a number", prf)
        return float(prf)
    rotary_dim = r.raw.get("rotary_dim")
    if is_int(rotary_dim) and head_dim:
        return rotary_dim / head_dim
    return 1.0
