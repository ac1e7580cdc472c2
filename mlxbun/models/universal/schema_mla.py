"""The multi-head latent attention knobs of a row (`ArchDescriptor.mla`): which ModelArgs
fields hold MLA's ranks and head dims, and the choices the mlx-lm MLA files differ in (the rope,
the softmax scale, the latent norms' eps). Data only; `mla.py` builds the attention from them."""

from __future__ import annotations

from dataclasses import dataclass

from mlxbun.models.universal.kinds import kind_field as _kind
from mlxbun.models.universal.kinds_mla import MlaKind, MlaMscale, MlaRope

__all__ = ["IndexerKnobs", "MlaKnobs"]


@dataclass(frozen=True)
class IndexerKnobs:
    """deepseek_v32's DSA indexer (MlaKind.ABSORBED_INDEXED): ModelArgs fields."""

    heads: str = "index_n_heads"
    head_dim: str = "index_head_dim"
    topk: str = "index_topk"
    traditional: str = "indexer_rope_interleave"  # its rope's traditional (over qk_rope_head_dim)

    def field_names(self) -> tuple[str, ...]:
        return (self.heads, self.head_dim, self.topk, self.traditional)


@dataclass(frozen=True)
class MlaKnobs:
    """Low-rank (or direct) q, a compressed KV latent with one rope key shared by the heads;
    `kind` says how the latent becomes keys / values (and what the cache holds)."""

    kind: MlaKind = _kind(MlaKind, MlaKind.EXPANDED)
    rope: MlaRope = _kind(MlaRope, MlaRope.DEEPSEEK_YARN)
    mscale: MlaMscale = _kind(MlaMscale, MlaMscale.ALL_DIM)
    traditional: bool | str = True  # MlaRope.INITIALIZE's traditional: a literal or a field
    traditional_if_none: bool | None = None  # what a null `traditional` field means (mistral4's
    # rope_interleave: True); None: a null is refused, as mlx-lm's rope fails on it
    norm_eps: float | str = 1e-6  # q_a_layernorm / kv_a_layernorm eps: a literal or a field
    q_direct: bool = True  # q_lora_rank None builds a direct q_proj (False: mlx-lm needs a rank)
    q_lora_rank: str = "q_lora_rank"  # field: None = direct q_proj, else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: str = "kv_lora_rank"  # field: the KV latent width
    nope_dim: str = "qk_nope_head_dim"  # field: the per-head q/k dims without rope
    rope_dim: str = "qk_rope_head_dim"  # field: the per-head q/k dims with rope (k's shared by heads)
    v_dim: str | None = "v_head_dim"  # field: the per-head value dims (None: hidden_size // heads)
    scaling: str = "rope_scaling"  # field: the rope scaling dict (factor, mscale, mscale_all_dim, ...)
    theta: str = "rope_theta"  # field: the rope base
    max_positions: str = "max_position_embeddings"  # field (INITIALIZE / SU_SCALED read it)
    indexer: IndexerKnobs | None = None  # MlaKind.ABSORBED_INDEXED's indexer

    def field_names(self) -> tuple[str, ...]:
        literal = (self.v_dim, *(v for v in (self.traditional, self.norm_eps) if isinstance(v, str)))
        return (self.q_lora_rank, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.scaling,
                self.theta, self.max_positions, *(f for f in literal if f is not None),
                *(self.indexer.field_names() if self.indexer is not None else ()))
