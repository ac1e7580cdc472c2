"""`mlxbun port`: targets, verdicts (pass / fail / refused), JSON, manifests, exit codes."""

import json
import os
import shutil
import stat
from pathlib import Path

import mlx.core as mx
import pytest

from mlxbun.cli import main
from mlxbun.parity.manifest import read_manifest
from mlxbun.parity.port import Target, port_one, resolve_targets

JSON_KEYS = {"target", "model_type", "dtype", "verdict", "max_abs_diff", "first_divergence", "reason"}


def _strict(constant):
    raise AssertionError(f"--json printed {constant}, which is not JSON")


def _run_json(capsys, argv):
    code = main(argv)
    return code, json.loads(capsys.readouterr().out, parse_constant=_strict)


def test_zoo_targets_pass_and_write_manifests(zoo_root, tmp_path, capsys):
    code, rows = _run_json(capsys, ["port", "zoo:qwen3", "zoo:gemma3_text", "--variants", "fp32,q8",
                                    "--zoo-cache", str(zoo_root), "--goldens", str(tmp_path), "--json"])
    assert code == 0
    assert [(r["target"], r["dtype"]) for r in rows] == [
        ("zoo:qwen3", "float32"), ("zoo:qwen3", "q8"), ("zoo:gemma3_text", "float32"), ("zoo:gemma3_text", "q8")]
    for r in rows:
        assert JSON_KEYS <= set(r)
        assert r["verdict"] == "pass" and r["max_abs_diff"] == 0.0 and r["first_divergence"] is None
        m = read_manifest(r["manifest"])
        assert m.checkpoint == f"{r['target']}/{r['dtype']}"  # no machine-specific path
        assert len(m.greedy_ids) == 17 and len(m.prompt_ids) == 40


def test_directory_target_and_table(zoo, capsys):
    path = zoo("granite", quant=4)
    assert main(["port", str(path), "--no-goldens"]) == 0
    out = capsys.readouterr().out
    assert "granite" in out and "q4" in out and "0 (bit-exact)" in out and "1/1 bit-exact" in out


def test_hub_cache_repo_id_target(tmp_path, capsys):
    from mlxbun.zoo import make_checkpoint

    make_checkpoint("phi", tmp_path, hf_cache=True)
    code, rows = _run_json(capsys, ["port", "mlxbun/tiny-phi", "--cache", str(tmp_path), "--no-goldens", "--json"])
    assert code == 0 and rows[0]["model_type"] == "phi" and rows[0]["verdict"] == "pass"
    with pytest.raises(Exception, match="not found in hub cache"):
        resolve_targets(["mlxbun/not-there"], cache_dir=tmp_path)


def _copy_with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unsupported_model_type_refuses_with_reason(zoo, tmp_path, capsys):
    odd = _copy_with_config(zoo("llama"), tmp_path / "odd", model_type="kimi_linear")
    code, rows = _run_json(capsys, ["port", str(odd), "--no-goldens", "--json"])
    assert code == 1
    assert rows[0]["verdict"] == "refused" and "kimi_linear" in rows[0]["reason"] and "llama" in rows[0]["reason"]


def test_unhandled_numerics_key_refuses_naming_the_key(zoo, tmp_path, capsys):
    odd = _copy_with_config(zoo("qwen2"), tmp_path / "odd", attention_temperature=2.0)
    code, rows = _run_json(capsys, ["port", str(odd), "--no-goldens", "--json"])
    assert code == 1
    assert rows[0]["verdict"] == "refused" and "attention_temperature" in rows[0]["reason"]


