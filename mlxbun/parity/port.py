"""`mlxbun port`: bring a checkpoint up on the universal graph and prove it bit-exact.

Steps per target, each reported: descriptor coverage (config keys), weight audit
dry run from safetensors headers, oracle run (mlx-lm, live, same process), the
gate (greedy trajectory + every step's raw logits bit-exact, batch-2 forward),
verdict, and the golden manifest entry.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxbun.errors import MlxbunError

VARIANT_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "4": "q4", "8": "q8"}
ZOO_VARIANTS = {
    "float32": dict(dtype="float32"),
    "float16": dict(dtype="float16"),
    "bfloat16": dict(dtype="bfloat16"),
    "q4": dict(quant=4),
    "q8": dict(quant=8),
    "mixed": dict(quant="mixed"),  # 4-bit with per-module 8-bit overrides
}


@dataclass
class PortResult:
    target: str
    path: str | None
    model_type: str | None = None
    dtype: str | None = None  # "float32" ... or "q4"/"q8"/"mixed" for quantized
    coverage: str = "-"  # "ok (N keys)" or the offending key
    audit: str = "-"
    trajectory: str = "-"  # "equal" / "diverges at step N"
    max_abs_diff: float | None = None
    first_divergence: dict | None = None
    verdict: str = "refused"  # "pass" | "fail" | "refused"
    reason: str | None = None
    manifest: str | None = None
    steps: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Target:
    label: str  # what the user typed (+ variant for zoo targets)
    path: Path
    variant: str | None = None


def resolve_targets(specs, *, variants=("float32",), zoo_root=None, cache_dir=None) -> list[Target]:
    """Expand `zoo:ARCH` / `zoo:all`, hub repo ids and directories into checkpoint dirs."""
    from mlxbun import zoo

    out: list[Target] = []
    for spec in specs:
        if spec.startswith("zoo:"):
            name = spec[4:]
            archs = zoo.ARCHS if name == "all" else (name,)
            for arch in archs:
                for variant in variants:
                    variant = VARIANT_ALIASES.get(variant, variant)
                    if variant not in ZOO_VARIANTS:
                        raise MlxbunError(f"unknown zoo variant '{variant}' (choose from {', '.join(ZOO_VARIANTS)})")
                    path = zoo.cached_checkpoint(arch, root=zoo_root, **ZOO_VARIANTS[variant])
                    out.append(Target(f"zoo:{arch}", path, variant))
        elif Path(spec).is_dir():
            out.append(Target(spec, Path(spec)))
        elif re.fullmatch(r"[\w.-]+/[\w.-]+", spec):
            out.append(Target(spec, _hub_snapshot(spec, cache_dir)))
        else:
            raise MlxbunError(f"target '{spec}' is not a directory, a repo id in the hub cache, or zoo:ARCH")
    return out


def _hub_snapshot(repo_id: str, cache_dir=None) -> Path:
    from huggingface_hub import scan_cache_dir

    from mlxbun.inventory import default_cache_dir

    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if not cache.is_dir():
        raise MlxbunError(f"repo '{repo_id}' not found: hub cache {cache} does not exist (mlxbun never downloads)")
    for repo in scan_cache_dir(cache).repos:
        if repo.repo_id == repo_id and repo.repo_type == "model":
            revs = sorted(repo.revisions, key=lambda r: ("main" not in r.refs, -r.last_modified))
            if revs:
                return revs[0].snapshot_path
    raise MlxbunError(f"repo '{repo_id}' not found in hub cache {cache} (mlxbun never downloads)")


def _dtype_label(config) -> str:
    q = config.quantization
    if q is None:
        return str(config.dtype or "float32").replace("torch.", "")
    return "mixed" if config.quant_overrides else f"q{q.bits}"


def port_one(target: Target, *, decode_steps: int = 16, prompt_len: int = 40, goldens_dir=None) -> PortResult:
    """Run every step for one checkpoint; never raises for a bad checkpoint."""
    from mlxbun.config import load_model_config
    from mlxbun.factory import audit_dry_run, check_target_coverage, open_model
    from mlxbun.models.mlxlm import load_mlxlm
    from mlxbun.parity.gate import gate
    from mlxbun.parity.oracle import varied_prompt_ids

    res = PortResult(target=target.label, path=str(target.path), dtype=target.variant)
    try:
        config = load_model_config(target.path)
        res.model_type, res.dtype = config.model_type, target.variant or _dtype_label(config)
        report = check_target_coverage(config, target.path)  # profile + config keys; raises on refusal
        res.coverage = f"ok ({len(report.understood)} keys)"
        res.steps.append(f"coverage: {res.coverage}")
        audit = audit_dry_run(target.path, config)
        res.audit = f"clean ({len(audit.consumed)} tensors" + (f", {len(audit.dropped)} dropped)" if audit.dropped else ")")
        res.steps.append(f"audit: {res.audit}")
    except MlxbunError as e:
        res.verdict, res.reason = "refused", str(e)
        res.steps.append(f"refused: {e}")
        return res
    try:
        oracle = load_mlxlm(target.path)
        res.steps.append("oracle: mlx-lm loaded")
        candidate = open_model(target.path)
        prompt, oracle_run = varied_prompt_ids(oracle, config.vocab_size, length=prompt_len, decode_steps=decode_steps)
        result = gate(candidate, oracle, prompt, decode_steps=decode_steps, oracle_trajectory=oracle_run)
    except MlxbunError as e:
        res.verdict, res.reason = "fail", str(e)
        res.steps.append(f"fail: {e}")
        return res
    res.max_abs_diff = result.max_abs_diff
    res.trajectory = "equal" if result.trajectory_equal else f"diverges at step {result.first_mismatch_step}"
    res.first_divergence = asdict(result.first_divergence) if result.first_divergence else None
    res.verdict = result.verdict
    res.reason = result.reason
    res.steps.append(f"gate: {result.verdict} (max |diff| {result.max_abs_diff})")
    if goldens_dir is not None:
        res.manifest = str(_write_golden(goldens_dir, target, config, result))
    return res


def golden_prefix(target: Target, config) -> str:
    base = target.label[4:] if target.label.startswith("zoo:") else Path(target.label).name
    base = re.sub(r"[^\w.-]+", "-", base).strip("-")
    return f"{'zoo-' if target.label.startswith('zoo:') else ''}{base}-{target.variant or _dtype_label(config)}"


def _write_golden(goldens_dir, target: Target, config, result) -> Path:
    from mlxbun.parity.manifest import write_manifest

    path = Path(goldens_dir) / f"{golden_prefix(target, config)}-parity.json"
    label = f"{target.label}/{target.variant}" if target.label.startswith("zoo:") else None
    write_manifest(path, target=target.label, checkpoint=target.path, config=config, result=result,
                   checkpoint_label=label)
    return path
