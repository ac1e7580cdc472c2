"""`render.ptxas_report`, which the kernels' compile-without-spills tests read."""

import re
import shutil

import pytest

from mlxbun.kernels.render import ptxas_report

# 48 live floats under a 32-register cap (1024 threads, 2 blocks an SM): ptxas must spill
SPILLS = """
__global__ void __launch_bounds__(1024, 2) spills(const float* x, float* o, int n) {
  float a[48];
#pragma unroll
  for (int i = 0; i < 48; i++) a[i] = x[threadIdx.x + i * n];
  float s = 0;
#pragma unroll
  for (int j = 0; j < 48; j++)
#pragma unroll
    for (int i = 0; i < 48; i++) s = fmaf(a[i], a[(i + j) % 48], s);
  o[threadIdx.x] = s;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_the_report_holds_the_spill_line_the_tests_read():
    """The spill counts are on an indented line of their own (no "ptxas" prefix): the report keeps
    it, so `[1-9]\\d* bytes spill` finds a kernel that spills."""
    report = ptxas_report(SPILLS)
    assert "Used 32 registers" in report, report
    assert re.search(r"[1-9]\d* bytes spill stores", report), report
    clean = ptxas_report(SPILLS.replace("__launch_bounds__(1024, 2) ", "").replace("48", "4"))
    assert "0 bytes spill stores, 0 bytes spill loads" in clean and not re.search(r"[1-9]\d* bytes spill", clean)
