"""What a diffusion run did: per block and in total (for tables and reveal plots).

Per block: the decoder forwards (denoising steps), how many positions each sampling step
accepted, and the step at which each canvas position was revealed for good. A position is
revealed at the earliest step from which the sampler kept it at every later sampling step;
positions the sampler had not settled when the block ended are revealed by the final argmax,
at the block's last step. So each block's `revealed_per_step` sums to its canvas length.

Caveat (the reference's own semantics): the block's emitted tokens are the argmax of its LAST
decoder forward, not the sampler's accepted tokens, so a revealed position may still change
its token at the last step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence

__all__ = ["BlockStats", "DiffusionStats", "reveal_steps"]


def reveal_steps(masks: Sequence[Sequence[bool]], steps: int, width: int) -> List[int]:
    """1-based reveal step of each of `width` positions, from the sampler's per-step masks
    (cumulative reveal masks for confidence-threshold, acceptance masks for entropy-bound)
    over a block of `steps` decoder forwards (len(masks) <= steps)."""
    out = []
    for pos in range(width):
        s = len(masks)
        if s == 0 or not masks[-1][pos]:
            out.append(steps)
            continue
        while s > 0 and masks[s - 1][pos]:
            s -= 1
        out.append(s + 1)
    return out


@dataclass
class BlockStats:
    index: int  # 1-based canvas index
    canvas_length: int
    steps: int  # decoder forwards (denoising steps) for this block
    accepted_per_step: List[int]  # positions the sampler accepted at each sampling step
    reveal_step: List[int]  # per canvas position, 1-based
    emitted: int  # tokens this block counted toward generation (EOS included)
    stopped_early: Optional[str] = None  # "all-revealed" | "stable" | None (ran every step)

    @property
    def revealed_per_step(self) -> List[int]:
        counts = [0] * self.steps
        for s in self.reveal_step:
            counts[s - 1] += 1
        return counts


@dataclass
class DiffusionStats:
    prompt_tokens: int = 0
    generation_tokens: int = 0  # as the reference counts: an EOS that stopped the run included
    tokens: List[int] = field(default_factory=list)  # emitted ids (the stopping EOS excluded)
    stop_token: Optional[int] = None  # the EOS id that stopped the run
    finish_reason: Optional[str] = None  # "stop" | "length"
    blocks: List[BlockStats] = field(default_factory=list)
    encoder_passes: int = 0  # prompt prefill (chunks counted once) + one per fed-back canvas
    prompt_time: float = 0.0
    generation_time: float = 0.0

    @property
    def denoising_steps(self) -> int:
        """Decoder forwards over all blocks (the number of function evaluations, NFE)."""
        return sum(b.steps for b in self.blocks)

    nfe = denoising_steps

    @property
    def canvas_tokens(self) -> int:
        return sum(b.canvas_length for b in self.blocks)

    @property
    def work_tokens(self) -> int:
        """Canvas positions processed by the decoder: sum of canvas_length x steps."""
        return sum(b.canvas_length * b.steps for b in self.blocks)

    @property
    def tokens_per_forward(self) -> float:
        return self.generation_tokens / self.nfe if self.nfe else 0.0

    @property
    def revealed_per_step(self) -> List[List[int]]:
        return [b.revealed_per_step for b in self.blocks]

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / max(self.prompt_time, 1e-9)

    @property
    def generation_tps(self) -> float:
        return self.generation_tokens / max(self.generation_time, 1e-9)

    def summary(self) -> dict:
        """Flat numbers for a results row."""
        return {
            "prompt_tokens": self.prompt_tokens,
            "generation_tokens": self.generation_tokens,
            "blocks": len(self.blocks),
            "denoising_steps": self.denoising_steps,
            "canvas_tokens": self.canvas_tokens,
            "work_tokens": self.work_tokens,
            "tokens_per_forward": self.tokens_per_forward,
            "encoder_passes": self.encoder_passes,
            "finish_reason": self.finish_reason,
            "prompt_tps": self.prompt_tps,
            "generation_tps": self.generation_tps,
        }
