"""Bad input to `zoo build`, `port`, `ls` and the weight audit (issue 11): each case asserts the
exit code, that no traceback is printed, that the message names the culprit, and that no file
outside the intended output changed (checksums before and after). Ends with a hypothesis fuzz of
the CLI argument parser."""

import json
import os
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxbun.cli import build_parser, main
from mlxbun.zoo import BUILDERS
from mlxbun.zoo.common import MARKER
from tests.bad_input.helpers import refused, run, tree

# ------------------------------------------------------------------ zoo build


@pytest.mark.parametrize("hf_cache", [False, True], ids=["plain", "hf-cache"])
def test_zoo_build_out_naming_a_file_is_one_line(tmp_path, capsys, hf_cache):
    (tmp_path / "afile").write_text("mine")
    before = tree(tmp_path)
    flags = ["--hf-cache"] if hf_cache else []
    refused(capsys, ["zoo", "build", "llama", "--out", str(tmp_path / "afile"), *flags],
            tmp_path / "afile", "is a file")
    refused(capsys, ["zoo", "build", "llama", "--out", str(tmp_path / "afile" / "sub"), *flags], "afile", "is a file")
    assert tree(tmp_path) == before


def test_zoo_build_never_deletes_a_users_files(tmp_path, capsys):
    """The issue's case: a NOTES.txt added to a zoo build survived no rebuild. Now a rebuild
    refuses before building; a directory the zoo did not build (no marker) and a file in the
    checkpoint's place are refused too; other builds in the same --out stay untouched."""
    out = tmp_path / "out"
    code, stdout, _ = run(capsys, ["zoo", "build", "llama", "qwen3", "--out", str(out)])
    assert code == 0 and [line.split("\t")[1] for line in stdout.splitlines()] == [
        str(out / "tiny-llama"), str(out / "tiny-qwen3")]  # the directories written
    (out / "tiny-llama" / "NOTES.txt").write_text("my notes")
    (tmp_path / "elsewhere.txt").write_text("untouched")
    before = tree(tmp_path)
    refused(capsys, ["zoo", "build", "llama", "--out", str(out)], out / "tiny-llama", "NOTES.txt",
            "did not write")
    refused(capsys, ["zoo", "build", "qwen3", "llama", "--out", str(out)], "NOTES.txt")  # nothing built first
    assert tree(tmp_path) == before

    foreign = tmp_path / "mine" / "tiny-llama"
    foreign.mkdir(parents=True)
    (foreign / "config.json").write_text("{}")
    (tmp_path / "mine" / "tiny-phi").write_text("a file named like a build")
    before = tree(tmp_path)
    refused(capsys, ["zoo", "build", "llama", "--out", str(foreign.parent)], foreign, "not built by the zoo", MARKER)
    refused(capsys, ["zoo", "build", "phi", "--out", str(foreign.parent)], foreign.parent / "tiny-phi",
            "not a directory")
    assert tree(tmp_path) == before

    # the zoo's own build, holding nothing else, is replaced: only it changes (here: not at all)
    (out / "tiny-llama" / "NOTES.txt").unlink()
    before = tree(tmp_path)
    code, _, _ = run(capsys, ["zoo", "build", "llama", "--out", str(out)])
    assert code == 0 and tree(tmp_path) == before


def test_zoo_build_hf_cache_adds_and_deletes_nothing(tmp_path, capsys):
    cache = tmp_path / "hub"
    (cache / "models--someone--else" / "snapshots" / "abc").mkdir(parents=True)
    (cache / "models--someone--else" / "snapshots" / "abc" / "NOTES.txt").write_text("mine")
    (cache / "NOTES.txt").write_text("mine")
    code, stdout, _ = run(capsys, ["zoo", "build", "llama", "--hf-cache", "--out", str(cache)])
    assert code == 0
    snap = Path(stdout.split("\t")[1].strip())
    (snap.parent.parent / "NOTES.txt").write_text("in the zoo's repo folder")
    before = tree(tmp_path)
    code, stdout_again, _ = run(capsys, ["zoo", "build", "llama", "--hf-cache", "--out", str(cache)])
    assert code == 0 and stdout_again == stdout and tree(tmp_path) == before  # same revision, nothing touched

    repo = cache / "models--mlxbun--tiny-phi"
    repo.mkdir()
    (repo / "blobs").write_text("not a directory")
    before = tree(tmp_path)
    refused(capsys, ["zoo", "build", "phi", "--hf-cache", "--out", str(cache)], repo / "blobs", "not a directory")
    assert tree(tmp_path) == before


