"""benchmarks/gpu_fused.py (run on the device: benchmarks/gpu-fused.md) also runs on the CPU, with the
MLX-op reference standing in for the CUDA kernels, so the script cannot rot between device sessions:
its check and its bench write their tables, and a check that fails says so."""

import json
import runpy
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_fused.py"


@pytest.fixture
def gpu_fused(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    module = runpy.run_path(str(SCRIPT), run_name="gpu_fused")
    yield module
    sys.modules.pop("gpu_profile", None)


def test_the_script_checks_and_benches_on_shrunken_shapes(gpu_fused, tmp_path):
    assert gpu_fused["main"](["--smoke", "--out", str(tmp_path), "--sections", "check", "bench",
                              "--specs", "llama-3.2-1b@4"]) == 0
    md = (tmp_path / "gpu_fused.md").read_text()
    assert "every check passed" in md and "failed" not in md
    rows = json.loads((tmp_path / "gpu_fused.json").read_text())
    assert {"fused (in place)", "mlx-lm", "mlxbun compiled step"} <= {r["what"].split(": ")[-1] for r in rows}
    fused = next(r for r in rows if r["what"].endswith("fused (in place)"))
    assert fused["kernels"] > 0 and fused["tok_s"] > 0


def test_a_kernel_outside_its_bound_fails_the_check(gpu_fused, monkeypatch):
    monkeypatch.setitem(gpu_fused["section_check"].__globals__, "CHECK_BOUND", -1.0)
    text = gpu_fused["section_check"](smoke=True)
    assert "SOME CHECKS FAILED" in text
