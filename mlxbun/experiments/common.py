"""What several experiments need: a model name with notebook-style options, and the tokenizer a
checkpoint may or may not have."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

from mlxbun.errors import MlxbunError
from mlxbun.locate import locate
from mlxbun.names import parse_model
from mlxbun.tokenizer import load_tokenizer

__all__ = ["model_path", "optional_tokenizer"]


def model_path(model, *, variant: Optional[str] = None, head_dim: Optional[int] = None, zoo_root=None) -> Path:
    """The checkpoint directory of a model name (`mlxbun.names`), with a notebook's `variant` and
    `head_dim` parameters filling in what a zoo name leaves out. `variant` is the zoo weight
    variant: other models have the weights they have and ignore it (the notebooks' default,
    "float32", is then no request); `head_dim` on another model is an error."""
    spec = parse_model(os.fspath(model) if isinstance(model, os.PathLike) else model)
    if spec.kind != "zoo":
        variant = None
    return locate(spec.with_options(variant=variant, head_dim=head_dim), zoo_root=zoo_root)


def optional_tokenizer(path):
    """The checkpoint's tokenizer, or None when it has none (ids are then shown without text)."""
    try:
        return load_tokenizer(path)
    except MlxbunError:
        return None
