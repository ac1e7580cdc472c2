"""Adaptive draft length: pick k from the running acceptance rate and the measured costs.

Model: each draft position is accepted with probability a (independently, until the first
rejection), so a round with k drafts emits E(k) = (1 - a^(k+1)) / (1 - a) tokens; it costs
k * c_draft + v0 + v1 * (k + 1) (per-token draft cost, verify cost linear in the tokens fed).
The controller picks the k in [k_min, k_max] maximizing E(k) / cost(k). All estimates decay
exponentially (`decay` per round) so the choice follows the text.

- a: the truncated-geometric estimate accepted / (accepted + rejections), rejections being the
  rounds that stopped before their last draft (a Beta(1, 1) prior keeps it off 0 and 1);
- c_draft: draft seconds per drafted token;
- v0, v1: least squares of verify seconds on tokens fed (v1 = 0 until two lengths were seen).

k = 0 (plain decoding) may win when acceptance is poor; every `probe_every`-th round then drafts
one token anyway so the acceptance estimate keeps learning.
"""

from __future__ import annotations

from mlxbun.errors import MlxbunError

__all__ = ["AdaptiveDraftLength"]


class AdaptiveDraftLength:
    def __init__(self, k_max: int, k_min: int = 0, *, decay: float = 0.9, probe_every: int = 8):
        if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
            raise MlxbunError(f"adaptive draft length: k_max must be a positive integer, got {k_max!r}")
        if not 0 <= k_min <= k_max:
            raise MlxbunError(f"adaptive draft length: k_min must be in [0, {k_max}], got {k_min!r}")
        if not 0 < decay <= 1:
            raise MlxbunError(f"adaptive draft length: decay must be in (0, 1], got {decay!r}")
        self.k_max, self.k_min, self.decay, self.probe_every = k_max, k_min, decay, probe_every
        self._acc = self._rej = 0.0
        self._draft_tok = self._draft_time = 0.0
        self._w = self._x = self._y = self._xx = self._xy = 0.0  # weighted sums for the verify fit
        self._plain_rounds = 0

    # ------------------------------------------------------------------ estimates

    @property
    def acceptance(self) -> float:
        return (self._acc + 1.0) / (self._acc + self._rej + 2.0)

    @property
    def draft_cost(self) -> float:
        return self._draft_time / self._draft_tok if self._draft_tok else 0.0

    def verify_cost(self, fed: int) -> float:
        if not self._w:
            return 1.0  # nothing measured yet: any positive constant gives the same argmax
        mx_, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx_ * mx_
        slope = max(0.0, (self._xy / self._w - mx_ * my) / var) if var > 1e-12 else 0.0
        return max(1e-9, my + slope * (fed - mx_))

    def expected_tokens(self, k: int) -> float:
        a = self.acceptance
        return (1 - a ** (k + 1)) / (1 - a)

    def rate(self, k: int) -> float:
        """Expected tokens per second with k drafts."""
        return self.expected_tokens(k) / (k * self.draft_cost + self.verify_cost(k + 1))

    # ------------------------------------------------------------------ choice

    def choose(self) -> int:
        if not self._w:
            return self.k_max  # first round: measure the full length
        best = max(range(self.k_min, self.k_max + 1), key=lambda k: (self.rate(k), -k))
        if best == 0:
            self._plain_rounds += 1
            if self._plain_rounds % self.probe_every == 0:
                return 1
        return best

    def update(self, k: int, n_drafted: int, n_accepted: int, draft_s: float, verify_s: float) -> None:
        d = self.decay
        self._acc *= d
        self._rej *= d
        self._draft_tok *= d
        self._draft_time *= d
        self._w, self._x, self._y, self._xx, self._xy = (v * d for v in (self._w, self._x, self._y, self._xx,
                                                                          self._xy))
        if n_drafted:
            self._acc += n_accepted
            self._rej += 1.0 if n_accepted < n_drafted else 0.0
            self._draft_tok += n_drafted
            self._draft_time += draft_s
        fed = n_drafted + 1
        self._w += 1.0
        self._x += fed
        self._y += verify_s
        self._xx += fed * fed
        self._xy += fed * verify_s
