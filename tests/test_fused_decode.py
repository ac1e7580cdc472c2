"""The fused decode step on the CPU: which models and caches it takes (and the reason it names for
the rest), its plumbing run by the MLX-op reference executor against the exact path, its kernel
accounting, the CUDA sources compiled with nvcc where it is installed, and the fallback a fast run
takes. The CUDA kernels themselves run on the H200 (`benchmarks/gpu_fused.py`)."""

from __future__ import annotations

import re
import shutil

import mlx.core as mx
import numpy as np
import pytest

from mlxbun.factory import open_model
from mlxbun.fast import CompiledDecoder, CompileGap, enable_fast
from mlxbun.fast.decoders import fast_decoder
from mlxbun.fast.fused_decoder import FusedDecoder
from mlxbun.fast.fused_plan import FusedGap, fused_plan
from mlxbun.fast.kernel_count import step_kernels
from mlxbun.generate import stream_generate
from mlxbun.kernels import fused_decode as fd
from mlxbun.kernels import fused_decode_source as fd_source
from mlxbun.kernels.common import float_bits
from mlxbun.kernels.fused_decode import ReferenceFusedOps, Weights, kernel_signature, weights_gap
from mlxbun.kernels.render import ptxas_report, render
from mlxbun.models.mlxlm import load_mlxlm
from mlxbun.tokenizer import load_tokenizer
from tests.decode_steps import PROMPT, decode_both

# ------------------------------------------------------------------ what the plan takes


@pytest.mark.parametrize("arch,quant,dtype,head_dim", [
    ("llama", None, "bfloat16", 64), ("llama", 4, "bfloat16", 64), ("llama", 8, "float16", 64),
    ("qwen3", None, "bfloat16", 64), ("qwen3", 4, "bfloat16", 64), ("qwen2", 4, "bfloat16", None),
    ("mistral", None, "bfloat16", None)])
def test_the_reference_executor_decodes_what_the_exact_path_does(zoo, arch, quant, dtype, head_dim):
    # The fused step's plumbing (which weights, RoPE frequencies, q/k norms, biases, the static
    # buffers and their positions) run by the kernels' MLX-op twin: greedy tokens as the exact
    # path's, logits within the half-precision rounding of another summation order.
    model = open_model(zoo(arch, quant=quant, dtype=dtype, head_dim=head_dim))
    exact, static, dec, pairs = decode_both(model)
    for e, f in pairs:
        assert mx.argmax(e).item() == mx.argmax(f).item()
        assert mx.abs(e.astype(mx.float32) - f.astype(mx.float32)).max().item() < 0.1
    dec.write_back()
    assert static[0].offset == exact[0].offset == len(PROMPT) + 6
    assert static[0].keys.shape == exact[0].keys[..., :exact[0].offset, :].shape
    y = mx.array([[11]])
    a, b = model(y, cache=exact), model(y, cache=static)  # the state came back and decodes on
    assert mx.argmax(a).item() == mx.argmax(b).item()


def test_a_broken_plan_is_seen_by_the_reference(zoo):
    # The comparison above can fail: the plan with another layer's output projection drifts.
    model = open_model(zoo("llama", dtype="bfloat16", head_dim=64))
    plan = fused_plan(model)
    from dataclasses import replace
    broken = replace(plan, layers=(replace(plan.layers[0], o=plan.layers[1].o), *plan.layers[1:]))
    ids = mx.array([list(PROMPT)])
    exact, static = model.make_cache(), model.make_cache()
    model(ids, cache=exact)
    model(ids, cache=static)
    dec = FusedDecoder(model, broken, static, 4, ReferenceFusedOps())
    e, f = model(mx.array([[7]]), cache=exact)[:, -1, :], dec(mx.array([[7]]))
    assert mx.abs(e.astype(mx.float32) - f.astype(mx.float32)).max().item() > 0.1


