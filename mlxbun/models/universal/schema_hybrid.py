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
    NormKind,
    NormSlot,
    Residual,
)
from mlxbun.models.universal.kinds import kind_field as _kind
from mlxbun.models.universal.kinds_sanitize import SanitizeOp
from mlxbun.models.universal.kinds_hybrid import (
    ConvLayout,
    GateUpLayout,
    HfCheckpoint,
    HybridBlock,
    MixerKind,
    MixerLayers,
)
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
    block: HybridBlock = _kind(HybridBlock, HybridBlock.PAIRED)
    norm_eps: float | None = None  # block 'single': the block norm's literal eps (mamba2's
    # nn.RMSNorm(hidden_size) keeps its default 1e-5); None: the row's norm eps field
    # block 'paired': the mixer layers' own norm placement and names, when not the row's
    # (olmo_hybrid: post-norm attention layers, pre-norm linear-attention layers); both or neither
    mixer_block: BlockKind | None = _kind(BlockKind, None)
    mixer_norms: Any = None  # a schema.NormNames

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
                                          or d.norm.kind is NormKind.FUNCTIONAL_RMS
                                          or d.block.kind is not BlockKind.PRE
                                          or d.block.residual is not Residual.PLAIN):
        raise d.error("hybrid block 'single' is x + op(norm(x)): a pre-norm block (a norm module "
                      "named names.norms.pre_attn) with a plain residual")
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
    if (h.mixer_block is None) != (h.mixer_norms is None):
        raise d.error("hybrid.mixer_block and hybrid.mixer_norms (the mixer layers' own norms) go together")
    if h.mixer_block is not None and h.block is HybridBlock.SINGLE:
        raise d.error("hybrid.mixer_block is the paired block's mixer-layer norms")
    if h.mixer_block is not None:
        if not callable(getattr(h.mixer_norms, "of", None)):
            raise d.error(f"hybrid.mixer_norms must be a NormNames, got {type(h.mixer_norms).__name__}")
        unnamed = sorted(s.value for s in BLOCK_SLOTS[h.mixer_block] if h.mixer_norms.of(s) is None)
        if unnamed:
            raise d.error(f"hybrid.mixer_block uses norm slot(s) {', '.join(unnamed)} that hybrid.mixer_norms "
                          f"leaves unnamed")
        if d.block.inner_norms:
            raise d.error("hybrid.mixer_block takes a row whose norms are the block's (not inner_norms)")
    if h.layers is MixerLayers.TYPE_LIST and not h.layer_types:
        raise d.error("hybrid.layers 'type_list' needs hybrid.layer_types (the mixer layers' names)")
    check_hybrid_sanitize(d)


def check_hybrid_sanitize(d: Any) -> None:
    """The args of the sanitize ops the hybrid rows brought (conv1d_layout, norm_plus_one,
    wrapper_keys, split_gate_up_experts), checked when the row is built."""
    for rule in d.sanitize:
        if rule.op is SanitizeOp.CONV1D_LAYOUT:
            arg = rule.arg
            if not (isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[0], str)
                    and isinstance(arg[1], ConvLayout)):
                raise d.error(f"sanitize 'conv1d_layout' takes (key substring, ConvLayout member), got "
                              f"{arg!r}")
        elif rule.op is SanitizeOp.NORM_PLUS_ONE:
            suffixes, test = rule.arg if isinstance(rule.arg, tuple) and len(rule.arg) == 2 else ((), "")
            if not suffixes or not all(isinstance(x, str) for x in suffixes) or test not in set(HfCheckpoint):
                raise d.error("sanitize 'norm_plus_one' takes (suffixes, HfCheckpoint), one of "
                              f"{', '.join(repr(h.value) for h in HfCheckpoint)}")
        elif rule.op is SanitizeOp.WRAPPER_KEYS and not d.names.wrapper:
            raise d.error("sanitize 'wrapper_keys' needs names.wrapper")
        elif rule.op is SanitizeOp.SPLIT_GATE_UP_EXPERTS and (
                d.moe is None or not (rule.arg is None or isinstance(rule.arg, GateUpLayout))):
            raise d.error("sanitize 'split_gate_up_experts' needs moe knobs and takes None or a "
                          f"GateUpLayout member, got {rule.arg!r}")
