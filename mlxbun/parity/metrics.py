"""Logit comparison of two runs over the same positions: the drift a lever causes.

`compare_logits(base, new, next_tokens)` takes per-position logits [N, V] of a
base run and a new run (a quantized cache, another backend, a fused kernel) and
the token that actually follows each position, and returns `KLDStats` with the
statistics `llama-perplexity --kl-divergence` reports
(llama.cpp tools/perplexity/perplexity.cpp, `kl_divergence()`), same names and
definitions:

- KLD per position: KL(base || new) = sum_v p_base(v) (ln p_base(v) - ln p_new(v));
  mean with its uncertainty, max, 99.9/99/95/90 %, median, 10/5/1/0.1 %, min;
- "same top p": the fraction of positions whose argmax agrees, with its
  binomial uncertainty sqrt(p (1 - p) / (N - 1));
- delta-p: p_new(token) - p_base(token) of the actual next token: mean with
  uncertainty, RMS with uncertainty, max, 99.9 .. 0.1 % (incl. 75/25 %), min;
- perplexity of each side, exp(mean NLL), with uncertainty PPL * sigma(mean NLL);
  their correlation; mean ln(PPL(new)/PPL(base)) with the covariance-aware
  uncertainty; the PPL ratio and difference with theirs.

Uncertainties follow llama.cpp's `mean_and_uncertainty`: sqrt(var / (N - 1))
with the population variance, and 0 when N <= 10 (too few to estimate);
the covariance is 0 when N < 10. Percentiles interpolate linearly between
sorted values at fraction * (N - 1), as llama.cpp's `percentile` does.

Two deliberate differences, both because the two runs' logits are in memory
here while llama.cpp reads the base from a file: the base log-probabilities
are exact (llama.cpp stores them as uint16 over [max - 16, max] and skips
p_base < e^-16 in the KLD sum), and all arithmetic is float64 (llama.cpp
accumulates per-token NLL in float32). Where llama.cpp divides 0 by 0 (the RMS
uncertainty when every delta-p is 0) this returns 0.

Also reported: the per-position max |new - base| of the raw logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from mlxbun.errors import MlxbunError

__all__ = ["KLDStats", "compare_logits", "kld_from_logprobs", "log_softmax", "logits_rows", "mean_and_uncertainty", "percentile",
           "step_max_abs_diff"]

KLD_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.10, 0.05, 0.01, 0.001)
DP_PERCENTILES = (0.999, 0.99, 0.95, 0.90, 0.75, 0.25, 0.10, 0.05, 0.01, 0.001)


# ---------------------------------------------------------------- llama.cpp's statistics


def mean_and_uncertainty(total: float, total_sq: float, count: int) -> tuple[float, float]:
    """llama.cpp: mean = sum/N; sigma = sqrt((sum2/N - mean^2) / (N - 1)) when positive and N > 10, else 0."""
    if count < 1:
        return 0.0, 0.0
    f = float(total) / count
    df = float(total_sq) / count - f * f
    return f, (math.sqrt(df / (count - 1)) if df > 0 and count > 10 else 0.0)


def _covariance(sum_a: float, sum_b: float, sum_ab: float, count: int) -> float:
    """llama.cpp: (sum_ab/N - mean_a mean_b) / (N - 1), 0 when N < 10."""
    if count < 10:
        return 0.0
    return float((sum_ab / count - (sum_a / count) * (sum_b / count)) / (count - 1))


def percentile(sorted_values: Sequence[float] | np.ndarray, fraction: float) -> float:
    """llama.cpp's percentile of ascending values: linear interpolation at fraction * (N - 1)."""
    v = np.asarray(sorted_values, dtype=np.float64)
    if v.size == 0:
        return math.nan
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (v.size - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * v[ip] + p * v[min(ip + 1, v.size - 1)])


