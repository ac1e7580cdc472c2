"""The processes of one run: `mlx.launch -n N --backend ring|nccl mlxbun COMMAND ...` starts N
ranks of the same command, and `mx.distributed.init()` joins them into one group (a plain run is
a group of one). A command that takes `--tp` splits its model across that group; only rank 0
prints and records."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator, Optional

import mlx.core as mx

from mlxbun.errors import MlxbunError

__all__ = ["ParallelError", "barrier", "gather_floats", "is_primary", "locate_on_all", "primary_output",
           "tensor_group", "world"]

LAUNCH_HINT = "mlx.launch -n {n} --backend ring (CPU) | nccl (CUDA) .venv/bin/mlxbun ..."


class ParallelError(MlxbunError):
    """A tensor-parallel option does not fit the processes this run was launched with."""


def world() -> mx.distributed.Group:
    """Every process of this run (size 1 unless started by mlx.launch or mpirun)."""
    return mx.distributed.init()


def tensor_group(tp: Optional[int]) -> Optional[mx.distributed.Group]:
    """The group to split the model across for `--tp`: None (the default) splits across every
    launched rank, 1 opts out (each rank runs the whole model), N must be the launch's size.
    None is returned for a run of one process."""
    if tp is not None and tp < 1:
        raise ParallelError(f"--tp {tp}: the tensor-parallel size is a positive number of ranks")
    if tp == 1:
        return None
    group = world()
    n = group.size()
    if tp is not None and tp != n:
        launched = f"was launched with {n} ranks" if n > 1 else "is one process"
        raise ParallelError(f"--tp {tp}: this run {launched}; start {tp} with "
                            f"`{LAUNCH_HINT.format(n=tp)}`")
    return group if n > 1 else None


def is_primary() -> bool:
    """Whether this process prints and records: rank 0 of the launch (a plain run always)."""
    return world().rank() == 0


@contextlib.contextmanager
def primary_output() -> Iterator[None]:
    """On ranks other than 0, what the enclosed code prints goes nowhere (rank 0 speaks for the
    run); an MlxbunError raised there still reaches the user, its message naming the rank."""
    rank = world().rank()
    if rank == 0:
        yield
        return
    saved = sys.stdout, sys.stderr
    with open(os.devnull, "w") as null:
        sys.stdout = sys.stderr = null
        try:
            yield
        except MlxbunError as e:
            raise type(e)(f"rank {rank}: {e}") from e
        finally:
            sys.stdout, sys.stderr = saved


def barrier(group: Optional[mx.distributed.Group] = None) -> None:
    """Wait until every rank of `group` (default: the launch) gets here."""
    group = group or world()
    if group.size() > 1:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def gather_floats(value: float, group: Optional[mx.distributed.Group] = None) -> list[float]:
    """Each rank's `value`, in rank order, on every rank (per-rank peak memory, say)."""
    group = group or world()
    if group.size() == 1:
        return [float(value)]
    out = mx.distributed.all_gather(mx.array([float(value)], dtype=mx.float32), group=group, stream=mx.cpu)
    return [float(v) for v in out.tolist()]


def locate_on_all(name, group: Optional[mx.distributed.Group] = None, **kwargs):
    """`locate(name)` on every rank, rank 0 first: a zoo build or a GGUF import happens once,
    the other ranks find it in the cache (their locks would serialize them anyway)."""
    from mlxbun.locate import locate

    group = group or world()
    if group.rank() != 0:
        barrier(group)  # rank 0 has built or imported it, or failed (then so does this call)
        return locate(name, **kwargs)
    try:
        return locate(name, **kwargs)
    finally:  # also when it fails: the others then try, and fail alike, instead of waiting
        barrier(group)