@pytest.mark.parametrize("argv, culprits", [
    (["--head-dim", "7"], ["head_dim", "7"]),
    (["--head-dim", "-2"], ["head_dim", "-2"]),
    (["--quant", "3"], ["quant", "3"]),
    (["--dtype", "int8"], ["dtype", "int8"]),
    (["--seed", "-1"], ["seed", "-1"]),
])
def test_zoo_build_bad_values_refuse_before_building(tmp_path, capsys, argv, culprits):
    refused(capsys, ["zoo", "build", "llama", "--out", str(tmp_path / "out"), *argv], *culprits)
    assert list(tmp_path.iterdir()) == []


def test_zoo_build_head_dim_from_the_cli(tmp_path, capsys, zoo_root):
    """`--head-dim N` builds the wide checkpoint quantized KV needs, prints its directory, and
    holds the same bytes as the name zoo:ARCH,head_dim=N; an arch whose mlx-lm ModelArgs has no
    head_dim is refused by name."""
    from mlxbun.locate import locate

    code, stdout, _ = run(capsys, ["zoo", "build", "qwen3", "--head-dim", "32", "--out", str(tmp_path)])
    assert code == 0 and stdout == f"qwen3\t{tmp_path / 'tiny-qwen3-hd32'}\n"
    built = tmp_path / "tiny-qwen3-hd32"
    assert json.loads((built / "config.json").read_text())["head_dim"] == 32
    named = locate("zoo:qwen3,head_dim=32", zoo_root=zoo_root)
    assert tree(built) == tree(named)
    refused(capsys, ["zoo", "build", "gpt_neox", "--head-dim", "32", "--out", str(tmp_path)], "gpt_neox", "head_dim")
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-qwen3-hd32"]


# ------------------------------------------------------------------ port and the audit


def test_port_check_values_refuses_nan_weights_by_name(zoo, tmp_path, capsys):
    from tests.conftest import nan_weight_copy

    name = "model.layers.0.self_attn.k_proj.weight"
    bad = nan_weight_copy(zoo("llama"), tmp_path / "nan-llama", name)
    before = tree(tmp_path)
    code, out, err = run(capsys, ["port", str(bad), "--check-values", "--goldens", str(tmp_path / "g")])
    assert code == 1 and "refused" in out and name in out and "NaN/inf" in out
    assert tree(tmp_path) == before  # a refused target writes no manifest


