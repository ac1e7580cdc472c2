"""Checkpoints the tests edit: a copy of a (zoo) checkpoint as one safetensors file, its tensors
and config changed."""

import json
import shutil
from pathlib import Path

import mlx.core as mx


def rewrite_checkpoint(src, dst, edit, config=None, *, fmt: str = "mlx") -> Path:
    """Copy checkpoint `src` to `dst` as one safetensors file (metadata format `fmt`: "pt" as the
    hub's files say) with its tensors passed through `edit`; `config`, where given, edits
    config.json: a dict is merged into it, a callable gets the dict and returns the new one or
    changes it in place (returning None)."""
    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    tensors = {}
    for f in sorted(dst.glob("*.safetensors")):
        tensors.update(mx.load(str(f)))
        f.unlink()
    (dst / "model.safetensors.index.json").unlink(missing_ok=True)
    mx.save_safetensors(str(dst / "model.safetensors"), edit(tensors), metadata={"format": fmt})
    if config is not None:
        path = dst / "config.json"
        cfg = json.loads(path.read_text())
        if callable(config):
            cfg = config(cfg) or cfg
        else:
            cfg = {**cfg, **config}
        path.write_text(json.dumps(cfg))
    return dst
