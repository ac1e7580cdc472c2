"""`mlxbun kv-plan`: the plan's kv_config file, and clear errors for bad arguments."""

from __future__ import annotations

import json

import pytest

from mlxbun import cli
from mlxbun.generation_caches import load_kv_plan

MODEL = "zoo:llama,head_dim=64"
SMALL = ["--prefill", "32", "--eval-tokens", "8"]


def test_loose_budget_writes_a_kv_config_generate_runs(tmp_path, capsys):
    out = tmp_path / "kv_config.json"
    assert cli.main(["kv-plan", MODEL, "--budget", "1e9", "--bits", "4,2", *SMALL, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "measured: mean KLD" in printed and str(out) in printed
    data = json.loads(out.read_text())
    meta = data["mlxbun_kv_plan"]
    assert meta["kld_mean"] > 0 and meta["bytes_per_token"] < meta["plain_bytes_per_token"]
    n = len(data["layers"])
    plan = load_kv_plan(str(out), n)
    assert plan.layers == {i: (2, 64) for i in range(n)}  # a budget above everything: the lowest width
    assert cli.main(["generate", "--model", MODEL, "--prompt", "The lighthouse", "--max-tokens", "3",
                     "--kv-config", str(out)]) == 0


def test_budget_zero_prints_an_all_plain_kv_config(capsys):
    assert cli.main(["kv-plan", MODEL, "--budget", "0", "--bits", "8", *SMALL]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert all(e["bits"] == 0 for e in data["layers"]) and data["mlxbun_kv_plan"]["kld_mean"] == 0
    assert "0 of" in captured.err


@pytest.mark.parametrize("argv, message", [
    (["--budget", "-1"], "--budget"),
    (["--budget", "x"], "--budget"),
    (["--budget", "0.1", "--bits", "4,x"], "--bits"),
])
def test_bad_arguments_exit_2(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["kv-plan", MODEL, *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--bits", "7"], "bits"),
    (["--group-size", "128"], "group size 128"),
    (["--prompt-file", "/nonexistent/text.txt"], "--prompt-file"),
    (["--prefill", "1"], "--prefill"),
])
def test_bad_values_are_one_line_errors(argv, message, capsys):
    assert cli.main(["kv-plan", MODEL, "--budget", "0.1", *SMALL, *argv]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mlxbun kv-plan: error:") and message in err
