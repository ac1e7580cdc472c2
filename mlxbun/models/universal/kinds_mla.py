"""The kinds an `mla` row chooses (`schema_mla.MlaKnobs`): how the latent becomes keys / values,
which rope the rope part of q / k runs and how yarn's mscale enters the softmax scale. Each
member's comment says what `mla.py` does for it."""

from __future__ import annotations

from mlxbun.models.universal.kinds import StrEnum

__all__ = ["MlaKind", "MlaMscale", "MlaRope"]


class MlaKind(StrEnum):
    """Which mlx-lm MLA attention an `mla` row runs (`mla.py`)."""

    EXPANDED = "expanded"  # deepseek_v2: kv_b_proj to per-head k_nope | v, full keys / values
    # cached, its own yarn rope
    ABSORBED = "absorbed"  # deepseek_v3: embed_q / unembed_out per-head linears, the latent and
    # k_pe cached, the rope part as the sdpa mask (pe scores), initialize_rope
    ABSORBED_DECODE = "absorbed_decode"  # mistral4: the latent and k_pe cached as ABSORBED; a
    # prefill runs one sdpa over [q_nope | q_pe] and [embed_q(latent) | k_pe per head] with the plain
    # mask, a decode step ABSORBED's (pe scores as the mask); q times the llama-4 query scale
    ABSORBED_INDEXED = "absorbed_indexed"  # deepseek_v32: ABSORBED with the DSA indexer (its own
    # keys cached beside the latent: CacheList(KVCache, KVCache) per layer); past index_topk cached
    # positions the attention sees only the indexer's top-k (a prefill: a sparse mask; a decode
    # step: the latent / rope keys gathered)


class MlaRope(StrEnum):
    """The rope over the qk_rope_head_dim part of q and the shared k."""

    DEEPSEEK_YARN = "deepseek_yarn"  # deepseek_v2.py's DeepseekV2YarnRotaryEmbedding (traditional,
    # yarn freqs, all of x times its mscale); the scaling dict with a factor is required
    INITIALIZE = "initialize"  # rope_utils.initialize_rope over the scaling dict (None: plain rope);
    # traditional per `MlaKnobs.traditional` (deepseek_v3, glm4_moe_lite, youtu_llm)
    SU_SCALED = "su_scaled"  # minicpm3: SuScaledRoPE whatever the dict's type (original max
    # positions default 4096, short / long factors default 1.0); the scaling dict is required


class MlaMscale(StrEnum):
    """What yarn's mscale does to the softmax scale (q_head_dim ** -0.5)."""

    ALL_DIM = "all_dim"  # times (0.1 * mscale_all_dim * log(factor) + 1) ** 2 when the dict has a
    # nonzero mscale_all_dim and factor > 1 (deepseek_v2 / v3, glm4_moe_lite)
    NONE = "none"  # the plain scale (minicpm3, youtu_llm)
    APPLY_YARN = "apply_yarn"  # rope_utils.apply_yarn_mscale: ALL_DIM's, only when the dict's type
    # is not 'default' (mistral4)
