"""Golden parity manifests (`goldens/<prefix>-parity.json`) and their logit blobs.

A manifest is tracked: it holds ids only (explicit prompt ids, the oracle's
greedy ids), the checkpoint's identity (model_type, dtype/quant, target and
path, HF snapshot fingerprint, sha256 of config.json's canonical JSON) and the
environment that produced it (mlx / mlx-lm versions, backend, device). Raw
logits are machine-specific: `save_logit_blobs` writes them as safetensors
under an untracked directory (goldens/blobs/), see goldens/README.md.

`read_manifest` validates every field; a malformed file raises
`ManifestError` naming the file and the field.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import json
import math
import os
import platform
import re
import tempfile
import uuid
from dataclasses import asdict, dataclass, is_dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

import mlx.core as mx

from mlxbun.errors import MlxbunError

__all__ = [
    "SCHEMA",
    "ManifestError",
    "ParityManifest",
    "config_fingerprint",
    "environment",
    "load_logit_blobs",
    "read_manifest",
    "save_logit_blobs",
    "write_manifest",
]

SCHEMA = "mlxbun-parity/1"


class ManifestError(MlxbunError):
    """A parity manifest or logit blob file is missing, malformed, or lacks a field."""


@dataclass(frozen=True)
class ParityManifest:
    path: Path | None
    model_type: str
    dtype: str  # weights: "float32" / "bfloat16" / ... or "q4" / "q8" / "mixed"
    target: str | None  # what was ported ("zoo:llama", a repo id, a directory)
    checkpoint: str | None
    artifact_fingerprint: str | None  # "hf:<org>/<repo>@<rev>" for an immutable hub snapshot
    config_fingerprint: str  # "sha256:<hex>" of config.json's canonical JSON
    prompt_ids: list  # flat for one prompt, nested for a batch
    greedy_ids: list  # the oracle's, same nesting
    decode_steps: int
    logits_dtype: str | None
    environment: Mapping[str, Any]  # mlx, mlx_lm, mlxbun, backend, device, platform
    created: str  # ISO 8601, UTC
    gate: Mapping[str, Any] | None = None  # verdict, max_abs_diff, ... when written from a gate run


# ------------------------------------------------------------------ identity helpers


def canonical_json(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def config_fingerprint(config_or_path: Any) -> str:
    """sha256 of the canonical JSON of config.json (a file, a checkpoint dir, a TextConfig or a dict)."""
    obj: Any
    if isinstance(config_or_path, (str, os.PathLike)):
        p = Path(config_or_path)
        file = p / "config.json" if p.is_dir() else p
        try:
            obj = json.loads(file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ManifestError(f"{file}: missing (needed for the config fingerprint)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ManifestError(f"{file}: not valid JSON ({e})") from None
    elif isinstance(config_or_path, Mapping):
        obj = config_or_path
    elif getattr(config_or_path, "path", None) is not None and (Path(config_or_path.path) / "config.json").is_file():
        return config_fingerprint(Path(config_or_path.path))
    elif hasattr(config_or_path, "raw_full"):
        obj = config_or_path.raw_full
    else:
        raise ManifestError(f"cannot fingerprint a config of type {type(config_or_path).__name__}")
    return "sha256:" + hashlib.sha256(canonical_json(obj).encode("utf-8")).hexdigest()


def environment() -> dict[str, Any]:
    """Versions, backend and device of this process (what makes a logit blob machine-specific)."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(dist: str) -> str | None:
        try:
            return version(dist)
        except PackageNotFoundError:
            return None

    dev = mx.default_device()
    backend = "cpu"
    if dev.type == mx.gpu:
        backend = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "gpu"
    try:
        device = mx.device_info().get("device_name")
    except Exception:  # device_info is best-effort metadata; absence must not block a manifest
        device = None
    return {
        "mlx": mx.__version__,
        "mlx_lm": ver("mlx-lm") or ver("mlx_lm"),
        "mlxbun": ver("mlxbun"),
        "backend": backend,
        "device": device,
        "platform": f"{platform.system()}-{platform.machine()}",
    }


