"""Bad checkpoints and bad values through the CLI (the cases that already behaved before issue 11,
kept here so they stay that way): corrupt, truncated, overlapping or oddly typed safetensors,
missing or broken config and tokenizer files, unknown model types, numerics keys the graph does not
handle, foreign prompt caches and results databases, bad KV plans, bad option values.

Each case runs `mlxbun generate` or `mlxbun port` in this process and asserts exit code 1, one
line on stderr naming the culprit, no traceback, and that the checkpoint and the working directory
are byte for byte what they were (a refusal writes nothing).
"""

from __future__ import annotations

import json
import shutil
import sqlite3
import struct
from pathlib import Path

import pytest

from tests.bad_input.helpers import refused, run, tree


@pytest.fixture
def ckpt(zoo, tmp_path, monkeypatch):
    """A private copy of the zoo's llama (float32) to damage, in a fresh working directory."""
    monkeypatch.chdir(tmp_path)
    return Path(shutil.copytree(zoo("llama"), tmp_path / "llama"))


def _shard(path: Path, tensor: str = "model.layers.1.mlp.down_proj.weight") -> Path:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][tensor]


def _rewrite_header(shard: Path, edit) -> None:
    raw = shard.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def _generate(path: Path) -> list[str]:
    return ["generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "2"]


def _refused_unchanged(capsys, tmp_path: Path, argv: list[str], *culprits) -> str:
    before = tree(tmp_path)
    line = refused(capsys, argv, *culprits)
    assert tree(tmp_path) == before, "a refusal changed files"
    return line


def _truncate(p: Path):
    s = _shard(p)
    s.write_bytes(s.read_bytes()[: s.stat().st_size // 2])
    return s.name


def _garbage(p: Path):
    s = _shard(p)
    s.write_bytes(b"\x13\x37" * 1000)
    return s.name


def _overlap(p: Path):
    s = _shard(p)

    def edit(h):
        by_size = {}
        for name, info in h.items():
            if name != "__metadata__":
                by_size.setdefault(info["data_offsets"][1] - info["data_offsets"][0], []).append(name)
        a, b = next(names for names in by_size.values() if len(names) > 1)[:2]
        h[b]["data_offsets"] = h[a]["data_offsets"]  # two tensors of one size on the same bytes
    _rewrite_header(s, edit)
    return s.name


def _unknown_dtype(p: Path):
    s = _shard(p)
    _rewrite_header(s, lambda h: h["model.layers.1.mlp.down_proj.weight"].update(dtype="Q9"))
    return "model.layers.1.mlp.down_proj.weight"


def _missing_tensor(p: Path):
    s = _shard(p)

    def edit(h):
        del h["model.layers.1.mlp.down_proj.weight"]
    _rewrite_header(s, edit)
    return "model.layers.1.mlp.down_proj.weight"


@pytest.mark.parametrize("damage, message", [
    (_truncate, "run past the end of the file"), (_garbage, ""), (_overlap, "overlap"), (_unknown_dtype, "Q9"),
    (_missing_tensor, "absent from their shard"),
], ids=["truncated", "garbage", "overlapping", "unknown-dtype", "missing-tensor"])
def test_damaged_safetensors_name_the_file_or_tensor(ckpt, tmp_path, capsys, damage, message):
    culprit = damage(ckpt)
    line = _refused_unchanged(capsys, tmp_path, _generate(ckpt), culprit)
    assert message in line, line
    # port reports a refusal as a row of its table (verdict refused, the reason under it), exit 1
    before = tree(tmp_path)
    code, out, _ = run(capsys, ["port", str(ckpt), "--no-goldens"])
    flat = " ".join(out.split())  # rich wraps the reason to the terminal's width
    assert code == 1 and "refused" in flat and culprit in flat and message in flat and "0/1 bit-exact" in flat
    assert tree(tmp_path) == before


@pytest.mark.parametrize("change, culprit", [
    (lambda p: (p / "config.json").unlink(), "config.json"),
    (lambda p: (p / "config.json").write_text("{not json"), "config.json"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                           "model_type": "no_such_arch"})), "no_such_arch"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                           "mystery_scale": 2.5})), "mystery_scale"),
    (lambda p: (p / "config.json").write_text(json.dumps({**json.loads((p / "config.json").read_text()),
                                                           "hidden_act": "gelu"})), "hidden_act"),
    (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json"),
    (lambda p: (p / "tokenizer.json").write_text("[1, 2"), "tokenizer.json"),
], ids=["no-config", "broken-config", "unknown-model-type", "unknown-numerics-key", "unsupported-activation",
        "no-tokenizer", "broken-tokenizer"])
