"""The hybrid part of `mlxbun explain`: the recurrent mixer's forward line by line and the label
each of its layers gets. `explain.py` places them; a new mixer kind adds its lines here (the
table is checked exhaustive at import). Lines are (code, note) pairs, as explain_moe's."""

from __future__ import annotations

from typing import Any

from mlxbun.models.universal.kinds import MixerKind, exhaustive
from mlxbun.models.universal.mixers import MIXERS
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.specs import LayerSpec, UniversalArgs

__all__ = ["hybrid_lines", "hybrid_title", "mixer_label"]


def _short_conv(d: ArchDescriptor, a: UniversalArgs, knobs: Any) -> list[tuple[str, str]]:
    k, bias = a.fields[knobs.kernel], bool(a.fields[knobs.bias])
    return [
        ("B, C, x = split(in_proj(x), 3)", f"Linear(D, 3*D); bias={bias}"),
        ("Bx = where(mask, B * x, 0)", "mask: the ssm mask (batch padding), None otherwise"),
        ("Bx = concat([state, Bx]); state = Bx[:, -(K - 1):]",
         f"K = {knobs.kernel} = {k}; state starts at zeros; cache slot 0"),
        ("y = C * conv(Bx)", f"Conv1d(D, D, K, groups=D) (depthwise, causal); bias={bias}"),
        ("out = out_proj(y)", f"Linear(D, D); bias={bias}"),
    ]


_LINES = exhaustive(MIXERS, {
    MixerKind.SHORT_CONV: _short_conv,
})


def hybrid_title(d: ArchDescriptor) -> str:
    n, h = d.names, d.hybrid
    return f"{h.mixer.value} mixer ({n.root}.{n.layers}[i].{h.name}) on the non-attention layers"


def hybrid_lines(d: ArchDescriptor, a: UniversalArgs) -> list[tuple[str, str]]:
    return _LINES[d.hybrid.mixer](d, a, d.hybrid.mixer_knobs())


def mixer_label(d: ArchDescriptor, a: UniversalArgs, s: LayerSpec) -> tuple[str, str] | None:
    """(what the layer runs, its cache) for a recurrent layer; None for an attention layer."""
    if s.mixer is MixerKind.ATTENTION:
        return None
    slots = MIXERS[s.mixer].cache_slots
    return f"{s.mixer.value} (ssm mask)", f"ArraysCache({slots})"
