"""`mlxbun convert`: a Hugging Face checkpoint to an MLX one, byte for byte what `mlx_lm.convert`
writes with the same options:

    convert(SRC, OUT)                          mlx_lm.convert --hf-path SRC --mlx-path OUT
    convert(SRC, OUT, dtype="bfloat16")        ... --dtype bfloat16
    convert(SRC, OUT, quant="4")               ... -q --q-bits 4 --q-group-size 64
    convert(SRC, OUT, quant="mixed_3_6")       ... -q --quant-predicate mixed_3_6 --q-group-size 64
    (group_size=G gives --q-group-size G)

SRC is any model name (`mlxbun.names`): a hub repo (`ORG/REPO[@REVISION]`, fetched by
`mlxbun.hub` with the files mlx_lm.convert fetches, its remote code and model card included), a
directory, a zoo or GGUF name. The options and OUT are checked before any download or work; the
conversion is mlx-lm's own (load, cast, quantize, save), run into a staging directory beside OUT
and renamed into place, so OUT appears whole or not at all. A hub SRC's model card names it as
base_model, from the converted revision's README (mlx_lm.convert reads main's; the same file for
an unpinned repo). Uploading is not offered: it could not be tested against a stand-in hub.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import Optional, Union

from mlxbun.errors import MlxbunError

__all__ = ["ConvertError", "DTYPES", "GROUP_SIZES", "QUANTS", "RECIPES", "check_options", "convert"]

RECIPES = ("mixed_2_6", "mixed_3_4", "mixed_3_6", "mixed_4_6")  # mlx_lm.convert.QUANT_RECIPES
QUANTS = ("4", "8", *RECIPES)
DTYPES = ("float16", "bfloat16", "float32")  # mlx_lm.convert.MODEL_CONVERSION_DTYPES
GROUP_SIZES = (32, 64, 128)
CARD_PATTERNS = ("README.md",)


class ConvertError(MlxbunError):
    """A conversion that cannot run: a bad option or output path, or mlx-lm refusing the checkpoint."""


def check_options(out, quant: Optional[str], group_size: int, dtype: Optional[str]) -> Path:
    """OUT as a path, once every option is one mlx_lm.convert takes and OUT can be created."""
    from mlxbun.atomic import unwritable

    if quant is not None and str(quant) not in QUANTS:
        raise ConvertError(f"--quant {quant!r}: choose one of {', '.join(QUANTS)}")
    if group_size not in GROUP_SIZES:
        raise ConvertError(f"--group-size {group_size!r}: choose one of {', '.join(map(str, GROUP_SIZES))}")
    if dtype is not None and dtype not in DTYPES:
        raise ConvertError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    out = Path(out).expanduser()
    if out.exists() or out.is_symlink():
        raise ConvertError(f"--out {out} already exists: give a new directory (nothing is replaced)")
    if why := unwritable(out):
        raise ConvertError(f"--out {out} cannot be created: {why}")
    return out


def _source(src) -> tuple[Path, Optional[str]]:
    """The checkpoint directory of `src` and, for a hub repo, its id (the card's base_model)."""
    from mlxbun.names import parse_model

    spec = parse_model(src)
    if spec.kind == "hub":
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        from mlxbun.hub import fetch

        return fetch(spec.value, spec.revision, patterns=(*DEFAULT_ALLOW_PATTERNS, *CARD_PATTERNS)), spec.value
    from mlxbun.locate import locate

    return locate(spec), None


def convert(src: Union[str, os.PathLike], out: Union[str, os.PathLike], *, quant: Optional[str] = None,
            group_size: int = 64, dtype: Optional[str] = None) -> Path:
    """Convert model `src` into the new directory `out` as mlx_lm.convert does; returns `out`."""
    from mlxbun.atomic import replace_dir, staging

    out = check_options(out, quant, group_size, dtype)
    path, repo_id = _source(src)
    from mlx_lm.convert import convert as mlx_lm_convert

    quant = None if quant is None else str(quant)
    with staging(out.absolute().parent, out.name, "convert") as work:
        target = work / "model"
        try:
            with contextlib.redirect_stdout(sys.stderr):  # mlx-lm's [INFO] lines: stdout stays the result's
                mlx_lm_convert(str(path), str(target), quantize=quant is not None, q_group_size=group_size,
                               q_bits=int(quant) if quant and quant.isdigit() else None, dtype=dtype,
                               quant_predicate=quant if quant in RECIPES else None)
        except (ValueError, FileNotFoundError, KeyError) as e:
            raise ConvertError(f"mlx-lm cannot convert {src}: {e}") from e
        if repo_id is not None:
            _hub_card(target, path / "README.md", repo_id)
        replace_dir(target, out)
    return out


def _hub_card(dst: Path, readme: Path, repo_id: str) -> None:
    """The model card mlx_lm.utils.create_model_card writes for a hub repo, from `readme` (the
    snapshot's: no second request) or, where the repo has none, the template it starts from."""
    from huggingface_hub import ModelCard, ModelCardData

    card = ModelCard.load(readme) if readme.is_file() else ModelCard.from_template(ModelCardData(language="en"))
    card.data.library_name = "mlx"
    card.data.pipeline_tag = "text-generation"
    if card.data.tags is None:
        card.data.tags = ["mlx"]
    elif "mlx" not in card.data.tags:
        card.data.tags += ["mlx"]
    card.data.base_model = repo_id
    card.text = ""
    card.save(os.path.join(dst, "README.md"))
