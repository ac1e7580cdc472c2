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
    assert gpu_fused["main"](["--smoke", "--out", str(tmp_path), "--sections", "check", "bench", "profile",
                              "--specs", "llama-3.2-1b@4", "--knobs", "rows4:RW=4,QKV_RW=2"]) == 0
    assert "(rows4)" in (tmp_path / "gpu_fused.md").read_text().split("## bench")[0]  # checked too
    md = (tmp_path / "gpu_fused.md").read_text()
    assert "every check passed" in md and "failed" not in md
    rows = json.loads((tmp_path / "gpu_fused.json").read_text())
    assert {"fused (in place)", "mlx-lm", "mlxbun compiled step"} <= {r["what"].split(": ")[-1] for r in rows}
    fused = next(r for r in rows if r["what"].endswith("fused (in place)"))
    assert fused["kernels"] > 0 and fused["tok_s"] > 0
    assert any(r["what"].endswith("fused (rows4)") for r in rows)  # the --knobs variant
    assert "Not run: it times the CUDA kernels" in md  # the profile section needs the device


def test_knobs_name_fused_decode_settings_and_bad_ones_are_refused(gpu_fused):
    parse = gpu_fused["parse_knobs"]
    assert parse(["a:RW=4,QKV_RW=1", "b:MAX_SPLIT=1"]) == [("a", {"RW": 4, "QKV_RW": 1}), ("b", {"MAX_SPLIT": 1})]
    assert all(hasattr(m, a) for m, a, _ in (gpu_fused["_module_value"](k, 32) for k in gpu_fused["KNOBS"]))
    from mlxbun.kernels import sdpa_decode
    assert gpu_fused["_module_value"]("ATTN_MIN_CHUNK", 32) == (sdpa_decode, "CHUNKS", (32, 64, 128, 256, 512))
    for bad in ("RW=4", "a:", "a:BOGUS=1", "a:RW=x"):
        with pytest.raises(SystemExit, match="--knobs"):
            parse([bad])


def test_a_kernel_outside_its_bound_fails_the_check(gpu_fused, monkeypatch):
    monkeypatch.setitem(gpu_fused["section_check"].__globals__, "CHECK_BOUND", -1.0)
    text = gpu_fused["section_check"](smoke=True)
    assert "SOME CHECKS FAILED" in text


def test_emulate_runs_the_check_with_the_cuda_kernels_emulated_and_nothing_else(gpu_fused, tmp_path, monkeypatch,
                                                                                capsys):
    """--emulate: the check's ops are the CUDA kernels (not the MLX-op reference), made by the
    emulator; bench / profile / torch time the device and are refused with it, as is a machine the
    emulator cannot run on."""
    import mlx.core as mx

    from mlxbun.kernels.emulator import EmulatedKernel
    from mlxbun.kernels.fused_decode import CudaFusedOps

    seen = {}

    def fake_check(smoke, knobs=()):  # the real check, emulated, is tests/test_kernels_emulated.py's
        ops = gpu_fused["_ops"](True)
        seen.update(ops=type(ops), kernel=mx.fast.cuda_kernel, smoke=smoke)
        return "## check\n"

    monkeypatch.setitem(gpu_fused["_run"].__globals__, "section_check", fake_check)
    assert gpu_fused["main"](["--smoke", "--emulate", "--sections", "check", "--out", str(tmp_path)]) == 0
    assert seen == {"ops": CudaFusedOps, "kernel": EmulatedKernel, "smoke": True}
    assert mx.fast.cuda_kernel is not EmulatedKernel and not gpu_fused["_run"].__globals__["EMULATE"]  # restored
    with pytest.raises(SystemExit):
        gpu_fused["main"](["--emulate", "--sections", "check", "bench"])
    seen.clear()
    monkeypatch.setitem(gpu_fused["main"].__globals__, "emulator_gap", lambda: "g++ is not on PATH")
    with pytest.raises(SystemExit):
        gpu_fused["main"](["--emulate", "--sections", "check"])
    assert "--emulate: g++ is not on PATH" in capsys.readouterr().err and not seen  # refused before the check
