"""The tower descriptor's typed knobs: one enum per branch point of the generic ViT-style tower
(vit.py), the projector (projectors.py) and the prompt splice (splice.py), each member commented
with what the graph does; a row with a value outside them fails when it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = ["MergeKind", "PatchEmbed", "Positions", "ProjectorKind", "SpliceKind", "TextPositions", "TowerDescriptor",
           "VideoKind", "VitAct", "VitKnobs", "VisionKeys", "VitLayout", "VitMlp", "VitNorm"]


class VitLayout(Enum):
    # mlx-vlm's SigLIP: embeddings.{patch_embedding, position_embedding}, encoder.layers.i.{layer_norm1,
    # self_attn.{q,k,v,out}_proj, layer_norm2, mlp}, post_layernorm; images batched [N, patches, D]
    SIGLIP = "siglip"
    # mlx-vlm's Qwen2-VL: patch_embed.proj, blocks.i.{norm1, attn.{qkv, proj}, norm2, mlp}; every image's
    # patches in one sequence [patches, D], each image attending within itself (cu_seqlens splits)
    QWEN_VL = "qwen_vl"
    # mlx-vlm's Pixtral: patch_conv, ln_pre, transformer.layers.i.{attention_norm, attention.{q,k,v,o}_proj,
    # ffn_norm, feed_forward}; each image's patch grid (its own size) cropped and concatenated into one
    # sequence [1, patches, D], a block-diagonal additive mask keeping each image to itself
    PIXTRAL = "pixtral"
    # mlx-vlm's Kimi-VL MoonViT, its own module (towers/moonvit.py): patch_embed.{proj, pos_emb},
    # blocks.i.{norm0, attn.{wqkv, wo}, norm1, mlp.{fc0, fc1}}, final_layernorm; every image's
    # patches in one sequence [patches, D], each image attending within itself
    MOONVIT = "moonvit"


class PatchEmbed(Enum):
    CONV2D = "conv2d"  # nn.Conv2d(C, hidden, patch, stride=patch) on NHWC pixels, the grid flattened row-major
    # nn.Conv3d(C, hidden, (temporal, patch, patch), stride = kernel, no bias) on the processor's
    # flattened patches [patches, C * T * P * P] (reshaped to [-1, T, P, P, C])
    CONV3D = "conv3d"
    # nn.Linear(C * P * P, hidden) over the processor's packed patch rows [views, patches, C*P*P]
    # (LFM2-VL's Siglip2 NaFlex)
    LINEAR = "linear"


class Positions(Enum):
    LEARNED = "learned"  # nn.Embedding(num_patches, hidden) at arange(num_patches), added to the patches
    # 2-D rotary on q / k (Qwen2-VL's VisionRotaryEmbedding: head_dim / 2 frequencies over (row, col)
    # ids laid out merge-window by merge-window, cos / sin tiled, rotate_half; no added positions)
    ROPE_2D = "rope_2d"
    # Pixtral's 2-D rotary: a [side * side, head_dim] table of row frequencies (even ones) beside
    # column frequencies (odd ones), read at row * side + col, cos / sin in the activations' dtype
    ROPE_2D_PIXTRAL = "rope_2d_pixtral"
    # Qwen3-VL: ROPE_2D plus a learned num_position_embeddings table, bilinearly interpolated to each
    # image's grid (fast_pos_embed_interpolate: four corner rows weighted in the table's dtype), laid
    # out merge window by merge window and added to the patches
    ROPE_2D_INTERP = "rope_2d_interp"
    # LFM2-VL's Siglip2: the learned square table bilinearly resized (antialiased, in float32) to
    # each view's patch grid, its padding rows the first position's, added to the patches; the
    # padding rows masked out of the attention
    LEARNED_RESIZED = "learned_resized"
    # Kimi-VL's MoonViT: a learned square table bicubically resized to each image's grid (as is at
    # its own size), added to the patches; a 2-D rotary on q / k in complex float32 (column and
    # row frequencies interleaved)
    MOONVIT = "moonvit"


class VitAct(Enum):
    GELU_TANH = "gelu_tanh"  # nn.gelu_approx (mlx's nn.GELU(approx="precise") and "tanh": mlx-vlm's GELUMLP)
    GELU = "gelu"  # nn.gelu, the erf GELU (nn.GELU(approx="none"))
    GELU_FAST = "gelu_fast"  # nn.gelu_fast_approx (nn.GELU(approx="fast"): Qwen2-VL's quick GELU)


class TextPositions(Enum):
    PLAIN = "plain"  # the text model's own positions (0..L-1): the merged rows need nothing more
    # mRoPE: with images, mlx-vlm's text model rotates by 3-D (t, h, w) position ids (get_rope_index)
    # in its own MRoPE arithmetic (towers/mrope.py runs the text row's modules that way), each
    # frequency reading the axis its mrope_section chunk says (Qwen2-VL)
    MROPE = "mrope"
    # the same with the sections interleaved (Qwen3-VL: h and w every third frequency)
    MROPE_INTERLEAVED = "mrope_interleaved"


class VitNorm(Enum):
    LAYERNORM = "layernorm"  # nn.LayerNorm(hidden, eps)
    RMSNORM = "rmsnorm"  # nn.RMSNorm(hidden, eps) (Qwen2.5-VL's blocks and merger)


class VitMlp(Enum):
    FC = "fc"  # fc1 -> act -> fc2, biased
    SWIGLU = "swiglu"  # down_proj(silu(gate_proj(x)) * up_proj(x)), biased (Qwen2.5-VL)
    LINEAR_FC = "linear_fc"  # linear_fc1 -> act -> linear_fc2, biased (Qwen3-VL)


class VisionKeys(Enum):
    """Which vision_config keys hold the tower's numbers (mlx-vlm's VisionConfig of the family)."""

    SIGLIP = "siglip"  # hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, ...
    # embed_dim, embed_dim * mlp_ratio, depth, num_heads, in_channels; the merger to hidden_size
    QWEN2_VL = "qwen2_vl"
    # hidden_size, intermediate_size, depth, num_heads, in_channels, window_size,
    # fullatt_block_indexes; the merger to out_hidden_size
    QWEN2_5_VL = "qwen2_5_vl"
    # hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, head_dim, image_size
    # (the rotary table's side), patch_size, num_channels, rope_theta, rms_norm_eps
    PIXTRAL = "pixtral"
    # hidden_size, intermediate_size, depth, num_heads, num_position_embeddings, deepstack_visual_indexes;
    # the mergers to out_hidden_size
    QWEN3_VL = "qwen3_vl"
    # Siglip2 (lfm2-vl): SigLIP's keys, num_patches the position table's rows, no image_size
    SIGLIP2 = "siglip2"
    # mlx-vlm's MoonViT config: depth, embed_dim (= hidden_size), num_heads, intermediate_size,
    # patch_size, init_pos_emb_height (the table's side), merge_kernel_size (HF's
    # num_hidden_layers / num_attention_heads are not its keys)
    MOONVIT = "moonvit"


class ProjectorKind(Enum):
    # gemma3: [B, patches, D] -> the patch grid -> AvgPool2d(k, k) to mm_tokens_per_image -> gemma
    # RMSNorm (1 + w, the vision eps) -> einsum("btm,md->btd") with mm_input_projection_weight,
    # cast back to the tower's dtype
    GEMMA3_AVGPOOL = "gemma3_avgpool"
    # qwen2_vl: PatchMerger (the tower's `merger`): LayerNorm(1e-6) over each patch, 2x2 merge windows
    # concatenated, Linear -> erf GELU -> Linear to the text width
    PATCH_MERGER = "patch_merger"
    PATCH_MERGER_RMS = "patch_merger_rms"  # qwen2_5_vl: the same with an RMSNorm ln_q
    LLAVA = "llava"  # pixtral: linear_1 -> erf GELU -> linear_2 (biased), per patch of the selected layer
    # mistral3: RMSNorm, spatial_merge_size^2 patches merged by a linear (Mistral3PatchMerger), then llava's
    MISTRAL3 = "mistral3"
    # lfm2-vl: each view's real patches as its grid, pixel-unshuffled by downsample_factor (odd sides
    # zero-padded), LayerNorm, linear_1 -> erf GELU -> linear_2
    LFM2 = "lfm2"
    # qwen3_vl: LayerNorm per patch, 2x2 windows concatenated, linear_fc1 -> erf GELU -> linear_fc2
    # (the deepstack mergers beside it, in the tower, norm after the concatenation)
    QWEN3_MERGER = "qwen3_merger"
    # kimi_vl: LayerNorm (1e-5) per patch, each 2x2 window's patches concatenated, linear_1 -> erf
    # GELU -> linear_2
    KIMI_VL = "kimi_vl"


class MergeKind(Enum):
    # gemma3: text ids embedded, pad ids zeroed, each image token's row the next soft token divided
    # by the wrapper's hidden_size ** 0.5 (mlx-vlm's ModelConfig default 2048 where the config has
    # no top-level hidden_size); the text model then scales every row by its embed scale
    GEMMA3_SCALED = "gemma3_scaled"
    # qwen2_vl, pixtral, mistral3: each image token's row the next soft token (merge_input_ids_with_image_features),
    # no scaling, no pad rows zeroed
    IN_ORDER = "in_order"
    # qwen3_vl: the soft tokens scattered into the image tokens' rows, cast to the embeddings' dtype
    # (masked_scatter); the deepstack features kept for the text model's first layers
    SCATTER = "scatter"


class SpliceKind(Enum):
    """What one image placeholder in the prompt text becomes (the processor's expansion)."""

    GEMMA3 = "gemma3"  # "\n\n" boi, the image token x soft tokens, eoi "\n\n"
    REPEAT = "repeat"  # the image token x soft tokens (qwen2_vl: its vision start / end are the prompt's)
    ROWS = "rows"  # pixtral: per patch row the image token x columns, rows split by a break token, an end token
    # lfm2-vl: start, per tile its row / column marker and tokens, the thumbnail marker and tokens
    # (a tiled image), or the one view's tokens; end
    TILES = "tiles"


class VideoKind(Enum):
    """Whether a row takes video, and how its processor writes a video into the prompt
    (towers/video.py: the frames through the image tower's Conv3d, temporal_patch_size a patch)."""

    NONE = "none"  # no video: a video given is refused (NoVideoTower)
    # qwen2_vl / qwen2_5_vl: the video token repeated t * h * w / merge^2 times (the prompt's vision
    # start / end kept); mRoPE at the video's grid, t counting temporal patches
    REPEAT = "repeat"
    # qwen3_vl: a placeholder wrapped in vision start / end becomes, per temporal patch, "<T.T seconds>"
    # + start + its h * w / merge^2 tokens + end (a bare one: the tokens repeated); mRoPE per
    # temporal patch, each a grid of one frame
    TIMESTAMPS = "timestamps"


def _check(row: str, name: str, value, enum) -> None:
    if not isinstance(value, enum):
        raise TypeError(f"tower row {row!r}: {name}={value!r}; accepted: "
                        f"{', '.join(repr(m.value) for m in enum)}")


@dataclass(frozen=True)
class VitKnobs:
    """A pre-norm ViT: patch embedding + positions, N x (LN -> attention -> +, LN -> MLP -> +),
    an optional final LayerNorm."""

    layout: VitLayout = VitLayout.SIGLIP
    patch: PatchEmbed = PatchEmbed.CONV2D
    positions: Positions = Positions.LEARNED
    act: VitAct = VitAct.GELU_TANH
    qkv_bias: bool = True  # q / k / v / out projections biased
    mlp_bias: bool = True  # the MLP's projections biased
    post_norm: bool = True  # a final LayerNorm over the last block's output
    post_norm_eps: float | None = 1e-5  # None: the config's layer_norm_eps (siglip's post_layernorm: nn.LayerNorm's default)
    norm: VitNorm = VitNorm.LAYERNORM
    mlp: VitMlp = VitMlp.FC
    # Qwen2.5-VL: patches reordered window by window (window_size pixels a side), the blocks but
    # fullatt_block_indexes attending within their window, the merger's tokens put back in order
    windows: bool = False
    patch_bias: bool = False  # the Conv3d patch embedding biased (Qwen3-VL)
    merger_act: VitAct = VitAct.GELU  # Qwen3-VL's mergers' activation (qwen3_vl_moe's: tanh GELU)
    # the heads zero-padded to the fused SDPA kernel's widths (64 / 80 / 128) and cut back after
    # (mlx-vlm's ensure_fused_sdpa, Qwen3-VL)
    sdpa_pad: bool = False


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
    splice: SpliceKind
    vision_keys: VisionKeys = VisionKeys.SIGLIP
    vision_defaults: dict = field(default_factory=dict)  # mlx-vlm's VisionConfig defaults
    top_defaults: dict = field(default_factory=dict)  # mlx-vlm's ModelConfig defaults (token ids)
    image_token_key: str = "image_token_index"  # the config key of the soft-token id
    boi_key: str | None = None  # the config key of the begin-of-image token (the prompt's placeholder)
    eoi_key: str | None = None  # the config key of the end-of-image token
    break_token: str | None = None  # pixtral: the row break token's text (its processor's)
    end_token: str | None = None  # pixtral: the image end token's text
    # the processor tokenizes with the tokenizer's special tokens when asked (lfm2-vl's never: its
    # Lfm2VlProcessor's text defaults set add_special_tokens False over the call's)
    special_tokens: bool = True
    # lfm2-vl: the processor's start / end / thumbnail tokens' texts (none has a config key)
    start_token: str | None = None
    image_end_token: str | None = None
    thumbnail_token: str | None = None
    placeholder_key: str | None = None  # the prompt's per-image placeholder token (None: boi_key's)
    # what a prompt without placeholders gets in front per image: "{placeholder}" / "{boi}" / "{eoi}" filled
    lead: str = "{placeholder} "
    text_positions: TextPositions = TextPositions.PLAIN
    video: VideoKind = VideoKind.NONE
    video_token_key: str | None = None  # the config key of the video token (mlx-vlm's video_token_id)
    notes: str = ""

    def __post_init__(self):
        _check(self.model_type, "vit.layout", self.vit.layout, VitLayout)
        _check(self.model_type, "vit.norm", self.vit.norm, VitNorm)
        _check(self.model_type, "vit.mlp", self.vit.mlp, VitMlp)
        _check(self.model_type, "vision_keys", self.vision_keys, VisionKeys)
        _check(self.model_type, "vit.patch", self.vit.patch, PatchEmbed)
        _check(self.model_type, "vit.positions", self.vit.positions, Positions)
        _check(self.model_type, "vit.act", self.vit.act, VitAct)
        _check(self.model_type, "projector", self.projector, ProjectorKind)
        _check(self.model_type, "merge", self.merge, MergeKind)
        _check(self.model_type, "splice", self.splice, SpliceKind)
        _check(self.model_type, "text_positions", self.text_positions, TextPositions)
        _check(self.model_type, "video", self.video, VideoKind)
