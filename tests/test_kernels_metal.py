"""The TurboQuant decode kernel's Metal variant on the CPU (it has never run: no Apple GPU is
reachable from this project's machines, so `METAL_TURBOQUANT_CHECKED` keeps it off): its gaps, its
launch plan, the calls it makes to `mx.fast.metal_kernel`, and its source compiled as C++ against a
stand-in of the Metal types and builtins (syntax and types, not Metal's semantics)."""

from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import pytest

import mlxbun.kernels.sdpa_decode as sdpa_mod
from mlxbun.kernels.sdpa_decode import decode_gap, plan, shared_bytes, turboquant_decode_gap
from mlxbun.kernels.sdpa_decode_metal import (METAL_COMBINE, METAL_HEADER, METAL_PARTIAL_TURBOQUANT,
                                              METAL_SHARED_LIMIT)


def _q(B=1, H=8, D=64, dtype=mx.float16):
    return mx.zeros((B, H, 1, D), dtype)


@pytest.fixture
def on_metal(monkeypatch):
    """The kernels' gaps and launches as on an Apple GPU."""
    monkeypatch.setattr(sdpa_mod, "cuda_available", lambda: False)
    monkeypatch.setattr(sdpa_mod, "metal_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)


def test_the_metal_variant_stays_off_until_an_apple_gpu_has_checked_it(on_metal, monkeypatch):
    assert sdpa_mod.METAL_TURBOQUANT_CHECKED is False
    gap = turboquant_decode_gap(_q(), (1, 2, 256), 64, 64, 3, 4)
    assert gap is not None and "never run on an Apple GPU" in gap.reason and not gap.by_design
    monkeypatch.setattr(sdpa_mod, "METAL_TURBOQUANT_CHECKED", True)
    assert turboquant_decode_gap(_q(), (1, 2, 256), 64, 64, 3, 4) is None
    # a shape whose threadgroup memory passes CUDA's 40 KiB but not Metal's 32 KiB
    big = turboquant_decode_gap(_q(H=8, D=256), (1, 1, 4096), 256, 256, 8, 8)
    assert big is not None and "threadgroup memory" in big.reason


def test_on_metal_the_16_bit_and_affine_kernels_leave_attention_to_mlx(on_metal):
    gap = decode_gap(_q(), (1, 2, 256, 64), mx.float16, values_shape=(1, 2, 256, 64))
    assert gap is not None and "a Metal device" in gap.reason


@pytest.mark.parametrize("B,H,KV,D,cap,bits", [(1, 16, 4, 128, 16640, (3, 4)), (2, 8, 8, 64, 768, (4, 3)),
                                                (1, 8, 1, 32, 300, (1, 8))])
def test_the_metal_plan_is_the_cuda_grid_within_metals_threadgroup_memory(B, H, KV, D, cap, bits):
    partial, combine = plan((B, H, 1, D), mx.float32, KV, cap, 1.0, turboquant=bits, backend="metal")
    t = dict(partial.template)
    assert partial.backend == combine.backend == "metal"
    assert partial.grid == (t["SPLITS"] * 32 * t["NWARPS"], B * KV, 1)
    assert partial.threadgroup == (32 * t["NWARPS"], 1, 1)
    assert t["SPLITS"] * t["CHUNK"] >= cap and (t["SPLITS"] - 1) * t["CHUNK"] < cap
    assert (t["KBITS"], t["VBITS"], t["G"]) == (*bits, H // KV)
    assert shared_bytes(t["CHUNK"], t["G"], D, book_floats=(1 << bits[0]) + (1 << bits[1])) <= METAL_SHARED_LIMIT
    assert [n for n, _ in partial.inputs] == ["q", "k_norms", "k_codes", "k_book", "v_norms", "v_codes", "v_book",
                                              "length"]
    assert combine.outputs[0][2] == (B, H, 1, D) and dict(combine.template)["SPLITS"] == t["SPLITS"]
    with pytest.raises(ValueError, match="TurboQuant"):
        plan((B, H, 1, D), mx.float16, KV, cap, 1.0, backend="metal")


def test_the_static_path_launches_the_metal_variant_through_mlxs_metal_kernel(on_metal, monkeypatch):
    """With the flag on, `turboquant_decode_attention` builds its two launches with
    `mx.fast.metal_kernel` and hands them the arrays in the signature's order (the kernels stood in
    for: nothing here can run Metal)."""
    from mlxbun.cache.turboquant_codec import TurboQuantCodec

    built, launched = {}, []

    def fake_metal_kernel(name, input_names, output_names, source, header, ensure_row_contiguous):
        built[name] = (input_names, output_names, source, header)

        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launched.append((name, [a.shape for a in inputs], dict(template), grid, threadgroup))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]
        return launch

    monkeypatch.setattr(sdpa_mod, "METAL_TURBOQUANT_CHECKED", True)
    monkeypatch.setattr(sdpa_mod, "_kernels", {})
    monkeypatch.setattr(mx.fast, "metal_kernel", fake_metal_kernel)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **k: pytest.fail("a CUDA kernel built on Metal"))
    kc, vc = TurboQuantCodec(64, 3, 0), TurboQuantCodec(64, 4, 1)
    x = mx.random.normal((1, 2, 40, 64))
    keys, values = kc.quantize(x), vc.quantize(x)
    out = sdpa_mod.turboquant_decode_attention(mx.zeros((1, 8, 1, 64)), keys, values, kc.codebook, vc.codebook,
                                               mx.array([33], dtype=mx.int32))
    assert out.shape == (1, 8, 1, 64) and out.dtype == mx.float32
    assert set(built) == {"mlxbun_sdpa_decode_tq_metal", "mlxbun_sdpa_decode_combine_metal"}
    assert built["mlxbun_sdpa_decode_tq_metal"][2:] == (METAL_PARTIAL_TURBOQUANT, METAL_HEADER)
    assert built["mlxbun_sdpa_decode_combine_metal"][2] == METAL_COMBINE
    (name, shapes, t, grid, _), (cname, _, ct, cgrid, cblock) = launched
    assert name == "mlxbun_sdpa_decode_tq_metal" and cname == "mlxbun_sdpa_decode_combine_metal"
    assert shapes[1:4] == [keys.norms.shape, keys.indices.shape, (8,)] and shapes[-1] == (1,)
    assert (t["KBITS"], t["VBITS"], t["G"], t["KV"], t["H"]) == (3, 4, 4, 2, 8)
    assert cgrid == (8 * 64, 1, 1) and cblock == (64, 1, 1) and ct["SPLITS"] == t["SPLITS"]