def _dtype_label(config: Any) -> str:
    if config is None:
        return "unknown"
    if hasattr(config, "quantization"):
        q = config.quantization
        if q is not None:
            return "mixed" if config.quant_overrides else f"q{q.bits}"
        return str(config.dtype or "float32").replace("torch.", "")
    raw = dict(config)
    q = raw.get("quantization")
    if isinstance(q, Mapping) and "bits" in q:
        return f"q{q['bits']}"
    return str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")


def _model_type(config: Any) -> str | None:
    if config is None:
        return None
    mt = getattr(config, "model_type", None)
    if mt is None and isinstance(config, Mapping):
        mt = config.get("model_type")
    return mt


def _jsonable(v: Any) -> Any:
    if is_dataclass(v):
        return _jsonable(asdict(v))
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return None if math.isnan(v) else ("inf" if v > 0 else "-inf")
    if isinstance(v, Path):
        return str(v)
    return v


# ------------------------------------------------------------------ write / read


def _same_but_created(path: Path, doc: dict) -> bool:
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(old, dict) and {**old, "created": None} == {**doc, "created": None}


def write_manifest(path: str | os.PathLike, *, config: Any = None, checkpoint: Any = None, target: str | None = None,
                   result: Any = None, trajectory: Any = None, model_type: str | None = None,
                   dtype: str | None = None, prompt_ids: list | None = None, greedy_ids: list | None = None,
                   decode_steps: int | None = None, logits_dtype: str | None = None,
                   created: str | None = None, checkpoint_label: str | None = None) -> ParityManifest:
    """Write `path` (a `<prefix>-parity.json`) and return what was written.

    The ids come from, in order: explicit arguments, a `GateResult` (`result`:
    the oracle's ids, plus the gate's verdict), or a `Trajectory`. The config
    (TextConfig or dict) gives model_type and dtype/quant unless given; the
    config fingerprint comes from `checkpoint`/config.json when present.
    `checkpoint_label` replaces the (machine-specific) checkpoint path in the
    identity, e.g. `zoo:llama/q4` for a zoo build.
    """
    from mlxbun.snapshot_identity import artifact_fingerprint

    path = Path(path)
    src = result if result is not None else trajectory
    prompt_ids = prompt_ids if prompt_ids is not None else getattr(src, "prompt_ids", None)
    greedy_ids = greedy_ids if greedy_ids is not None else getattr(src, "greedy_ids", None)
    decode_steps = decode_steps if decode_steps is not None else getattr(src, "decode_steps", None)
    logits_dtype = logits_dtype or getattr(result, "logits_dtype", None) or getattr(trajectory, "dtype", None)
    if prompt_ids is None or greedy_ids is None or decode_steps is None:
        raise ManifestError(f"{path}: write_manifest needs prompt_ids, greedy_ids and decode_steps "
                            "(pass a GateResult, a Trajectory, or the ids)")
    if checkpoint is None and getattr(config, "path", None) is not None:
        checkpoint = config.path
    fp_source = checkpoint if checkpoint is not None and (Path(checkpoint) / "config.json").is_file() else config
    if fp_source is None:
        raise ManifestError(f"{path}: write_manifest needs the checkpoint directory or its config for the fingerprint")
    gate = None
    if result is not None and hasattr(result, "verdict"):
        gate = {
            "verdict": result.verdict,
            "trajectory_equal": result.trajectory_equal,
            "first_mismatch_step": result.first_mismatch_step,
            "max_abs_diff": result.max_abs_diff,
            "batch2_equal": result.batch2_equal,
            "first_divergence": result.first_divergence,
        }
    doc = {
        "schema": SCHEMA,
        "identity": {
            "model_type": model_type or _model_type(config),
            "dtype": dtype or _dtype_label(config),
            "target": target,
            "checkpoint": checkpoint_label or (None if checkpoint is None else str(checkpoint)),
            "artifact_fingerprint": None if checkpoint is None else artifact_fingerprint(checkpoint),
            "config_fingerprint": config_fingerprint(fp_source),
        },
        "trajectory": {
            "prompt_ids": prompt_ids,
            "greedy_ids": greedy_ids,
            "decode_steps": decode_steps,
            "logits_dtype": logits_dtype,
        },
        "environment": environment(),
        "created": created or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if gate is not None:
        doc["gate"] = gate
    doc = _jsonable(doc)
    manifest = _validate(doc, path)  # never write what read_manifest would refuse
    if _same_but_created(path, doc):
        return read_manifest(path)  # a re-run that reproduced the golden leaves the tracked file alone
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name, suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~_umask())  # what open() would give (mkstemp makes 0600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(_dumps(doc))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return manifest


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _dumps(doc: Mapping) -> str:
    """Indented JSON with flat lists of ints kept on one line (ids stay readable in diffs)."""
    nonce = uuid.uuid4().hex
    flat: list[str] = []

    def swap(v: Any) -> Any:
        if isinstance(v, dict):
            return {k: swap(x) for k, x in v.items()}
        if isinstance(v, list):
            if v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
                flat.append(json.dumps(v))
                return f"@{nonce}:{len(flat) - 1}@"
            return [swap(x) for x in v]
        return v

    text = json.dumps(swap(doc), indent=2, ensure_ascii=False)
    return re.sub(f'"@{nonce}:(\\d+)@"', lambda m: flat[int(m.group(1))], text) + "\n"