@pytest.mark.parametrize("arch,options,reason", [
    ("llama", {"dtype": "float32"}, "float32 activations"),
    ("gemma3_text", {"dtype": "bfloat16"}, "sandwich block"),
    ("qwen3_moe", {"dtype": "bfloat16", "quant": 4}, "MoE row"),
    ("falcon_h1", {"dtype": "bfloat16"}, "hybrid row"),
    ("phi3", {"dtype": "bfloat16"}, "q/k/v projections"),
    ("cohere", {"dtype": "bfloat16"}, "block"),
])
def test_the_plan_names_the_knob_it_lacks(zoo, arch, options, reason):
    model = open_model(zoo(arch, **options))
    with pytest.raises(FusedGap, match=reason):
        fused_plan(model)


def test_the_plan_refuses_mlx_lm_models_and_what_the_kernels_cannot_read(zoo):
    path = zoo("llama", dtype="bfloat16", head_dim=64)
    with pytest.raises(FusedGap, match="UniversalDense"):
        fused_plan(load_mlxlm(path))
    w = mx.zeros((64, 64), mx.bfloat16)
    q = Weights(*mx.quantize(w, group_size=64, bits=4), bits=4, group_size=64)
    assert "two formats" in weights_gap("gate/up", [Weights.dense(w), q], 64, mx.bfloat16).reason
    assert "float16 weights" in weights_gap("o", [Weights.dense(w.astype(mx.float16))], 64, mx.bfloat16).reason
    assert "input width 64, expected 128" in weights_gap("o", [Weights.dense(w)], 128, mx.bfloat16).reason
    q3 = Weights(*mx.quantize(w, group_size=64, bits=3), bits=3, group_size=64)
    assert "3-bit" in weights_gap("o", [q3], 64, mx.bfloat16).reason
    assert weights_gap("o", [q, q], 64, mx.bfloat16) is None


def test_the_decoder_refuses_caches_and_shapes_it_cannot_hold(zoo):
    model = open_model(zoo("llama", dtype="bfloat16", head_dim=64))
    plan = fused_plan(model)
    ids = mx.array([list(PROMPT)])
    quantized = model.make_cache()
    model(ids, cache=quantized)
    quantized = [c.to_quantized(group_size=32, bits=4) for c in quantized]
    with pytest.raises(FusedGap, match="one plain KVCache per layer"):
        FusedDecoder(model, plan, quantized, 4, ReferenceFusedOps())
    with pytest.raises(FusedGap, match="nothing prefilled"):
        FusedDecoder(model, plan, model.make_cache(), 4, ReferenceFusedOps())
    batch = model.make_cache()
    model(mx.array([list(PROMPT), list(PROMPT)]), cache=batch)
    with pytest.raises(FusedGap, match="batch 2"):
        FusedDecoder(model, plan, batch, 4, ReferenceFusedOps())
    cache = model.make_cache()
    model(ids, cache=cache)
    dec = FusedDecoder(model, plan, cache, 1, ReferenceFusedOps())
    assert cache[0].keys is None  # the exact cache let go of its buffer: the decoder holds the tokens
    with pytest.raises(FusedGap, match="one token of batch 1"):
        dec(mx.array([[1, 2]]))
    for _ in range(dec.capacity - len(PROMPT)):
        dec(mx.array([[1]]))
    with pytest.raises(CompileGap, match="static cache is full"):  # a FusedGap is a CompileGap
        dec(mx.array([[1]]))


def test_the_decoders_buffers_are_its_own(zoo):
    # The in-place K/V write is safe only for buffers no other array can see: the decoder's are new
    # arrays (the prefix copied in), never the exact cache's, and those are let go.
    model = open_model(zoo("llama", dtype="bfloat16", head_dim=64))
    cache = model.make_cache()
    model(mx.array([list(PROMPT)]), cache=cache)
    before = [(c.keys, c.values) for c in cache]
    dec = FusedDecoder(model, fused_plan(model), cache, 4, ReferenceFusedOps())
    for buffer, (k, v) in zip(dec.buffers, before):
        assert buffer is not k and buffer is not v and buffer.shape == (2, k.shape[1], dec.capacity, k.shape[3])
        assert mx.array_equal(buffer[0:1, :, :len(PROMPT)], k[..., :len(PROMPT), :])
    assert all(c.keys is None and c.values is None for c in cache)


