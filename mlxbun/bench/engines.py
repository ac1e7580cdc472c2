"""The models a benchmark runs: mlxbun's graph and mlx-lm's, over ONE set of weight arrays.

`load_engines(spec, ...)` resolves a model name (`mlxbun.names`: a directory, a hub repo id,
`zoo:ARCH[@VARIANT]`, or `random:SHAPE`):

- a checkpoint (a directory, a hub snapshot, or a zoo checkpoint): mlxbun opens it (`open_model`: profile,
  coverage, weight audit); mlx-lm loads the same directory lazily (its own loader, strict) and
  then receives mlxbun's arrays, so no tensor is held twice. The names, shapes and dtypes
  mlx-lm's loader expects are checked against mlxbun's before the swap.
- `random:SHAPE`: the config of a real model (bench.shapes) gets seeded random weights once,
  in the requested dtype, quantized with `mlx_lm.utils.quantize_model` when asked; mlxbun's
  `build_model` graph is quantized from those arrays the way its loader does and loads them.

Both engines expose `forward(ids[B, L], cache) -> logits` and `make_cache()`.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.errors import LoadError, MlxbunError
from mlxbun.locate import locate
from mlxbun.names import ENGINES, parse_model

__all__ = ["DTYPES", "ENGINES", "Engine", "ModelUnderTest", "load_engines", "shares_weights"]

DTYPES = ("bfloat16", "float16", "float32")
QUANT_BITS = (4, 8)
GROUP_SIZE = 64  # mlx-lm's default affine group
INIT_STD = 0.02  # the initializer_range of the real configs


@dataclass
class Engine:
    """One implementation of the model under test."""

    name: str
    module: nn.Module
    forward: Callable[[mx.array, list], mx.array]
    make_cache: Callable[[], list]
    # (cache holding a prefix, tokens to come) -> ids [B, 1] -> logits [B, V]; None: forward()
    decode_step: Optional[Callable[[list, int], Callable[[mx.array], mx.array]]] = None


@dataclass
class ModelUnderTest:
    """The engines plus what describes the model (for the table and the results row)."""

    spec: str  # as given: PATH, zoo:ARCH, random:SHAPE
    label: str  # short name for tables
    kind: str  # "checkpoint" | "zoo" | "random"
    model_type: str
    dtype: str  # dtype of the float weights
    quant: Optional[str]  # "affine 4-bit g64" or None
    weights_bytes: int
    n_params: int
    vocab_size: int
    decode_bytes: int  # the weight bytes one decoded token reads (MoE: the routed experts' top-k share)
    config: dict
    engines: dict[str, Engine]
    identity: dict  # model columns for the results table
    path: Optional[Path] = None
    extra: dict = field(default_factory=dict)


# ------------------------------------------------------------------ helpers


def _mlxbun_engine(model) -> Engine:
    model.eval()
    return Engine("mlxbun", model, lambda ids, cache: model(ids, cache), model.make_cache)


def _mlxlm_engine(module: nn.Module) -> Engine:
    from mlx_lm.models.cache import make_prompt_cache

    module.eval()
    return Engine("mlx-lm", module, lambda ids, cache: module(ids, cache=cache),
                  lambda: make_prompt_cache(module))


def shares_weights(a: nn.Module, b: nn.Module) -> bool:
    """Whether two modules hold the very same array objects under the same parameter names."""
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    return pa.keys() == pb.keys() and all(pa[k] is pb[k] for k in pa)


def _quant_label(quantization: Optional[dict]) -> Optional[str]:
    if not quantization:
        return None
    return f"{quantization.get('mode', 'affine')} {quantization.get('bits')}-bit g{quantization.get('group_size')}"


def _float_dtype(params: dict) -> str:
    for name, v in params.items():
        if mx.issubdtype(v.dtype, mx.floating) and not name.endswith((".scales", ".biases")):
            return str(v.dtype).rsplit(".", 1)[-1]
    return "?"


def unread_expert_bytes(model) -> int:
    """Bytes of routed-expert weights that one decoded token does not read: each MoE layer reads
    top_k of its E experts, so (E - top_k) / E of its fused expert tensors stay untouched.
    `model`: an nn.Module, or a runtime model wrapping its graph in `.module`."""
    from mlxbun.models.universal.moe import MoEBlock

    module = model if isinstance(model, nn.Module) else model.module
    unread = 0
    for _, m in module.named_modules():
        if isinstance(m, MoEBlock):
            size = sum(v.nbytes for _, v in tree_flatten(m.fused_experts().parameters()))
            n, k = m.router.n_experts, m.router.top_k
            unread += size * (n - k) // n
    return unread


def _n_params(module: nn.Module) -> int:
    from mlx_lm.utils import get_total_parameters

    return int(get_total_parameters(module))


# ------------------------------------------------------------------ checkpoints


def _split_hint(group) -> str:
    if group is None:
        return ""
    return (f" (split across {group.size()} ranks: mlx-lm's shard() divides KV heads fewer than the ranks, "
            "mlxbun repeats them; benchmark mlxbun alone with --vs none)")


def _shard_mlxlm(module: nn.Module, group, where: str) -> None:
    """mlx-lm's own split of its (lazy) model, as its sharded_load does; refused where its model
    file has no shard() (the benchmark then runs mlxbun alone: --vs none)."""
    if group is None:
        return
    if not hasattr(module, "shard"):
        from mlxbun.models.sharding import ShardingError

        raise ShardingError(f"{where}: mlx-lm's {type(module).__module__} has no shard(), so mlx-lm cannot run "
                            "it split; benchmark mlxbun alone with --vs none")
    module.shard(group)


def _share_into_mlxlm(path: Path, mb_params: dict, group=None) -> nn.Module:
    """mlx-lm's model of `path` (lazily loaded, never evaluated) holding mlxbun's arrays (split
    across `group` first, so both hold the same rank's parts)."""
    from mlxbun.models.mlxlm import load_mlxlm

    wrapped = load_mlxlm(path, lazy=True)
    module = wrapped.module
    _shard_mlxlm(module, group, str(path))
    _check_same_tree(path, dict(tree_flatten(module.parameters())), mb_params, _split_hint(group))
    module.load_weights(list(mb_params.items()), strict=True)
    return module


def _check_same_tree(path, own: dict, mb_params: dict, hint: str = "", dtypes: bool = True) -> None:
    """mlx-lm's parameter names, shapes and dtypes equal mlxbun's (before one takes the other's
    arrays); a split that differs (mlx-lm divides KV heads fewer than the ranks, mlxbun repeats
    them) is named."""
    if own.keys() != mb_params.keys():
        only_lm = sorted(own.keys() - mb_params.keys())[:5]
        only_mb = sorted(mb_params.keys() - own.keys())[:5]
        raise LoadError(f"{path}: mlx-lm and mlxbun build different parameter trees "
                        f"(only mlx-lm: {only_lm}, only mlxbun: {only_mb}); cannot share weights{hint}")
    bad = [k for k in own if own[k].shape != mb_params[k].shape or (dtypes and own[k].dtype != mb_params[k].dtype)]
    if bad:
        k = bad[0]
        raise LoadError(f"{path}: tensor {k!r} is {own[k].dtype}{tuple(own[k].shape)} for mlx-lm but "
                        f"{mb_params[k].dtype}{tuple(mb_params[k].shape)} for mlxbun "
                        f"({len(bad)} differ); cannot share weights{hint}")


def _from_checkpoint(path: Path, spec: str, kind: str, engines: tuple[str, ...],
                     group=None) -> ModelUnderTest:
    from mlxbun.factory import open_model
    from mlxbun.quant import resolve_quantization
    from mlxbun.results.identity import model_identity

    mb = open_model(path, tensor_group=group)
    params = dict(tree_flatten(mb.parameters()))
    built: dict[str, Engine] = {}
    if "mlxbun" in engines:
        built["mlxbun"] = _mlxbun_engine(mb)
    lm_module = None
    if "mlx-lm" in engines:
        lm_module = _share_into_mlxlm(path, params, group)
        built["mlx-lm"] = _mlxlm_engine(lm_module)
    raw = json.loads((path / "config.json").read_text())
    if lm_module is None:
        from mlxbun.models.mlxlm import load_mlxlm

        lm_module = load_mlxlm(path, lazy=True).module  # parameter count only: nothing evaluated
    return ModelUnderTest(
        spec=spec, label=spec if kind == "zoo" else path.name, kind=kind, model_type=mb.model_type,
        dtype=_float_dtype(params), quant=_quant_label(resolve_quantization(raw)),
        weights_bytes=mb.weights_bytes, n_params=_n_params(lm_module), vocab_size=int(mb.config.vocab_size),
        decode_bytes=mb.weights_bytes - unread_expert_bytes(mb),
        config=raw, engines=built, identity=model_identity(path), path=path,
    )


# ------------------------------------------------------------------ random weights


def _random_param(name: str, p: mx.array, dtype, seed: int) -> mx.array:
    """Norm weights 1, biases 0, everything else N(0, 0.02): keyed by (seed, name), not order."""
    if not mx.issubdtype(p.dtype, mx.floating):
        return p
    if p.ndim == 1:
        fill = 0.0 if name.endswith("bias") else 1.0
        return mx.full(p.shape, fill, dtype=dtype)
    digest = hashlib.sha256(f"mlxbun-bench:{seed}:{name}".encode()).digest()
    key = mx.random.key(int.from_bytes(digest[:4], "little"))
    return mx.random.normal(p.shape, dtype=dtype, scale=INIT_STD, key=key)


def _random_fingerprint(cfg: dict, dtype: str, quant: Optional[int], seed: int) -> str:
    blob = json.dumps({"config": cfg, "dtype": dtype, "quant": quant, "seed": seed}, sort_keys=True)
    return "random:" + hashlib.sha256(blob.encode()).hexdigest()[:16]


def _from_random(label: str, cfg: dict, spec: str, dtype: str, quant: Optional[int], seed: int,
                 engines: tuple[str, ...], group=None) -> ModelUnderTest:
    from mlx_lm.utils import _get_classes
    from mlx_lm.utils import quantize_model as lm_quantize_model

    from mlxbun.models.universal.coverage import require_coverage
    from mlxbun.models.universal.loader import build_model
    from mlxbun.quant import quantize_model, resolve_quantization

    require_coverage(cfg["model_type"], cfg)  # refuse a shape mlxbun's graph does not understand
    try:
        model_class, args_class = _get_classes(cfg)
        lm_module = model_class(args_class.from_dict(cfg))
    except (ValueError, TypeError, KeyError) as e:
        raise MlxbunError(f"{spec}: mlx-lm cannot build this config ({type(e).__name__}: {e})") from None
    target = getattr(mx, dtype)
    # One parameter at a time, evaluated at once: the module's own (lazy) init is never materialized.
    values = []
    for name, p in tree_flatten(lm_module.parameters()):
        values.append((name, _random_param(name, p, target, seed)))
        mx.eval(values[-1][1])
    lm_module.update(tree_unflatten(values))
    del values
    qcfg = dict(cfg)
    if quant is not None:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints its bits per weight
            _, qcfg = lm_quantize_model(lm_module, cfg, GROUP_SIZE, quant, mode="affine")
        mx.eval(lm_module.parameters())
    # mlxbun's graph over the same arrays (no copies), also when only mlx-lm runs: it counts the
    # bytes a decoded token reads
    mb = build_model(qcfg)
    quantization = resolve_quantization(qcfg)
    if quantization is not None:  # as the loader: modules whose .scales are present
        quantize_model(mb, quantization, dict(tree_flatten(lm_module.parameters())))
    n_params = _n_params(lm_module)  # the whole model's, before any split
    if group is None:
        params = dict(tree_flatten(lm_module.parameters()))
        mb.load_weights(list(params.items()), strict=True)
    elif "mlx-lm" in engines:  # both split the same way, mlxbun holding mlx-lm's parts
        _shard_mlxlm(lm_module, group, spec)
        mx.eval(lm_module.parameters())
        mb.shard(group)  # its own (lazy) init is replaced before anything evaluates it
        params = dict(tree_flatten(lm_module.parameters()))
        # (shapes only: mlxbun's own init is float32 until it takes mlx-lm's arrays)
        _check_same_tree(spec, params, dict(tree_flatten(mb.parameters())), _split_hint(group), dtypes=False)
        mb.load_weights(list(params.items()), strict=True)
    else:  # mlxbun alone: its split of the random arrays
        mb.load_weights(tree_flatten(lm_module.parameters()), strict=True)
        mb.shard(group)
        mx.eval(mb.parameters())
        params = dict(tree_flatten(mb.parameters()))
    built: dict[str, Engine] = {}
    if "mlxbun" in engines:
        built["mlxbun"] = _mlxbun_engine(mb)
    if "mlx-lm" in engines:
        built["mlx-lm"] = _mlxlm_engine(lm_module)
    quant_label = _quant_label(resolve_quantization(qcfg))
    identity = {"model_path": spec, "model_fingerprint": _random_fingerprint(cfg, dtype, quant, seed),
                "model_type": cfg["model_type"], "model_quant": quant_label}
    return ModelUnderTest(
        spec=spec, label=f"random:{Path(label).stem if label.endswith('.json') else label}", kind="random",
        model_type=cfg["model_type"], dtype=dtype, quant=quant_label,
        weights_bytes=sum(v.nbytes for v in params.values()), n_params=n_params,
        decode_bytes=sum(v.nbytes for v in params.values()) - unread_expert_bytes(mb),
        vocab_size=int(cfg["vocab_size"]), config=qcfg, engines=built, identity=identity,
    )


# ------------------------------------------------------------------ entry point


def load_engines(spec: str, *, dtype: Optional[str] = None, quant: Optional[int] = None, seed: int = 0,
                 engines: tuple[str, ...] = ENGINES, scale_down: Optional[int] = None,
                 zoo_root: Any = None, tensor_group: Any = None) -> ModelUnderTest:
    """Resolve a model name (a directory, a hub repo id, `zoo:ARCH[@VARIANT]`, `random:SHAPE`)
    into the engines named in `engines`; `tensor_group` splits them across its ranks (mlxbun
    by its `shard`, mlx-lm by its file's own shard(), holding mlxbun's parts)."""
    if dtype is not None and dtype not in DTYPES:
        raise MlxbunError(f"dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if quant is not None and quant not in QUANT_BITS:
        raise MlxbunError(f"quant {quant!r}: choose 4 or 8 (affine, group size {GROUP_SIZE})")
    unknown = [e for e in engines if e not in ENGINES]
    if unknown or not engines:
        raise MlxbunError(f"engines {list(engines)}: choose from {', '.join(ENGINES)}")
    model = parse_model(spec)
    if scale_down is not None and model.kind != "random":
        raise MlxbunError("scale-down applies to random:SHAPE models only")
    if model.kind == "random":
        from mlxbun.bench.shapes import load_shape
        from mlxbun.bench.shapes import scale_down as shrink

        label, cfg = load_shape(model.value)
        if scale_down is not None and scale_down != 1:
            cfg = shrink(cfg, scale_down)
            label = f"{label}/{scale_down}"
        return _from_random(label, cfg, spec, dtype or "bfloat16", quant, seed, tuple(engines), tensor_group)
    if model.kind == "zoo":
        from mlxbun.zoo import cached_checkpoint

        if model.variant is not None and (dtype is not None or quant is not None):
            raise MlxbunError(f"{spec}: the name gives the zoo variant; drop --dtype/--quant (or the @{model.variant})")
        options = dict(model.zoo_options)  # what the name says (variant, seed, head_dim)
        if model.variant is None:
            options.update(dtype=dtype or "float32", quant=quant)
        path = cached_checkpoint(model.value, root=zoo_root, **options)
        return _from_checkpoint(path, spec, "zoo", tuple(engines), tensor_group)
    path = locate(model)
    if dtype is not None or quant is not None:
        raise MlxbunError(f"{spec}: a checkpoint runs in its own dtype and quantization; "
                          "--dtype/--quant apply to zoo: and random: models")
    return _from_checkpoint(path, str(path), "checkpoint", tuple(engines), tensor_group)
