"""What several experiments need: a model name with notebook-style options, the tokenizer a
checkpoint may or may not have, and a full-size run's written outputs (a CSV, a markdown table, a plot)."""

from __future__ import annotations

import filecmp
import os
from pathlib import Path
from typing import Optional

from mlxbun.errors import MlxbunError
from mlxbun.locate import locate
from mlxbun.names import parse_model
from mlxbun.tokenizer import load_tokenizer

__all__ = ["model_path", "optional_tokenizer", "output_stem", "write_run_outputs"]


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


def output_stem(table, prefix: str, suffix: str = "") -> str:
    """prefix_<model>suffix for a table of one model (a `model` column; real:smollm2 -> prefix_smollm2),
    else prefix + suffix."""
    import re

    models = list(dict.fromkeys(table["model"]))
    one = "_" + re.sub(r"\W+", "_", models[0].split(":")[-1]) if len(models) == 1 else ""
    return prefix + one + suffix


def write_run_outputs(out_dir, stem: str, table, markdown, markdown_suffix: str, fig) -> list[Path]:
    """<stem>.csv (`table`, every row), <stem><markdown_suffix>.md (the `markdown` table) and <stem>.png
    (`fig`) in `out_dir` (made when missing). Returns the paths."""
    from mlxbun.results.export import to_markdown

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.csv", out / f"{stem}{markdown_suffix}.md", out / f"{stem}.png"]
    table.to_csv(paths[0], index=False, float_format="%.6g")
    paths[1].write_text(to_markdown(markdown, float_fmt=".4g") + "\n", encoding="utf-8")
    fig.savefig(paths[2], dpi=110, bbox_inches="tight")
    return paths
