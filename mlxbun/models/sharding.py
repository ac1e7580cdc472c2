"""Tensor-parallel building blocks for the graphs' `shard(group)` methods.

The graphs split themselves the way mlx-lm's model files do (`Model.shard`): attention heads
and MLP hidden units across the ranks of an `mx.distributed` group, with MLX's own sharded
layers (`mlx.nn.layers.distributed`: "all-to-sharded" splits a linear's outputs, so each rank
holds some heads; "sharded-to-all" splits its inputs and all-sums the partial products), so
where mlx-lm shards an arch the sharded graph runs mlx-lm's sharded ops.

What this module adds is the checking mlx leaves to a crash: every split is checked before
any array moves (outputs, inputs and each fused segment divisible by the group size, a
quantized input split on whole quantization groups), and a refusal names the module path,
the sizes and the group size. A graph whose piece cannot split raises `ShardingError` from
its `shard` before anything changed.
"""

from __future__ import annotations

from typing import Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers import distributed as D
from mlx.utils import tree_map

from mlxbun.errors import MlxbunError

__all__ = [
    "ShardedRMSNorm",
    "ShardingError",
    "check_heads",
    "gather_last_axis",
    "repeat_heads",
    "repeat_rows",
    "rms_norm_over_ranks",
    "shard_depthwise_conv",
    "shard_inplace",
    "shard_inplace_all",
    "shard_linear",
    "slice_heads",
    "split_heads_plan",
    "slice_heads_inplace",
]

Segments = Union[int, Sequence[int]]
ALL_TO_SHARDED, SHARDED_TO_ALL = "all-to-sharded", "sharded-to-all"


class ShardingError(MlxbunError):
    """A model (or one of its modules) cannot be split across the group as asked."""


