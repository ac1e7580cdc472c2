"""Build a Gemma3nModel from a config, audit a checkpoint against it, load it.

As mlx-lm's `load_model` does for gemma3n: read config.json, build the graph from text_config,
sanitize (the vision and audio towers and their embedders under `model.` are dropped: mlxbun
runs the text model alone; the towers load apart, through mlxbun.towers.usm (audio) and
mlxbun.towers.gemma3n_vision (images)), quantize the modules whose
`.scales` are present, load strictly. The audit compares the tensors present with the
parameters the graph needs before any tensor is loaded; it runs from safetensors headers alone
for `mlxbun port`'s dry run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxbun.config import load_model_config
from mlxbun.config_reader import thaw
from mlxbun.errors import LoadError, UnsupportedModelError
from mlxbun.models.gemma3n.config import gemma3n_args, require_coverage
from mlxbun.models.gemma3n.model import Gemma3nModel
from mlxbun.quant import quantize_model, resolve_quantization
from mlxbun.weight_audit import AuditReport, DropRule, WeightAudit
from mlxbun.weights import name_list, read_index

__all__ = ["DROPPED_TOWERS", "audit_gemma3n", "build_gemma3n", "load_gemma3n", "sanitize_gemma3n"]

# mlx-lm's Model.sanitize pops these from weights["model"]
DROPPED_TOWERS = ("vision_tower", "audio_tower", "embed_audio", "embed_vision")
_WHY = ("the {} (mlx-lm's gemma3n runs the text model alone; audio goes through mlxbun.towers.usm, images "
        "through mlxbun.towers.gemma3n_vision)")
# AltUp's coefficient layers: mlx-lm casts their weight to float32 on every call, which a packed
# (quantized) weight cannot take
_COEFS = ("altup.prediction_coefs", "altup.correction_coefs")


def build_gemma3n(config: Mapping[str, Any], *, text_config: Any = None) -> Gemma3nModel:
    """An unquantized Gemma3nModel for a config.json dict (the wrapper level)."""
    raw = thaw(config)
    return Gemma3nModel(gemma3n_args(raw), config=text_config, raw_config=raw)


def sanitize_gemma3n(weights: Mapping[str, Any]) -> tuple[dict, dict[str, str]]:
    """(kept, dropped name -> reason): mlx-lm's sanitize on flat names."""
    kept, dropped = {}, {}
    for name, value in weights.items():
        tower = next((t for t in DROPPED_TOWERS if name.startswith(f"model.{t}.")), None)
        if tower is None:
            kept[name] = value
        else:
            dropped[name] = _WHY.format(tower.replace("_", " "))
    return kept, dropped


def _prepare(path: Path, config, *, headers_only: bool):
    if config is None:
        config = load_model_config(path)
    raw = thaw(config.raw_full)
    require_coverage(raw, str(path / "config.json"))
    model = build_gemma3n(raw, text_config=config)
    index = read_index(path)
    if headers_only:
        unloadable = [n for n, t in index.tensors.items() if t.mx_dtype is None]
        if unloadable:
            raise LoadError(f"{path}: tensor(s) with dtypes mlx cannot load: {name_list(unloadable)}")
        originals = dict(index.tensors)
    else:
        originals = index.load()
    weights, dropped = sanitize_gemma3n(originals)
    quantization = resolve_quantization(raw)
    if quantization is not None:
        packed = sorted(n for n in weights if n.endswith(tuple(f"{c}.scales" for c in _COEFS)))
        if packed:
            raise UnsupportedModelError(
                f"{path}: quantized AltUp coefficient layer(s) {name_list(packed)}: mlx-lm's gemma3n casts "
                "their weight to float32 on every call, so they must stay unquantized")
        quantize_model(model, quantization, weights)
    report = _audit(model, weights, dropped, index, str(path))
    return model, weights, report


def _audit(model, weights, dropped, index, source: str) -> AuditReport:
    present = {n: index.tensors[n] for n in list(weights) + list(dropped)}
    rules = [DropRule(lambda n, names=frozenset(k for k, r in dropped.items() if r == reason): n in names, reason)
             for reason in set(dropped.values())]
    audit = WeightAudit(present, rules)
    params = tree_flatten(model.parameters())
    for name, p in params:  # shapes as mlx-lm's strict load checks them; packed weights uint32
        audit.expect(name, p.shape, p.dtype if p.dtype == mx.uint32 else None)
    report = dataclasses.replace(audit.finish(), source=f"weights in {source}")
    if not report.ok:
        raise LoadError(report.describe())
    wrong = [n for n, p in params if mx.issubdtype(p.dtype, mx.floating)
             and not mx.issubdtype(index.tensors[n].mx_dtype, mx.floating)]
    if wrong:
        raise LoadError(f"weights in {source}: non-float tensor(s) for float parameters: {name_list(wrong)}")
    return report


def audit_gemma3n(path, config=None) -> AuditReport:
    """The weight audit from safetensors headers only (no tensor data is read)."""
    _, _, report = _prepare(Path(path), config, headers_only=True)
    return report


def load_gemma3n(path, config=None, *, tensor_group=None) -> Gemma3nModel:
    """Load a gemma3n checkpoint directory (parameters evaluated, `model.audit` set).
    `tensor_group`: an `mx.distributed` group to split the graph across (`Gemma3nModel.shard`)
    before the weights are evaluated, so each rank reads its own part (as mlx-lm's sharded_load)."""
    path = Path(path)
    model, weights, report = _prepare(path, config, headers_only=False)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if tensor_group is not None:
        model.shard(tensor_group)
    mx.eval(model.parameters())
    model.audit = report
    return model
