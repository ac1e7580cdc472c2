"""The recurrent mixers a hybrid row's layers may run instead of attention, one module per
`MixerKind`, each a transcription of its mlx-lm file. A mixer module is constructed as
`Mixer(args, knobs, layer_index)` (knobs: its own frozen dataclass of ModelArgs field names,
`Mixer.Knobs`), is called as `mixer(x, ssm_mask, cache)`, and keeps its state in an
ArraysCache of `cache_slots` slots."""

from __future__ import annotations

from mlxbun.models.universal.kinds import (
    exhaustive,
)
from mlxbun.models.universal.kinds_hybrid import (
    MixerKind,
)
from mlxbun.models.universal.mixers.gated_delta import GatedDeltaKnobs, GatedDeltaNet
from mlxbun.models.universal.mixers.gated_delta_split import GatedDeltaSplitConv, GatedDeltaSplitKnobs
from mlxbun.models.universal.mixers.mamba import JambaMambaKnobs, JambaMambaMixer, MambaKnobs, MambaMixer
from mlxbun.models.universal.mixers.mamba2 import Mamba2Knobs, Mamba2Mixer
from mlxbun.models.universal.mixers.short_conv import ShortConv, ShortConvKnobs

__all__ = ["MIXERS", "MIXER_KNOBS"]

# kind -> (module class, its knobs class)
MIXERS = exhaustive([k for k in MixerKind if k is not MixerKind.ATTENTION], {
    MixerKind.SHORT_CONV: ShortConv,
    MixerKind.GATED_DELTA: GatedDeltaNet,
    MixerKind.GATED_DELTA_SPLIT_CONV: GatedDeltaSplitConv,
    MixerKind.MAMBA2: Mamba2Mixer,
    MixerKind.MAMBA: MambaMixer,
    MixerKind.JAMBA_MAMBA: JambaMambaMixer,
})
MIXER_KNOBS = exhaustive(MIXERS, {
    MixerKind.SHORT_CONV: ShortConvKnobs,
    MixerKind.GATED_DELTA: GatedDeltaKnobs,
    MixerKind.GATED_DELTA_SPLIT_CONV: GatedDeltaSplitKnobs,
    MixerKind.MAMBA2: Mamba2Knobs,
    MixerKind.MAMBA: MambaKnobs,
    MixerKind.JAMBA_MAMBA: JambaMambaKnobs,
})
