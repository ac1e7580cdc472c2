"""The whole CUDA translation unit `mx.fast.cuda_kernel` builds from a kernel's body, written out
for an offline compiler: to check a kernel compiles, and read its registers, spills and shared
memory (`nvcc -Xptxas -v`), on a machine without a GPU.

It follows MLX 0.32's `build_kernel` (mlx/backend/cuda/custom_kernel.cpp): the header, then in
`namespace mlx::core::cu` a `__global__` function whose parameters are the inputs (`const T*`) and
outputs (`T*`) in order, the template constants as `constexpr` / `using` lines, then the body.
MLX's own device header (`mlx/backend/cuda/device/utils.cuh`, compiled into MLX) is replaced by the
CUDA headers the kernels use; the shape / stride parameters MLX adds for inputs whose names the
body mentions are not written (mlxbun's kernels use none).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

__all__ = ["ptxas_report", "render"]

_CTYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.uint32: "uint32_t",
           mx.int32: "int32_t"}
PRELUDE = "#include <cstdint>\n#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"


def _ctype(dtype) -> str:
    if dtype not in _CTYPES:
        raise ValueError(f"render: no CUDA type for {dtype} (known: {sorted(map(str, _CTYPES))})")
    return _CTYPES[dtype]


def _constant(name: str, value) -> str:
    if isinstance(value, bool):
        return f"  constexpr bool {name} = {'true' if value else 'false'};\n"
    if isinstance(value, int):
        return f"  constexpr int {name} = {value};\n"
    return f"  using {name} = {_ctype(value)};\n"


def render(name: str, header: str, source: str, inputs: Sequence[tuple[str, object]],
           outputs: Sequence[tuple[str, object]], template: Sequence[tuple[str, object]]) -> str:
    """The translation unit for kernel `name`: `inputs` / `outputs` are (name, dtype) pairs."""
    params = [f"    const {_ctype(d)}* {n}" for n, d in inputs] + [f"    {_ctype(d)}* {n}" for n, d in outputs]
    consts = "".join(_constant(n, v) for n, v in template)
    return (f"{PRELUDE}{header}namespace mlx::core::cu {{\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + consts + "\n" + source
            + "\n}\n\n} // namespace mlx::core::cu\n")


def ptxas_report(unit: str, arch: str = "sm_90", nvcc: Optional[str] = None) -> str:
    """Compile `unit` with nvcc for `arch` and return ptxas's resource lines, each function's
    "N bytes stack frame, N bytes spill stores, N bytes spill loads" among them (raises with the
    compiler's messages when it does not compile; FileNotFoundError without nvcc)."""
    nvcc = nvcc or shutil.which("nvcc")
    if nvcc is None:
        raise FileNotFoundError("nvcc is not on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "unit.cu"
        src.write_text(unit)
        run = subprocess.run([nvcc, f"-arch={arch}", "-std=c++17", "-cubin", "-Xptxas", "-v", "-o",
                              str(Path(tmp) / "unit.cubin"), str(src)], capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"nvcc failed:\n{run.stderr[-4000:]}")
    # the stack and spill line of each function is indented under "Function properties", without
    # the "ptxas" prefix: keep it, or a test for spills reads nothing
    return "\n".join(line for line in run.stderr.splitlines() if "ptxas" in line or "bytes spill" in line)
