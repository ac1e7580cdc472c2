"""The kinds a hybrid row chooses from (`schema_hybrid.HybridKnobs`): which recurrent mixer,
which layers run it, the block shape, and how a checkpoint's conv / norm tensors are told to be
in transformers' layout. Same conventions as `kinds.py`."""

from __future__ import annotations

from mlxbun.models.universal.kinds import StrEnum

__all__ = ["ConvLayout", "GateUpLayout", "HfCheckpoint", "HybridBlock", "MixerKind", "MixerLayers"]


class MixerKind(StrEnum):
    """What mixes the tokens of a layer: attention, or one of the recurrent mixers of
    `mixers/` (a hybrid row's `hybrid.mixer`, on the layers its `hybrid.layers` rule leaves)."""

    ATTENTION = "attention"  # the universal attention (its KV cache)
    SHORT_CONV = "short_conv"  # lfm2: in_proj -> B * x -> causal depthwise conv1d -> C * . ->
    # out_proj; state: the last kernel - 1 inputs (mixers/short_conv.py)
    GATED_DELTA = "gated_delta"  # qwen3_next, qwen3_5: projections -> causal depthwise conv1d +
    # silu on q | k | v -> q / k l2-norm -> the gated delta rule -> gated RMSNorm (silu(z)) ->
    # out_proj; state: the last kernel - 1 conv inputs, the [Hv, Dv, Dk] float32 delta state
    # (mixers/gated_delta.py)
    GATED_DELTA_SPLIT_CONV = "gated_delta_split_conv"  # olmo_hybrid: separate q / k / v / a / b / g
    # projections, a causal depthwise conv1d + silu on each of q, k, v (no mask on the inputs) ->
    # q / k l2-norm -> the gated delta rule (beta * 2 when the row's field allows negative
    # eigenvalues) -> gated RMSNorm (silu(g)) -> o_proj; state: three conv windows, the delta
    # state (mixers/gated_delta_split.py)
    MAMBA2 = "mamba2"  # in_proj -> [gate | conv1d + SiLU -> x, B, C | dt] -> SSD scan -> gated
    # RMSNorm -> out_proj; state: conv inputs and the SSM state (mixers/mamba2.py, mixers/ssm.py)
    MAMBA = "mamba"  # mamba v1 (falcon_mamba too): in_proj -> [x | z]; causal depthwise conv1d + SiLU
    # on x; per token the selective scan (x_proj -> delta, B, C; softplus(dt_proj(delta))); swiglu(z, y)
    # -> out_proj; state: the conv inputs and the [I, N] SSM state (mixers/mamba.py)
    JAMBA_MAMBA = "jamba_mamba"  # jamba: mamba's mixer of width mamba_expand * hidden, delta / B / C
    # through RMSNorm modules, every token's update at once then a compiled fma chain (mixers/mamba.py)


class MixerLayers(StrEnum):
    """Which layers of a hybrid attend (the others run the row's recurrent mixer)."""

    INDEX_LIST = "index_list"  # field: the attending layers' indices (lfm2's full_attn_idxs)
    INTERVAL = "interval"  # field n: layer i attends when (i + 1) % n == 0 (qwen3_next)
    TYPE_LIST = "type_list"  # field: every layer's kind name; the layers named one of
    # hybrid.layer_types run the mixer, every other one attends (olmo_hybrid's layer_types)
    ALL = "all"  # no layer attends (mamba2); no field
    PATTERN = "pattern"  # field: one char per layer, M the mixer, * attention, - the MLP alone,
    # E the MoE block (nemotron_h's hybrid_override_pattern; block 'single' only)
    LAYER_TYPES = "layer_types"  # field: a list, the mixer where the entry is one of
    # hybrid.layer_types, attention where it is "attention", any other entry refused
    # (granitemoehybrid's "mamba" / "attention")


class HybridBlock(StrEnum):
    """The decoder layer of a hybrid row."""

    PAIRED = "paired"  # the mixer (or attention), then the MLP, each with its norm and residual
    SINGLE = "single"  # one op per layer: x + op(norm(x)), the op the mixer, attention or the MLP
    # (mamba2, nemotron_h: every op is the layer's `hybrid.name` attribute)
    PARALLEL = "parallel"  # every layer: x + mixer(n(x)) + attention(n(x)) on one normed input,
    # then the MLP with its norm and residual; the cache a CacheList(ArraysCache, KVCache) (falcon_h1)


class ConvLayout(StrEnum):
    """When a checkpoint's depthwise conv1d weight is in torch's [C, 1, K] layout (mlx: [C, K, 1]),
    as the mlx-lm file tests it before moving the kernel axis."""

    LAST_GT_MIDDLE = "last_gt_middle"  # lfm2: shape[-1] > shape[1] -> transpose(0, 2, 1)
    LAST_NE_ONE = "last_ne_one"  # qwen3_next, mamba2: shape[-1] != 1 -> moveaxis(2, 1)
    MIDDLE_ONE = "middle_one"  # gear: shape[1] == 1 -> transpose(0, 2, 1)


class GateUpLayout(StrEnum):
    """split_gate_up_experts' arg: where a fused experts.gate_up_proj keeps its 2I axis."""

    ROWS = "rows"  # qwen3_5_moe: [E, 2I, D] split on axis 1; experts.down_proj as it is
    LAST_TRANSPOSED = "last_transposed"  # qwen3_vl_moe: [E, D, 2I] split on the last axis; both
    # halves and experts.down_proj swapaxes(-2, -1)


class HfCheckpoint(StrEnum):
    """How an mlx-lm file's sanitize tells a transformers checkpoint from a converted one."""

    EXPERT_WEIGHTS = "expert_weights"  # qwen3_next: a key ends with .mlp.experts.0.up_proj.weight
    TORCH_CONV1D = "torch_conv1d"  # qwen3_5: a conv1d.weight whose last dim is not 1