def test_port_outside_the_checkout_writes_no_goldens(zoo_root, tmp_path, monkeypatch, capsys):
    (tmp_path / "goldens").mkdir()
    (tmp_path / "goldens" / "keep.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    before = tree(tmp_path)
    code, _, err = run(capsys, ["port", "zoo:llama", "--variants", "fp32", "--zoo-cache", str(zoo_root),
                                "--decode-steps", "1", "--prompt-len", "4"])
    assert code == 0 and "no golden manifests written" in err and "--goldens DIR" in err
    assert len(err.strip().splitlines()) == 1
    assert tree(tmp_path) == before


def test_missing_and_misshapen_tensors_name_what_was_expected(zoo, tmp_path, capsys):
    """A wrong-shaped norm said "expected (64,) ?": the unchecked dtype is left out now."""
    import mlx.core as mx

    bad = tmp_path / "bad"
    shutil.copytree(zoo("llama"), bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    shard = bad / index["weight_map"]["model.norm.weight"]
    weights = dict(mx.load(str(shard)))
    weights["model.norm.weight"] = weights["model.norm.weight"][:32]
    mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
    before = tree(tmp_path)
    code, out, _ = run(capsys, ["port", str(bad), "--no-goldens", "--json"])
    (row,) = json.loads(out)
    assert code == 1 and row["verdict"] == "refused"
    assert row["reason"].endswith("1 mismatched: model.norm.weight (expected (64,), found (32,) float32)")
    code, _, err = run(capsys, ["generate", "--model", str(bad), "--prompt-ids", "1,2"])
    assert code == 1 and "(expected (64,), found (32,) float32)" in err and "?" not in err
    assert tree(tmp_path) == before


# ------------------------------------------------------------------ ls


def test_ls_on_an_empty_cache_says_how_to_fill_it(tmp_path, capsys):
    before = tree(tmp_path)
    code, out, err = run(capsys, ["ls", "--cache", str(tmp_path)])
    assert code == 0 and err == ""
    assert f"No models found in {tmp_path}" in out and "mlxbun zoo build ARCH --hf-cache --out" in out
    assert "mlxbun ls DIR" in out
    assert tree(tmp_path) == before
    refused(capsys, ["ls", "--cache", str(tmp_path / "missing")], tmp_path / "missing")


# ------------------------------------------------------------------ fuzz: the argument parser

def _commands(parser, path=()) -> list[tuple[list[str], list[str]]]:
    """(command path, its flags) for the parser and every subcommand under it, read from the
    parser itself, so the vocabulary follows the CLI."""
    import argparse

    out = [(list(path), [o for a in parser._actions for o in a.option_strings])]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += _commands(sub, (*path, name))
    return out


# Values that are wrong or harmless. No real arch, model, notebook or `all`: nothing here builds,
# loads or runs a model, so each example is fast.
VALUES = ["", "-", "-1", "0", "1", "2", "3", "7", "1e999", "nan", "x", "q4", "4", "mixed", "int8", "float16",
          "mamba", "zoo:nope", "zoo:", "zoo:all@q3", "zoo:llama,seed=x", "zoo:llama@q9", "nope/nope",
          "missing-dir", "file.gguf", "random:", "ngram:0", "uniform:3", "turboquant:x", "csv", "md",
          "not-a-date", "nope.ipynb", "1,2,x", "99999", "--", "NAME", "=", "\x00", "é"]
LONG_WORK = {"all", *BUILDERS}  # `zoo build --out DIR all` builds every arch


def _harmless(text: str) -> bool:
    """Not a name that starts work, nor a path leaving the working directory ("/x", "~/x")."""
    return text not in LONG_WORK and "/" not in text and not text.startswith("~")


VALUE = st.sampled_from(VALUES) | st.text(max_size=12).filter(_harmless)
# the flags argparse requires, so that most examples get past it
REQUIRED = {("generate",): ["--model"], ("bench",): ["--model"], ("zoo", "build"): ["--out", "out"],
            ("import", "gguf"): ["--out", "out"]}
COMMANDS = _commands(build_parser()) + [(["nope"], [])]


@st.composite
def argvs(draw) -> list[str]:
    path, flags = draw(st.sampled_from(COMMANDS))
    required = REQUIRED.get(tuple(path), [])
    head = required + [draw(VALUE)] if required and draw(st.booleans()) else []
    rest = draw(st.lists(st.sampled_from(flags) | VALUE if flags else VALUE, max_size=6))
    return path + head + rest


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=argvs())
def test_fuzz_the_cli_never_tracebacks(tmp_path, monkeypatch, capsys, argv):
    """Random argv through `mlxbun.cli.main` (in a temp HOME, results database, zoo and GGUF caches, hub
    cache and working directory): it returns or exits with 0, 1 or 2, never raises, never
    prints a traceback."""
    import huggingface_hub.constants

    for var, sub in (("HOME", "home"), ("MLXBUN_RESULTS", "results.sqlite"), ("MLXBUN_ZOO_CACHE", "zoo"),
                     ("MLXBUN_GGUF_CACHE", "gguf"), ("HF_HOME", "hf")):
        monkeypatch.setenv(var, str(tmp_path / sub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    work = tmp_path / "cwd"
    work.mkdir(exist_ok=True)
    monkeypatch.chdir(work)
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    assert code in (0, 1, 2), (argv, code, err)
    assert "Traceback" not in out + err, (argv, err)


def test_a_zoo_build_sweeps_the_staging_a_killed_build_left(tmp_path):
    """Builds stage in `.NAME.build-PID.HOST-XXXXXXXX`: one whose process is gone is removed by the
    next build of that name there; a live process's, another name's and a lookalike file stay."""
    import subprocess
    import sys

    from mlxbun import atomic
    from mlxbun.zoo.common import build_into

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    killed = tmp_path / f".tiny.build-{int(dead.stdout)}.{atomic.HOST}-abcd1234"
    (killed / "tiny").mkdir(parents=True)
    live = tmp_path / f".tiny.build-{os.getpid()}.{atomic.HOST}-abcd1234"
    other = tmp_path / f".other.build-{int(dead.stdout)}.{atomic.HOST}-abcd1234"
    for d in (live, other):
        d.mkdir()
    (tmp_path / ".tiny.build-abcd1235").write_text("a file")
    final = build_into(tmp_path, "tiny", lambda d: (d / "config.json").write_text("{}"))
    assert (final / "config.json").read_text() == "{}"
    assert not killed.exists() and live.is_dir() and other.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".tiny.")) == sorted(
        [live.name, ".tiny.build-abcd1235"])