# ------------------------------------------------------------------ the source, as C++

_STAND_IN = r"""
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <algorithm>
#define device
#define threadgroup
#define thread
using ulong = unsigned long;
using ushort = unsigned short;
using uint = unsigned int;
struct half { float v; operator float() const { return v; } };
struct uint3 { uint x, y, z; };
template <class T> T as_type(int v) { T t; std::memcpy(&t, &v, sizeof t); return t; }
template <class T> T simd_shuffle_xor(T v, ushort) { return v; }
enum class mem_flags { mem_none, mem_threadgroup };
inline void threadgroup_barrier(mem_flags) {}
using std::exp2;
using std::fmax;
using std::min;
"""


def _unit(widths, dim, group, splits=12, chunk=64) -> str:
    """A translation unit laid out as MLX's `metal_kernel` lays one out: the header, then each kernel's
    inputs as `const device T*`, outputs as `device T*`, the thread attributes it names, and its template
    constants (written as constexpr lines here)."""
    consts = dict(D=dim, G=group, KV=2, H=2 * group, CAP=splits * chunk, CHUNK=chunk, NWARPS=4, SPLITS=splits,
                  KBITS=widths[0], VBITS=widths[1], SCALE_BITS=1065353216)
    lines = "".join(f"  constexpr int {k} = {v};\n" for k, v in consts.items())
    attrs = ("uint3 threadgroup_position_in_grid, uint3 thread_position_in_threadgroup, "
             "uint thread_index_in_simdgroup, uint simdgroup_index_in_threadgroup")
    partial = ("void partial(const device float* q, const device half* k_norms, const device uint32_t* k_codes, "
               "const device float* k_book, const device half* v_norms, const device uint32_t* v_codes, "
               "const device float* v_book, const device int32_t* length, device float* o_part, device float* ml, "
               f"{attrs}) {{\n{lines}{METAL_PARTIAL_TURBOQUANT}\n}}\n")
    combine = ("void combine(const device float* o_part, const device float* ml, const device int32_t* length, "
               f"device float* out, {attrs}) {{\n{lines}{METAL_COMBINE}\n}}\n")
    return _STAND_IN + METAL_HEADER + partial + combine


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
@pytest.mark.parametrize("widths,dim,group", [((3, 4), 128, 4), ((1, 8), 32, 1), ((5, 2), 256, 2), ((4, 4), 64, 8),
                                              ((8, 6), 128, 8), ((2, 7), 64, 3)])
def test_the_metal_source_compiles_as_cpp_against_a_stand_in(tmp_path, widths, dim, group):
    src = tmp_path / "unit.cpp"
    src.write_text(_unit(widths, dim, group))
    run = subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-Werror=return-type", str(src)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
