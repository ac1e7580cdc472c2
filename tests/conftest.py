"""Shared test fixtures. Tests never touch the network: hub and transformers run offline."""

import os

# before anything imports huggingface_hub / transformers (they read these at import)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def zoo_root(tmp_path_factory) -> Path:
    """Where zoo checkpoints are built: $MLXBUN_ZOO_CACHE, else a directory every
    pytest-xdist worker of this run shares (the parent of the workers' basetemps)."""
    env = os.environ.get("MLXBUN_ZOO_CACHE")
    if env:
        return Path(env)
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    return shared / "zoo"


@pytest.fixture(scope="session")
def zoo(zoo_root):
    """`zoo(arch, quant=None, dtype="float32", seed=0) -> Path`: a cached tiny checkpoint."""
    from mlxbun.zoo import cached_checkpoint

    def get(arch: str, quant=None, dtype: str = "float32", seed: int = 0) -> Path:
        return cached_checkpoint(arch, quant=quant, dtype=dtype, seed=seed, root=zoo_root)

    return get