def test_every_descriptor_knob_is_placed_by_what_the_fused_step_does_with_it():
    from mlxbun.fast import fused_knobs as fk
    paths = list(fk.knob_paths())
    placed = [fk.AT_DEFAULT, fk.READ, fk.NOT_MATH]
    assert len(paths) == len(set(paths)) > 60
    assert not set(paths) - set().union(*placed), "a knob the fused step has not placed: fused_knobs.py"
    assert not set().union(*placed) - set(paths), "fused_knobs.py places a knob the schema lacks"
    assert sum(len(p) for p in placed) == len(set().union(*placed))  # each in one set only


def test_a_row_setting_a_knob_the_kernels_do_not_do_is_refused_by_name(zoo):
    from dataclasses import replace

    from mlxbun.fast.fused_knobs import knob_gap
    from mlxbun.models.universal.table import DESCRIPTORS
    llama = DESCRIPTORS["llama"]
    assert knob_gap(llama) is None and knob_gap(DESCRIPTORS["qwen3"]) is None
    assert "head.bias" in knob_gap(replace(llama, head=replace(llama.head, bias=True)))
    assert "v_head_dim" in knob_gap(replace(llama, v_head_dim="v_head_dim", fields={**llama.fields, "v_head_dim": 64}))
    model = open_model(zoo("llama", dtype="bfloat16", head_dim=64))
    object.__setattr__(model, "descriptor", replace(llama, head=replace(llama.head, bias=True)))
    with pytest.raises(FusedGap, match="the head.bias knob"):
        fused_plan(model)


# ------------------------------------------------------------------ kernel accounting


class _CountingOps(ReferenceFusedOps):
    """The reference, counting the kernel launches each call stands for."""

    LAUNCHES = {"qkv_rope": 2, "attention": 2, "gemv": 1, "gemv_swiglu": 1}

    def __init__(self):
        self.launches = 0

    def __getattribute__(self, name):
        if name in _CountingOps.LAUNCHES:
            object.__setattr__(self, "launches", object.__getattribute__(self, "launches")
                               + _CountingOps.LAUNCHES[name])
        return object.__getattribute__(self, name)


def test_a_fused_step_makes_seven_launches_per_layer_and_one_for_the_head(zoo):
    model = open_model(zoo("qwen3", dtype="bfloat16", head_dim=64))
    plan = fused_plan(model)
    ops = _CountingOps()
    ids = mx.array([list(PROMPT)])
    cache = model.make_cache()
    model(ids, cache=cache)
    from mlxbun.fast.fused_decoder import fused_step
    fused_step(plan, ops, mx.array([[7]]), mx.array([7], mx.int32),
               *[mx.zeros((2, layer.attn.hkv, 256, layer.attn.head_dim), mx.bfloat16) for layer in plan.layers])
    assert plan.kernels_per_layer() == 7 and plan.kernels_per_layer(rope_attention=True) == 5
    assert ops.launches == plan.kernels_per_step() == len(plan.layers) * 7 + 1
    assert plan.kernels_per_step(scatter=True) == len(plan.layers) * 8 + 1
    assert plan.kernels_per_step(rope_attention=True) == len(plan.layers) * 5 + 1


def test_step_kernels_counts_primitives_and_sets_views_apart():
    x = mx.ones((4, 4))
    mx.eval(x)
    counted = step_kernels(mx.exp(x).reshape(16) + 1, (x * 2).T)
    assert counted.kernels == {"Exp": 1, "Add": 1, "Multiply": 1} and counted.total == 3
    assert counted.views >= 2  # the reshape, the transpose (and the scalars' broadcasts)


def test_the_compiled_and_fused_steps_are_counted_from_their_graphs(zoo):
    model = open_model(zoo("llama", dtype="bfloat16", head_dim=64))
    ids = mx.array([list(PROMPT)])
    a, b = model.make_cache(), model.make_cache()
    model(ids, cache=a)
    model(ids, cache=b)
    y = mx.array([[7]])
    compiled = CompiledDecoder(model, a, 4)
    fused = FusedDecoder(model, fused_plan(model), b, 4, ReferenceFusedOps())
    n_compiled, n_fused = step_kernels(*compiled.pending(y)).total, step_kernels(*fused.pending(y)).total
    assert n_compiled > 20 and n_fused > 20
    assert compiled.offset == fused.offset == len(PROMPT)  # counting does not advance a decoder


# ------------------------------------------------------------------ the CUDA sources


