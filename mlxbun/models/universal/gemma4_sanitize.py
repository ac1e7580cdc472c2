"""gemma4_text's `Model.sanitize` (mlx-lm 0.32.2), the `gemma4` sanitize rule of its rows, on real
arrays or header-only tensors (sanitize.py's `Meta`, handled by duck typing: this module sits
below sanitize.py).

Per key, in mlx-lm's order: rope tables and the activation-range buffers (`input_max` ...)
dropped; the KV-shared layers' k_proj / v_proj / k_norm dropped (those layers read another
layer's keys / values); HF's fused `experts.gate_up_proj` [E, 2I, D] split into the SwitchGLU's
gate_proj | up_proj, `experts.down_proj` renamed to its down_proj. The gemma4 wrapper's rule (arg: the wrapper's
name) first unwraps HF's layout and drops the vision / audio towers.
"""

from __future__ import annotations

from collections.abc import Mapping

import mlx.core as mx

__all__ = ["gemma4_sanitize"]

_BUFFERS = ("self_attn.rotary_emb", "input_max", "input_min", "output_max", "output_min")
_KV = (".self_attn.k_proj", ".self_attn.v_proj", ".self_attn.k_norm")


def _halves(v):
    if isinstance(v, mx.array):
        return tuple(map(mx.contiguous, mx.split(v, 2, axis=-2)))
    shape = list(v.shape)
    shape[-2] //= 2
    half = type(v)(shape, v.dtype)  # a header-only Meta
    return half, half


def _layer_of(k: str) -> int | None:
    try:
        return int(k.split("layers.")[1].split(".")[0])
    except (IndexError, ValueError):
        return None


_TOWERS = ("vision_tower", "multi_modal_projector", "audio_tower", "embed_audio", "embed_vision",
           "vision_embedder")


def _unwrap(w: Mapping, wrapper: str) -> tuple[dict, dict[str, str], dict[str, str]]:
    """mlx-lm's gemma4 (VLM wrapper) `sanitize` before the text model's: "model." stripped, the
    vision / audio towers and their projections dropped, HF's model.<wrapper>.* moved to
    <wrapper>.model.*; a key without "model." (mlx-lm's own layout) kept as it is. Also returns
    each renamed key's checkpoint name (the audit names what the checkpoint holds)."""
    out, dropped, source = {}, {}, {}
    for k, v in w.items():
        hf = k.startswith("model.")
        k2 = k.removeprefix("model.")
        if k2.startswith(_TOWERS):
            dropped[k] = "the vision / audio towers (the text model runs alone; image and audio input are not ported)"
            continue
        if hf and k2.startswith(wrapper):
            k2 = k2.replace(f"{wrapper}.", f"{wrapper}.model.")
        out[k2 if hf else k] = v
        source[k2 if hf else k] = k
    return out, dropped, source


def gemma4_sanitize(w: Mapping, fields: Mapping, wrapper: str | None = None) -> tuple[dict, dict[str, str]]:
    """(weights, dropped name -> reason), as mlx-lm's gemma4_text `sanitize` (with `wrapper`:
    gemma4's, which unwraps first)."""
    first_shared = fields["num_hidden_layers"] - fields["num_kv_shared_layers"]
    out, dropped, source = {}, {}, {}
    if wrapper is not None:
        w, dropped, source = _unwrap(w, wrapper)
    for k, v in w.items():
        if any(s in k for s in _BUFFERS):
            dropped[source.get(k, k)] = "a rope table or activation-range buffer (mlx-lm's sanitize drops it)"
            continue
        if any(s in k for s in _KV):
            layer = _layer_of(k)
            if layer is not None and layer >= first_shared:
                dropped[source.get(k, k)] = (f"layer {layer} is KV-shared (num_kv_shared_layers): it reads "
                                             "the keys / values of an earlier layer of its type")
                continue
        if k.endswith(".experts.gate_up_proj"):
            base = k.removesuffix(".gate_up_proj")
            out[f"{base}.switch_glu.gate_proj.weight"], out[f"{base}.switch_glu.up_proj.weight"] = _halves(v)
            continue
        if k.endswith(".experts.down_proj"):
            out[f"{k.removesuffix('.down_proj')}.switch_glu.down_proj.weight"] = v
            continue
        out[k] = v
    return out, dropped
