"""What a resolved row holds (`resolve.resolve_args` builds them): every number the graph reads,
the model's (`UniversalArgs`) and each layer's (`LayerSpec`, its `RopeSpec`). Data only."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlxbun.models.universal.kinds import (
    FinalSoftcap,
    PostOp,
    RopeKind,
)
from mlxbun.models.universal.kinds_hybrid import (
    MixerKind,
)
from mlxbun.models.universal.moe_args import MoESpec

__all__ = ["LayerSpec", "RopeSpec", "UniversalArgs"]


@dataclass(frozen=True)
class RopeSpec:
    """One layer's rope, as the constructor arguments of its class."""

    kind: RopeKind
    dims: int
    base: Any
    traditional: Any = False
    scaling: Mapping | None = None  # initialize: the scaling dict; phi3, su_scaled: rope_scaling
    max_positions: Any = None
    original_max_positions: Any = None  # phi3, su_scaled
    scale: Any = 1.0  # nemotron: 1 / factor for linear scaling
    alpha: Any = 1.0  # hunyuan_alpha


@dataclass(frozen=True)
class LayerSpec:
    index: int
    sliding: bool
    rope: RopeSpec | None  # None: NoPE
    moe: bool = False  # the MoE block (args.moe) instead of the dense MLP
    kv_proj: bool = True  # KVShare.CLA: False = the layer takes the last projecting layer's k/v
    heads: tuple[int, int] | None = None  # (query, key/value) heads when not the model's (step3p5)
    swiglu_limits: tuple[float, float] = (0, 0)  # clamped SwiGLU: (routed experts, shared / dense);
    # 0: plain SwiGLU
    dims: tuple[int, int] | None = None  # (q/k, value) head dims when not the model's head_dim
    scale: float | None = None  # the attention scale when not the model's (mimo_v2_flash)
    sinks: bool = False  # the attention adds per-head sink logits (ArchDescriptor.sinks)
    mixer: MixerKind = MixerKind.ATTENTION  # a hybrid's recurrent layers: the row's mixer
    width: int | None = None  # the dense MLP's width when not the model's (openelm)
    ffn_only: bool = False  # block 'single': the layer's one op is the MLP or (moe) the MoE block
    # (no mixer, no cache)


@dataclass(frozen=True)
class UniversalArgs:
    """A descriptor applied to one config: every number the graph needs."""

    model_type: str
    fields: Mapping[str, Any]  # the ModelArgs view (after __post_init__)
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab: int
    intermediate: int
    eps: float
    attn_bias: bool
    out_bias: bool
    mlp_bias: bool
    norm_bias: bool
    qk_norm: bool
    attn_scale: float
    attn_softcap: float | None
    layers: tuple[LayerSpec, ...]
    sliding_window: int | None
    tie: bool  # for TieRule.CHECKPOINT: the constructor's choice (untied), the loader decides
    embed_scale: Any  # the multiplier of an embed_scale field (the sqrt kinds compute theirs)
    residual_scale: Any
    head_pre_divide: Any
    head_post: tuple[PostOp, Any] | None
    final_softcap: FinalSoftcap
    final_softcap_value: float | None  # None: no cap applied
    llama4: tuple[float, int] | None  # (beta, original_max_position_embeddings)
    parallel: bool
    moe: MoESpec | None = None  # the MoE block's numbers (layers[i].moe says where it runs)
