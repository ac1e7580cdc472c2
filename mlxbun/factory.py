"""open_model(path): resolve the profile first, then (and only then) open weights.

The profile decides the graph; a checkpoint the profile does not fit refuses
before any tensor is read. Graph builders are looked up by the profile's
`execution.graph`, so a new family adds one row to GRAPH_BUILDERS.
"""

from __future__ import annotations

from pathlib import Path

from mlxbun.config_reader import thaw
from mlxbun.errors import MlxbunError, UnsupportedModelError


def _checkpoint_dir(path) -> Path:
    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf" and not p.is_dir():  # a GGUF file: imported once, then the import
        from mlxbun.gguf.importer import cached_import

        return cached_import(p)
    if not p.exists():
        raise MlxbunError(f"{p}: no such checkpoint directory")
    if not p.is_dir():
        raise MlxbunError(f"{p}: not a directory (a checkpoint is a directory holding config.json)")
    return p


def _universal_coverage(config):
    from mlxbun.models.universal.coverage import require_coverage

    return require_coverage(config.model_type, thaw(config.raw_full))  # as the loader checks it


def _gemma3n_coverage(config):
    from mlxbun.models.gemma3n.config import require_coverage

    return require_coverage(thaw(config.raw_full))


def _universal_audit(path, config):
    from mlxbun.models.universal.loader import audit_checkpoint

    return audit_checkpoint(path, config)


def _gemma3n_audit(path, config):
    from mlxbun.models.gemma3n.loader import audit_gemma3n

    return audit_gemma3n(path, config)


# The graphs `port` gates against mlx-lm (L1): (config-key coverage, header-only weight audit).
GATED_GRAPHS = {
    "universal-dense": (_universal_coverage, _universal_audit),
    "gemma3n": (_gemma3n_coverage, _gemma3n_audit),
}


def _gated(config, path=None):
    from mlxbun.profile import resolve_model_profile, validate_profile

    profile = validate_profile(resolve_model_profile(config, path))
    if profile.execution.graph not in GATED_GRAPHS:
        raise UnsupportedModelError(
            f"profile '{profile.id}' ({profile.fidelity}) is a dedicated graph held to {profile.fidelity.oracle}, "
            "not one that `port` gates against mlx-lm; its parity lives in its own test suite")
    return GATED_GRAPHS[profile.execution.graph]


def check_target_coverage(config, path=None):
    """Resolve + validate the profile and check the config keys; raises on refusal."""
    coverage, _ = _gated(config, path)
    return coverage(config)


def audit_dry_run(path, config, *, check_values: bool = False):
    """The weight audit from safetensors headers only: no tensor data is read, so NaN/inf
    weights go unseen. `check_values` also reads every floating tensor's values: one holding
    NaN or inf fails the audit (a LoadError naming it)."""
    _, audit = _gated(config, path)
    report = audit(path, config)
    if check_values:
        from mlxbun.weight_audit import check_values as scan_values
        from mlxbun.weights import read_index

        report = scan_values(report, read_index(path))
    return report


def _open_universal(path: Path, config, profile, tensor_group=None):
    from mlxbun.models.universal.coverage import require_coverage
    from mlxbun.models.universal.loader import load_universal

    require_coverage(config.model_type, thaw(config.raw_full))
    return load_universal(path, config=config, tensor_group=tensor_group)


def _open_diffusion_gemma(path: Path, config, profile):
    from mlxbun.models.diffusion_gemma.loader import load_diffusion_gemma

    return load_diffusion_gemma(path)


def _open_gemma3n(path: Path, config, profile, tensor_group=None):
    from mlxbun.models.gemma3n.loader import load_gemma3n

    return load_gemma3n(path, config, tensor_group=tensor_group)


def _open_llada2(path: Path, config, profile):
    from mlxbun.models.llada2 import load_llada2

    return load_llada2(path)


GRAPH_BUILDERS = {
    "universal-dense": _open_universal,
    "diffusion-gemma": _open_diffusion_gemma,
    "llada2": _open_llada2,
    "gemma3n": _open_gemma3n,
}


# the graphs that split across a tensor-parallel group (their builder takes `tensor_group`)
SHARDABLE_GRAPHS = frozenset({"universal-dense", "gemma3n"})


def open_model(path, *, tensor_group=None):
    """Open a checkpoint directory (or a .gguf file, imported into the GGUF cache on first open)
    as a RuntimeModel (with `.profile` set). `tensor_group`: an `mx.distributed` group of more
    than one rank splits the graph across it (tensor parallelism); a graph that cannot split is
    refused by name."""
    from mlxbun.config import load_model_config
    from mlxbun.profile import resolve_model_profile, validate_profile

    path = _checkpoint_dir(path)
    config = load_model_config(path)
    profile = validate_profile(resolve_model_profile(config, path))
    builder = GRAPH_BUILDERS.get(profile.execution.graph)
    if builder is None:
        raise UnsupportedModelError(f"profile '{profile.id}': graph '{profile.execution.graph}' has no builder")
    if tensor_group is not None and tensor_group.size() > 1:
        if profile.execution.graph not in SHARDABLE_GRAPHS:
            from mlxbun.models.sharding import ShardingError

            raise ShardingError(f"{path}: the {profile.execution.graph} graph ({config.model_type}) has no "
                                f"tensor-parallel split; run it in one process (--tp 1)")
        model = builder(path, config, profile, tensor_group=tensor_group)
    else:
        model = builder(path, config, profile)
    model.profile = profile
    return model
