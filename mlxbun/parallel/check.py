"""The tensor-parallel check: a model split across the group against the same model whole, and
against mlx-lm's own split of it.

Two holds, as issue 18 states them:
- **vs the whole model** (this process, no communication): the greedy ids step for step and every
  logit (the prefill's positions and each decode step's) within the stated tolerance. A split sums
  the partial products of o_proj / down_proj (and the MoE's experts) in another order, so bits move
  by rounding; the tolerance says how far:
  - float32 logits: `FLOAT32_TOLERANCE` (2^-17, about 7.6e-6) times the largest logit magnitude,
    a few units in the last place (seen up to 3.5e-6 relative on the zoo and 3.2e-6 on real:gemma3
    with OpenBLAS; under mlx's bundled reference BLAS, whose dot products round in one sequential
    pass, real:gemma3 drifts 8.3e-6 and fails it, greedy ids equal);
  - float16 / bfloat16 logits: `HALF_NOISE_FACTOR` (2) times the model's own rounding noise, the
    largest |logit| difference between the model and the same weights run in float32 over the
    prompt (`noise_floor`). A reordered sum is one more rounding; on the zoo the split's drift was
    0.5-1.2x that noise (bfloat16 gemma3: 0.24 vs 0.36; llama: 0.031 vs 0.027).
  A greedy id may differ only where the whole model's two candidates lie within that tolerance of
  each other (a tie the dtype cannot resolve: `tie_at`); the comparison stops there, as the inputs
  part. Any other difference in the ids fails.
- **vs mlx-lm's split** (where its model file has `shard()` and splits the same parameters the
  same way): the raw logits of every position and step bit for bit, since both sides run MLX's
  sharded layers over the same ops.

A model (or a piece of it) that cannot split is `refused` with the reason, which is what a user
asking for that split sees.
"""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

from mlxbun.errors import MlxbunError
from mlxbun.parallel.world import locate_on_all
from mlxbun.parity.compare import bit_equal, max_abs_diff
from mlxbun.parity.gate import compare_trajectories
from mlxbun.parity.oracle import Trajectory, default_prompt_ids, run_trajectory

__all__ = ["FLOAT32_TOLERANCE", "HALF_NOISE_FACTOR", "TensorParallelCheck", "check_tensor_parallel"]

FLOAT32_TOLERANCE = 2.0 ** -17  # relative to max |logit|
HALF_NOISE_FACTOR = 2.0  # times the half-precision model's own drift from float32


@dataclass
class TensorParallelCheck:
    """One model's split against its whole self and against mlx-lm's split."""

    target: str
    ranks: int
    status: str  # "pass", "fail" or "refused"
    reason: Optional[str] = None  # why refused / failed
    dtype: Optional[str] = None
    tokens_equal: Optional[bool] = None  # greedy ids of the split == the whole model's
    tie_at: Optional[int] = None  # the step where the ids part on a tie within the tolerance
    max_abs_diff: Optional[float] = None  # over the prefill and every compared step
    max_abs_logit: Optional[float] = None  # of the whole model
    noise_floor: Optional[float] = None  # half precision: max |whole - whole in float32| (prefill)
    tolerance: Optional[float] = None  # the absolute bound max_abs_diff is held to
    # mlx-lm's own split: "bit-exact", "differs", "no shard()" or "splits otherwise (...)"
    mlxlm: Optional[str] = None
    mlxlm_first_divergence: Optional[int] = None

    @property
    def relative_diff(self) -> Optional[float]:
        if self.max_abs_diff is None or not self.max_abs_logit:
            return self.max_abs_diff
        return self.max_abs_diff / self.max_abs_logit

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "relative_diff": self.relative_diff}


def _max_abs(t: Trajectory) -> float:
    return max(float(mx.max(mx.abs(x.astype(mx.float32))).item()) for x in [t.prefill_logits, *t.step_logits])