def test_missing_tensor_refuses_at_the_header_only_audit(zoo, tmp_path):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(zoo("llama"), bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.up_proj.weight"
    shard = bad / index["weight_map"].pop(name)
    tensors = load_file(shard)
    del tensors[name]
    save_file(tensors, shard, metadata={"format": "mlx"})
    (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    res = port_one(Target(str(bad), bad))
    assert res.verdict == "refused" and name in res.reason


def test_a_diverging_graph_fails_and_names_the_first_divergence(zoo, monkeypatch):
    import mlxbun.factory

    real_open = mlxbun.factory.open_model

    def open_perturbed(path, **kwargs):
        model = real_open(path, **kwargs)
        w = model.model.layers[1].mlp.down_proj.weight
        model.model.layers[1].mlp.down_proj.weight = w + mx.array(1e-3, dtype=w.dtype)
        return model

    monkeypatch.setattr(mlxbun.factory, "open_model", open_perturbed)
    path = zoo("llama")
    res = port_one(Target("zoo:llama", path, "float32"))
    assert res.verdict == "fail" and res.max_abs_diff > 0
    assert res.first_divergence["path"] == "model.layers.1.mlp"
    assert res.first_divergence["layer_index"] == 1


def test_a_nan_weight_checkpoint_fails_and_says_why(zoo, tmp_path, capsys):
    """Both sides load the same NaN weight: their logits are NaN alike, which is a failure (not
    "bit-equal"), reported at the prefill with both sides named and the NaN's first module."""
    from tests.conftest import nan_weight_copy

    bad = nan_weight_copy(zoo("llama"), tmp_path / "nan-llama", "model.layers.1.mlp.down_proj.weight")
    code, rows = _run_json(capsys, ["port", str(bad), "--no-goldens", "--json"])
    assert code == 1
    (r,) = rows
    assert r["verdict"] == "fail" and r["max_abs_diff"] is None  # not comparable: no |diff| (null)
    assert "prefill logits are not finite (NaN/inf) on the candidate and oracle" in r["reason"]
    d = r["first_divergence"]
    assert (d["path"], d["step"], d["kind"], d["nonfinite"]) == (
        "model.layers.1.mlp", 0, "nonfinite", "candidate and oracle")


def test_golden_manifests_match_the_zoo_and_vary():
    """One tracked manifest per zoo arch and port variant (the variants this device runs: MoE
    experts in float32 or quantized on mlx's CPU backend), each a bit-exact pass whose oracle
    trajectory is not one token repeated (every decode step fed the same id proves little)."""
    from mlxbun.parity.manifest import read_manifest
    from mlxbun.parity.oracle import repeated_tokens
    from mlxbun.zoo import ARCHS
    from mlxbun.zoo.archs import runnable_variants

    goldens = Path(__file__).parent.parent / "goldens"
    files = sorted(goldens.glob("zoo-*-parity.json"))
    assert {f.name for f in files} == {f"zoo-{a}-{v}-parity.json" for a in ARCHS for v in runnable_variants(a)}
    for f in files:
        m = read_manifest(f)
        assert m.gate["verdict"] == "pass" and m.gate["max_abs_diff"] == 0.0, f.name
        assert repeated_tokens(m.greedy_ids) is None, f"{f.name}: greedy ids are one token repeated"


def test_bad_arguments_are_one_line_errors(capsys, tmp_path):
    for argv in (["port", "zoo:nope"], ["port", str(tmp_path / "missing")], ["port", "zoo:llama", "--variants", "q3"]):
        assert main(argv) == 1
        err = capsys.readouterr().err
        assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_check_values_refuses_nan_weights_by_name_and_the_default_audit_says_headers_only(zoo, tmp_path, capsys):
    from tests.conftest import nan_weight_copy

    name = "model.layers.1.mlp.down_proj.weight"
    bad = nan_weight_copy(zoo("llama"), tmp_path / "nan-llama", name)
    code, rows = _run_json(capsys, ["port", str(bad), "--no-goldens", "--check-values", "--json"])
    assert code == 1
    (r,) = rows
    assert r["verdict"] == "refused" and r["trajectory"] == "-"  # refused at the audit: no oracle run
    assert r["reason"] == f"weights in {bad} fail the value check: 1 holding NaN/inf: {name}"
    good = port_one(Target("zoo:llama", zoo("llama"), "float32"), decode_steps=2, prompt_len=8, check_values=True)
    assert good.verdict == "pass" and good.audit == "clean (21 tensors, values finite)"
    assert "audit (headers and values): clean (21 tensors, values finite)" in good.steps
    plain = port_one(Target("zoo:llama", zoo("llama"), "float32"), decode_steps=2, prompt_len=8)
    assert plain.audit == "clean (21 tensors)" and "audit (headers only): clean (21 tensors)" in plain.steps


def test_manifests_go_to_the_checkouts_goldens_or_to_goldens_dir_only(zoo_root, tmp_path, monkeypatch, capsys):
    """Outside the checkout `port` writes no manifest and says so in one line; `--goldens DIR`
    writes world-readable files there (mkstemp's 0600 is not kept)."""
    from mlxbun.parity.port import checkout_goldens

    repo = Path(__file__).resolve().parent.parent
    assert checkout_goldens(repo) == repo / "goldens"
    fake = tmp_path / "elsewhere"
    (fake / "goldens").mkdir(parents=True)
    (fake / "pyproject.toml").write_text('[project]\nname = "other"\n')
    (fake / "goldens" / "README.md").write_text("x")
    assert checkout_goldens(fake) is None
    (fake / "pyproject.toml").write_text('[project]\nname = "mlxbun"\n')
    assert checkout_goldens(fake) == fake / "goldens"
    (fake / "goldens" / "README.md").unlink()
    assert checkout_goldens(fake) is None

    monkeypatch.chdir(fake)
    argv = ["port", "zoo:llama", "--variants", "q4", "--zoo-cache", str(zoo_root), "--decode-steps", "2",
            "--prompt-len", "8"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err == ("mlxbun port: no golden manifests written: not run in the mlxbun checkout "
                   "(pass --goldens DIR to write them)\n")
    assert list((fake / "goldens").iterdir()) == []
    old = os.umask(0o022)
    try:
        assert main([*argv, "--goldens", "out"]) == 0
    finally:
        os.umask(old)
    (written,) = (fake / "out").iterdir()
    assert written.name == "zoo-llama-q4-parity.json" and stat.S_IMODE(written.stat().st_mode) == 0o644
    assert "no golden manifests" not in capsys.readouterr().err
