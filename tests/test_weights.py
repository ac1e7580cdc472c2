"""mlxbun.weights (header-only index, corrupt-file refusal, lazy load, parameter counts),
mlxbun.weight_audit and mlxbun.snapshot_identity."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from mlx.utils import tree_flatten
from safetensors.numpy import save_file

from mlxbun.errors import LoadError, WeightsError
from mlxbun.snapshot_identity import artifact_fingerprint
from mlxbun.weight_audit import DropRule, TensorSpec, WeightAudit, check_values
from mlxbun.weights import (
    INDEX_FILE,
    SAFETENSORS_DTYPE_BITS,
    TensorInfo,
    WeightIndex,
    dtype_name,
    read_index,
    read_safetensors_header,
)

NP_TO_ST = {
    np.dtype(np.bool_): "BOOL", np.dtype(np.uint8): "U8", np.dtype(np.int8): "I8",
    np.dtype(np.uint16): "U16", np.dtype(np.int16): "I16", np.dtype(np.uint32): "U32",
    np.dtype(np.int32): "I32", np.dtype(np.uint64): "U64", np.dtype(np.int64): "I64",
    np.dtype(np.float16): "F16", np.dtype(np.float32): "F32", np.dtype(np.float64): "F64",
}
ST_TO_NP = {v: k for k, v in NP_TO_ST.items()} | {
    "C64": np.dtype(np.complex64), "F8_E4M3": np.dtype(np.uint8), "F8_E8M0": np.dtype(np.uint8),
    "BF16": np.dtype(np.uint16),
}


def raw_file(header: dict, data: bytes = b"", hlen: int | None = None) -> bytes:
    """Hand-built safetensors bytes (header not validated)."""
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if hlen is None else hlen) + h + data


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def array_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a).tobytes()


# ------------------------------------------------------------------ single files


def test_single_file_roundtrip(tmp_path):
    arrays = {
        "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4),
        "b": np.arange(5, dtype=np.int8),
        "scalar": np.array(7, dtype=np.int64),
        "empty": np.zeros((0, 3), dtype=np.float16),
    }
    f = tmp_path / "x.safetensors"
    save_file(arrays, str(f), metadata={"format": "pt"})
    ix = read_index(f)
    raw = f.read_bytes()
    assert set(ix.names()) == set(arrays) and len(ix) == 4 and "b" in ix and "zz" not in ix
    assert ix.files == (f,) and ix.root == tmp_path
    assert ix.metadata[f] == {"format": "pt"}
    for name, arr in arrays.items():
        t = ix.tensors[name]
        assert (t.file, t.dtype, t.shape) == (f, NP_TO_ST[arr.dtype], arr.shape)
        assert t.nbytes == arr.nbytes == t.offsets[1] - t.offsets[0]
        assert raw[t.offsets[0]:t.offsets[1]] == arr.tobytes()
    assert ix.total_bytes == sum(a.nbytes for a in arrays.values())
    assert ix.num_parameters() == sum(a.size for a in arrays.values())
    loaded = ix.load()
    assert set(loaded) == set(arrays)
    for name, arr in arrays.items():
        assert np.array_equal(np.array(loaded[name]), arr)
    assert list(ix.load(["b"])) == ["b"]


def test_mlx_written_bf16(tmp_path):
    f = tmp_path / "model.safetensors"
    w = mx.random.normal((4, 8)).astype(mx.bfloat16)
    mx.save_safetensors(str(f), {"w": w, "q": mx.zeros((2, 3), dtype=mx.uint32)})
    ix = read_index(tmp_path)
    assert ix.tensors["w"].dtype == "BF16" and ix.tensors["w"].mx_dtype == mx.bfloat16
    assert ix.tensors["q"].dtype == "U32"
    got = ix.load(["w"])["w"]
    assert got.dtype == mx.bfloat16 and mx.array_equal(got, w)
    assert f.read_bytes()[slice(*ix.tensors["w"].offsets)] == array_bytes(w)


def test_dtype_names():
    assert dtype_name(mx.bfloat16) == dtype_name("BF16") == dtype_name("bfloat16") == "bfloat16"
    assert dtype_name("F8_E4M3") == "uint8"  # mlx loads fp8 as raw bytes
    assert dtype_name("F8_E5M2") == "F8_E5M2"  # mlx cannot load it: stays the code
    with pytest.raises(ValueError):
        dtype_name("F128")


# ------------------------------------------------------------------ directories and shards


def make_sharded(d: Path, *, index: dict | None = None) -> dict[str, np.ndarray]:
    d.mkdir(parents=True, exist_ok=True)
    s1 = {"embed.weight": np.ones((8, 4), np.float32), "layers.0.w": np.full((4, 4), 2, np.float32)}
    s2 = {"layers.1.w": np.full((4, 4), 3, np.float32), "norm.weight": np.ones(4, np.float16)}
    save_file(s1, str(d / "model-00001-of-00002.safetensors"))
    save_file(s2, str(d / "model-00002-of-00002.safetensors"))
    wmap = {n: "model-00001-of-00002.safetensors" for n in s1} | {n: "model-00002-of-00002.safetensors" for n in s2}
    doc = index if index is not None else {"metadata": {"total_size": 1}, "weight_map": wmap}
    (d / INDEX_FILE).write_text(json.dumps(doc))
    return s1 | s2


def test_sharded_dir_and_lazy_per_file_load(tmp_path, monkeypatch):
    arrays = make_sharded(tmp_path / "ckpt")
    ix = read_index(tmp_path / "ckpt")
    assert [f.name for f in ix.files] == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert ix.tensors["norm.weight"].file.name == "model-00002-of-00002.safetensors"
    assert ix.index_metadata == {"total_size": 1}
    assert read_index(tmp_path / "ckpt" / INDEX_FILE).tensors == ix.tensors

    opened = []
    real_load = mx.load
    monkeypatch.setattr(mx, "load", lambda f, **kw: opened.append(Path(f).name) or real_load(f, **kw))
    out = ix.load(["layers.1.w"])
    assert opened == ["model-00002-of-00002.safetensors"]
    assert np.array_equal(np.array(out["layers.1.w"]), arrays["layers.1.w"])
    with pytest.raises(WeightsError, match="nope"):
        ix.load(["nope"])


def test_dir_discovery_priority(tmp_path):
    # index json wins over stray files (e.g. Mistral's consolidated.safetensors)
    make_sharded(tmp_path / "a")
    save_file({"consolidated": np.zeros(2, np.float32)}, str(tmp_path / "a" / "consolidated.safetensors"))
    assert "consolidated" not in read_index(tmp_path / "a")
    # model.safetensors wins over other files
    (tmp_path / "b").mkdir()
    save_file({"x": np.zeros(2, np.float32)}, str(tmp_path / "b" / "model.safetensors"))
    save_file({"y": np.zeros(2, np.float32)}, str(tmp_path / "b" / "other.safetensors"))
    assert read_index(tmp_path / "b").names() == ["x"]
    # otherwise every *.safetensors, sorted
    (tmp_path / "c").mkdir()
    save_file({"z": np.zeros(2, np.float32)}, str(tmp_path / "c" / "zz.safetensors"))
    save_file({"y": np.zeros(2, np.float32)}, str(tmp_path / "c" / "aa.safetensors"))
    ix = read_index(tmp_path / "c")
    assert [f.name for f in ix.files] == ["aa.safetensors", "zz.safetensors"] and set(ix.names()) == {"y", "z"}


def test_no_safetensors_in_dir(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(WeightsError, match="no \\*.safetensors") as e:
        read_index(tmp_path)
    assert str(tmp_path) in str(e.value)
    with pytest.raises(WeightsError, match="no such"):
        read_index(tmp_path / "missing")


def test_duplicate_tensor_across_shards(tmp_path):
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "a.safetensors"))
    save_file({"w": np.zeros(2, np.float32)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(WeightsError) as e:
        read_index(tmp_path)
    msg = str(e.value)
    assert "'w'" in msg and "a.safetensors" in msg and "b.safetensors" in msg


SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
GOOD_MAP = {"embed.weight": SHARD1, "layers.0.w": SHARD1, "layers.1.w": SHARD2, "norm.weight": SHARD2}


@pytest.mark.parametrize("doc, needles", [
    ({"weight_map": GOOD_MAP | {"layers.1.w": "model-00003-of-00003.safetensors"}},
     ["model-00003-of-00003.safetensors", "layers.1.w"]),
    ({"weight_map": GOOD_MAP | {"ghost.weight": SHARD1}}, ["ghost.weight", SHARD1]),
    ({"weight_map": {k: v for k, v in GOOD_MAP.items() if k != "norm.weight"}}, ["norm.weight", SHARD2]),
    ({"weight_map": GOOD_MAP | {"norm.weight": SHARD1}}, ["norm.weight"]),  # mapped to the wrong shard
    ({"weight_map": GOOD_MAP | {"x": "../outside.safetensors"}}, ["../outside.safetensors"]),
    ({"weight_map": [1, 2]}, ["weight_map"]),
    ({"weight_map": {"a": 3}}, ["weight_map"]),
    ({"metadata": {}}, ["weight_map"]),
    ([], ["weight_map"]),
])
def test_bad_weight_map(tmp_path, doc, needles):
    make_sharded(tmp_path, index=doc)
    with pytest.raises(WeightsError) as e:
        read_index(tmp_path)
    msg = str(e.value)
    assert str(tmp_path / INDEX_FILE) in msg
    for n in needles:
        assert n in msg


def test_unparseable_index_json(tmp_path):
    make_sharded(tmp_path)
    (tmp_path / INDEX_FILE).write_text("{not json")
    with pytest.raises(WeightsError, match="unreadable shard index") as e:
        read_index(tmp_path)
    assert INDEX_FILE in str(e.value)


# ------------------------------------------------------------------ corrupt files

T = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
BAD_FILES = {
    # id: (bytes, tensor name the message must contain or None, message fragment)
    "empty": (b"", None, "empty"),
    "short": (b"\x05\x00\x00", None, "only 3 bytes"),
    "header-past-eof": (raw_file({"t": T}, bytes(8), hlen=500), None, "past the end"),
    "absurd-header-len": (struct.pack("<Q", 2**63) + b"{}", None, "exceeds"),
    "non-utf8": (struct.pack("<Q", 4) + b"{\xff\xfe}", None, "UTF-8"),
    "non-json": (struct.pack("<Q", 5) + b"{abc:", None, "JSON"),
    "zero-header": (struct.pack("<Q", 0), None, "JSON"),
    "bom": (struct.pack("<Q", 5) + b"\xef\xbb\xbf{}", None, "JSON"),
    "not-object": (raw_file([1, 2]), None, "not an object"),
    "deep-nesting": (struct.pack("<Q", 200000) + b"[" * 100000 + b"]" * 100000, None, "JSON"),
    "nan": (struct.pack("<Q", 13) + b'{"a": NaN}   ', None, "NaN"),
    "duplicate-key": (struct.pack("<Q", 16) + b'{"t": 1, "t": 2}', None, "duplicate"),
    "entry-not-object": (raw_file({"t": [1]}), "t", "not an object"),
    "no-dtype": (raw_file({"t": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "t", "dtype"),
    "no-shape": (raw_file({"t": {"dtype": "F32", "data_offsets": [0, 8]}}, bytes(8)), "t", "shape"),
    "no-offsets": (raw_file({"t": {"dtype": "F32", "shape": [2]}}, bytes(8)), "t", "data_offsets"),
    "dtype-int": (raw_file({"t": T | {"dtype": 5}}, bytes(8)), "t", "dtype"),
    "unknown-dtype": (raw_file({"t": T | {"dtype": "F128"}}, bytes(8)), "t", "unknown dtype"),
    "shape-str": (raw_file({"t": T | {"shape": "2"}}, bytes(8)), "t", "shape"),
    "shape-neg": (raw_file({"t": T | {"shape": [-2]}}, bytes(8)), "t", "shape"),
    "shape-float": (raw_file({"t": T | {"shape": [2.0]}}, bytes(8)), "t", "shape"),
    "shape-bool": (raw_file({"t": T | {"shape": [True, 2]}}, bytes(8)), "t", "shape"),
    "offsets-three": (raw_file({"t": T | {"data_offsets": [0, 4, 8]}}, bytes(8)), "t", "data_offsets"),
    "offsets-str": (raw_file({"t": T | {"data_offsets": ["0", "8"]}}, bytes(8)), "t", "data_offsets"),
    "offsets-reversed": (raw_file({"t": T | {"data_offsets": [8, 0]}}, bytes(8)), "t", "end before"),
    "nbytes-mismatch": (raw_file({"t": T | {"shape": [3]}}, bytes(8)), "t", "span 8"),
    "huge-dims": (raw_file({"t": T | {"shape": [2**62] * 50}}, bytes(8)), "t", "more than 8"),
    "sub-byte-fraction": (raw_file({"t": T | {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)),
                          "t", "fractional"),
    "offsets-past-eof": (raw_file({"t": T | {"data_offsets": [4, 12]}}, bytes(8)), "t", "past the end"),
    "overlap": (raw_file({"t": T, "u": T | {"data_offsets": [4, 12]}}, bytes(12)), "u", "overlap"),
    "metadata-not-str": (raw_file({"__metadata__": {"k": 1}, "t": T}, bytes(8)), None, "__metadata__"),
    "metadata-list": (raw_file({"__metadata__": [], "t": T}, bytes(8)), None, "__metadata__"),
    "lone-surrogate-name": (raw_file({"\ud800": T}, bytes(8)), None, "UTF-8"),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_file_names_file_and_tensor(tmp_path, case):
    content, tensor, fragment = BAD_FILES[case]
    f = write(tmp_path / "model.safetensors", content)
    with pytest.raises(WeightsError) as e:
        read_index(tmp_path)
    msg = str(e.value)
    assert str(f) in msg
    assert fragment in msg
    if tensor is not None:
        assert repr(tensor) in msg


def test_overlap_names_both_tensors(tmp_path):
    f = write(tmp_path / "x.safetensors", BAD_FILES["overlap"][0])
    with pytest.raises(WeightsError, match="'t' and 'u' overlap"):
        read_safetensors_header(f)


def test_empty_tensors_do_not_overlap(tmp_path):
    z = {"dtype": "F32", "shape": [0, 4], "data_offsets": [4, 4]}
    f = write(tmp_path / "x.safetensors", raw_file({"t": T, "z1": z, "z2": z}, bytes(8)))
    tensors, _ = read_safetensors_header(f)
    assert tensors["z1"].nbytes == 0 and tensors["t"].nbytes == 8


def test_sub_byte_dtype_sizes(tmp_path):
    f = write(tmp_path / "x.safetensors", raw_file(
        {"a": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]},
         "b": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [2, 5]}}, bytes(5)))
    tensors, _ = read_safetensors_header(f)
    assert (tensors["a"].nbytes, tensors["b"].nbytes) == (2, 3)


def test_unreadable_path_is_weights_error(tmp_path):
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(WeightsError, match="dir.safetensors"):
        read_safetensors_header(tmp_path / "dir.safetensors")


@pytest.mark.parametrize("dtype, nbytes", [("F64", 16), ("F8_E5M2", 2)])
def test_load_refuses_dtypes_mlx_cannot_read(tmp_path, dtype, nbytes):
    # a valid safetensors file, but mx.load would fail on its header
    f = write(tmp_path / "x.safetensors", raw_file(
        {"ok": T, "odd": {"dtype": dtype, "shape": [2], "data_offsets": [8, 8 + nbytes]}}, bytes(8 + nbytes)))
    ix = read_index(f)
    assert ix.tensors["odd"].dtype == dtype and ix.tensors["odd"].mx_dtype is None
    with pytest.raises(WeightsError) as e:
        ix.load(["ok"])
    assert str(f) in str(e.value) and "'odd'" in str(e.value) and dtype in str(e.value)


def test_load_refuses_dims_beyond_int32(tmp_path):
    f = write(tmp_path / "x.safetensors", raw_file({"z": T | {"shape": [0, 2**40], "data_offsets": [0, 0]}}))
    ix = read_index(f)
    with pytest.raises(WeightsError, match="int32") as e:
        ix.load()
    assert str(f) in str(e.value) and "'z'" in str(e.value)


def test_load_maps_mlx_errors_and_changed_files(tmp_path):
    f = tmp_path / "x.safetensors"
    save_file({"w": np.zeros((2, 2), np.float32)}, str(f))
    ix = read_index(f)
    f.write_bytes(struct.pack("<Q", 2**40))  # corrupted after indexing
    with pytest.raises(WeightsError, match="mlx could not load") as e:
        ix.load()
    assert str(f) in str(e.value)
    save_file({"w": np.zeros((3, 2), np.float32)}, str(f))  # replaced after indexing
    with pytest.raises(WeightsError, match="changed") as e:
        ix.load()
    assert "'w'" in str(e.value) and str(f) in str(e.value)


# ------------------------------------------------------------------ property tests

NAMES = st.text(min_size=0, max_size=12).filter(lambda s: s != "__metadata__")
NP_DTYPES = st.sampled_from(sorted(NP_TO_ST, key=str))
ARRAYS = NP_DTYPES.flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)))


@pytest.fixture(scope="session")
def prop_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prop")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tensors=st.dictionaries(NAMES, ARRAYS, max_size=5),
       metadata=st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3))
def test_valid_headers_roundtrip(prop_dir, tensors, metadata):
    f = prop_dir / "roundtrip.safetensors"
    save_file(tensors, str(f), metadata=metadata or None)
    ix = read_index(f)
    raw = f.read_bytes()
    assert set(ix.names()) == set(tensors)
    assert dict(ix.metadata[f]) == metadata
    for name, arr in tensors.items():
        t = ix.tensors[name]
        assert (t.dtype, t.shape, t.nbytes) == (NP_TO_ST[arr.dtype], arr.shape, arr.nbytes)
        assert raw[t.offsets[0]:t.offsets[1]] == arr.tobytes()
    if any(a.dtype == np.float64 for a in tensors.values()):
        with pytest.raises(WeightsError, match="F64"):
            ix.load()
    else:
        loaded = ix.load()
        for name, arr in tensors.items():
            assert array_bytes(loaded[name]) == arr.tobytes()


BASE = raw_file(
    {"__metadata__": {"format": "mlx"},
     "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
     "b": {"dtype": "I8", "shape": [3], "data_offsets": [16, 19]},
     "c": {"dtype": "F16", "shape": [], "data_offsets": [19, 21]},
     "d": {"dtype": "U8", "shape": [0, 5], "data_offsets": [21, 21]}},
    bytes(range(1, 22)),
)
HEADER_END = 8 + struct.unpack("<Q", BASE[:8])[0]

POSITIONS = st.one_of(st.integers(0, HEADER_END), st.integers(0, len(BASE) - 1))
# Structure-aware edits reach the checks past JSON parsing; byte edits cover the rest.
FIELD_VALUES = st.one_of(
    st.sampled_from([*SAFETENSORS_DTYPE_BITS, "X", ""]),
    st.lists(st.integers(-1, 24), max_size=3),
    st.lists(st.integers(0, 2**64), max_size=3),
    st.lists(st.sampled_from([0, 2**31 - 1, 2**31, 2**40]), max_size=3),
    st.integers(-1, 24),
    st.none(),
    st.text(max_size=3),
)
FIELD_EDIT = st.tuples(
    st.just("field"),
    st.sampled_from(["a", "b", "c", "d", "e", "__metadata__"]),
    st.sampled_from(["dtype", "shape", "data_offsets", "extra", "format"]),
    FIELD_VALUES,
)
BYTE_EDIT = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, len(BASE))),
    st.tuples(st.just("overwrite"), POSITIONS, st.binary(min_size=1, max_size=4)),
    st.tuples(st.just("insert"), POSITIONS, st.binary(min_size=1, max_size=4)),
    st.tuples(st.just("delete"), POSITIONS, st.integers(1, 4)),
    st.tuples(st.just("digit"), POSITIONS, st.sampled_from(b"0123456789-")),
    st.tuples(st.just("hlen"), st.one_of(st.integers(0, 2**64 - 1), st.integers(HEADER_END - 16, HEADER_END + 16))),
)


def mutate(data: bytes, op: tuple) -> bytes:
    kind = op[0]
    if kind == "field":
        _, name, key, value = op
        try:
            hlen = struct.unpack("<Q", data[:8])[0]
            header = json.loads(data[8:8 + hlen])
            entry = header.setdefault(name, {})
            entry[key] = value
        except (ValueError, TypeError, struct.error):
            return data
        return raw_file(header, data[8 + hlen:])
    if kind == "truncate":
        return data[:op[1]]
    if kind == "overwrite":
        return data[:op[1]] + op[2] + data[op[1] + len(op[2]):]
    if kind == "insert":
        return data[:op[1]] + op[2] + data[op[1]:]
    if kind == "delete":
        return data[:op[1]] + data[op[1] + op[2]:]
    if kind == "digit":
        return data[:op[1]] + bytes([op[2]]) + data[op[1] + 1:]
    return struct.pack("<Q", op[1]) + data[8:]


MUTATIONS = st.tuples(st.lists(FIELD_EDIT, max_size=3), st.lists(BYTE_EDIT, max_size=1)).map(
    lambda fb: fb[0] + fb[1]).filter(bool)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=MUTATIONS)
def test_mutated_files_parse_consistently_or_raise_weights_error(prop_dir, ops):
    data = BASE
    for op in ops:
        data = mutate(data, op)
    f = write(prop_dir / "mutated.safetensors", data)
    try:
        ix = read_index(f)
    except WeightsError as e:
        assert str(f) in str(e)
        return
    # a header that passed must describe the file truthfully
    hlen = struct.unpack("<Q", data[:8])[0]
    spans = []
    for t in ix.tensors.values():
        assert 8 + hlen <= t.offsets[0] <= t.offsets[1] <= len(data)
        n = 1
        for d in t.shape:
            n *= d
        assert t.nbytes * 8 == n * SAFETENSORS_DTYPE_BITS[t.dtype]
        if t.nbytes:
            spans.append(t.offsets)
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    # and mlx, given only what passed, loads exactly those bytes or we refuse first
    try:
        loaded = ix.load()
    except WeightsError as e:
        assert str(f) in str(e)
        return
    for name, a in loaded.items():
        t = ix.tensors[name]
        mx.eval(a)
        want = np.frombuffer(data[t.offsets[0]:t.offsets[1]], dtype=ST_TO_NP[t.dtype])
        assert array_bytes(a) == want.tobytes()


# ------------------------------------------------------------------ parameter counts


@pytest.fixture(scope="session")
def llama_args():
    from mlx_lm.models import llama

    return llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256,
        tie_word_embeddings=False,
    )


def tiny_llama(args):
    from mlx_lm.models import llama

    mx.random.seed(0)
    return llama.Model(args)


def save_model(model, d: Path, extra: dict | None = None) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "model.safetensors"), dict(tree_flatten(model.parameters())) | (extra or {}))
    return d


OVERRIDE = "model.layers.1.mlp.down_proj"


@pytest.mark.parametrize("scheme", ["dense", "affine", "mxfp4", "nvfp4"])
def test_logical_parameters_match_mlx_lm(tmp_path, llama_args, scheme):
    from mlx_lm.utils import get_total_parameters

    model = tiny_llama(llama_args)
    quantization = None
    if scheme == "affine":
        # 4-bit gs32 with an 8-bit gs64 per-module override, as mlx-lm's config records it
        quantization = {"group_size": 32, "bits": 4, OVERRIDE: {"group_size": 64, "bits": 8}}
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda p, m: quantization.get(p, hasattr(m, "to_quantized")))
    elif scheme != "dense":
        gs = {"mxfp4": 32, "nvfp4": 16}[scheme]
        nn.quantize(model, group_size=gs, bits=4, mode=scheme)
    ix = read_index(save_model(model, tmp_path))
    expected = get_total_parameters(model)
    assert ix.num_parameters(quantization) == expected
    if scheme == "affine":
        assert ix.tensors[f"{OVERRIDE}.weight"].dtype == "U32"
        # without the per-module entry the override layer is counted wrongly or refused
        with pytest.raises(WeightsError, match=OVERRIDE):
            ix.num_parameters({"group_size": 32, "bits": 4})
        with pytest.raises(WeightsError, match="group size"):
            ix.num_parameters()  # no config.json, no quantization: refuse rather than guess
        (tmp_path / "config.json").write_text(json.dumps({"quantization": quantization}))
        assert ix.num_parameters() == expected  # read from the checkpoint's config.json
    else:
        assert ix.num_parameters() == expected  # dense, or fp modes fixed by the shapes


def test_logical_parameters_plain_u32_not_packed(tmp_path):
    f = tmp_path / "x.safetensors"
    save_file({"ids.weight": np.zeros((4, 4), np.uint32)}, str(f))
    assert read_index(f).num_parameters() == 16


# ------------------------------------------------------------------ weight audit

ROTARY = DropRule(r"\.rotary_emb\.inv_freq$", "rotary inv_freq is recomputed")
VISION = DropRule(r"^(vision_tower|multi_modal_projector)\.", "vision tower unused in text-only mode")


@pytest.fixture(scope="session")
def audit_ckpt(tmp_path_factory, llama_args):
    model = tiny_llama(llama_args)
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": mx.zeros((8,)),
        "model.layers.1.self_attn.rotary_emb.inv_freq": mx.zeros((8,)),
        "vision_tower.patch.weight": mx.zeros((4, 4)),
        "multi_modal_projector.linear.weight": mx.zeros((4, 4)),
    }
    d = save_model(model, tmp_path_factory.mktemp("audit"), extra)
    return read_index(d), model


def test_audit_clean_dry_run_from_headers(audit_ckpt, monkeypatch):
    ix, model = audit_ckpt
    monkeypatch.setattr(mx, "load", lambda *a, **k: pytest.fail("audit must not load data"))
    audit = WeightAudit(ix, [ROTARY, VISION])
    audit.expect_params(model.parameters())
    report = audit.check()
    assert report.ok and not report.missing and not report.unconsumed and not report.mismatched
    assert set(report.consumed) == {n for n, _ in tree_flatten(model.parameters())}
    assert report.dropped == {
        "model.layers.0.self_attn.rotary_emb.inv_freq": "rotary inv_freq is recomputed",
        "model.layers.1.self_attn.rotary_emb.inv_freq": "rotary inv_freq is recomputed",
        "vision_tower.patch.weight": "vision tower unused in text-only mode",
        "multi_modal_projector.linear.weight": "vision tower unused in text-only mode",
    }


def test_audit_unconsumed_without_drop_rules(audit_ckpt):
    ix, model = audit_ckpt
    audit = WeightAudit(ix, [ROTARY])
    audit.expect_params(model.parameters())
    report = audit.finish()
    assert report.unconsumed == ("multi_modal_projector.linear.weight", "vision_tower.patch.weight")
    with pytest.raises(LoadError) as e:
        audit.check()
    msg = str(e.value)
    assert "2 unconsumed" in msg and "vision_tower.patch.weight" in msg and str(ix.root) in msg


def test_audit_missing_and_mismatched(audit_ckpt):
    ix, model = audit_ckpt
    audit = WeightAudit(ix, [ROTARY, VISION])
    audit.expect_params(model.parameters())
    audit.expect("model.layers.2.mlp.up_proj.weight", (128, 64), mx.float32)
    audit.expect("lm_head.bias", (256,))
    # a shape the checkpoint contradicts, and a dtype it contradicts
    audit2 = WeightAudit(ix, [ROTARY, VISION])
    params = dict(tree_flatten(model.parameters()))
    params["model.norm.weight"] = mx.zeros((32,))
    params["lm_head.weight"] = params["lm_head.weight"].astype(mx.bfloat16)
    audit2.expect_params(params)
    with pytest.raises(LoadError) as e:
        audit.check()
    assert "2 missing" in str(e.value) and "model.layers.2.mlp.up_proj.weight" in str(e.value)
    assert audit.finish().missing == ("lm_head.bias", "model.layers.2.mlp.up_proj.weight")
    report = audit2.finish()
    assert [m.name for m in report.mismatched] == ["lm_head.weight", "model.norm.weight"]
    norm = report.mismatched[1]
    name, expected, found = norm
    assert (name, expected.shape, found.shape, found.dtype) == ("model.norm.weight", (32,), (64,), "float32")
    assert report.mismatched[0].found.dtype == "float32" and report.mismatched[0].expected.dtype == "bfloat16"
    with pytest.raises(LoadError, match=r"model\.norm\.weight \(expected \(32,\) float32, found \(64,\) float32\)"):
        audit2.check()
    # shapes-only mode forgives the dtype, as mlx-lm's load_weights does
    audit3 = WeightAudit(ix, [ROTARY, VISION])
    audit3.expect_params(params, dtype=False)
    assert [m.name for m in audit3.finish().mismatched] == ["model.norm.weight"]
    # an unchecked dtype is left out of the message (it printed as a bare "?")
    assert "model.norm.weight (expected (32,), found (64,) float32)" in audit3.finish().describe()
    assert (str(TensorSpec(None, "uint32")), str(TensorSpec(None, None))) == ("uint32", "any")


def test_audit_lists_ten_names_then_counts():
    audit = WeightAudit([f"w{i:02d}" for i in range(25)])
    with pytest.raises(LoadError) as e:
        audit.check()
    msg = str(e.value)
    assert "25 unconsumed" in msg and "w09" in msg and "w10" not in msg and "and 15 more" in msg


def test_audit_names_only_and_predicate_rules():
    audit = WeightAudit(["a", "b.scales_old", "c"], [DropRule(lambda n: n.endswith("_old"), "legacy")])
    audit.expect("a", (9, 9), mx.float16)  # no header info: presence only
    audit.expect("c")
    report = audit.check()
    assert report.consumed == ("a", "c") and report.dropped == {"b.scales_old": "legacy"}


def test_audit_on_loaded_arrays_and_conflicting_expect():
    audit = WeightAudit({"w": mx.zeros((2, 3), dtype=mx.float16)})
    audit.expect("w", (2, 3), "F16")
    assert audit.check().consumed == ("w",)
    with pytest.raises(ValueError):
        audit.expect("w", (3, 2))


def test_check_values_names_nan_and_inf_tensors_and_skips_dropped_ones(tmp_path, llama_args):
    """Headers cannot show values: the header-only report says so (values_checked False), and
    `check_values` reads every floating tensor but the dropped ones, failing on NaN/inf by name."""
    model = tiny_llama(llama_args)
    weights = dict(tree_flatten(model.parameters()))
    weights["model.norm.weight"] = mx.full((64,), float("nan"))
    weights["model.layers.0.mlp.up_proj.weight"] = mx.full((128, 64), float("inf"))
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": mx.full((8,), float("nan")),
             "ids": mx.zeros((4,), dtype=mx.int32)}
    ix = read_index(save_model(model, tmp_path / "ckpt", extra | weights))
    audit = WeightAudit(ix, [ROTARY, DropRule(r"^ids$", "not a weight")])
    audit.expect_params(model.parameters())
    report = audit.check()
    assert report.ok and not report.values_checked and report.nonfinite == ()
    with pytest.raises(LoadError) as e:
        check_values(report, ix)
    assert str(e.value) == (f"weights in {ix.root} fail the value check: 2 holding NaN/inf: "
                            "model.layers.0.mlp.up_proj.weight, model.norm.weight")
    clean = read_index(save_model(model, tmp_path / "clean", extra))
    audit = WeightAudit(clean, [ROTARY, DropRule(r"^ids$", "not a weight")])
    audit.expect_params(model.parameters())
    checked = check_values(audit.check(), clean)
    assert checked.values_checked and checked.ok and checked.describe().endswith("all match, values finite")


def test_consumed_beats_drop_rule():
    audit = WeightAudit(["x.rotary_emb.inv_freq"], [ROTARY])
    audit.expect("x.rotary_emb.inv_freq")
    report = audit.check()
    assert report.consumed == ("x.rotary_emb.inv_freq",) and not report.dropped


# ------------------------------------------------------------------ artifact fingerprint

REV = "0123456789abcdef0123456789abcdef01234567"


def hub_snapshot(cache: Path, folder: str, rev: str = REV) -> Path:
    """A hub-cache-shaped tree: files in snapshots/<rev> are relative symlinks into blobs/."""
    repo = cache / folder
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    snap = repo / "snapshots" / rev
    (snap / "sub").mkdir(parents=True, exist_ok=True)
    (repo / "blobs" / "cfgblob").write_text("{}")
    (repo / "blobs" / "subblob").write_text("x")
    os.symlink("../../blobs/cfgblob", snap / "config.json")
    os.symlink("../../../blobs/subblob", snap / "sub" / "file.txt")
    return snap


def test_fingerprint_snapshot_paths(tmp_path):
    snap = hub_snapshot(tmp_path / "hub", "models--Qwen--Qwen3-0.6B")
    want = f"hf:Qwen/Qwen3-0.6B@{REV}"
    assert (snap / "config.json").resolve().parent.name == "blobs"  # really a link into blobs
    for p in (snap, snap / "config.json", snap / "sub", snap / "sub" / "file.txt", str(snap) + "/"):
        assert artifact_fingerprint(p) == want, p


def test_fingerprint_survives_relocation_and_symlinked_aliases(tmp_path):
    snap = hub_snapshot(tmp_path / "hub", "models--org--repo")
    moved = tmp_path / "elsewhere" / "cache"
    shutil.copytree(tmp_path / "hub", moved, symlinks=True)
    shutil.rmtree(tmp_path / "hub")
    msnap = moved / "models--org--repo" / "snapshots" / REV
    assert (msnap / "config.json").read_text() == "{}"
    assert artifact_fingerprint(msnap) == artifact_fingerprint(msnap / "config.json") == f"hf:org/repo@{REV}"
    alias = tmp_path / "my-model"
    os.symlink(msnap, alias)
    assert artifact_fingerprint(alias) == f"hf:org/repo@{REV}"
    assert artifact_fingerprint(alias / "config.json") == f"hf:org/repo@{REV}"
    assert snap != msnap


def test_fingerprint_no_org_and_sha256_rev(tmp_path):
    rev64 = "ab" * 32
    assert artifact_fingerprint(hub_snapshot(tmp_path, "models--gpt2", rev64)) == f"hf:gpt2@{rev64}"


@pytest.mark.parametrize("folder, rev", [
    ("models--org--repo", "main"),  # mutable alias
    ("models--org--repo", REV.upper()),
    ("models--org--repo", REV[:39]),
    ("models--org--repo", "a" * 65),
    ("models--org--repo", "g" * 40),
    ("models--a--b--c", REV),  # '--' inside a name cannot come from a valid repo id
    ("models--org--", REV),
    ("datasets--org--repo", REV),
    ("org--repo", REV),
])
def test_fingerprint_refuses_non_snapshots(tmp_path, folder, rev):
    assert artifact_fingerprint(hub_snapshot(tmp_path, folder, rev)) is None


def test_fingerprint_plain_dirs_and_blobs(tmp_path):
    snap = hub_snapshot(tmp_path / "hub", "models--org--repo")
    assert artifact_fingerprint(tmp_path) is None
    assert artifact_fingerprint(snap.parent) is None  # .../snapshots
    assert artifact_fingerprint(snap.parent.parent / "blobs" / "cfgblob") is None
    plain = tmp_path / "plain"
    plain.mkdir()
    assert artifact_fingerprint(plain) is None


# ------------------------------------------------------------------ misc API shape


def test_index_is_immutable_and_typed(tmp_path):
    f = tmp_path / "x.safetensors"
    save_file({"w": np.zeros(2, np.float32)}, str(f))
    ix = read_index(f)
    assert isinstance(ix, WeightIndex) and isinstance(ix.tensors["w"], TensorInfo)
    with pytest.raises(TypeError):
        ix.tensors["v"] = ix.tensors["w"]  # type: ignore[index]
