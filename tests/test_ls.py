"""`mlxbun ls`: hub cache + directories, tiers, fit, JSON, empty cache, bad input."""

import json
import shutil

import pytest

from mlxbun.cli import main
from mlxbun.inventory import list_models
from mlxbun.zoo import make_checkpoint


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    make_checkpoint("qwen3", root, hf_cache=True)
    make_checkpoint("llama", root, quant=4, hf_cache=True)
    return root


def test_lists_hub_cache_repos_with_type_params_quant_tier(hub_cache):
    entries, warnings = list_models(hub_cache)
    assert warnings == []
    by_type = {e.model_type: e for e in entries}
    assert set(by_type) == {"qwen3", "llama"}
    q3, ll = by_type["qwen3"], by_type["llama"]
    assert q3.repo.startswith("mlxbun/tiny-qwen3") and len(q3.revision) == 40
    assert q3.tier == "generic" and q3.quantization is None and q3.fits_memory is True
    assert ll.quantization.startswith("affine 4-bit g64")
    # Logical parameters are the same whether or not the weights are packed.
    assert q3.parameters > 10_000 and ll.parameters > 10_000
    assert q3.size_bytes > 0 and q3.weights_bytes > 0


def test_cli_json_and_table(hub_cache, capsys):
    assert main(["ls", "--cache", str(hub_cache), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["model_type"] for r in rows} == {"qwen3", "llama"}
    assert all({"repo", "revision", "parameters", "size_bytes", "quantization", "tier", "fits_memory"} <= set(r) for r in rows)
    assert main(["ls", "--cache", str(hub_cache)]) == 0
    out = capsys.readouterr().out
    assert "qwen3" in out and "generic" in out


def test_empty_cache_says_so_and_how_to_put_a_model_there(tmp_path, capsys):
    cache = tmp_path / "my cache"
    cache.mkdir()
    assert main(["ls", "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert f"No models found in {cache}." in out
    assert f"mlxbun zoo build ARCH --hf-cache --out '{cache}'" in out and "mlxbun ls DIR" in out
    # the hint works as printed
    assert main(["zoo", "build", "llama", "--hf-cache", "--out", str(cache)]) == 0
    assert main(["ls", "--cache", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "mlxbun/tiny-llama" in out and "No models found" not in out


def test_directories_unsupported_type_and_broken_config(tmp_path, capsys):
    good = make_checkpoint("gemma2", tmp_path / "good")
    odd = tmp_path / "odd"
    shutil.copytree(good, odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "kimi_linear"
    (odd / "config.json").write_text(json.dumps(cfg))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    (tmp_path / "empty-cache").mkdir()
    entries, _ = list_models(tmp_path / "empty-cache", [good, odd, broken])
    rows = {e.path: e for e in entries}
    assert rows[str(good)].tier == "generic"
    assert rows[str(odd)].tier == "unsupported" and "kimi_linear" in rows[str(odd)].reason
    assert rows[str(broken)].tier == "unsupported" and "config.json" in rows[str(broken)].reason


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
    assert main(["ls", str(tmp_path / "nope")]) == 1
    err = capsys.readouterr().err
    assert "nope" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:
        main(["ls", "--bogus"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--bogus" in err and len(err.strip().splitlines()) == 1
