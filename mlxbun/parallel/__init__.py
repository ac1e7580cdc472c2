"""Tensor parallelism over `mx.distributed`: the group a command runs in, rank-0 output, the
per-rank figures, and the check that holds a split model to the whole one and to mlx-lm's own
split (`check.py`). The split itself is each graph's `shard(group)` (`mlxbun.models.sharding`)."""

from mlxbun.parallel.world import (
    ParallelError,
    barrier,
    gather_floats,
    is_primary,
    locate_on_all,
    primary_output,
    tensor_group,
    world,
)

__all__ = ["ParallelError", "barrier", "gather_floats", "is_primary", "locate_on_all", "primary_output",
           "tensor_group", "world"]
