"""The fast path in a speculative round: the target's verify forward through the compiled step.

With `fast`, a round's verify forward (the pending token and the drafts, T = m + 1 tokens) runs
through the fast path's `CompiledDecoder` over static copies of the target's caches (one compiled
trace per T), and a rejection goes back by moving the decoder's position instead of trimming the
caches (`CompiledDecoder.rewind`). The verify forward is then the fast path's, not the exact
one: the greedy tokens are the fast path's own decode, measured (L2-fast), not equal by
construction to the exact path's.

It applies where every target cache is full attention (KVCache / QuantizedKVCache) and nothing
converts the caches while decoding; elsewhere the round verifies eagerly and the FastPath notes
why once. A draft model's (or self-draft's) own forwards stay eager: the fast path speeds up the
target's side.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from mlxbun.fast import CompiledDecoder, CompileGap, FastPath

__all__ = ["FastVerify", "start_fast_verify"]


class FastVerify:
    """The target's verify steps through a rewindable compiled decoder (see the module)."""

    def __init__(self, fast: FastPath, target, cache: list, room: int):
        self.fast = fast
        self.decoder = CompiledDecoder(target, cache, room, kernels=fast.switch, rewindable=True)

    def verify(self, ids: mx.array) -> mx.array:
        """Logits [T, V] of `ids` [1, T] (raises CompileGap when the step cannot take them)."""
        with self.fast.on():
            return self.decoder.verify(ids)

    def commit(self, n_kept: int, n_fed: int) -> None:
        """Keep the first `n_kept` of the `n_fed` tokens the last verify step fed."""
        self.decoder.rewind(n_fed - n_kept)

    def close(self) -> None:
        """Hand the decoded tokens back to the exact caches."""
        self.decoder.write_back()


def start_fast_verify(fast: Optional[FastPath], target, cache: list, *, recurrent: bool, converting: bool,
                      room: int) -> Optional[FastVerify]:
    """A FastVerify over the prefilled `cache`, or None (eager verify; the reason goes to the
    notes). `recurrent`: the target rolls recurrent states back (its mixers replay);
    `converting`: a KV quantize hook converts the caches while decoding."""
    if fast is None or not fast.compile_decode:
        return None
    reason = None
    if recurrent:
        reason = "recurrent layers roll back by replay, which the compiled step does not hold"
    elif converting:
        reason = "KV quantization converts the caches while decoding"
    if reason is None:
        try:
            return FastVerify(fast, target, cache, room)
        except CompileGap as e:
            reason = str(e)
    fast.note(f"speculative verify eager: {reason}")
    return None