def _median(sorted_values: np.ndarray) -> float:
    n = sorted_values.size
    if n == 0:
        return math.nan
    return float(sorted_values[n // 2]) if n % 2 else float(0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]))


def _pct_key(fraction: float) -> str:
    return f"{fraction * 100:g}"  # 0.999 -> "99.9"


# ---------------------------------------------------------------- inputs


def _to_numpy(x: Any, name: str) -> np.ndarray:
    """Floats as numpy, without rounding: mlx arrays go through float32 (exact for bf16/fp16)."""
    try:
        import mlx.core as mx

        if isinstance(x, mx.array):
            return np.asarray(x if x.dtype in (mx.float32,) else x.astype(mx.float32))
    except ImportError:  # pragma: no cover - mlx is a dependency
        pass
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as e:
        raise MlxbunError(f"{name}: cannot read as an array ({e})") from None
    if arr.dtype == object or not np.issubdtype(arr.dtype, np.number):
        raise MlxbunError(f"{name}: expected numeric logits, got dtype {arr.dtype}")
    return arr if arr.dtype in (np.float32, np.float64) else arr.astype(np.float32)


def logits_rows(logits: Any, name: str = "logits") -> np.ndarray:
    """Per-position logits as one [N, V] array: from [N, V], [B, L, V], [V], or a list of those."""
    if isinstance(logits, (list, tuple)):
        if not logits:
            raise MlxbunError(f"{name}: empty list of logits")
        parts = [_to_numpy(x, f"{name}[{i}]") for i, x in enumerate(logits)]
        vocab = {p.shape[-1] if p.ndim else None for p in parts}
        if len(vocab) != 1 or None in vocab:
            raise MlxbunError(f"{name}: the arrays disagree on the vocabulary size (last axis): {sorted(map(str, vocab))}")
        return np.concatenate([p.reshape(-1, p.shape[-1]) for p in parts], axis=0)
    arr = _to_numpy(logits, name)
    if arr.ndim == 0:
        raise MlxbunError(f"{name}: a scalar is not logits")
    return arr.reshape(-1, arr.shape[-1])


def _tokens(tokens: Any, n: int, vocab: int) -> np.ndarray:
    if isinstance(tokens, (list, tuple)) and tokens and not np.isscalar(tokens[0]):
        tokens = [t for part in tokens for t in np.asarray(part).reshape(-1).tolist()]
    t = np.asarray(tokens.tolist() if hasattr(tokens, "tolist") else tokens).reshape(-1)
    if t.size and not np.issubdtype(t.dtype, np.integer):
        raise MlxbunError(f"next_tokens: expected integer token ids, got dtype {t.dtype}")
    if t.size != n:
        raise MlxbunError(f"next_tokens: {t.size} ids for {n} logit positions (one next token per position)")
    bad = np.flatnonzero((t < 0) | (t >= vocab))
    if bad.size:
        raise MlxbunError(f"next_tokens: id {int(t[bad[0]])} at position {int(bad[0])} is outside the vocabulary "
                          f"[0, {vocab})")
    return t.astype(np.int64)


def log_softmax(rows: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64 (max-subtracted, as llama.cpp does)."""
    x = np.asarray(rows, dtype=np.float64)
    m = np.max(x, axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)  # an all -inf row stays -inf rather than NaN
    shifted = x - m
    with np.errstate(divide="ignore"):
        return shifted - np.log(np.sum(np.exp(shifted), axis=-1, keepdims=True))


def kld_from_logprobs(logp_base: np.ndarray, logp_new: np.ndarray) -> np.ndarray:
    """Row-wise KL(base || new) = sum p_base (ln p_base - ln p_new), from log-probabilities."""
    p = np.exp(logp_base)
    with np.errstate(invalid="ignore"):
        # p_base = 0 contributes 0 (not 0 * -inf); p_base > 0 with p_new = 0 is an honest +inf.
        return np.sum(np.where(p > 0, p * (logp_base - logp_new), 0.0), axis=-1)


def step_max_abs_diff(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per row max |a - b| in (at least) float32; equal values, NaN vs NaN and inf vs inf count as 0."""
    dt = np.result_type(a.dtype, b.dtype, np.float32)
    a, b = a.astype(dt, copy=False), b.astype(dt, copy=False)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    with np.errstate(invalid="ignore"):
        d = np.where(same, 0.0, np.abs(a - b))
    return d.max(axis=-1) if d.shape[-1] else np.zeros(d.shape[:-1], dt)


# ---------------------------------------------------------------- the result


@dataclass
class KLDStats:
    """llama-perplexity's KL-divergence report for two runs over the same N positions (probabilities as fractions)."""

    count: int
    vocab_size: int
    max_abs_diff: float  # max over positions of max |new - base| over the vocabulary (raw logits)
    kld_mean: float
    kld_mean_unc: float
    kld_max: float
    kld_median: float
    kld_min: float
    kld_percentiles: dict[str, float]  # "99.9", "99", "95", "90", "10", "5", "1", "0.1"
    n_same_top: int
    same_top_p: float
    same_top_p_unc: float
    # From here on: None unless next_tokens were given.
    ppl_new: float | None = None
    ppl_new_unc: float | None = None
    ppl_base: float | None = None
    ppl_base_unc: float | None = None
    ppl_cor: float | None = None  # correlation of the two runs' ln PPL
    ln_ppl_ratio: float | None = None  # mean ln(PPL(new) / PPL(base))
    ln_ppl_ratio_unc: float | None = None
    ppl_ratio: float | None = None
    ppl_ratio_unc: float | None = None
    ppl_diff: float | None = None
    ppl_diff_unc: float | None = None
    dp_mean: float | None = None
    dp_mean_unc: float | None = None
    dp_rms: float | None = None
    dp_rms_unc: float | None = None
    dp_max: float | None = None
    dp_median: float | None = None
    dp_min: float | None = None
    dp_percentiles: dict[str, float] | None = None  # "99.9", ..., "75", "25", ..., "0.1"
    # Per position (not part of as_dict() unless asked).
    step_max_abs_diff: np.ndarray = field(default=None, repr=False)
    kld_values: np.ndarray = field(default=None, repr=False)
    top_base: np.ndarray = field(default=None, repr=False)
    top_new: np.ndarray = field(default=None, repr=False)
    nll_base: np.ndarray | None = field(default=None, repr=False)
    nll_new: np.ndarray | None = field(default=None, repr=False)
    dp_values: np.ndarray | None = field(default=None, repr=False)

    @property
    def has_tokens(self) -> bool:
        return self.ppl_new is not None

    def as_dict(self, per_position: bool = False) -> dict[str, Any]:
        """The statistics as JSON-able values (per-position lists too when asked)."""
        out: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            if isinstance(v, np.ndarray) or (v is None and k in _PER_POSITION):
                if per_position:
                    out[k] = None if v is None else v.tolist()
                continue
            out[k] = dict(v) if isinstance(v, dict) else v
        return out

    def per_position(self):
        """One row per position: KLD, top ids, max |diff|, and (with tokens) NLLs and delta-p."""
        import pandas as pd

        cols = {"kld": self.kld_values, "top_base": self.top_base, "top_new": self.top_new,
                "max_abs_diff": self.step_max_abs_diff}
        if self.has_tokens:
            cols.update(nll_base=self.nll_base, nll_new=self.nll_new, delta_p=self.dp_values)
        return pd.DataFrame(cols).rename_axis("position")

    def _rows(self) -> list[tuple[str, str, str, float, float | None, str]]:
        """(section, key, label, value, uncertainty, unit) in llama.cpp's report order."""
        rows: list[tuple[str, str, str, float, float | None, str]] = [
            ("logits", "n_positions", "Positions", self.count, None, ""),
            ("logits", "max_abs_diff", "Max |logit diff|", self.max_abs_diff, None, ""),
        ]
        if self.has_tokens:
            rows += [
                ("perplexity", "ppl_new", "Mean PPL(Q)", self.ppl_new, self.ppl_new_unc, ""),
                ("perplexity", "ppl_base", "Mean PPL(base)", self.ppl_base, self.ppl_base_unc, ""),
                ("perplexity", "ppl_cor", "Cor(ln(PPL(Q)), ln(PPL(base)))", 100 * self.ppl_cor, None, "%"),
                ("perplexity", "ln_ppl_ratio", "Mean ln(PPL(Q)/PPL(base))", self.ln_ppl_ratio,
                 self.ln_ppl_ratio_unc, ""),
                ("perplexity", "ppl_ratio", "Mean PPL(Q)/PPL(base)", self.ppl_ratio, self.ppl_ratio_unc, ""),
                ("perplexity", "ppl_diff", "Mean PPL(Q)-PPL(base)", self.ppl_diff, self.ppl_diff_unc, ""),
            ]
        rows += [("kl_divergence", "kld_mean", "Mean    KLD", self.kld_mean, self.kld_mean_unc, "nats"),
                 ("kl_divergence", "kld_max", "Maximum KLD", self.kld_max, None, "nats")]
        for frac in KLD_PERCENTILES:
            if frac == 0.10:
                rows.append(("kl_divergence", "kld_median", "Median  KLD", self.kld_median, None, "nats"))
            key = _pct_key(frac)
            rows.append(("kl_divergence", f"kld_p{key}", f"{frac * 100:4.1f}%   KLD", self.kld_percentiles[key],
                         None, "nats"))
        rows.append(("kl_divergence", "kld_min", "Minimum KLD", self.kld_min, None, "nats"))
        if self.has_tokens:
            rows += [("token_probability", "dp_mean", "Mean    Δp", 100 * self.dp_mean, 100 * self.dp_mean_unc, "%"),
                     ("token_probability", "dp_max", "Maximum Δp", 100 * self.dp_max, None, "%")]
            for frac in DP_PERCENTILES:
                if frac == 0.25:
                    rows.append(("token_probability", "dp_median", "Median  Δp", 100 * self.dp_median, None, "%"))
                key = _pct_key(frac)
                rows.append(("token_probability", f"dp_p{key}", f"{frac * 100:4.1f}%   Δp",
                             100 * self.dp_percentiles[key], None, "%"))
            rows += [("token_probability", "dp_min", "Minimum Δp", 100 * self.dp_min, None, "%"),
                     ("token_probability", "dp_rms", "RMS Δp", 100 * self.dp_rms, 100 * self.dp_rms_unc, "%")]
        rows.append(("token_probability", "same_top_p", "Same top p", 100 * self.same_top_p,
                     100 * self.same_top_p_unc, "%"))
        return rows

    def as_table(self):
        """A pandas DataFrame: section, key, statistic, value, uncertainty, unit (probabilities in %)."""
        import pandas as pd

        return pd.DataFrame(self._rows(), columns=["section", "key", "statistic", "value", "uncertainty", "unit"])

    def as_rows(self) -> list[tuple[str, float, str | None]]:
        """(metric, value, unit) for the results table; uncertainties as `<key>_unc`."""
        out = []
        for _, key, _, value, unc, unit in self._rows():
            out.append((key, float(value), unit or None))
            if unc is not None:
                out.append((f"{key}_unc", float(unc), unit or None))
        return out

    def __str__(self) -> str:
        lines, section = [], None
        for sec, _, label, value, unc, unit in self._rows():
            if sec != section:
                lines.append(f"====== {sec.replace('_', ' ')} ======")
                section = sec
            text = f"{label:<31}: {value:12.6f}" if isinstance(value, float) else f"{label:<31}: {value:>12}"
            if unc is not None:
                text += f" ± {unc:10.6f}"
            lines.append(text + (f" {unit}" if unit in ("%",) else ""))
        return "\n".join(lines)


_PER_POSITION = {"step_max_abs_diff", "kld_values", "top_base", "top_new", "nll_base", "nll_new", "dp_values"}


# ---------------------------------------------------------------- the comparison


def compare_logits(base: Any, new: Any, next_tokens: Any = None, *, chunk_rows: int | None = None) -> KLDStats:
    """llama-perplexity --kl-divergence statistics of `new` against `base`.

    `base`, `new`: logits of the same N positions (mx or numpy arrays [N, V] or
    [B, L, V], or lists of per-step arrays [V] / [1, V] / [B, L, V]).
    `next_tokens`: for each position the token that actually follows it (what
    its logits predict); without them the perplexity and delta-p rows are None.
    """
    a, b = logits_rows(base, "base"), logits_rows(new, "new")
    if a.shape != b.shape:
        raise MlxbunError(f"base logits {list(a.shape)} and new logits {list(b.shape)} differ in shape "
                          "(same positions, same vocabulary needed)")
    n, vocab = a.shape
    if n == 0 or vocab == 0:
        raise MlxbunError(f"no logits to compare (shape {list(a.shape)})")
    tokens = None if next_tokens is None else _tokens(next_tokens, n, vocab)

    kld = np.empty(n)
    top_a = np.empty(n, dtype=np.int64)
    top_b = np.empty(n, dtype=np.int64)
    nll_a = np.empty(n) if tokens is not None else None
    nll_b = np.empty(n) if tokens is not None else None
    step = max(1, chunk_rows or (1 << 22) // vocab)  # bounded float64 working set
    for s in range(0, n, step):
        e = min(n, s + step)
        la, lb = log_softmax(a[s:e]), log_softmax(b[s:e])
        kld[s:e] = kld_from_logprobs(la, lb)
        top_a[s:e] = np.argmax(a[s:e], axis=-1)  # first maximum, as llama.cpp's strict '>' scan
        top_b[s:e] = np.argmax(b[s:e], axis=-1)
        if tokens is not None:
            rows = np.arange(e - s)
            nll_a[s:e] = -la[rows, tokens[s:e]]
            nll_b[s:e] = -lb[rows, tokens[s:e]]

    kld_mean, kld_unc = mean_and_uncertainty(kld.sum(), (kld * kld).sum(), n)
    kld_sorted = np.sort(kld)
    same = int(np.sum(top_a == top_b))
    p_top = same / n
    stats = KLDStats(
        count=n, vocab_size=vocab, step_max_abs_diff=step_max_abs_diff(a, b),
        max_abs_diff=0.0,
        kld_mean=float(kld_mean), kld_mean_unc=float(kld_unc), kld_max=float(kld_sorted[-1]),
        kld_median=_median(kld_sorted), kld_min=float(kld_sorted[0]),
        kld_percentiles={_pct_key(f): percentile(kld_sorted, f) for f in KLD_PERCENTILES},
        n_same_top=same, same_top_p=p_top,
        same_top_p_unc=math.sqrt(p_top * (1 - p_top) / (n - 1)) if n > 1 else math.nan,
        kld_values=kld, top_base=top_a, top_new=top_b,
    )
    stats.max_abs_diff = float(stats.step_max_abs_diff.max())
    if tokens is not None:
        _perplexity_and_dp(stats, nll_a, nll_b)
    return stats


def _perplexity_and_dp(stats: KLDStats, nll_base: np.ndarray, nll_new: np.ndarray) -> None:
    n = stats.count
    log_ppl, log_ppl_unc = mean_and_uncertainty(nll_new.sum(), (nll_new ** 2).sum(), n)
    log_base, log_base_unc = mean_and_uncertainty(nll_base.sum(), (nll_base ** 2).sum(), n)
    cov = _covariance(nll_new.sum(), nll_base.sum(), (nll_new * nll_base).sum(), n)
    ppl, ppl_base = math.exp(log_ppl), math.exp(log_base)
    ppl_unc, ppl_base_unc = ppl * log_ppl_unc, ppl_base * log_base_unc
    denom = log_ppl_unc * log_base_unc
    ratio_log = log_ppl - log_base
    ratio_log_unc = math.sqrt(max(0.0, log_ppl_unc ** 2 + log_base_unc ** 2 - 2.0 * cov))
    ratio = math.exp(ratio_log)
    ppl_cov = ppl * ppl_base * cov
    stats.ppl_new, stats.ppl_new_unc, stats.ppl_base, stats.ppl_base_unc = ppl, ppl_unc, ppl_base, ppl_base_unc
    stats.ppl_cor = cov / denom if denom > 0 else math.nan
    stats.ln_ppl_ratio, stats.ln_ppl_ratio_unc = ratio_log, ratio_log_unc
    stats.ppl_ratio, stats.ppl_ratio_unc = ratio, ratio * ratio_log_unc
    stats.ppl_diff = ppl - ppl_base
    stats.ppl_diff_unc = math.sqrt(max(0.0, ppl_unc ** 2 + ppl_base_unc ** 2 - 2.0 * ppl_cov))

    dp = np.exp(-nll_new) - np.exp(-nll_base)
    dp_sorted = np.sort(dp)
    stats.dp_values = dp
    stats.nll_base, stats.nll_new = nll_base, nll_new
    stats.dp_mean, stats.dp_mean_unc = mean_and_uncertainty(dp.sum(), (dp ** 2).sum(), n)
    mse, mse_unc = mean_and_uncertainty((dp ** 2).sum(), (dp ** 4).sum(), n)
    stats.dp_rms = math.sqrt(mse)
    stats.dp_rms_unc = 0.5 / stats.dp_rms * mse_unc if stats.dp_rms > 0 else 0.0
    stats.dp_max, stats.dp_min = float(dp_sorted[-1]), float(dp_sorted[0])
    stats.dp_median = _median(dp_sorted)
    stats.dp_percentiles = {_pct_key(f): percentile(dp_sorted, f) for f in DP_PERCENTILES}