def _segment_sizes(total: int, segments: Segments) -> list[int]:
    if isinstance(segments, int):
        return [total // segments] * segments
    edges = [0, *segments, total]
    return [b - a for a, b in zip(edges, edges[1:])]


def _in_out(module: nn.Module) -> tuple[int, int, int | None]:
    """(output features, input features, quantization group or None) of a linear-like module
    whose weight is [..., out, in] (packed for a quantized one)."""
    w = module["weight"]
    bits = getattr(module, "bits", None)
    if "scales" in module and bits:
        return w.shape[-2], w.shape[-1] * 32 // bits, module.group_size
    return w.shape[-2], w.shape[-1], None


def _check(where: str, module: nn.Module, sharding: str, n: int, segments: Segments) -> None:
    if sharding not in (ALL_TO_SHARDED, SHARDED_TO_ALL):
        raise ShardingError(f"{where}: unknown sharding {sharding!r} ({ALL_TO_SHARDED} or {SHARDED_TO_ALL})")
    if not isinstance(module, nn.Module) or "weight" not in module:
        raise ShardingError(f"{where}: {type(module).__name__} holds no weight to split")
    out_dims, in_dims, group = _in_out(module)
    if sharding == ALL_TO_SHARDED:
        sizes = _segment_sizes(out_dims, segments)
        bad = [s for s in sizes if s % n]
        if bad:
            parts = f" (fused parts {sizes})" if len(sizes) > 1 else ""
            raise ShardingError(f"{where}: {out_dims} output features{parts} do not split into {n} "
                                f"equal parts (tensor-parallel group of {n})")
        return
    sizes = _segment_sizes(in_dims, segments)
    for s in sizes:
        if s % n:
            raise ShardingError(f"{where}: {in_dims} input features do not split into {n} equal "
                                f"parts (tensor-parallel group of {n})")
        if group is not None and (s // n) % group:
            raise ShardingError(f"{where}: a rank's {s // n} of {in_dims} input features are not "
                                f"whole quantization groups of {group} (tensor-parallel group of {n}); "
                                "a smaller group or fewer ranks split it")


def shard_linear(module: nn.Module, sharding: str, group: mx.distributed.Group, *, where: str,
                 segments: Segments = 1) -> nn.Module:
    """MLX's sharded counterpart of a Linear / QuantizedLinear (`mlx.nn.layers.distributed.
    shard_linear`, as mlx-lm's shard() calls it), after the split is checked."""
    if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
        raise ShardingError(f"{where}: {type(module).__name__} is not a Linear or QuantizedLinear; "
                            "it has no sharded counterpart")
    _check(where, module, sharding, group.size(), segments)
    return D.shard_linear(module, sharding, segments=segments, group=group)


def shard_inplace(module: nn.Module, sharding: str, group: mx.distributed.Group, *, where: str,
                  segments: Segments = 1) -> None:
    """Split a module's own parameters in place (`mlx.nn.layers.distributed.shard_inplace`): for
    modules that sum across the group themselves (MoE experts, whose block all-sums once)."""
    _check(where, module, sharding, group.size(), segments)
    D.shard_inplace(module, sharding, segments=segments, group=group)


def shard_inplace_all(pieces: Sequence[tuple[str, nn.Module, str, Segments]],
                      group: mx.distributed.Group) -> None:
    """`shard_inplace` over the (where, module, sharding, segments) pieces of a block that all-sums
    their outputs once (an MoE block's experts and shared expert: mlx-lm's `sharding_group`), every
    split checked before any parameter moves. A sharded-to-all piece keeps its bias whole on every
    rank, so the bias is divided by the group size (each rank adds its share, the one all-sum the
    whole: mlx-lm gpt_oss's `down_proj.bias /= N`)."""
    n = group.size()
    for where, module, sharding, segments in pieces:
        _check(where, module, sharding, n, segments)
    for _, module, sharding, segments in pieces:
        D.shard_inplace(module, sharding, segments=segments, group=group)
        if sharding == SHARDED_TO_ALL and "bias" in module:
            module.bias = module.bias / n


def split_heads_plan(attn: nn.Module, group: mx.distributed.Group, where: str):
    """Check the split of an attention module's heads across `group` and return the call that makes
    it: q_proj / k_proj / v_proj all-to-sharded, o_proj sharded-to-all (k / v where the module has
    them), KV heads fewer than the ranks repeated to one per rank first (then they always split);
    `attn.n_heads` / `n_kv_heads` become the rank's. Nothing changes until the call, so a refusal of
    another piece checked before it leaves the weights as they were."""
    n, H, KV = group.size(), attn.n_heads, attn.n_kv_heads
    check_heads(where, H, n)
    repeat = KV % n != 0
    if repeat and n % KV:
        raise ShardingError(f"{where}: {KV} KV heads neither split across {n} ranks nor repeat to one per rank")
    kv_names = [name for name in ("k_proj", "v_proj") if name in attn]
    layers = {"q_proj": shard_linear(attn.q_proj, ALL_TO_SHARDED, group, where=f"{where}.q_proj"),
              "o_proj": shard_linear(attn.o_proj, SHARDED_TO_ALL, group, where=f"{where}.o_proj")}
    if not repeat:
        layers.update({name: shard_linear(attn[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
                       for name in kv_names})

    def apply() -> None:
        for name in kv_names if repeat else ():
            repeat_heads(attn[name], KV, n)
            layers[name] = shard_linear(attn[name], ALL_TO_SHARDED, group, where=f"{where}.{name}")
        for name, module in layers.items():
            setattr(attn, name, module)
        attn.n_heads, attn.n_kv_heads = H // n, max(KV // n, 1)

    return apply


def check_heads(where: str, heads: int, n: int, what: str = "attention heads") -> None:
    if heads % n:
        raise ShardingError(f"{where}: {heads} {what} do not split across {n} ranks")


def slice_heads(a: mx.array, group: mx.distributed.Group, axis: int = 0) -> mx.array:
    """This rank's contiguous part of `a` along `axis` (per-head vectors: sinks, norms' rows)."""
    n, r = group.size(), group.rank()
    return mx.contiguous(mx.split(a, n, axis=axis)[r])


def slice_heads_inplace(module: nn.Module, group: mx.distributed.Group) -> None:
    """Every parameter of a per-head module ([heads, ...]: a MultiLinear, quantized or not) cut to
    this rank's heads (mlx-lm deepseek_v3's `embed_q.apply(shard_heads)`); heads checked by the
    caller (`check_heads`)."""
    module.update(tree_map(lambda p: slice_heads(p, group), module.parameters()))


def repeat_heads(module: nn.Module, heads: int, n: int) -> None:
    """Repeat each of a projection's `heads` output heads n // heads times (in place), so n ranks
    each hold one: mlx-lm's qwen3_5 does this for KV heads fewer than the ranks. Query head q of
    rank r reads KV head r // (n // heads), the one it reads unsharded."""
    repeat_rows(module, heads, n)


def repeat_rows(module: nn.Module, blocks: int, n: int, rows: tuple[int, int] | None = None) -> None:
    """Repeat each of `blocks` equal blocks of output rows n // blocks times (in place), in every
    parameter of a linear-like or conv module (its outputs are axis 0 of each): all rows, or those
    in [start, stop) of `rows` (one fused segment, e.g. a Mamba2 in_proj's B rows)."""
    def _repeat(p):
        lo, hi = (0, p.shape[0]) if rows is None else rows
        part = p if rows is None else p[lo:hi]
        s = part.shape
        part = part.reshape(blocks, s[0] // blocks, *s[1:])
        part = mx.repeat(part, n // blocks, axis=0).reshape(-1, *s[1:])
        return part if rows is None else mx.concatenate([p[:lo], part, p[hi:]], axis=0)

    module.update(tree_map(_repeat, module.parameters()))


def shard_depthwise_conv(conv: nn.Module, group: mx.distributed.Group, *, where: str,
                         segments: Segments = 1) -> None:
    """Split a depthwise Conv1d's channels across `group` (in place): each rank keeps its part of
    every fused segment's channels, weight and bias alike, and its groups shrink to match (mlx-lm
    qwen3_5's conv1d split: shard_inplace along axis 0, `groups //= N`). Checked first."""
    n = group.size()
    channels = conv["weight"].shape[0] if isinstance(conv, nn.Conv1d) else None
    if channels is None or conv.groups != channels or conv["weight"].shape[-1] != 1:
        raise ShardingError(f"{where}: {type(conv).__name__} is not a depthwise Conv1d; its channels "
                            "have no tensor-parallel split")
    sizes = _segment_sizes(channels, segments)
    if any(s % n for s in sizes):
        parts = f" (fused parts {sizes})" if len(sizes) > 1 else ""
        raise ShardingError(f"{where}: {channels} conv channels{parts} do not split into {n} equal "
                            f"parts (tensor-parallel group of {n})")
    D.shard_inplace(conv, lambda path, w: (0, segments), group=group)
    conv.groups //= n


def gather_last_axis(x: mx.array, group: mx.distributed.Group) -> mx.array:
    """The last axis of `x`, split across `group`, gathered in rank order (mlx-lm base.py's
    gather_last_axis, op for op: the vocabulary of a split head)."""
    n, size = group.size(), x.shape[-1]
    parts = mx.distributed.all_gather(x.reshape(-1, size), group=group)
    parts = parts.reshape(n, -1, size).transpose(1, 0, 2)
    return parts.reshape(*x.shape[:-1], n * size)


def rms_norm_over_ranks(group: mx.distributed.Group, span: int | None = None):
    """(x, weight, eps) -> the RMS norm of features split across ranks: each rank holds its slice
    of x (and of the weight), the squared sums are all-summed. `span`: how many consecutive ranks
    share one normalized group (default all of them; with fewer, ranks r // span alike form a
    group: a grouped norm whose groups are fewer than the ranks). For the whole group it is mlx-lm
    minimax.py's sharded_rms_norm, op for op: the compile is split so that the upcast does not
    break it (one kernel squares the upcast input, another normalizes and downcasts)."""
    n = group.size()
    span = n if span is None else span
    slots, mine = n // span, group.rank() // span

    @mx.compile
    def _cast_square_sum(x):
        return x.astype(mx.float32).square().sum(-1, keepdims=True)

    @mx.compile
    def _normalize(x, norm2, w, eps):
        if slots == 1:
            norm2 = mx.distributed.all_sum(norm2, group=group)
        else:  # each rank's sum in its group's slot, zeros elsewhere; this group's slot back
            hot = (mx.arange(slots) == mine).astype(norm2.dtype)
            norm2 = mx.distributed.all_sum(norm2 * hot, group=group)[..., mine:mine + 1]
        norm = mx.rsqrt(norm2 / (x.shape[-1] * span) + eps)
        return (x.astype(mx.float32) * norm * w).astype(x.dtype)

    def _inner(x, w, eps):
        return _normalize(x, _cast_square_sum(x), w, eps)

    return _inner


class ShardedRMSNorm(nn.Module):
    """An RMSNorm over features split across the group (a flat q / k norm over all heads): each
    rank holds its slice of the weight, the squared sums are all-summed. mlx-lm minimax.py's
    ShardedRMSNorm, op for op."""

    def __init__(self, weight: mx.array, eps: float, group: mx.distributed.Group):
        super().__init__()
        self.weight = weight
        self.eps = eps
        object.__setattr__(self, "_norm", rms_norm_over_ranks(group))
        object.__setattr__(self, "_group", group)

    def _extra_repr(self):
        return f"{self.weight.shape[0] * self._group.size()}, eps={self.eps}"

    def __call__(self, x):
        return self._norm(x, self["weight"], self.eps)

    @classmethod
    def from_rms_norm(cls, norm: nn.RMSNorm, group: mx.distributed.Group, *, where: str) -> "ShardedRMSNorm":
        if not isinstance(norm, nn.RMSNorm):
            raise ShardingError(f"{where}: {type(norm).__name__} over split features has no sharded form")
        check_heads(where, norm.weight.shape[0], group.size(), "normalized features")
        return cls(slice_heads(norm.weight, group, axis=-1), norm.eps, group)
