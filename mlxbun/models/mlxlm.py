"""Any mlx-lm model as a RuntimeModel: the oracle side of the parity gate.

`load_mlxlm(path)` loads a local checkpoint with mlx-lm's own loader (strict,
no network) and wraps it. The adapter adds nothing to the numerics: `__call__`
is the mlx-lm model's call, and the hidden/logits split is cut out of that
same call, so `logits_from_hidden(forward_hidden(x))` runs exactly the ops of
`model(x)` whatever the arch does in its head (tied `as_linear`, softcap,
logit scaling):

- `forward_hidden` runs the full call with the inner model (`model.model`,
  `language_model.model`, `transformer`, ...) intercepted and returns what the
  inner model returned; the head's ops are only traced lazily, never evaluated.
- `logits_from_hidden(h)` runs the full call with the inner model replaced by
  "return h", so the arch's own head code produces the logits.

The interception swaps the inner instance's `__class__` for the duration of
the call (as the taps do), so no parameter or attribute changes.
"""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxbun.errors import ConfigError, LoadError, MlxbunError
from mlxbun.models.taps import capture

__all__ = ["MlxLmRuntimeModel", "as_ids", "ensure_runtime", "find_inner_model", "load_mlxlm"]

# Where mlx-lm archs keep the decoder stack whose output is the final hidden state (first match wins).
INNER_MODEL_PATHS = (
    "language_model.model",
    "model",
    "transformer",
    "gpt_neox",
    "backbone",
)


def find_inner_model(model: nn.Module) -> tuple[str, nn.Module]:
    """The (path, module) of the decoder stack inside an mlx-lm top-level model."""
    for path in INNER_MODEL_PATHS:
        node: Any = model
        for part in path.split("."):
            node = node.get(part) if isinstance(node, nn.Module) else None
            if node is None:
                break
        if isinstance(node, nn.Module):
            return path, node
    raise MlxbunError(
        f"{type(model).__module__}.{type(model).__name__}: no inner decoder at any of "
        f"{', '.join(INNER_MODEL_PATHS)}; forward_hidden/logits_from_hidden need one"
    )


@contextmanager
def _swap_call(inst: nn.Module, fn: Callable[..., Any]) -> Iterator[None]:
    """Within the block, `inst(...)` runs `fn(orig_call, inst, *args, **kwargs)`."""
    orig_cls = inst.__class__
    orig_call = orig_cls.__call__

    def __call__(self, *args, **kwargs):
        return fn(orig_call, self, *args, **kwargs)

    inst.__class__ = type(orig_cls.__name__, (orig_cls,), {
        "__call__": __call__, "__module__": orig_cls.__module__, "__qualname__": orig_cls.__qualname__,
    })
    try:
        yield
    finally:
        inst.__class__ = orig_cls


def as_ids(ids: Any) -> mx.array:
    """Token ids as an int32 [B, L] array (a flat list or 1-D array becomes B = 1)."""
    arr = ids if isinstance(ids, mx.array) else mx.array(ids, dtype=mx.int32)
    if arr.ndim == 1:
        arr = arr[None]
    if arr.ndim != 2:
        raise MlxbunError(f"token ids must be [L] or [B, L], got shape {tuple(arr.shape)}")
    return arr


