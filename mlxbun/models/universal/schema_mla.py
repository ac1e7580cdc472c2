"""The multi-head latent attention knobs of a row (`ArchDescriptor.mla`): which ModelArgs
fields hold MLA's ranks and head dims. Data only; `mla.py` builds the attention from them."""

from __future__ import annotations

from dataclasses import dataclass

from mlxbun.models.universal.kinds import MlaKind
from mlxbun.models.universal.kinds import kind_field as _kind

__all__ = ["MlaKnobs"]


@dataclass(frozen=True)
class MlaKnobs:
    """Low-rank (or direct) q, a compressed KV latent with one rope key shared by the heads;
    `kind` says how the latent becomes keys / values (and what the cache holds)."""

    kind: MlaKind = _kind(MlaKind, MlaKind.EXPANDED)
    q_lora_rank: str = "q_lora_rank"  # field: None = direct q_proj, else q_a_proj -> norm -> q_b_proj
    kv_lora_rank: str = "kv_lora_rank"  # field: the KV latent width
    nope_dim: str = "qk_nope_head_dim"  # field: the per-head q/k dims without rope
    rope_dim: str = "qk_rope_head_dim"  # field: the per-head q/k dims with rope (k's shared by heads)
    v_dim: str = "v_head_dim"  # field: the per-head value dims
    scaling: str = "rope_scaling"  # field: the yarn dict (factor, mscale, mscale_all_dim, ...)
    theta: str = "rope_theta"  # field: the rope base
    max_positions: str = "max_position_embeddings"  # field (ABSORBED: initialize_rope's)

    def field_names(self) -> tuple[str, ...]:
        return (self.q_lora_rank, self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim,
                self.scaling, self.theta, self.max_positions)
