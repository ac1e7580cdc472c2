"""The hybrid part of a descriptor row: `HybridKnobs` (which recurrent mixer runs on which
layers), with its checks and the ModelArgs fields it reads (`schema.py` calls them when a
row is built). A row without `hybrid` attends on every layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mlxbun.models.universal.kinds import HybridBlock, MixerKind, MixerLayers, NormSlot, Residual
from mlxbun.models.universal.kinds import kind_field as _kind
from mlxbun.models.universal.mixers import MIXER_KNOBS

__all__ = ["HybridKnobs", "check_hybrid", "hybrid_refs"]


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
    block: HybridBlock = _kind(HybridBlock, HybridBlock.PAIRED)
    norm_eps: float | None = None  # block 'single': the block norm's literal eps (mamba2's
    # nn.RMSNorm(hidden_size) keeps its default 1e-5); None: the row's norm eps field

    def mixer_knobs(self) -> Any:
        return self.knobs if self.knobs is not None else MIXER_KNOBS[self.mixer]()


def hybrid_refs(h: HybridKnobs) -> Iterator[tuple[str, str]]:
    """(knob, ModelArgs field) for every field a row's HybridKnobs `h` reads."""
    if h.field:
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
    if not h.name or (not h.field) != (h.layers is MixerLayers.ALL):
        raise d.error("hybrid needs name (the mixer's attribute) and field (what its layers rule "
                      "reads; none for layers 'all')")
    if h.layers is MixerLayers.PATTERN and h.block is not HybridBlock.SINGLE:
        raise d.error("hybrid.layers 'pattern' (its MLP-only layers) goes with block 'single'")
    if h.block is HybridBlock.SINGLE and (d.names.norms.pre_attn is None
                                          or d.norm.kind.value == "functional_rms"):
        raise d.error("hybrid block 'single' takes a norm module named names.norms.pre_attn")
    elif h.norm_eps is not None and h.block is not HybridBlock.SINGLE:
        raise d.error("hybrid.norm_eps is the single-op block's norm eps")
    if h.block is HybridBlock.PARALLEL and (
            h.layers is not MixerLayers.ALL or d.moe is not None or d.block.residual is not Residual.PLAIN
            or set(d.block.norm_slots(False)) != {NormSlot.PRE_ATTN, NormSlot.PRE_MLP}):
        raise d.error("hybrid block 'parallel' runs the mixer and attention on every layer (layers "
                      "'all'), a pre-norm block with a plain residual, a dense MLP")
    if h.name in (d.names.attn, d.names.mlp) and h.block is not HybridBlock.SINGLE:
        raise d.error(f"hybrid.name {h.name!r} is already the attention's or the MLP's attribute")
    if d.block.parallel is not False or d.layers.kv_share is not None:
        raise d.error("a hybrid row takes a sequential block without shared k/v")
