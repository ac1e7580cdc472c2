"""`mlxbun convert` writes byte for byte what mlx_lm.convert writes with the same options, run live
here on the same source (a hub repo served by the loopback hub of tests/hub_server.py, or a
directory); bad arguments are refused before any download or work."""

import filecmp

import pytest

from mlxbun import cli
from tests.hub_server import REPO, loopback  # noqa: F401  (the loopback hub fixture)


def _mlx_lm_convert(argv):
    """mlx_lm.convert's own command line, run in this process."""
    from mlx_lm.convert import configure_parser, convert

    convert(**vars(configure_parser().parse_args(argv)))


def _same_tree(a, b):
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert filecmp.cmp(a / name, b / name, shallow=False), name
    return names


@pytest.mark.parametrize("ours, theirs", [
    (["--quant", "4"], ["-q", "--q-bits", "4", "--q-group-size", "64"]),
    (["--quant", "mixed_3_6", "--group-size", "32", "--dtype", "bfloat16"],
     ["-q", "--quant-predicate", "mixed_3_6", "--q-group-size", "32", "--dtype", "bfloat16"]),
])
def test_a_hub_repo_converts_as_mlx_lm_convert_does(loopback, tmp_path, capsys, ours, theirs):  # noqa: F811
    assert cli.main(["convert", REPO, "--out", str(tmp_path / "ours"), *ours]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "ours")
    _mlx_lm_convert(["--hf-path", REPO, "--mlx-path", str(tmp_path / "theirs"), *theirs])
    names = _same_tree(tmp_path / "ours", tmp_path / "theirs")
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    assert f"base_model: {REPO}" in (tmp_path / "ours" / "README.md").read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left


def test_a_directory_converts_as_mlx_lm_convert_does(zoo, tmp_path):
    src = str(zoo("llama"))
    assert cli.main(["convert", src, "--out", str(tmp_path / "ours"), "--dtype", "float16"]) == 0
    _mlx_lm_convert(["--hf-path", src, "--mlx-path", str(tmp_path / "theirs"), "--dtype", "float16"])
    _same_tree(tmp_path / "ours", tmp_path / "theirs")


@pytest.mark.parametrize("argv, words", [
    (["--out", "{existing}"], "already exists: give a new directory"),
    (["--out", "{file}/sub"], "cannot be created: .* is a file"),
    (["--out", "{new}", "--upload", "me/model"], "--upload me/model: mlxbun does not upload"),
])
def test_bad_arguments_are_refused_before_any_download(loopback, tmp_path, capsys, argv, words):  # noqa: F811
    (tmp_path / "existing").mkdir()
    (tmp_path / "file").write_text("x")
    paths = {k: str(tmp_path / k) for k in ("existing", "file", "new")}
    assert cli.main(["convert", REPO, *(a.format(**paths) for a in argv)]) == 1
    import re

    assert re.search(words, capsys.readouterr().err)
    assert loopback.requests == [] and not (tmp_path / "new").exists()


@pytest.mark.parametrize("flag", [["--quant", "3"], ["--group-size", "48"], ["--dtype", "int8"]])
def test_options_mlx_lm_convert_lacks_are_usage_errors(flag, tmp_path):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", "org/repo", "--out", str(tmp_path / "x"), *flag])
    assert exit_.value.code == 2 and not (tmp_path / "x").exists()
