"""`mlxbun port`: bring a checkpoint up on mlxbun's graph and prove it bit-exact.

The graph is the universal one or a dedicated port held to mlx-lm (`factory.GATED_GRAPHS`:
gemma3n). Steps per target, each reported: config-key coverage, weight audit
dry run from safetensors headers (plus every tensor's values with `check_values`),
oracle run (mlx-lm, live, same process), the gate (greedy trajectory + every step's
raw logits bit-exact, batch-2 forward), verdict, and the golden manifest entry.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mlxbun.config_reader import json_safe
from mlxbun.errors import MlxbunError
from mlxbun.gguf.importer import MARKER as IMPORT_MARKER
from mlxbun.locate import locate
from mlxbun.names import ModelSpec, parse_model


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
    note: str | None = None  # what the verdict does not say (e.g. about an imported GGUF)
    steps: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """A JSON-safe dict: a |diff| that is not finite (NaN logits) is None."""
        return json_safe(asdict(self))


@dataclass(frozen=True)
class Target:
    label: str  # what the user typed (+ variant for zoo targets)
    path: Path
    variant: str | None = None


def resolve_targets(specs, *, variants=("float32",), zoo_root=None, cache_dir=None) -> list[Target]:
    """Expand model names (`mlxbun.names`: `zoo:ARCH` / `zoo:all` per variant, hub repo ids,
    directories) into checkpoint dirs. A zoo name's own `@VARIANT` wins over `variants`;
    `variants=None` means each arch's variants this device can run (`zoo.archs.runnable_variants`:
    unquantized half-precision experts are left out where mlx's gather_mm takes float32 only)."""
    from mlxbun import zoo
    from mlxbun.zoo.archs import runnable_variants

    out: list[Target] = []
    for text in specs:
        spec = parse_model(text)
        if spec.kind != "zoo":
            out.append(Target(str(text), locate(spec, cache_dir=cache_dir)))
            continue
        archs = zoo.ARCHS if spec.value == "all" else (spec.value,)
        for arch in archs:
            chosen = variants if variants is not None else runnable_variants(arch)
            for variant in ((spec.variant,) if spec.variant else chosen):
                one = ModelSpec("zoo", arch, seed=spec.seed, head_dim=spec.head_dim).with_options(variant=variant)
                out.append(Target(f"zoo:{arch}", locate(one, zoo_root=zoo_root), one.variant))
    return out


def _dtype_label(config) -> str:
    q = config.quantization
    if q is None:
        return str(config.dtype or "float32").replace("torch.", "")
    return "mixed" if config.quant_overrides else f"q{q.bits}"


def port_one(target: Target, *, decode_steps: int = 16, prompt_len: int = 40, goldens_dir=None,
             check_values: bool = False) -> PortResult:
    """Run every step for one checkpoint; never raises for a bad checkpoint. The audit reads
    headers only unless `check_values` (then a NaN/inf tensor refuses the target, by name)."""
    from mlxbun.config import load_model_config
    from mlxbun.factory import audit_dry_run, check_target_coverage, open_model
    from mlxbun.models.mlxlm import load_mlxlm
    from mlxbun.parity.gate import gate
    from mlxbun.parity.oracle import varied_prompt_ids

    res = PortResult(target=target.label, path=str(target.path), dtype=target.variant, note=_import_note(target.path))
    try:
        config = load_model_config(target.path)
        res.model_type, res.dtype = config.model_type, target.variant or _dtype_label(config)
        report = check_target_coverage(config, target.path)  # profile + config keys; raises on refusal
        res.coverage = f"ok ({len(report.understood)} keys)"
        res.steps.append(f"coverage: {res.coverage}")
        audit = audit_dry_run(target.path, config, check_values=check_values)
        notes = [f"{len(audit.consumed)} tensors"]
        notes += [f"{len(audit.dropped)} dropped"] if audit.dropped else []
        notes += ["values finite"] if audit.values_checked else []
        res.audit = f"clean ({', '.join(notes)})"
        res.steps.append(f"audit ({'headers and values' if check_values else 'headers only'}): {res.audit}")
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


def _import_note(path: Path) -> str | None:
    """An imported GGUF passes the gate whether or not the import is right: say so."""
    marker = Path(path) / IMPORT_MARKER
    if not marker.is_file():
        return None
    try:
        source = json.loads(marker.read_text()).get("source", "a GGUF file")
    except (OSError, ValueError):
        source = "a GGUF file"
    return (f"an import of {source}: the gate compares mlxbun with mlx-lm on this same directory, so a "
            "wrong import passes it too; the import is held to llama.cpp's own outputs by the real-model "
            "goldens (tests/test_real_models.py)")


def checkout_goldens(cwd=None) -> Path | None:
    """`cwd/goldens` when `cwd` (default: the working directory) is the mlxbun checkout: its
    pyproject.toml names the project mlxbun and goldens/README.md is there. Else None."""
    root = Path("." if cwd is None else cwd)
    try:
        pyproject = (root / "pyproject.toml").read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    named = re.search(r'^name\s*=\s*"mlxbun"\s*$', pyproject, re.M)
    return root / "goldens" if named and (root / "goldens" / "README.md").is_file() else None


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