def read_manifest(path: str | os.PathLike) -> ParityManifest:
    """Read and validate a `<prefix>-parity.json`; ManifestError names the file and the field."""
    path = Path(path)
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManifestError(f"{path}: no such manifest") from None
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text ({e})") from None
    except json.JSONDecodeError as e:
        raise ManifestError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    return _validate(doc, path)


def _is_ids(v: Any) -> bool:
    def flat(x):
        return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)
    return flat(v) or (isinstance(v, list) and bool(v) and all(flat(r) and r for r in v))


def _validate(doc: Any, path: Path) -> ParityManifest:
    def fail(field: str, what: str) -> ManifestError:
        return ManifestError(f"{path}: field '{field}': {what}")

    if not isinstance(doc, dict):
        raise fail("<root>", f"expected a JSON object, got {type(doc).__name__}")

    def get(section: str | None, key: str, check: Callable[[Any], bool], what: str, optional: bool = False):
        holder = doc if section is None else doc.get(section)
        name = key if section is None else f"{section}.{key}"
        if section is not None and not isinstance(holder, dict):
            raise fail(section, "missing" if holder is None else f"expected an object, got {type(holder).__name__}")
        if key not in holder:
            if optional:
                return None
            raise fail(name, "missing")
        value = holder[key]
        if optional and value is None:
            return None
        if not check(value):
            raise fail(name, f"expected {what}, got {json.dumps(value)[:80]}")
        return value

    def is_str(v):
        return isinstance(v, str) and bool(v)

    schema = get(None, "schema", is_str, "a string")
    if schema != SCHEMA:
        raise fail("schema", f"unsupported schema '{schema}' (this mlxbun reads '{SCHEMA}')")
    prompt = get("trajectory", "prompt_ids", lambda v: _is_ids(v) and bool(v), "a non-empty list of token ids")
    greedy = get("trajectory", "greedy_ids", _is_ids, "a list of token ids")
    steps = get("trajectory", "decode_steps", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                "a non-negative integer")
    batched = bool(prompt) and isinstance(prompt[0], list)
    if batched != (bool(greedy) and isinstance(greedy[0], list)):
        raise fail("trajectory.greedy_ids", "nesting differs from trajectory.prompt_ids (flat vs per-row)")
    rows = greedy if batched else [greedy]
    if batched and len(greedy) != len(prompt):
        raise fail("trajectory.greedy_ids", f"{len(greedy)} rows for {len(prompt)} prompt rows")
    if any(len(r) != steps + 1 for r in rows):
        raise fail("trajectory.greedy_ids", f"expected decode_steps + 1 = {steps + 1} ids per row, "
                   f"got {[len(r) for r in rows]}")
    created = get(None, "created", is_str, "an ISO 8601 timestamp")
    try:
        _dt.datetime.fromisoformat(created)
    except ValueError:
        raise fail("created", f"not an ISO 8601 timestamp: '{created}'") from None
    fp = get("identity", "config_fingerprint", lambda v: isinstance(v, str) and re.fullmatch(r"sha256:[0-9a-f]{64}", v),
             "'sha256:' + 64 hex digits")
    env = get(None, "environment", lambda v: isinstance(v, dict), "an object")
    for key in ("mlx", "mlx_lm", "backend"):
        get("environment", key, is_str, "a string")
    gate = get(None, "gate", lambda v: isinstance(v, dict), "an object", optional=True)
    if gate is not None:
        get("gate", "verdict", lambda v: v in ("pass", "fail"), "'pass' or 'fail'")
    return ParityManifest(
        path=path,
        model_type=get("identity", "model_type", is_str, "a string"),
        dtype=get("identity", "dtype", is_str, "a string"),
        target=get("identity", "target", is_str, "a string", optional=True),
        checkpoint=get("identity", "checkpoint", is_str, "a string", optional=True),
        artifact_fingerprint=get("identity", "artifact_fingerprint", is_str, "a string", optional=True),
        config_fingerprint=fp,
        prompt_ids=prompt,
        greedy_ids=greedy,
        decode_steps=steps,
        logits_dtype=get("trajectory", "logits_dtype", is_str, "a string", optional=True),
        environment=env,
        created=created,
        gate=gate,
    )