class MlxLmRuntimeModel:
    """An mlx-lm `Model` behind the RuntimeModel contract (+ taps, + the inner-model split)."""

    def __init__(self, module: nn.Module, config: Any = None, *, mlx_config: Optional[dict] = None,
                 path: Optional[Path] = None):
        if not isinstance(module, nn.Module):
            raise MlxbunError(f"MlxLmRuntimeModel wraps an mlx.nn.Module, got {type(module).__name__}")
        self.module = module
        self.mlx_config = dict(mlx_config or {})
        self.config = config if config is not None else self.mlx_config
        self.path = Path(path) if path is not None else None
        self.profile = None  # the oracle runs mlx-lm's own graph; no mlxbun profile applies
        self.inner_path, self.inner = find_inner_model(module)

    def __repr__(self) -> str:
        return f"MlxLmRuntimeModel({self.model_type}, {self.path or type(self.module).__name__})"

    # ------------------------------------------------------------ identity

    @property
    def model_type(self) -> str:
        mt = getattr(self.module, "model_type", None)
        if mt is None:
            args = getattr(self.module, "args", None)
            mt = getattr(args, "model_type", None) or self.mlx_config.get("model_type")
        return str(mt)

    @property
    def weights_bytes(self) -> int:
        return sum(v.nbytes for _, v in tree_flatten(self.module.parameters()))

    # ------------------------------------------------------------ forward

    def make_cache(self, **kv_options: Any) -> list[Any]:
        from mlx_lm.models.cache import make_prompt_cache

        unknown = sorted(set(kv_options) - {"max_kv_size"})
        if unknown:
            raise MlxbunError(f"mlx-lm caches take only max_kv_size; unsupported kv option(s): {unknown}")
        return make_prompt_cache(self.module, max_kv_size=kv_options.get("max_kv_size"))

    def __call__(self, ids: Any, cache: Optional[list[Any]] = None) -> mx.array:
        return self.module(as_ids(ids), cache=cache)

    def forward_hidden(self, ids: Any, cache: Optional[list[Any]] = None) -> mx.array:
        seen: list[Any] = []

        def record(orig_call, inst, *args, **kwargs):
            out = orig_call(inst, *args, **kwargs)
            seen.append(copy.copy(out) if isinstance(out, mx.array) else out)
            return out

        with _swap_call(self.inner, record):
            self.module(as_ids(ids), cache=cache)
        if len(seen) != 1:
            raise MlxbunError(f"{self}: the top-level call ran '{self.inner_path}' {len(seen)} times, expected once")
        return seen[0]

    def logits_from_hidden(self, h: mx.array) -> mx.array:
        def replay(orig_call, inst, *args, **kwargs):
            return copy.copy(h)  # a fresh handle: an in-place op in the head must not touch the caller's h

        dummy = mx.zeros(tuple(h.shape[:-1]), dtype=mx.int32)
        with _swap_call(self.inner, replay):
            return self.module(dummy, cache=None)

    # ------------------------------------------------------------ taps

    def layers_tap(self, paths: Any = None):
        return capture(self.module, paths)


def ensure_runtime(model: Any) -> Any:
    """A bare mlx-lm `nn.Module` gets the adapter; anything with `layers_tap` is used as is."""
    if isinstance(model, nn.Module) and not hasattr(model, "layers_tap"):
        return MlxLmRuntimeModel(model)
    return model


def load_mlxlm(path: str | Path, *, strict: bool = True, lazy: bool = False,
               tensor_group=None) -> MlxLmRuntimeModel:
    """Load a local checkpoint directory with mlx-lm (no network) as a RuntimeModel.
    `tensor_group`: split it with its file's own `Model.shard(group)` before the weights are
    evaluated, as mlx-lm's sharded_load does (refused where the file has no shard())."""
    from mlx_lm.utils import load_model

    p = Path(path).expanduser()
    if not p.is_dir():
        raise LoadError(f"{p}: not a checkpoint directory")
    if not (p / "config.json").is_file():
        raise ConfigError(f"{p / 'config.json'}: missing")
    if tensor_group is not None:
        lazy = True
    try:
        module, mlx_config = load_model(p, lazy=lazy, strict=strict)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p / 'config.json'}: invalid JSON ({e})") from None
    except (FileNotFoundError, ValueError, KeyError, TypeError) as e:
        raise LoadError(f"{p}: mlx-lm could not load the checkpoint: {type(e).__name__}: {e}") from None
    if tensor_group is not None:
        if not hasattr(module, "shard"):
            from mlxbun.models.sharding import ShardingError

            raise ShardingError(f"{p}: mlx-lm's {type(module).__module__} has no shard(); it runs in "
                                "one process only")
        module.shard(tensor_group)
        mx.eval(module.parameters())
    return MlxLmRuntimeModel(module, _text_config(p), mlx_config=mlx_config, path=p)


def _text_config(path: Path) -> Any:
    """mlxbun's normalized config when it parses; an arch it cannot normalize keeps None (raw dict used)."""
    from mlxbun.config import load_model_config

    try:
        return load_model_config(path)
    except MlxbunError:
        return None
