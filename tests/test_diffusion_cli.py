"""Diffusion checkpoints through profile dispatch: open_model, `mlxbun generate --json`."""

import json

import pytest

import mlxbun
from mlxbun.cli import main
from mlxbun.profile import resolve_model_profile, validate_profile


@pytest.fixture(scope="module")
def dgemma(zoo_root):
    from mlxbun.zoo import cached_checkpoint

    return cached_checkpoint("diffusion_gemma", root=zoo_root)


@pytest.fixture(scope="module")
def llada(zoo_root):
    from mlxbun.zoo import cached_checkpoint

    return cached_checkpoint("llada2_moe", root=zoo_root)


def test_profiles_declare_l2_vs_mlx_vlm_and_diffusion_loops(dgemma, llada):
    from mlxbun.config import load_model_config

    for path, loop, graph in ((dgemma, "diffusion", "diffusion-gemma"), (llada, "masked-diffusion", "llada2")):
        prof = validate_profile(resolve_model_profile(load_model_config(path), path))
        assert (prof.fidelity.level, prof.fidelity.oracle, prof.fidelity.bar) == ("L2", "mlx-vlm", "bit-exact")
        assert prof.execution.loop == loop and prof.execution.graph == graph and prof.tier == "targeted"
        assert mlxbun.open_model(path).profile == prof


def _generate_json(capsys, argv):
    assert main(["generate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("sampler", ["confidence-threshold", "entropy-bound"])
def test_generate_json_for_diffusion_gemma_matches_the_engine(dgemma, capsys, sampler):
    from mlxbun.diffusion.engine import collect, diffusion_generate
    from mlxbun.tokenizer import load_tokenizer

    out = _generate_json(capsys, ["--model", str(dgemma), "--prompt-ids", "10,11,12,13", "--seed", "3",
                                  "--max-tokens", "40", "--sampler", sampler, "--steps", "6"])
    ids, stats = collect(diffusion_generate(mlxbun.open_model(dgemma), load_tokenizer(dgemma), [10, 11, 12, 13],
                                            max_tokens=40, seed=3, sampler=sampler, steps=6))
    assert out["tokens"] == ids
    d = out["diffusion"]
    assert d["denoising_steps"] == stats.denoising_steps and d["blocks"] == len(stats.blocks)
    assert d["sampler"] == sampler and len(d["reveal_step"]) == d["blocks"]
    assert {"text", "finish_reason", "prompt_tokens", "generation_tokens", "generation_tps"} <= set(out)


def test_generate_json_for_llada2(llada, capsys):
    out = _generate_json(capsys, ["--model", str(llada), "--prompt-ids", "10,11,12", "--seed", "0",
                                  "--max-tokens", "20", "--block-length", "8"])
    assert len(out["tokens"]) <= 20 and out["diffusion"]["loop"] == "masked-diffusion"
    assert out["diffusion"]["nfe"] >= out["diffusion"]["blocks"] >= 1


def test_autoregressive_only_options_refuse_for_diffusion(dgemma, capsys):
    assert main(["generate", "--model", str(dgemma), "--prompt-ids", "1,2", "--kv-bits", "4"]) == 1
    err = capsys.readouterr().err
    assert "--kv-bits" in err and "diffusion" in err and len(err.strip().splitlines()) == 1
    assert main(["generate", "--model", str(dgemma), "--prompt-ids", "1,2", "--sampler", "nope"]) == 1
    assert "--sampler" in capsys.readouterr().err


def test_port_refuses_dedicated_graphs_with_a_pointer(dgemma):
    from pathlib import Path

    from mlxbun.parity.port import Target, port_one

    res = port_one(Target(str(dgemma), Path(dgemma)))
    assert res.verdict == "refused" and "dedicated graph" in res.reason and "mlx-vlm" in res.reason