def _compare_to_whole(split: Trajectory, whole: Trajectory, tol: float) -> tuple[float, Optional[int], Optional[str]]:
    """(max |split - whole| over the prefill and the steps fed the same ids, the step of a tie
    within `tol` where the ids part, a problem or None)."""
    worst = max_abs_diff(split.prefill_logits, whole.prefill_logits)
    for step, (a, b) in enumerate(zip(split.step_logits, whole.step_logits)):
        d = max_abs_diff(a, b)
        worst = d if d != d or worst != worst else max(worst, d)  # a NaN stays NaN
        mine, theirs = split.greedy_ids[step], whole.greedy_ids[step]
        if mine != theirs:
            row = b[0].astype(mx.float32)
            margin = float((row[theirs] - row[mine]).item())
            if margin <= tol:
                return worst, step, None
            return worst, None, (f"greedy ids part from the whole model's at step {step} ({mine} vs {theirs}, "
                                 f"whose logits differ by {margin:.3g} > tolerance {tol:.3g})")
    return worst, None, None


def _as_float32(model) -> None:
    """Every floating parameter upcast to float32 in place (quantized codes stay as they are)."""
    module = getattr(model, "module", model)
    module.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
                           module.parameters()))


def _split_difference(shapes: dict, theirs) -> Optional[str]:
    """Where mlx-lm's split holds other parameters or shapes than mlxbun's, the first such one."""
    module = getattr(theirs, "module", theirs)
    own = {k: v.shape for k, v in tree_flatten(module.parameters())}
    if own.keys() != shapes.keys():
        names = sorted(own.keys() ^ shapes.keys())
        return f"parameter {names[0]} on one side only"
    for k, shape in own.items():
        if shape != shapes[k]:
            return f"{k}: {tuple(shape)} in mlx-lm, {tuple(shapes[k])} in mlxbun"
    return None


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
    try:  # a name that does not resolve or a model that does not open is that target's refusal
        path = locate_on_all(target, group, zoo_root=zoo_root)
        whole_model = open_runtime(path)
    except MlxbunError as e:
        return TensorParallelCheck(target, n, "refused", reason=str(e))
    prompt = list(prompt_ids) if prompt_ids is not None else default_prompt_ids(
        vocab_size_of(whole_model), length=prompt_len)
    whole = run_trajectory(whole_model, prompt, decode_steps)
    scale, noise = _max_abs(whole), None
    if whole.dtype == "float32":
        tol = FLOAT32_TOLERANCE * scale
    else:  # the dtype's own rounding: the same weights in float32, over the prompt
        _as_float32(whole_model)
        noise = max_abs_diff(run_trajectory(whole_model, prompt, 0).prefill_logits, whole.prefill_logits)
        tol = HALF_NOISE_FACTOR * noise
    del whole_model
    _release()
    try:
        split_model = open_runtime(path, tensor_group=group)
    except ShardingError as e:
        return TensorParallelCheck(target, n, "refused", reason=str(e), dtype=whole.dtype)
    split = run_trajectory(split_model, prompt, decode_steps)
    shapes = {k: v.shape for k, v in tree_flatten(split_model.parameters())}
    del split_model
    _release()

    diff, tie, problem = _compare_to_whole(split, whole, tol)
    result = TensorParallelCheck(target, n, "pass", dtype=whole.dtype,
                                 tokens_equal=split.greedy_ids == whole.greedy_ids, tie_at=tie,
                                 max_abs_diff=diff, max_abs_logit=scale, noise_floor=noise, tolerance=tol)
    try:
        theirs_model = open_runtime(path, "mlx-lm", tensor_group=group)
    except ShardingError:
        result.mlxlm = "no shard()"
    else:
        differs = _split_difference(shapes, theirs_model)
        if differs:  # e.g. its shard() divides 1 KV head across 2 ranks where mlxbun repeats it
            result.mlxlm = f"splits otherwise ({differs})"
        else:
            theirs = run_trajectory(theirs_model, prompt, decode_steps)
            cmp = compare_trajectories(split, theirs)  # every step's logits and ids, bit for bit
            prefill_equal = bit_equal(split.prefill_logits, theirs.prefill_logits)  # every position
            result.mlxlm = "bit-exact" if cmp.equal and prefill_equal else "differs"
            result.mlxlm_first_divergence = 0 if not prefill_equal else cmp.first_mismatch_step
        del theirs_model
        _release()

    problems = [problem] if problem else []
    if not diff <= tol:  # (a NaN fails too)
        problems.append(f"max |split - whole| {diff:.3g} exceeds the tolerance {tol:.3g}")
    if result.mlxlm == "differs":
        problems.append(f"logits differ from mlx-lm's split at step {result.mlxlm_first_divergence}")
    if problems:
        result.status, result.reason = "fail", "; ".join(problems)
    return result
