"""The hybrid part of a descriptor row: `HybridKnobs` (which recurrent mixer runs on which
layers), with its checks and the ModelArgs fields it reads (`schema.py` calls them when a
row is built). A row without `hybrid` attends on every layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlxbun.models.universal.kinds import (
    BLOCK_SLOTS,
    BlockKind,
    HfCheckpoint,
    MixerKind,
    MixerLayers,
    SanitizeOp,
)
from mlxbun.models.universal.kinds import kind_field as _kind
from mlxbun.models.universal.mixers import MIXER_KNOBS

__all__ = ["HybridKnobs", "check_hybrid", "check_hybrid_sanitize", "hybrid_refs"]


@dataclass(frozen=True)
class HybridKnobs:
    """A hybrid row: `mixer` runs on the layers `layers` does not pick for attention."""

    mixer: MixerKind = _kind(MixerKind)
    layers: MixerLayers = _kind(MixerLayers)
    field: str = ""  # the ModelArgs field the `layers` rule reads
    name: str = ""  # the decoder layer's attribute holding the mixer (lfm2: conv)
    knobs: Any = None  # the mixer's own knobs (`mixers.MIXER_KNOBS[mixer]`); None: its defaults
    layer_types: tuple[str, ...] = ()  # the config's layer_types values naming the mixer's layers
    # (lfm2: "conv"): coverage holds layer_types to the layers the rule picks
    # the mixer layers' own norm placement and names, when not the row's (olmo_hybrid: post-norm
    # attention layers, pre-norm linear-attention layers); both or neither
    block: BlockKind | None = _kind(BlockKind, None)
    norms: Any = None  # a schema.NormNames

    def mixer_knobs(self) -> Any:
        return self.knobs if self.knobs is not None else MIXER_KNOBS[self.mixer]()


def hybrid_refs(h: HybridKnobs) -> Iterator[tuple[str, str]]:
    """(knob, ModelArgs field) for every field a row's HybridKnobs `h` reads."""
    yield "hybrid.field", h.field
    yield from h.mixer_knobs().field_refs()


def check_hybrid(d: Any) -> None:
    """Combinations the graph has no branch for (d: the ArchDescriptor being built)."""
    h = d.hybrid
    if h.mixer is MixerKind.ATTENTION:
        raise d.error("hybrid.mixer names the recurrent mixer; 'attention' is every other layer's")
    want = MIXER_KNOBS[h.mixer]
    if h.knobs is not None and not isinstance(h.knobs, want):
        raise d.error(f"hybrid.knobs for mixer {h.mixer.value!r} must be a {want.__name__}, "
                      f"got {type(h.knobs).__name__}")
    if not h.field or not h.name:
        raise d.error("hybrid needs field (what its layers rule reads) and name (the mixer's attribute)")
    if h.name in (d.names.attn, d.names.mlp):
        raise d.error(f"hybrid.name {h.name!r} is already the attention's or the MLP's attribute")
    if d.block.parallel is not False or d.layers.kv_share is not None:
        raise d.error("a hybrid row takes a sequential block without shared k/v")
    if (h.block is None) != (h.norms is None):
        raise d.error("hybrid.block and hybrid.norms (the mixer layers' own norms) go together")
    if h.block is not None:
        if not callable(getattr(h.norms, "of", None)):
            raise d.error(f"hybrid.norms must be a NormNames, got {type(h.norms).__name__}")
        unnamed = sorted(s.value for s in BLOCK_SLOTS[h.block] if h.norms.of(s) is None)
        if unnamed:
            raise d.error(f"hybrid.block uses norm slot(s) {', '.join(unnamed)} that hybrid.norms "
                          f"leaves unnamed")
        if d.block.inner_norms:
            raise d.error("hybrid.block takes a row whose norms are the block's (not inner_norms)")
    if h.layers is MixerLayers.TYPE_LIST and not h.layer_types:
        raise d.error("hybrid.layers 'type_list' needs hybrid.layer_types (the mixer layers' names)")
    check_hybrid_sanitize(d)


def check_hybrid_sanitize(d: Any) -> None:
    """The args of the sanitize ops the hybrid rows brought (norm_plus_one, wrapper_keys,
    split_gate_up_experts), checked when the row is built."""
    for rule in d.sanitize:
        if rule.op is SanitizeOp.NORM_PLUS_ONE:
            suffixes, test = rule.arg if isinstance(rule.arg, tuple) and len(rule.arg) == 2 else ((), "")
            if not suffixes or not all(isinstance(x, str) for x in suffixes) or test not in set(HfCheckpoint):
                raise d.error("sanitize 'norm_plus_one' takes (suffixes, HfCheckpoint), one of "
                              f"{', '.join(repr(h.value) for h in HfCheckpoint)}")
        elif rule.op is SanitizeOp.WRAPPER_KEYS and not d.names.wrapper:
            raise d.error("sanitize 'wrapper_keys' needs names.wrapper")
        elif rule.op is SanitizeOp.SPLIT_GATE_UP_EXPERTS and d.moe is None:
            raise d.error("sanitize 'split_gate_up_experts' needs moe knobs")
