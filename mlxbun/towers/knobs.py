"""The tower descriptor's typed knobs: one enum per branch point of the generic ViT-style tower
(vit.py), the projector (projectors.py) and the prompt splice (splice.py), each member commented
with what the graph does; a row with a value outside them fails when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["MergeKind", "PatchEmbed", "Positions", "ProjectorKind", "TowerDescriptor", "VitAct", "VitKnobs"]


class PatchEmbed(Enum):
    CONV2D = "conv2d"  # nn.Conv2d(C, hidden, patch, stride=patch) on NHWC pixels, the grid flattened row-major


class Positions(Enum):
    LEARNED = "learned"  # nn.Embedding(num_patches, hidden) at arange(num_patches), added to the patches


class VitAct(Enum):
    GELU_TANH = "gelu_tanh"  # nn.gelu_approx (mlx's nn.GELU(approx="precise") and "tanh": mlx-vlm's GELUMLP)
    GELU = "gelu"  # nn.gelu, the erf GELU (nn.GELU(approx="none"))


class ProjectorKind(Enum):
    # gemma3: [B, patches, D] -> the patch grid -> AvgPool2d(k, k) to mm_tokens_per_image -> gemma
    # RMSNorm (1 + w, the vision eps) -> einsum("btm,md->btd") with mm_input_projection_weight,
    # cast back to the tower's dtype
    GEMMA3_AVGPOOL = "gemma3_avgpool"


class MergeKind(Enum):
    # gemma3: text ids embedded, pad ids zeroed, each image token's row the next soft token divided
    # by the wrapper's hidden_size ** 0.5 (mlx-vlm's ModelConfig default 2048 where the config has
    # no top-level hidden_size); the text model then scales every row by its embed scale
    GEMMA3_SCALED = "gemma3_scaled"


def _check(row: str, name: str, value, enum) -> None:
    if not isinstance(value, enum):
        raise TypeError(f"tower row {row!r}: {name}={value!r}; accepted: "
                        f"{', '.join(repr(m.value) for m in enum)}")


@dataclass(frozen=True)
class VitKnobs:
    """A pre-norm ViT: patch embedding + positions, N x (LN -> attention -> +, LN -> MLP -> +),
    an optional final LayerNorm."""

    patch: PatchEmbed = PatchEmbed.CONV2D
    positions: Positions = Positions.LEARNED
    act: VitAct = VitAct.GELU_TANH
    qkv_bias: bool = True  # q / k / v / out projections biased
    post_norm: bool = True  # a final LayerNorm over the last block's output
    post_norm_eps: float | None = 1e-5  # None: the config's layer_norm_eps (siglip's post_layernorm: nn.LayerNorm's default)


@dataclass(frozen=True)
class TowerDescriptor:
    """A VLM's vision side, keyed by the wrapper's model_type (the text side's descriptor idea):
    which vision_config model_types it accepts, where its tensors live, its knobs."""

    model_type: str
    vision_types: tuple[str, ...]  # vision_config.model_type values mlx-vlm accepts for it
    tower_prefix: str  # checkpoint prefix of the tower's tensors
    projector_prefix: str
    vit: VitKnobs
    projector: ProjectorKind
    merge: MergeKind
    vision_defaults: dict = field(default_factory=dict)  # mlx-vlm's VisionConfig defaults
    image_token_key: str = "image_token_index"  # the config key of the soft-token id
    boi_key: str | None = None  # the config key of the begin-of-image token (the prompt's placeholder)
    notes: str = ""

    def __post_init__(self):
        _check(self.model_type, "vit.patch", self.vit.patch, PatchEmbed)
        _check(self.model_type, "vit.positions", self.vit.positions, Positions)
        _check(self.model_type, "vit.act", self.vit.act, VitAct)
        _check(self.model_type, "projector", self.projector, ProjectorKind)
        _check(self.model_type, "merge", self.merge, MergeKind)
