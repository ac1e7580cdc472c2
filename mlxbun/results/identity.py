"""Who measured what, where: the identity columns every results row carries.

`environment()` describes the code (git revision of the mlxbun checkout, else
the package version; mlx / mlx-lm versions), the backend and device, and the
machine. The slow, process-constant parts (git, CPU name, RAM) are computed
once per process; the device is read on every call because a notebook may
switch `mx.set_default_device` between runs.

`model_identity(model)` describes a model: a RuntimeModel, a checkpoint
directory, a dict of the fields, or None.
"""

from __future__ import annotations

import functools
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any, Mapping

__all__ = ["ENV_COLUMNS", "MODEL_COLUMNS", "environment", "model_identity"]

ENV_COLUMNS = (
    "revision", "mlxbun_version", "mlx_version", "mlx_lm_version", "backend", "device", "device_name",
    "platform", "cpu", "cpu_count", "ram_bytes",
)
MODEL_COLUMNS = ("model_path", "model_fingerprint", "model_type", "model_quant")


def _package_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def _revision() -> str:
    """`git:<sha>[+dirty]` of the checkout mlxbun is imported from, else `mlxbun-<version>`."""
    import mlxbun

    root = Path(mlxbun.__file__).resolve().parent.parent
    # Only a checkout of mlxbun itself: an install inside some other repository must not report that repo.
    if (root / ".git").exists() and (root / "pyproject.toml").is_file():
        sha = _git(root, "rev-parse", "HEAD")
        if sha:
            dirty = _git(root, "status", "--porcelain", "--untracked-files=no")
            return f"git:{sha}" + ("+dirty" if dirty else "")
    return f"mlxbun-{mlxbun.__version__}"


def _cpu_name() -> str:
    system = platform.system()
    if system == "Linux":
        try:
            for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
        except OSError:
            pass
    elif system == "Darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int | None:
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        pass
    try:
        import psutil  # optional: Windows and odd platforms

        return int(psutil.virtual_memory().total)
    except Exception:  # noqa: BLE001 - no RAM figure is not worth failing a measurement
        return None


@functools.lru_cache(maxsize=1)
def _static() -> dict[str, Any]:
    import mlxbun

    return {
        "revision": _revision(),
        "mlxbun_version": mlxbun.__version__,
        "mlx_version": _package_version("mlx"),
        "mlx_lm_version": _package_version("mlx-lm"),
        "platform": platform.platform(),
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "ram_bytes": _ram_bytes(),
    }


def _device() -> dict[str, Any]:
    import mlx.core as mx

    dev = mx.default_device()
    kind = str(dev.type).rsplit(".", 1)[-1]  # DeviceType.gpu -> "gpu"
    backend = kind
    if kind == "gpu":
        if mx.metal.is_available():
            backend = "metal"
        elif getattr(mx, "cuda", None) is not None and mx.cuda.is_available():
            backend = "cuda"
    name = None
    if hasattr(mx, "device_info"):
        try:
            name = mx.device_info(dev).get("device_name")
        except Exception:  # noqa: BLE001 - older mlx or a backend without the query
            name = None
    # Device exposes only `type`; the index lives in its repr, "Device(gpu, 0)".
    m = re.fullmatch(r"Device\((\w+),\s*(\d+)\)", str(dev))
    return {"backend": backend, "device": f"{kind}:{m.group(2)}" if m else str(dev), "device_name": name}


def environment() -> dict[str, Any]:
    """The code, backend/device and machine identity (one dict with the ENV_COLUMNS keys)."""
    env = {**_static(), **_device()}
    return {k: env.get(k) for k in ENV_COLUMNS}


# ---------------------------------------------------------------- models


def _quant_label(q: Any, mixed: bool = False) -> str | None:
    """"affine 4-bit g64" from a QuantSpec or a config's `quantization` dict."""
    if q is None or q is False:
        return None
    if isinstance(q, Mapping):
        bits, group, mode = q.get("bits"), q.get("group_size"), q.get("mode", "affine")
        mixed = mixed or any(isinstance(v, Mapping) or v is False for v in q.values())
    else:
        bits, group, mode = getattr(q, "bits", None), getattr(q, "group_size", None), getattr(q, "mode", "affine")
    if bits is None:
        return None
    return f"{mode} {bits}-bit g{group}" + (" (mixed)" if mixed else "")


def _from_config(config: Any) -> tuple[str | None, str | None]:
    """(model_type, quant label) from a TextConfig or a raw config dict."""
    if config is None:
        return None, None
    if isinstance(config, Mapping):
        q = config.get("quantization", config.get("quantization_config"))
        return config.get("model_type"), _quant_label(q)
    return getattr(config, "model_type", None), _quant_label(
        getattr(config, "quantization", None), mixed=bool(getattr(config, "quant_overrides", None)))


def _fingerprint(path: str | None) -> str | None:
    if path is None:
        return None
    from mlxbun.snapshot_identity import artifact_fingerprint

    try:
        return artifact_fingerprint(path)
    except OSError:
        return None


def _from_path(path: Path) -> dict[str, Any]:
    import json

    model_type = quant = None
    try:
        from mlxbun.config import load_model_config

        model_type, quant = _from_config(load_model_config(path))
    except Exception:  # noqa: BLE001 - an arch mlxbun cannot normalize still has a raw config.json
        try:
            model_type, quant = _from_config(json.loads((path / "config.json").read_text()))
        except (OSError, ValueError):
            pass
    return {"model_path": str(path), "model_fingerprint": _fingerprint(str(path)), "model_type": model_type,
            "model_quant": quant}


def _is_module(x: Any) -> bool:
    import mlx.nn as nn

    return isinstance(x, nn.Module)


def model_identity(model: Any) -> dict[str, Any]:
    """The MODEL_COLUMNS of a RuntimeModel, a checkpoint path, a dict of those fields, or None."""
    empty = dict.fromkeys(MODEL_COLUMNS)
    if model is None:
        return empty
    if isinstance(model, (str, os.PathLike)):
        return _from_path(Path(model).expanduser().absolute())
    # mlx.nn.Module subclasses dict: a graph is a model, not a mapping of identity fields
    if isinstance(model, Mapping) and not _is_module(model):
        from mlxbun.errors import MlxbunError

        unknown = sorted(set(model) - set(MODEL_COLUMNS) - {"path", "fingerprint", "type", "quant"})
        if unknown:
            raise MlxbunError(f"model identity: unknown key(s) {unknown}; use {list(MODEL_COLUMNS)}")
        out = dict(empty)
        for k, v in model.items():
            out[k if k.startswith("model_") else f"model_{k}"] = None if v is None else str(v)
        if out["model_path"] and not out["model_fingerprint"]:
            out["model_fingerprint"] = _fingerprint(out["model_path"])
        return out
    # A RuntimeModel (mlxbun graph or the mlx-lm adapter): path, config and model_type attributes.
    path = getattr(model, "path", None) or getattr(getattr(model, "config", None), "path", None)
    config = getattr(model, "config", None)
    if isinstance(config, Mapping) and not config and getattr(model, "mlx_config", None):
        config = model.mlx_config
    model_type, quant = _from_config(config)
    try:
        model_type = getattr(model, "model_type", None) or model_type
    except Exception:  # noqa: BLE001 - a model_type property that cannot answer
        pass
    return {
        "model_path": None if path is None else str(path),
        "model_fingerprint": _fingerprint(None if path is None else str(path)),
        "model_type": None if model_type in (None, "None") else str(model_type),
        "model_quant": quant,
    }
