"""What several experiments need: a model name with notebook-style options, and the tokenizer a
checkpoint may or may not have."""

from __future__ import annotations

import filecmp
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


def same_weights(a: Path, b: Path) -> bool:
    """True when two checkpoint directories hold byte-identical config.json and weight files
    (the same *.safetensors names): two paths to one model, e.g. a GGUF whose tensors are all
    Q4_1 imported with and without `--quant 4` (only the types it dequantizes are re-quantized)."""
    names = sorted(p.name for p in Path(a).glob("*.safetensors"))
    if not names or names != sorted(p.name for p in Path(b).glob("*.safetensors")):
        return False
    return all(filecmp.cmp(Path(a) / n, Path(b) / n, shallow=False) for n in [*names, "config.json"]
               if (Path(a) / n).is_file() or (Path(b) / n).is_file())