def test_bad_config_and_tokenizer_files_are_named(ckpt, tmp_path, capsys, change, culprit):
    change(ckpt)
    _refused_unchanged(capsys, tmp_path, _generate(ckpt), culprit)


def test_a_foreign_prompt_cache_is_refused(ckpt, zoo, tmp_path, capsys):
    not_a_cache = _shard(ckpt)  # a safetensors file, but a model shard
    _refused_unchanged(capsys, tmp_path, [*_generate(ckpt), "--prompt-cache", str(not_a_cache)], not_a_cache.name)
    other = tmp_path / "qwen3.safetensors"  # a real prompt cache, of another model
    code, _, err = run(capsys, ["generate", "--model", str(zoo("qwen3")), "--prompt", "hi", "--max-tokens", "1",
                                "--save-prompt-cache", str(other)])
    assert code == 0, err
    _refused_unchanged(capsys, tmp_path, [*_generate(ckpt), "--prompt-cache", str(other)], other.name)


def test_a_foreign_results_database_is_refused(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    db = tmp_path / "someone-elses.sqlite"
    with sqlite3.connect(db) as con:
        con.execute("CREATE TABLE invoices (id INTEGER, amount REAL)")
    for argv in (["results", "show", "--results", str(db)], ["results", "export", "--results", str(db)]):
        _refused_unchanged(capsys, tmp_path, argv, db.name)


@pytest.mark.parametrize("plan, culprit", [
    ([{"layer_idx": 9, "bits": 4}], "layer_idx=9"), ([{"layer_idx": 0, "bits": 7}], "bits=7"),
    ({"kv_config": []}, "layers"), ("not a plan", "kv_config"),
])
def test_bad_kv_plans_are_named(ckpt, tmp_path, capsys, plan, culprit):
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(plan))
    _refused_unchanged(capsys, tmp_path, [*_generate(ckpt), "--kv-config", str(f)], culprit)


@pytest.mark.parametrize("flags, culprit", [
    (["--max-tokens", "0"], "max_tokens"), (["--temp", "-1"], "temp"), (["--top-p", "1.5"], "top_p"),
    (["--kv-bits", "7"], "kv_bits 7"), (["--kv-group-size", "48", "--kv-bits", "4"], "kv_group_size 48"),
    (["--kv-scheme", "lossy"], "lossy"), (["--engine", "torch"], "torch"), (["--prompt-ids", "1,x"], "1,x"),
    (["--draft", "ngram:0"], "ngram:0"), (["--max-kv-size", "0"], "max_kv_size"),
])
def test_bad_option_values_are_named(ckpt, tmp_path, capsys, flags, culprit):
    argv = ["generate", "--model", str(ckpt), "--max-tokens", "2", *flags]
    if "--prompt-ids" not in flags:
        argv += ["--prompt", "hello"]
    _refused_unchanged(capsys, tmp_path, argv, culprit)


def test_nan_weights_stop_generation_with_the_reason(zoo, tmp_path, capsys, monkeypatch):
    """NaN logits used to stream `<pad>` tokens without a word."""
    from tests.conftest import nan_weight_copy

    monkeypatch.chdir(tmp_path)
    bad = nan_weight_copy(zoo("llama"), tmp_path / "nan-llama", "model.layers.1.mlp.down_proj.weight")
    _refused_unchanged(capsys, tmp_path, _generate(bad), "logits are NaN", "--check-values")