def _template(kind, dtype, bits, **kw):
    D = kw.get("D", 64)
    if kind == "rope":
        return [("T", dtype), ("NW", -(-D // 32)), ("HQ", 32), ("HKV", 8), ("D", D), ("QK_NORM", kw.get("qk", True)),
                ("QK_EPS_BITS", float_bits(1e-6)), ("BIAS", kw.get("bias", True)), ("ROPE_TRAD", kw.get("trad", False)),
                ("ROPE_SCALE_BITS", float_bits(1.0)), ("CAP", 512), ("INPLACE", kw.get("inplace", True))]
    rows = [("NQ", 32 * D), ("NKV", 8 * D)] if kind == "qkv" else [("N", 2048)]
    t = [("T", dtype), ("BF16", dtype == mx.bfloat16), ("K", kw.get("K", 2048)), *rows, ("BITS", bits),
         ("GS", kw.get("GS", 64)), ("NW", fd.NW), ("SPLIT", kw.get("split", 1)),
         ("RW", kw.get("rw", fd.QKV_RW if kind == "qkv" else fd.RW)), ("CODES", kw.get("codes", fd.CODES)),
         ("QUNROLL", kw.get("qunroll", fd.QUNROLL)), ("NORM_VEC", kw.get("norm_vec", False)),
         ("EPS_BITS", float_bits(1e-5))]
    if kind == "gemv":
        t += [("NORM", kw.get("norm", True)), ("RESIDUAL", kw.get("residual", True))]
    return t


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("kind", ["gemv", "swiglu", "qkv", "rope"])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("bits,group", [(16, 32), (4, 32), (4, 128), (8, 64)])
def test_the_fused_sources_compile_without_spills(kind, dtype, bits, group):
    inputs, outputs = kernel_signature(kind, dtype, bits)
    unit = render(f"mlxbun_fused_{kind}", fd.HEADER, fd._SOURCES[kind], inputs, outputs,
                  _template(kind, dtype, bits, GS=group))
    report = ptxas_report(unit)
    assert "Used" in report and not re.search(r"[1-9]\d* bytes spill", report), report


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("variant", [dict(qk=False, bias=False, trad=True, inplace=False, D=128),
                                     dict(norm=False, residual=False, D=256), dict(split=2, D=128),
                                     dict(split=8, K=8192), dict(rw=4, split=2), dict(rw=1),
                                     dict(codes=0), dict(codes=1, GS=32, qunroll=2), dict(norm_vec=True),
                                     dict(norm_vec=True, K=14336)])
def test_the_fused_sources_compile_in_their_other_variants(variant):
    for kind in ("gemv", "swiglu", "qkv", "rope"):
        inputs, outputs = kernel_signature(kind, mx.bfloat16, 4)
        assert "Used" in ptxas_report(render("k", fd.HEADER, fd._SOURCES[kind], inputs, outputs,
                                             _template(kind, mx.bfloat16, 4, **variant)))


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("mma", [1, 2])
@pytest.mark.parametrize("kind,K,split,group", [("swiglu", 4096, 4, 64), ("gemv", 14336, 8, 64), ("qkv", 4096, 8, 64),
                                                ("gemv", 4096, 8, 32), ("swiglu", 2048, 1, 128)])
def test_the_tensor_core_sources_compile_without_spills(dtype, mma, kind, K, split, group):
    """The MMA GEMVs at the Llama-3-8B's shapes (and the other group sizes) for sm_90."""
    inputs, outputs = kernel_signature(kind, dtype, 4)
    template = _template(kind, dtype, 4, K=K, split=split, GS=group) + [("MMA", mma), ("MMA_EARLY", mma == 2)]
    report = ptxas_report(render(f"mlxbun_fused_{kind}_mma", fd.MMA_HEADER, fd._MMA_SOURCES[kind], inputs, outputs,
                                 template))
    assert "Used" in report and not re.search(r"[1-9]\d* bytes spill", report), report


def test_the_tensor_core_gemvs_take_4_bit_codes_that_fit_shared_memory(monkeypatch):
    w = lambda n, k, bits=4, group=64: Weights(mx.zeros((n, k * bits // 32), mx.uint32), mx.zeros((1,)),  # noqa: E731
                                               mx.zeros((1,)), bits, group)
    qkv = fd.MMA_QKV
    assert not fd.uses_mma(w(4096, 4096), qkv)  # off by default
    monkeypatch.setattr(fd, "MMA", 1)
    assert fd.uses_mma(w(4096, 4096), qkv) and fd.uses_mma(w(4096, 16384), qkv)
    assert not fd.uses_mma(w(4096, 16384 + 64), qkv)  # x would not fit shared memory: the FFMA loop
    assert not fd.uses_mma(w(4096, 4096, bits=8), qkv)
    assert not fd.uses_mma(Weights.dense(mx.zeros((64, 64), mx.bfloat16)), qkv)
    monkeypatch.setattr(fd, "MMA_KINDS", fd.MMA_QKV | fd.MMA_HEAD)
    assert fd.uses_mma(w(4096, 4096), fd.MMA_HEAD) and not fd.uses_mma(w(4096, 4096), fd.MMA_SWIGLU)
    # warps per 16-row tile: toward TARGET_WARPS, each an equal run of at least 4 groups
    assert fd.mma_split(w(14336, 4096), 14336) == 8  # 896 tiles: 3584 warps short of 4096, so 8 groups each
    assert fd.mma_split(w(4096, 14336), 4096) == 8  # 224 groups: 28 a warp
    assert fd.mma_split(w(4096, 4096, group=128), 4096) == 8  # 32 groups: 4 a warp
    assert fd.mma_split(w(128256, 4096), 128256) == 1
    assert fd.mma_split(w(64, 192, group=32), 64) == 1  # 6 groups: no equal runs of 4


def test_split_k_gives_few_rows_more_warps_and_every_lane_a_chunk():
    w = lambda n, k, bits=16: Weights(mx.zeros((n, k if bits == 16 else k * bits // 32),  # noqa: E731
                                               mx.bfloat16 if bits == 16 else mx.uint32), mx.zeros((1,)), mx.zeros((1,)),
                                      bits, 64)
    assert fd.split_for(w(2048, 2048), 2048) == 2  # 256 chunks a row: 2 warps reach 4096
    assert fd.split_for(w(512, 2048), 512) == 8
    assert fd.split_for(w(128256, 2048), 128256) == 1  # the head has warps enough
    assert fd.split_for(w(2048, 2048, 4), 2048) == 2  # 64 chunks a row: one each for 2 warps' lanes
    assert fd.split_for(w(2048, 1024, 4), 2048) == 1  # 32 chunks: one warp's lanes take them all
    assert fd.split_for(w(512, 8192, 4), 512) == 8
    assert fd.split_for(w(64, 64), 64) == 1


def test_the_signature_names_every_operand_the_sources_read():
    for kind, source in [*fd._SOURCES.items(), *fd._MMA_SOURCES.items()]:
        inputs, outputs = kernel_signature(kind, mx.bfloat16, 4)
        for name, _ in inputs + outputs:
            assert re.search(rf"\b{name}\b", source), (kind, name)
    with pytest.raises(ValueError, match="no kernel"):
        kernel_signature("attention", mx.bfloat16, 4)


# ------------------------------------------------------------------ what a fast run takes


def test_the_kernels_stay_off_on_a_gpu_until_their_check_passes(monkeypatch):
    monkeypatch.setattr(fd, "cuda_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(fd, "FUSED_CHECKED", False)
    assert "not yet passed their GPU check" in fd.backend_gap().reason
    monkeypatch.setattr(fd, "FUSED_CHECKED", True)
    assert fd.backend_gap() is None
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    assert "default device" in fd.backend_gap().reason


def test_a_fast_run_on_the_cpu_says_why_the_fused_step_is_off_and_decodes_compiled(zoo):
    path = zoo("llama", dtype="bfloat16", head_dim=64)
    model, tok = open_model(path), load_tokenizer(path)
    exact = [r.token for r in stream_generate(model, tok, [1, 2, 3, 4], max_tokens=8)]
    fast = enable_fast(model)
    got = [r.token for r in stream_generate(model, tok, [1, 2, 3, 4], max_tokens=8, fast=fast)]
    assert got == exact
    assert any(n.startswith("fused decode off: no CUDA device") for n in fast.notes), fast.notes


def test_generation_through_the_fused_step_hands_the_cache_back(zoo):
    path = zoo("qwen3", quant=4, dtype="bfloat16", head_dim=64)
    model, tok = open_model(path), load_tokenizer(path)
    # what the fused step decodes greedily, token by token (the reference's sums are not the exact
    # path's, so a near-tie may part them: generation must give the decoder's own tokens)
    cache = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache=cache)
    dec = FusedDecoder(model, fused_plan(model), cache, 8, ReferenceFusedOps())
    y, expected = mx.array([[4]]), []
    for _ in range(8):
        y = mx.argmax(dec(y), axis=-1)[:, None]
        expected.append(y.item())
    fast = enable_fast(model)
    fast.fused_ops = ReferenceFusedOps()
    cache = model.make_cache()
    got = [r.token for r in stream_generate(model, tok, [1, 2, 3, 4], max_tokens=8, fast=fast, prompt_cache=cache)]
    assert got == expected
    assert not any("fused decode off" in n for n in fast.notes), fast.notes
    # the prompt and eight decode steps (generation computes one token ahead of the one it yields)
    assert cache[0].offset == 4 + 8 and cache[0].keys.shape[2] == cache[0].offset
    assert isinstance(fast_decoder(fast, cache, 4), FusedDecoder)
    fast.fused = False  # the switch the benchmarks flip: the compiled step again
    other = model.make_cache()
    model(mx.array([[1, 2, 3]]), cache=other)
    assert isinstance(fast_decoder(fast, other, 4), CompiledDecoder)


def test_a_model_the_plan_refuses_decodes_compiled_with_the_reason(zoo):
    path = zoo("gemma3_text", dtype="bfloat16")
    model = open_model(path)
    fast = enable_fast(model)
    fast.fused_ops = ReferenceFusedOps()
    cache = model.make_cache()
    model(mx.array([list(PROMPT)]), cache=cache)
    decoder = fast_decoder(fast, cache, 4)
    assert isinstance(decoder, CompiledDecoder)
    assert any("fused decode off" in n and "sandwich block" in n for n in fast.notes), fast.notes


def test_codes_as_subnormal_floats_sum_to_the_bits_of_the_offset_codes():
    """CODES 1 (`q << 4i` read as the subnormal q 16^i 2^-149, x scaled by 2^(149 - SHIFT) / 16^i) and
    CODES 0 (`(q << 4i) | 0x4b000000` less 2^23, x / 16^i) run the same float32 roundings: every
    product is exact and the partial sums differ by the power of two 2^-SHIFT. numpy float32 keeps
    subnormals (as MLX's NVRTC does, without -ftz); both products are exact, so mul + add is the FFMA."""
    shift = int(re.search(r"SHIFT = (\d+);", fd_source.HELPERS).group(1))
    rng = np.random.default_rng(0)
    f32 = np.float32
    for bits in (4, 8):
        per_half, mask = 16 // bits, (1 << bits) - 1
        words = rng.integers(0, 2**32, size=(64, 4), dtype=np.uint64).astype(np.uint32)
        x = (rng.standard_normal((64, 128 // bits)) * rng.choice([1e-3, 1.0, 300.0], (64, 1))).astype(f32)
        for row, xrow in zip(words, x):
            offset_sum, subnormal_sum = f32(0), f32(0)
            for j, xj in enumerate(xrow):
                word = int(row[j // (2 * per_half)])
                half = word >> 16 if (j // per_half) % 2 else word & 0xFFFF
                code_bits = half & (mask << (bits * (j % per_half)))
                i = j % per_half
                offset = np.array([code_bits | 0x4B000000], np.uint32).view(f32)[0] - f32(2**23)
                offset_sum = f32(offset_sum + offset * f32(xj * f32(2.0 ** (-bits * i))))
                sub = np.array([code_bits], np.uint32).view(f32)[0]
                subnormal_sum = f32(subnormal_sum + sub * f32(xj * f32(2.0 ** (149 - shift - bits * i))))
            unscaled = f32(subnormal_sum * f32(2.0**shift))
            assert np.array([offset_sum]).view(np.uint32) == np.array([unscaled]).view(np.uint32)
