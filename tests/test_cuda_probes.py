"""The two run-to-run probes benchmarks/gpu-h200-hybrid.md quotes from the H200 also run here: on
CPU every run reproduces itself and mlxbun equals mlx-lm, so the probes must say so (and would
say otherwise when a side differs)."""

import runpy
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _probe(name: str):
    return runpy.run_path(str(BENCH / "cuda_hybrid_probe.py"), run_name="probe")[name]


def test_hybrid_probe_reports_reproducible_and_equal_on_cpu(zoo_root):
    lines = _probe("probe")("zoo:lfm2@q4", zoo_root)
    assert len(lines) == 6
    runs = [ln for ln in lines if ": run-to-run" in ln]
    cross = [ln for ln in lines if "mlxbun vs mlx-lm" in ln]
    assert len(runs) == 4 and all(ln.endswith("run-to-run bit-equal [True, True], max |diff| 0") for ln in runs)
    assert len(cross) == 2 and all(ln.endswith("bit-equal True, max |diff| 0") for ln in cross)


def test_module_probe_reports_every_module_reproducible_on_cpu(zoo_root):
    lines = _probe("probe_modules")("zoo:lfm2@q4", zoo_root)
    assert lines[0].endswith(" module runs checked, 0 not reproducible") and not lines[0].startswith("zoo:lfm2@q4: 0 ")
    assert lines[1:] == [f"zoo:lfm2@q4: {e} vs itself, tapped prefill + 4 decode steps: bit-equal"
                         for e in ("mlx-lm", "mlxbun")]
