"""Bad input found trying the CLI as a new user would (issue 33): GGUF import paths, kv-plan
outputs, comma lists, stray files, and messages that name a flag the user did not type.

Each case runs the real CLI (`mlxbun.cli.main`) and asserts a one-line named error with no
traceback, raised before any work (a model that does not exist is never reached), and that no
file appeared or changed (checksums of the directory before and after).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlxbun import atomic
from tests.bad_input.helpers import ROOT, refused, run, tree

NO_MODEL = "/nonexistent/model-dir"  # refusals must come before the model is looked for


def _gguf(path: Path, dims: list[int], ggml_type: int = 0) -> Path:
    """A GGUF v3 header with one tensor of `dims` (GGML order) and 64 bytes of data."""
    def s(x: str) -> bytes:
        return struct.pack("<Q", len(x)) + x.encode()

    h = b"GGUF" + struct.pack("<IQQ", 3, 1, 1) + s("general.architecture") + struct.pack("<I", 8) + s("llama")
    h += s("t.weight") + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
    h += struct.pack("<IQ", ggml_type, 0)
    path.write_bytes(h + b"\0" * (-len(h) % 32) + b"\0" * 64)
    return path


# ------------------------------------------------------------------ import gguf


@pytest.mark.parametrize("dims, ggml_type", [([2**40, 2**40], 0), ([2**62, 4], 0), ([32, 2**60], 8)],
                         ids=["2^40x2^40-F32", "2^62x4-F32", "Q8_0-2^60-rows"])
def test_import_gguf_dims_past_int64_are_named(tmp_path, capsys, dims, ggml_type):
    """Dims whose product wraps int64 once gave numpy's 'cannot reshape array of size 0'."""
    f = _gguf(tmp_path / "big.gguf", dims, ggml_type)
    before = tree(tmp_path)
    line = refused(capsys, ["import", "gguf", str(f), "--out", str(tmp_path / "out")],
                   f, "truncated GGUF file", "'t.weight'", f"dims {dims}", "the file has 192")
    assert "reshape" not in line
    assert tree(tmp_path) == before


def test_import_gguf_out_that_cannot_be_created(tmp_path, capsys):
    """--out under a file, under a broken link, or the root: refused before the file is read
    (the GGUF file here is corrupt: its error never shows)."""
    f = _gguf(tmp_path / "big.gguf", [2**40, 2**40])
    (tmp_path / "afile").write_text("mine")
    os.symlink(tmp_path / "nowhere" / "x", tmp_path / "dangling")
    before = tree(tmp_path)
    for out in ("afile/sub", "afile/sub/deeper"):
        refused(capsys, ["import", "gguf", str(f), "--out", str(tmp_path / out)],
                f"--out {tmp_path / out}: cannot be created", f"{tmp_path / 'afile'} is a file, not a directory")
    refused(capsys, ["import", "gguf", str(f), "--out", str(tmp_path / "dangling" / "sub")], "is a broken link")
    refused(capsys, ["import", "gguf", str(f), "--out", str(tmp_path / "afile")], "exists and is not a directory")
    refused(capsys, ["import", "gguf", str(f), "--out", "/", "--force"], "the root directory cannot be replaced")
    assert tree(tmp_path) == before


def _killed_staging(out: Path) -> Path:
    """The staging directory of an import into `out` whose process was killed (SIGKILL) inside it."""
    code = ("import os, sys\nfrom pathlib import Path\nfrom mlxbun.gguf.writer import staging\n"
            "with staging(Path(sys.argv[1])) as w:\n"
            "    (w / 'model.safetensors').write_bytes(b'x' * 1000)\n    print(w, flush=True)\n"
            "    os.kill(os.getpid(), 9)\n")
    p = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == -9, p.stderr
    left = Path(p.stdout.strip())
    assert left.is_dir() and left.parent == out.parent
    return left


def test_import_gguf_sweeps_staging_that_killed_imports_left(zoo, tmp_path, capsys):
    from tests.gguf_export import export_gguf

    f = export_gguf(zoo("llama"), tmp_path / "tiny.gguf")
    out = tmp_path / "ckpt"
    killed = _killed_staging(out)
    old = tmp_path / ".ckpt.import-abcd1234"  # an older mlxbun's name, untouched for two days
    (old / "ckpt").mkdir(parents=True)
    two_days = time.time() - 2 * 86400
    for p in (old / "ckpt", old):
        os.utime(p, (two_days, two_days))
    # kept: a live import's, a recent one of another host, another --out's, and lookalikes
    live = tmp_path / f".ckpt.import-{os.getpid()}.{atomic.HOST}-abcd1234"
    recent = tmp_path / ".ckpt.import-123.0000ffff-abcd1234"
    other = tmp_path / f".other.import-{killed.name.split('-')[1]}-abcd1234"
    notes = tmp_path / ".ckpt.import-my-notes"
    for d in (live, recent, other, notes):
        d.mkdir()
    lookalike_file = tmp_path / ".ckpt.import-abcd1235"
    lookalike_file.write_text("a file")
    kept = tree(tmp_path / ".ckpt.import-my-notes")
    code, out_text, err = run(capsys, ["import", "gguf", str(f), "--out", str(out)])
    assert code == 0 and out_text.startswith(str(out)), err
    assert "removed 2 staging directories a killed import left" in err and str(killed) in err and str(old) in err
    assert not killed.exists() and not old.exists()
    assert all(d.is_dir() for d in (live, recent, other, notes)) and lookalike_file.read_text() == "a file"
    assert tree(notes) == kept
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt.import-")) == sorted(
        p.name for p in (live, recent, notes, lookalike_file))


