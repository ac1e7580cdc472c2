"""Layer taps: record what chosen modules of any `mlx.nn.Module` tree return.

One mechanism for mlx-lm's modules and mlxbun's alike. Inside `capture(...)`
each targeted instance's `__class__` is swapped for a dynamic subclass whose
`__call__` runs the original and records its output; on exit (exception or
not) every instance gets its class back. No attribute is set and no parameter
moves, so `tree_flatten(model.parameters())` is unchanged and the forward runs
exactly the ops it runs untapped.

Keys are module paths as `named_modules()` spells them (`model.layers.0.mlp`).
Each call appends one output, so a prefill and its decode steps are all kept;
`Taps.order` lists (path, call index) in completion order, which is execution
order for localization: a block's children finish before the block does.

A module that returns a tuple of arrays (an MoE router's `Routing`: experts, weights,
logits) is recorded by its first array like any other, and whole in `Taps.tuples`.
A module whose `observer` attribute is true exists in mlxbun's tree only (the MoE
router where mlx-lm routes inline); its paths are listed in `Taps.observers`, so a
comparison with another engine's taps need not find it there.

Selections (`paths=`):
- None (default): "layers" plus each block's direct children (attention, mlp,
  norms): layer and sub-step granularity.
- "layers": the blocks (int-indexed children of a module list that are not
  inside another block) and the pieces around them (embedding, final norm,
  head: modules hanging off the blocks' ancestors).
- "all": every module except the root.
- a list of paths (unknown ones refuse, naming them), or a predicate
  `(path, module) -> bool`.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator, Union

import mlx.core as mx
import mlx.nn as nn

from mlxbun.errors import MlxbunError

__all__ = ["Taps", "TapError", "block_paths", "capture", "select_paths", "substep_of", "layer_index_of"]

Selection = Union[None, str, Iterable[str], Callable[[str, nn.Module], bool]]


class TapError(MlxbunError):
    """A tap selection names a module path the tree does not have."""


class Taps(dict):
    """path -> list of recorded outputs (one per call); `order` is completion order."""

    def __init__(self, paths: Iterable[str]):
        super().__init__((p, []) for p in paths)
        self.order: list[tuple[str, int]] = []
        self.tuples: dict[str, list[tuple]] = {}  # path -> whole tuple outputs, one per call
        self.observers: set[str] = set()  # paths of modules only mlxbun's tree has

    def called(self) -> list[str]:
        """Paths in the order their first call completed."""
        seen: dict[str, None] = {}
        for path, _ in self.order:
            seen.setdefault(path, None)
        return list(seen)


def _is_index(part: str) -> bool:
    return part.isdigit()


def block_paths(named: Iterable[tuple[str, nn.Module]]) -> list[str]:
    """Transformer blocks: `x.<int>` modules with no block among their ancestors."""
    blocks: list[str] = []
    for path, _ in sorted(named, key=lambda pm: pm[0].count(".")):
        if not path or not _is_index(path.rsplit(".", 1)[-1]):
            continue
        if not any(path.startswith(b + ".") for b in blocks):
            blocks.append(path)
    return sorted(blocks, key=lambda b: (_parent(b), int(b.rsplit(".", 1)[-1])))


def _parent(path: str) -> str:
    return path.rsplit(".", 1)[0] if "." in path else ""


def select_paths(module: nn.Module, paths: Selection = None) -> list[str]:
    """The module paths a selection names, in `named_modules()` order."""
    named = [(p, m) for p, m in module.named_modules() if p]
    known = {p for p, _ in named}
    if callable(paths):
        return [p for p, m in named if paths(p, m)]
    if paths is None or paths == "layers":
        blocks = set(block_paths(named))
        # Ancestors of blocks (`model`, the root ""); the list itself (`model.layers`) is no module.
        ancestors = {""}
        for b in blocks:
            parts = b.split(".")
            ancestors.update(".".join(parts[:i]) for i in range(1, len(parts)))
        chosen = []
        for p, _ in named:
            inside = any(p.startswith(b + ".") for b in blocks)
            if p in blocks:
                chosen.append(p)
            elif not inside and p not in ancestors and _parent(p) in ancestors:
                chosen.append(p)  # embedding, final norm, head, ...
            elif paths is None and inside and _parent(p) in blocks:
                chosen.append(p)  # a block's attention / mlp / norms
        return chosen
    if paths == "all":
        return [p for p, _ in named]
    if isinstance(paths, str):
        raise TapError(f"tap selection '{paths}': use None, 'layers', 'all', a list of module paths or a predicate")
    wanted = list(paths)
    unknown = [p for p in wanted if p not in known]
    if unknown:
        raise TapError(f"no module at path(s) {unknown} (e.g. {sorted(known)[:5]})")
    return wanted


def _first_array(out):
    if isinstance(out, mx.array):
        # A copy of the handle: later in-place ops (`h *= s`) on the caller's array don't reach it.
        return copy.copy(out)
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], mx.array):
        return copy.copy(out[0])
    return None


def _whole_tuple(out):
    """A tuple output of arrays, each handle copied (a NamedTuple keeps its type)."""
    if not isinstance(out, tuple) or len(out) < 2 or not all(isinstance(x, mx.array) for x in out):
        return None
    items = [copy.copy(x) for x in out]
    return type(out)(*items) if hasattr(out, "_fields") else tuple(items)


@contextmanager
def capture(module: nn.Module, paths: Selection = None) -> Iterator[Taps]:
    """Record the outputs of the selected modules of `module` for the duration of the block."""
    if not isinstance(module, nn.Module):
        raise TapError(f"capture() needs an mlx.nn.Module, got {type(module).__name__}")
    chosen = select_paths(module, paths)
    by_path = dict(module.named_modules())
    taps = Taps(chosen)
    taps.observers = {p for p in chosen if getattr(by_path[p], "observer", False) is True}
    # One instance may sit at several paths (shared modules): record under each.
    where: dict[int, list[str]] = {}
    for p in chosen:
        where.setdefault(id(by_path[p]), []).append(p)

    subclasses: dict[type, type] = {}

    def tapped(cls: type) -> type:
        if cls not in subclasses:
            orig_call = cls.__call__

            def __call__(self, *args, **kwargs):
                out = orig_call(self, *args, **kwargs)
                value = _first_array(out)
                if value is not None:
                    whole = _whole_tuple(out)
                    for p in where.get(id(self), ()):
                        taps[p].append(value)
                        taps.order.append((p, len(taps[p]) - 1))
                        if whole is not None:
                            taps.tuples.setdefault(p, []).append(whole)
                return out

            subclasses[cls] = type(cls.__name__, (cls,), {
                "__call__": __call__, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            })
        return subclasses[cls]

    swapped: list[tuple[nn.Module, type]] = []
    try:
        for p in chosen:
            inst = by_path[p]
            if any(inst is s for s, _ in swapped):
                continue
            orig = inst.__class__
            inst.__class__ = tapped(orig)
            swapped.append((inst, orig))
        yield taps
    finally:
        for inst, orig in reversed(swapped):
            inst.__class__ = orig


def layer_index_of(path: str, blocks: Iterable[str] | None = None) -> int | None:
    """The block index in a path (`model.layers.3.mlp` -> 3), None outside the blocks."""
    if blocks is not None:
        for b in blocks:
            if path == b or path.startswith(b + "."):
                return int(b.rsplit(".", 1)[-1])
        return None
    for part in path.split("."):
        if _is_index(part):
            return int(part)
    return None


# (label, substrings, whole "_"-separated words); norms first: `post_attention_layernorm` is a norm.
_SUBSTEP_WORDS = (
    ("norm", ("norm",), ("ln", "ln_f", "ln_1", "ln_2")),
    ("attention", ("attn", "attention", "mixer"), ()),
    ("mlp", ("mlp", "feed_forward", "ffn", "moe", "experts"), ()),
    ("head", ("lm_head", "embed_out"), ("head", "output")),
    ("embedding", ("embed",), ("wte", "wpe")),
)


def substep_of(path: str, blocks: Iterable[str] | None = None) -> str:
    """A label for reports: 'embedding' | 'layer' | 'attention' | 'mlp' | 'norm' | 'head' | <name>."""
    last = path.rsplit(".", 1)[-1]
    if _is_index(last) and (blocks is None or path in set(blocks)):
        return "layer"
    # Inside a block the label comes from the block's child (`...layers.0.self_attn.o_proj` -> attention).
    block = next((b for b in blocks or () if path.startswith(b + ".")), None)
    if block is not None:
        name = path[len(block) + 1:].split(".")[0]
    else:
        parts = path.split(".")
        idx = next((i for i, part in enumerate(parts) if _is_index(part)), None)
        name = parts[idx + 1] if idx is not None and idx + 1 < len(parts) else last
    low = name.lower()
    tokens = set(low.split("_")) | {low}
    for label, subs, words in _SUBSTEP_WORDS:
        if any(w in low for w in subs) or tokens & set(words):
            return label
    return name
