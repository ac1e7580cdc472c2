"""Build a UniversalDense from a config, and load a checkpoint into it with a weight audit.

Loading follows mlx-lm's `utils.load_model`: read config.json, build the graph,
apply the arch's `sanitize` (the descriptor's rules), quantize the modules whose
`.scales` are present (per-module overrides first), load with `strict=True`.
Before any tensor is loaded the audit compares the tensors present (after
sanitize) with the parameters the graph needs: anything missing, unconsumed
(and not dropped by a documented rule) or of the wrong shape is a `LoadError`
naming the tensors. `audit_checkpoint` runs the same steps from the
safetensors headers alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

import mlx.core as mx
from mlx.utils import tree_flatten

from mlxbun.config import load_model_config
from mlxbun.config_reader import thaw
from mlxbun.errors import ConfigError, LoadError, UnsupportedModelError
from mlxbun.models.switch_layers import SwitchLinear, gather_mm_supported
from mlxbun.models.universal.coverage import require_coverage
from mlxbun.models.universal.baichuan_m1 import BAICHUAN_M1_TYPES, BaichuanM1Dense
from mlxbun.models.universal.afm7 import AFM7_TYPES, Afm7Dense
from mlxbun.models.universal.dbrx import DBRX_TYPES, DbrxDense
from mlxbun.models.universal.dense import UniversalDense
from mlxbun.models.universal.gear import GEAR_TYPES, GearDense
from mlxbun.models.universal.gemma4 import Gemma4Text
from mlxbun.models.universal.gemma4_args import GEMMA4_MODEL_TYPES
from mlxbun.models.universal.kinds import TieRule
from mlxbun.models.universal.loop_gated import LOOP_GATED_TYPES, LoopGatedDense
from mlxbun.models.universal.looped import LoopedDense
from mlxbun.models.universal.nas import NAS_TYPES, NasDense
from mlxbun.models.universal.plamo2 import PLAMO2_TYPES, Plamo2Dense
from mlxbun.models.universal.recurrent_gemma import RECURRENT_GEMMA_TYPES, RecurrentGemmaDense
from mlxbun.models.universal.rwkv7 import RWKV7_TYPES, Rwkv7Dense
from mlxbun.models.universal.talkie import TALKIE_TYPES, TalkieDense
from mlxbun.models.universal.resolve import descriptor_for, resolve_args
from mlxbun.models.universal.schema import ArchDescriptor
from mlxbun.models.universal.sanitize import Meta, sanitize_weights
from mlxbun.quant import quantize_model, resolve_quantization
from mlxbun.weight_audit import AuditReport, DropRule, WeightAudit
from mlxbun.weights import name_list, read_index

__all__ = ["audit_checkpoint", "build_model", "load_universal"]


def build_model(config: Mapping[str, Any], model_type: Optional[str] = None, *,
                text_config: Any = None, descriptor: Optional[ArchDescriptor] = None) -> UniversalDense:
    """An unquantized UniversalDense for a config.json dict (as mlx-lm's ModelArgs reads it).

    `model_type` overrides the dict's; either is remapped as mlx-lm does.
    `model.config` is `text_config` (an `mlxbun.config.TextConfig`) when given,
    else the raw dict; `model.raw_config` is always the raw dict. `descriptor`: the row to build
    instead of the model_type's (towers/kimi_vl_text.py: kimi_vl's text model as mlx-vlm runs it).
    """
    if not isinstance(config, Mapping):
        raise ConfigError(f"config must be a JSON object, got {type(config).__name__}")
    raw = thaw(config)
    mt = model_type or raw.get("model_type")
    if not isinstance(mt, str):
        raise ConfigError("config.json: required key 'model_type' is missing or not a string")
    raw.setdefault("model_type", mt)
    d = descriptor if descriptor is not None else descriptor_for(mt, raw)
    args = resolve_args(d, raw)
    # a plain dict attribute would join the module tree: hand over a read-only view
    config_view = text_config if text_config is not None else MappingProxyType(raw)
    graph = LoopedDense if d.loops is not None else _GRAPHS.get(d.model_type, UniversalDense)
    return graph(args, d, config=config_view, raw_config=raw)


# rows whose forward is a UniversalDense subclass of its own (the row's knobs still drive the
# loader, sanitize, quantization, audit and coverage)
_GRAPHS = {**dict.fromkeys(GEMMA4_MODEL_TYPES, Gemma4Text), **dict.fromkeys(LOOP_GATED_TYPES, LoopGatedDense),
           **dict.fromkeys(NAS_TYPES, NasDense), **dict.fromkeys(TALKIE_TYPES, TalkieDense),
           **dict.fromkeys(DBRX_TYPES, DbrxDense), **dict.fromkeys(BAICHUAN_M1_TYPES, BaichuanM1Dense),
           **dict.fromkeys(PLAMO2_TYPES, Plamo2Dense), **dict.fromkeys(RECURRENT_GEMMA_TYPES, RecurrentGemmaDense),
           **dict.fromkeys(RWKV7_TYPES, Rwkv7Dense), **dict.fromkeys(GEAR_TYPES, GearDense),
           **dict.fromkeys(AFM7_TYPES, Afm7Dense)}


# ----------------------------------------------------------------- loading


def _audit(model: UniversalDense, weights: Mapping[str, Any], dropped: Mapping[str, str],
           source: str, originals: Mapping[str, Any]) -> AuditReport:
    present = dict(weights)
    for name in dropped:
        present.setdefault(name, originals.get(name))
    rules = [DropRule(lambda n, names=frozenset(k for k, r in dropped.items() if r == reason): n in names,
                      reason) for reason in set(dropped.values())]
    audit = WeightAudit(present, rules)
    # Shapes as mlx-lm's strict load checks them; dtypes are the checkpoint's (mlx-lm keeps
    # them), except packed quantized weights, which must be uint32.
    for name, p in tree_flatten(model.parameters()):
        audit.expect(name, p.shape, p.dtype if p.dtype == mx.uint32 else None)
    report = dataclasses.replace(audit.finish(), source=f"weights in {source}")
    wrong_kind = [n for n, p in tree_flatten(model.parameters())
                  if n in weights and mx.issubdtype(p.dtype, mx.floating)
                  and not mx.issubdtype(weights[n].dtype, mx.floating)]
    if not report.ok:
        raise LoadError(report.describe())
    if wrong_kind:
        raise LoadError(f"weights in {source}: non-float tensor(s) for float parameters: "
                        f"{name_list(wrong_kind)}")
    return report


def _prepare(path: Path, config, *, headers_only: bool, descriptor: Optional[ArchDescriptor] = None):
    if config is None:
        config = load_model_config(path)
    raw = thaw(config.raw_full)
    model = build_model(raw, config.model_type, text_config=config, descriptor=descriptor)
    index = read_index(path)
    if headers_only:
        originals = {n: Meta(t.shape, t.mx_dtype) for n, t in index.tensors.items()}
        unloadable = [n for n, t in index.tensors.items() if t.mx_dtype is None]
        if unloadable:
            raise LoadError(f"{path}: tensor(s) with dtypes mlx cannot load: {name_list(unloadable)}")
    else:
        originals = index.load()
    weights, dropped = sanitize_weights(model.descriptor, originals, model.tied, model.args.fields)
    n = model.descriptor.names
    head = f"{n.wrapper}.{n.head}" if n.wrapper else n.head
    if model.descriptor.head.tie is TieRule.CHECKPOINT and f"{head}.weight" not in weights:
        model.tie_to_embedding()
    quantization = resolve_quantization(raw)
    if quantization is not None:
        quantize_model(model, quantization, weights)
    report = _audit(model, weights, dropped, str(path), originals)
    _check_experts_runnable(model, weights, path)
    return model, weights, report


def _check_experts_runnable(model: UniversalDense, weights: Mapping[str, Any], path) -> None:
    """Unquantized experts run through `gather_mm`, which mlx's CPU backend takes in float32
    only: refuse (mlx-lm fails at the first forward) rather than load what cannot run."""
    dtypes = {str(weights[f"{p}.weight"].dtype).removeprefix("mlx.core.")
              for p, m in model.named_modules() if isinstance(m, SwitchLinear)}
    bad = sorted(dt for dt in dtypes if not gather_mm_supported(dt))
    if bad:
        raise UnsupportedModelError(
            f"{path}: unquantized {'/'.join(bad)} experts: mlx {mx.__version__} on "
            f"{mx.default_device()} runs gather_mm in float32 only (mlx-lm cannot run them here "
            f"either); quantize the experts or convert them to float32")


def audit_checkpoint(path, config=None) -> AuditReport:
    """The weight audit from safetensors headers only (no tensor data is read)."""
    _, _, report = _prepare(Path(path), config, headers_only=True)
    return report


def load_universal(path, config=None, *, check_coverage: bool = True,
                   tensor_group=None, descriptor: Optional[ArchDescriptor] = None) -> UniversalDense:
    """Load a checkpoint directory as a UniversalDense (parameters evaluated).

    `config` is an `mlxbun.config.TextConfig` (read from `path` when None).
    With `check_coverage`, a config key that could change numerics and that the
    descriptor does not understand refuses the load (`UnsupportedModelError`).
    `tensor_group`: an `mx.distributed` group to split the graph across (`UniversalDense.shard`)
    before the weights are evaluated, so each rank reads its own part (as mlx-lm's sharded_load).
    `descriptor`: build that row instead of the config's (build_model).
    """
    path = Path(path)
    if config is None:
        config = load_model_config(path)
    if check_coverage:
        require_coverage(config.model_type, thaw(config.raw_full))
    model, weights, report = _prepare(path, config, headers_only=False, descriptor=descriptor)
    model.eval()
    model.load_weights(list(weights.items()), strict=True)
    if tensor_group is not None:
        model.shard(tensor_group)
    mx.eval(model.parameters())
    model.audit = report
    return model