# ------------------------------------------------------------------ generate


@pytest.mark.parametrize("ids, culprit", [("1,,3", "item 2 of 3 is empty"), ("1,2,", "item 3 of 3 is empty"),
                                          (",1", "item 1 of 2 is empty"), ("1, x", "item 2 ('x') is not an integer"),
                                          ("", "nothing given")])
def test_generate_prompt_ids_refuse_empty_items(capsys, ids, culprit):
    """`1,,3` once ran as `1,3`; refused before the model is looked for."""
    refused(capsys, ["generate", "--model", NO_MODEL, "--prompt-ids", ids], "--prompt-ids", culprit)


def test_generate_kv_messages_quote_the_setting(tmp_path, capsys):
    line = refused(capsys, ["generate", "--model", NO_MODEL, "--prompt", "x", "--kv", "turboquant:9"],
                   "KV setting 'turboquant:9'", "BITS 9 is not a TurboQuant width")
    assert "kv_bits" not in line
    line = refused(capsys, ["generate", "--model", NO_MODEL, "--prompt", "x", "--kv", "uniform:4,group=48"],
                   "KV setting 'uniform:4,group=48'", "group=48 is not a KV group size")
    assert "kv_group_size" not in line
    refused(capsys, ["generate", "--model", NO_MODEL, "--prompt", "x", "--kv-config", str(tmp_path)],
            f"--kv-config {tmp_path}: is a directory")
    refused(capsys, ["generate", "--model", NO_MODEL, "--prompt", "x", "--kv-config", str(tmp_path / "no.json")],
            "no such file")
    refused(capsys, ["generate", "--model", NO_MODEL, "--prompt", "x", "--prompt-cache", str(tmp_path)],
            f"--prompt-cache {tmp_path}: is a directory")


def test_corrupt_prompt_cache_names_the_path_first(tmp_path, capsys, monkeypatch, zoo_root):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    for name, data in (("garbage.safetensors", b"garbage\n" * 4), ("short.safetensors", b"abcd")):
        (tmp_path / name).write_bytes(data)
        before = tree(tmp_path)
        line = refused(capsys, ["generate", "--model", "zoo:llama", "--prompt", "x", "--prompt-cache",
                                str(tmp_path / name)], "prompt cache unreadable")
        assert line.startswith(f"mlxbun generate: error: {tmp_path / name}: prompt cache unreadable"), line
        assert tree(tmp_path) == before


# ------------------------------------------------------------------ kv-plan


def test_kv_plan_out_is_checked_before_the_measurement(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    before = tree(tmp_path)
    refused(capsys, ["kv-plan", NO_MODEL, "--budget", "0.01", "--out", str(tmp_path / "missing" / "plan.json")],
            f"directory {tmp_path / 'missing'} does not exist")
    refused(capsys, ["kv-plan", NO_MODEL, "--budget", "0.01", "--out", str(tmp_path)],
            f"--out {tmp_path}: is a directory")
    refused(capsys, ["kv-plan", NO_MODEL, "--budget", "0.01", "--out", str(tmp_path / "afile" / "plan.json")],
            "is a file, not a directory")
    assert tree(tmp_path) == before


def test_kv_plan_bits_refuse_empty_items(capsys):
    refused(capsys, ["kv-plan", NO_MODEL, "--budget", "0.01", "--bits", "8,,4"], "--bits", "item 2 of 3 is empty",
            code=2)


def test_kv_plan_narrow_heads_get_generates_advice(tmp_path, capsys, zoo_root):
    """zoo:llama's head dim 16 is below every group size: no group size to advise, the wide zoo name."""
    line = refused(capsys, ["kv-plan", "zoo:llama", "--budget", "0.01", "--prefill", "8", "--eval-tokens", "2",
                            "--zoo-cache", str(zoo_root), "--out", str(tmp_path / "plan.json")],
                   "head dim 16", "below every KV group size", "zoo:llama,head_dim=64")
    assert "(32, 64, 128)" in line and "use a group size that does" not in line
    refused(capsys, ["kv-plan", "zoo:llama", "--budget", "0.01", "--prefill", "8", "--eval-tokens", "2",
                     "--group-size", "32", "--zoo-cache", str(zoo_root)], "zoo:llama,head_dim=32")
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------ bench, spec results


def test_refused_bench_creates_no_results_file(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    before = tree(tmp_path)
    refused(capsys, ["bench", "--model", "random:nonexistent-shape", "--results", str(tmp_path / "X")],
            "random:nonexistent-shape", "unknown shape")
    refused(capsys, ["bench", "--model", "random:nonexistent-shape", "--results", str(tmp_path / "new" / "r.db")],
            "unknown shape")
    refused(capsys, ["bench", "--model", "random:nonexistent-shape", "--results", str(tmp_path / "afile" / "r.db")],
            "cannot create the results database", "is a file, not a directory")
    assert tree(tmp_path) == before


def test_spec_results_that_cannot_be_created_refuse_first(tmp_path, capsys):
    (tmp_path / "afile").write_text("mine")
    before = tree(tmp_path)
    refused(capsys, ["generate", "--model", NO_MODEL, "--prompt", "x", "--draft", "ngram",
                     "--spec-results", str(tmp_path / "afile" / "r.db")], "cannot create the results database")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("argv", [["port", "zoo:llama", "--variants", "f32,,q4"],
                                  ["tp-check", "zoo:llama", "--variants", "f32,"]])
def test_variant_lists_refuse_empty_items(capsys, argv):
    """The siblings of --prompt-ids: comma lists that dropped an empty item silently."""
    refused(capsys, argv, "--variants", "is empty")
