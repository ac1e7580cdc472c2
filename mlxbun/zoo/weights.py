"""Zoo weights: the mlx-lm model of a tiny config, made non-trivial, cast and quantized the way
`mlx_lm.convert` does it, saved as sharded safetensors in mlx-lm's layout."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path

GROUP_SIZE = 64
MIXED_BITS, MIXED_HIGH_BITS = 4, 8
MXFP4_BITS, MXFP4_GROUP_SIZE = 4, 32  # mlx-lm's convert defaults for --q-mode mxfp4


def build_model(config: dict, seed: int) -> nn.Module:
    """Instantiate mlx-lm's model for `config` with seeded, perturbed float32 parameters.
    (Module init draws from mlx's global RNG, which this reseeds with `seed`.)"""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.update(tree_map_with_path(lambda name, p: perturb(name, p, seed), model.parameters()))
    mx.eval(model.parameters())
    return model


def perturb(name: str, p: mx.array, seed: int) -> mx.array:
    """Seeded noise on every float parameter, keyed by its name (independent of order): norm
    weights leave 1 (or 0 for 1+w norms), biases leave 0, so a dropped bias or a `w` vs `1+w`
    norm mix-up changes the logits."""
    if not mx.issubdtype(p.dtype, mx.floating):
        return p
    digest = hashlib.sha256(f"mlxbun-zoo:{seed}:{name}".encode()).digest()
    k1, k2 = mx.random.split(mx.random.key(int.from_bytes(digest[:4], "little")))
    scale = mx.random.normal(p.shape, key=k1)
    if p.ndim == 0:  # activation parameters (xIELU alpha/beta/eps): keep the sign and size
        return p * (1.0 + 0.1 * scale)
    shift = mx.random.normal(p.shape, key=k2)
    return p * (1.0 + 0.1 * scale) + 0.05 * shift


def cast(model: nn.Module, dtype: str) -> None:
    """mlx_lm.convert's cast: floating parameters the model allows (cast_predicate) to `dtype`."""
    target = getattr(mx, dtype)
    cast_predicate = getattr(model, "cast_predicate", lambda _: True)

    def set_dtype(k, v):
        if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
            return v.astype(target)
        return v

    model.update(tree_map_with_path(set_dtype, model.parameters()))


def _layer_index(path: str) -> int | None:
    m = re.search(r"\.(\d+)\.", path)
    return int(m.group(1)) if m else None


def mixed_predicate(model: nn.Module):
    """A per-layer recipe in the style of mlx-lm's mixed_* recipes: 4 bit by default, the last
    transformer layer and lm_head at 8 bit (written as per-module overrides), embeddings kept
    unquantized."""
    num_layers = len(model.layers)
    high = {"group_size": GROUP_SIZE, "bits": MIXED_HIGH_BITS, "mode": "affine"}

    def predicate(path: str, module: nn.Module):
        if isinstance(module, nn.Embedding):
            return False
        if path.endswith("lm_head") or _layer_index(path) == num_layers - 1:
            return dict(high)
        return True

    return predicate


def quantize(model: nn.Module, config: dict, quant) -> dict:
    """Quantize like `mlx_lm.convert -q` (affine, group 64; "mxfp4": `--q-mode mxfp4`, group 32);
    returns the config convert writes."""
    from mlx_lm.utils import quantize_model

    group, mode, predicate = GROUP_SIZE, "affine", None  # None: the model's own quant_predicate
    if quant == "mixed":
        bits, predicate = MIXED_BITS, mixed_predicate(model)
    elif quant == "mxfp4":
        bits, group, mode = MXFP4_BITS, MXFP4_GROUP_SIZE, "mxfp4"
    else:
        bits = int(quant)
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
        _, qconfig = quantize_model(model, config, group, bits, mode=mode, quant_predicate=predicate)
    return qconfig


def save_weights(model: nn.Module, out: Path) -> None:
    """mlx_lm.utils.save_model's files, but in two shards (it would write one for a tiny model)."""
    from mlx_lm.utils import get_total_parameters

    save_shards(dict(tree_flatten(model.parameters())), out,
                total_parameters=get_total_parameters(model), fmt="mlx")


def save_shards(weights: dict[str, mx.array], out: Path, *, total_parameters: int, fmt: str) -> None:
    """Two safetensors shards (cut in two halves by bytes, in the given order, each non-empty)
    with metadata {"format": fmt}, plus the HF index json."""
    names = list(weights)
    total = sum(v.nbytes for v in weights.values())
    running, cut = 0, len(names) - 1
    for i, name in enumerate(names):
        if running >= total / 2:
            cut = i
            break
        running += weights[name].nbytes
    cut = max(1, min(cut, len(names) - 1))
    shards = [names[:cut], names[cut:]]
    index = {"metadata": {"total_size": total, "total_parameters": total_parameters}, "weight_map": {}}
    for i, shard in enumerate(shards):
        shard_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(out / shard_name), {n: weights[n] for n in shard}, metadata={"format": fmt})
        for name in shard:
            index["weight_map"][name] = shard_name
    index["weight_map"] = dict(sorted(index["weight_map"].items()))
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4), encoding="utf-8")
