"""The tensor-parallel check: a model split across the group against the same model whole, and
against mlx-lm's own split of it.

Two holds, as issue 18 states them:
- **vs the whole model** (this process, no communication): greedy ids equal step for step, and
  every logit within `TOLERANCE[dtype]` times the largest logit magnitude (a split sums the
  partial products of o_proj / down_proj in another order, so bits move by rounding);
- **vs mlx-lm's split** (where its model file has `shard()`): the raw logits of every step bit
  for bit (`parity.gate.compare_trajectories`), since both sides run MLX's sharded layers over
  the same ops.

A model (or a piece of it) that cannot split is `refused` with the reason, which is what a user
asking for that split sees.
"""

from __future__ import annotations

import gc
import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

import mlx.core as mx

from mlxbun.errors import MlxbunError
from mlxbun.parallel.world import locate_on_all
from mlxbun.parity.compare import bit_equal, max_abs_diff
from mlxbun.parity.gate import compare_trajectories
from mlxbun.parity.oracle import Trajectory, default_prompt_ids, run_trajectory

__all__ = ["TOLERANCE", "TensorParallelCheck", "check_tensor_parallel"]

# max |split - whole| / max |whole| allowed, by the logits' dtype (a float32 model's logits are
# float32, a bfloat16 model's bfloat16 whatever its quantization): a few units in the last place
# of the largest logit, 2^-17 for float32 (~7.6e-6; seen up to ~2e-6 on the zoo) and 2^-5 for the
# 8-bit-mantissa formats (their rounding step at the top is 2^-8 of the magnitude: a moved
# reduction can flip a few roundings in the residual stream, each worth one step)
TOLERANCE = {"float32": 2.0 ** -17, "float16": 2.0 ** -7, "bfloat16": 2.0 ** -5}


@dataclass
class TensorParallelCheck:
    """One model's split against its whole self and against mlx-lm's split."""

    target: str
    ranks: int
    status: str  # "pass", "fail" or "refused"
    reason: Optional[str] = None  # why refused / failed
    dtype: Optional[str] = None
    tokens_equal: Optional[bool] = None  # greedy ids of the split == the whole model's
    first_token_divergence: Optional[int] = None
    max_abs_diff: Optional[float] = None  # over the prefill and every compared step
    max_abs_logit: Optional[float] = None  # of the whole model, the diff's scale
    tolerance: Optional[float] = None  # relative, TOLERANCE[dtype]
    mlxlm: Optional[str] = None  # "bit-exact", "differs" or "no shard()" (mlx-lm's own split)
    mlxlm_first_divergence: Optional[int] = None

    @property
    def relative_diff(self) -> Optional[float]:
        if self.max_abs_diff is None or not self.max_abs_logit:
            return self.max_abs_diff
        return self.max_abs_diff / self.max_abs_logit

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "relative_diff": self.relative_diff}


def _max_abs(t: Trajectory) -> float:
    return max(float(mx.max(mx.abs(t.prefill_logits.astype(mx.float32))).item()),
               *(float(mx.max(mx.abs(s.astype(mx.float32))).item()) for s in t.step_logits))


def _diff_until_divergence(split: Trajectory, whole: Trajectory) -> tuple[float, Optional[int]]:
    """(max |split - whole| over the prefill and the steps fed the same ids, first step whose
    greedy id differs or None)."""
    worst = max_abs_diff(split.prefill_logits, whole.prefill_logits)
    first = None
    for step, (a, b) in enumerate(zip(split.step_logits, whole.step_logits)):
        d = max_abs_diff(a, b)
        worst = math.nan if d is None or math.isnan(d) else max(worst, d)
        if split.greedy_ids[step] != whole.greedy_ids[step]:
            first = step
            break
    return worst, first


def _release() -> None:
    gc.collect()
    mx.clear_cache()


def check_tensor_parallel(target: str, group: mx.distributed.Group, *, decode_steps: int = 8,
                          prompt_len: int = 24, prompt_ids: Optional[list[int]] = None,
                          zoo_root=None) -> TensorParallelCheck:
    """Split `target` (a model name) across `group` with mlxbun, and hold it to the whole model and
    to mlx-lm's split. Every rank must call it with the same arguments; each returns the same
    result (rank 0 reports it)."""
    from mlxbun.generate import vocab_size_of
    from mlxbun.locate import open_runtime
    from mlxbun.models.sharding import ShardingError

    n = group.size()
    if n < 2:
        raise MlxbunError("the tensor-parallel check needs a launch of 2 or more ranks "
                          "(mlx.launch -n 2 --backend ring .venv/bin/mlxbun tp-check ...)")
    path = locate_on_all(target, group, zoo_root=zoo_root)
    whole_model = open_runtime(path)
    prompt = list(prompt_ids) if prompt_ids is not None else default_prompt_ids(
        vocab_size_of(whole_model), length=prompt_len)
    whole = run_trajectory(whole_model, prompt, decode_steps)
    del whole_model
    _release()
    try:
        split_model = open_runtime(path, tensor_group=group)
    except ShardingError as e:
        return TensorParallelCheck(target, n, "refused", reason=str(e), dtype=whole.dtype)
    split = run_trajectory(split_model, prompt, decode_steps)
    del split_model
    _release()

    diff, first = _diff_until_divergence(split, whole)
    scale = _max_abs(whole)
    tol = TOLERANCE.get(whole.dtype)
    result = TensorParallelCheck(target, n, "pass", dtype=whole.dtype, tokens_equal=first is None,
                                 first_token_divergence=first, max_abs_diff=diff, max_abs_logit=scale,
                                 tolerance=tol)
    try:
        theirs_model = open_runtime(path, "mlx-lm", tensor_group=group)
    except ShardingError:
        result.mlxlm = "no shard()"
    else:
        theirs = run_trajectory(theirs_model, prompt, decode_steps)
        del theirs_model
        _release()
        cmp = compare_trajectories(split, theirs)  # every step's logits and ids, bit for bit
        prefill_equal = bit_equal(split.prefill_logits, theirs.prefill_logits)  # every position
        result.mlxlm = "bit-exact" if cmp.equal and prefill_equal else "differs"
        result.mlxlm_first_divergence = 0 if not prefill_equal else cmp.first_mismatch_step

    problems = []
    if first is not None:
        problems.append(f"greedy ids part from the whole model's at step {first}")
    if tol is None:
        problems.append(f"no tolerance for {whole.dtype} logits")
    elif not (diff <= tol * max(scale, 1e-30)):
        problems.append(f"max |split - whole| {diff:.3g} exceeds {tol:.3g} x max |logit| {scale:.3g}")
    if result.mlxlm == "differs":
        problems.append(f"logits differ from mlx-lm's split at step {result.mlxlm_first_divergence}")
    if problems:
        result.status, result.reason = "fail", "; ".join(problems)
    return result