# ------------------------------------------------------------------ logit blobs (untracked)


def save_logit_blobs(directory: str | os.PathLike, trajectory: Any, prefix: str = "trajectory") -> Path:
    """Write a trajectory's raw logits to `<directory>/<prefix>-logits.safetensors` (+ its ids as metadata)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / f"{prefix}-logits.safetensors"
    arrays = {"prefill": trajectory.prefill_logits}
    arrays.update({f"step_{i:04d}": a for i, a in enumerate(trajectory.step_logits)})
    meta = {
        "format": SCHEMA + "/logits",
        "prompt_ids": json.dumps(trajectory.prompt_ids),
        "greedy_ids": json.dumps(trajectory.greedy_ids),
        "decode_steps": str(trajectory.decode_steps),
        "dtype": trajectory.dtype,
        "batched": json.dumps(bool(trajectory.batched)),
        "environment": json.dumps(environment()),
    }
    mx.save_safetensors(str(file), arrays, metadata=meta)
    return file


def load_logit_blobs(path: str | os.PathLike, prefix: str | None = None):
    """Read what `save_logit_blobs` wrote back into a `Trajectory` (a file, or a directory + prefix)."""
    from mlxbun.parity.oracle import Trajectory

    file = Path(path)
    if prefix is not None:
        file = file / f"{prefix}-logits.safetensors"
    if not file.is_file():
        raise ManifestError(f"{file}: no such logit blob file")
    try:
        arrays, meta = mx.load(str(file), return_metadata=True)
    except Exception as e:  # mlx raises RuntimeError/ValueError subclasses for a corrupt file
        raise ManifestError(f"{file}: unreadable safetensors ({e})") from None
    if meta.get("format") != SCHEMA + "/logits":
        raise ManifestError(f"{file}: metadata 'format' is {meta.get('format')!r}, expected '{SCHEMA}/logits'")
    try:
        steps = int(meta["decode_steps"])
        prompt_ids, greedy_ids = json.loads(meta["prompt_ids"]), json.loads(meta["greedy_ids"])
        batched, dtype = json.loads(meta["batched"]), meta["dtype"]
    except KeyError as e:
        raise ManifestError(f"{file}: metadata field {e.args[0]!r} missing") from None
    except (ValueError, TypeError) as e:
        raise ManifestError(f"{file}: malformed metadata ({e})") from None
    missing = [k for k in ["prefill"] + [f"step_{i:04d}" for i in range(steps + 1)] if k not in arrays]
    if missing:
        raise ManifestError(f"{file}: tensor(s) {missing} missing")
    return Trajectory(
        prompt_ids=prompt_ids,
        greedy_ids=greedy_ids,
        step_logits=[arrays[f"step_{i:04d}"] for i in range(steps + 1)],
        prefill_logits=arrays["prefill"],
        dtype=dtype,
        decode_steps=steps,
        batched=batched,
    )
