"""The one-launch rope + attention kernel (`kernels.rope_attention`) on the CPU: which path the CUDA
executor takes and why, its shared-memory and counter limits, the operands its source reads, and its
source compiled with nvcc where installed. Its arithmetic is held to the three launches it replaces,
bit for bit, on the device (`benchmarks/gpu_fused.py --sections check`)."""

from __future__ import annotations

import re
import shutil

import mlx.core as mx
import pytest

from mlxbun.fast.fused_plan import FusedAttention
from mlxbun.kernels import fused_decode as fd
from mlxbun.kernels import rope_attention as ra
from mlxbun.kernels.render import ptxas_report, render
from mlxbun.kernels.rope_attention_source import ROPE_ATTENTION
from mlxbun.kernels.sdpa_decode_source import PARTIAL_PLAIN, partial_body


def _attn(hq=32, hkv=8, d=64, cap=768, **kw):
    x = mx.zeros((d // 2,), mx.float32)
    return FusedAttention(hq, hkv, d, d ** -0.5, x, 1.0, kw.get("trad", False),
                          bias=(mx.zeros((hq * d,), mx.bfloat16),) * 3 if kw.get("bias") else None,
                          q_norm=mx.ones((d,), mx.bfloat16) if kw.get("qk") else None,
                          k_norm=mx.ones((d,), mx.bfloat16) if kw.get("qk") else None, qk_eps=1e-6, capacity=cap)


def test_the_partial_body_is_the_attention_kernels_own():
    # the attention kernel's source is unchanged by the hooks rope_attention fills in
    assert partial_body() in PARTIAL_PLAIN and "MLXBUN_" + "LOAD_Q" not in PARTIAL_PLAIN
    assert "qsh[g][slot * 8 + j]" in ROPE_ATTENTION and "mlxbun_load_q8" not in ROPE_ATTENTION


def test_the_signature_names_every_operand_the_source_reads():
    inputs, outputs = ra.rope_attention_signature(mx.bfloat16)
    for name, _ in inputs + outputs:
        assert re.search(rf"\b{name}\b", ROPE_ATTENTION), name


def test_shared_memory_and_the_counter_bound_the_one_launch_path():
    assert ra.rope_attention_gap(_attn()) is None
    assert ra.rope_attention_gap(_attn(hq=64, hkv=8, d=128, qk=True)) is None
    gap = ra.rope_attention_gap(_attn(hq=64, hkv=8, d=256))
    assert gap is not None and "shared memory" in gap.reason and "8 query heads of dim 256" in gap.reason
    assert "merge counter" in ra.rope_attention_gap(_attn(hq=512, hkv=512, d=64)).reason
    counters = ra.Counters()
    assert counters.array.dtype == mx.int32 and counters.array.shape == (ra.MAX_KV_HEADS,)
    assert not counters.array.any().item()


def _routes(monkeypatch, attn, *, knob, inplace=True):
    """Which path CudaFusedOps.qkv_attention takes: 'one launch' or 'three'."""
    taken = []
    monkeypatch.setattr(fd, "ROPE_ATTENTION", knob)
    monkeypatch.setattr(fd, "rope_attention", lambda *a: taken.append("one launch") or (a[1].pos, a[1].pos))
    monkeypatch.setattr(fd, "composed_qkv_attention", lambda *a: taken.append("three") or (None, None, None))
    ops = fd.CudaFusedOps(inplace=inplace)
    monkeypatch.setattr(ops, "qkv_sums", lambda *a: None)
    buffer = mx.zeros((2, attn.hkv, attn.capacity, attn.head_dim))
    ops.qkv_attention(mx.zeros((4,), mx.bfloat16), None, None, attn.at(buffer, mx.array([5], mx.int32)))
    return taken


def test_the_cuda_executor_takes_one_launch_only_where_the_knob_the_write_and_the_memory_allow(monkeypatch):
    assert _routes(monkeypatch, _attn(), knob=True) == ["one launch"]
    assert _routes(monkeypatch, _attn(), knob=False) == ["three"]
    assert _routes(monkeypatch, _attn(), knob=True, inplace=False) == ["three"]  # rows by a scatter
    assert _routes(monkeypatch, _attn(hq=64, hkv=8, d=256), knob=True) == ["three"]  # shared memory
    # a 16k buffer: 65 splits, more than the one launch's merge is measured to pay for
    assert _routes(monkeypatch, _attn(cap=16640), knob=True) == ["three"]
    assert "65 splits" in ra.rope_attention_gap(_attn(cap=16640), fd.ROPE_ATTENTION_MAX_SPLITS).reason
    assert fd.ROPE_ATTENTION and ra.rope_attention_gap(_attn(cap=1024), fd.ROPE_ATTENTION_MAX_SPLITS) is None


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
@pytest.mark.parametrize("kw", [dict(), dict(qk=True, bias=True), dict(trad=True, d=128, hq=16),
                                dict(hq=64, d=128, qk=True, cap=16640)])
def test_the_source_compiles_without_spills(kw):
    attn = _attn(**kw)
    for dtype in (mx.bfloat16, mx.float16):
        inputs, outputs = ra.rope_attention_signature(dtype)
        report = ptxas_report(render("mlxbun_rope_attention", ra.HEADER, ROPE_ATTENTION, inputs, outputs,
                                     ra.rope_attention_template(attn, dtype)))
        assert "Used" in report and not re.search(r"[1-9]\d* bytes spill", report), report
