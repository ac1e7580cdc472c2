"""benchmarks/gpu_profile.py (run on the H200: benchmarks/gpu-h200-fast.md section 8) also runs on
the CPU: its timing split and its cache-write section, so the script cannot rot between device
sessions, and the write ops it compares must write the same values."""

import runpy
from pathlib import Path

import mlx.core as mx

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_profile.py"


def _profile():
    return runpy.run_path(str(SCRIPT), run_name="gpu_profile")


def test_the_split_accounts_for_the_step():
    prof = _profile()
    calls = []

    def step():
        calls.append(1)
        return mx.ones((64, 64)) @ mx.ones((64, 64))

    row = prof["split"](step, n=4, warm=1, pipelined=3)
    assert len(calls) == 1 + 4 + 3
    assert set(row) == {"build_us", "encode_us", "total_us", "gpu_after_us", "pipelined_us"}
    assert all(v >= 0 for v in row.values())
    assert row["total_us"] >= row["build_us"] and row["total_us"] >= row["encode_us"]


def test_the_write_variants_write_the_same_values():
    variants = _profile()["_write_variants"](64, 3)
    assert len(variants) == 4  # dynamic, static, scatter, dynamic compiled
    results = [step() for step in variants.values()]
    first = results[0]
    assert all(len(r) == 3 for r in results)
    assert all(mx.array_equal(a, b) for r in results[1:] for a, b in zip(first, r))
    # buffer 0 starts at zeros: the row of ones lands at capacity // 2 and nowhere else
    assert mx.array_equal(first[0][:, :, 32], mx.ones((1, 4, 128), mx.float16))
    assert mx.array_equal(first[0][:, :, 31], mx.zeros((1, 4, 128), mx.float16))
    assert mx.sum(first[0]).item() == 4 * 128


def test_the_writes_section_runs(tmp_path):
    assert _profile()["main"](["--smoke", "--sections", "writes", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "gpu_profile.md").read_text()
    assert md.count("| 4 x ") == 8 and "capacity 1024" in md
