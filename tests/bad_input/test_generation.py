"""Bad input to generation (issue 11): token ids outside the vocabulary, prompt-cache paths, a
checkpoint's own kv_config.json, foreign results databases, quantized KV on narrow heads.

Every CLI case runs `mlxbun generate` through `mlxbun.cli.main` (a subprocess where the old
failure was a crash) and asserts the exit code, that no traceback is printed, that the message
names the culprit, and (where files are involved) that no file changed or appeared.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlxbun.errors import GenerationError, MlxbunError
from tests.bad_input.helpers import run as cli_run
from tests.bad_input.helpers import tree as checksums

VOCAB = 512  # every zoo model's vocabulary
RANGE = "(valid ids: 0..511)"


@pytest.fixture
def run(monkeypatch, zoo_root, capsys):
    """`run(*argv) -> (exit code, stdout, stderr)` of `mlxbun generate`; zoo names resolve in the test zoo."""
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    return lambda *argv: cli_run(capsys, ["generate", *argv])


def refused(result, *culprits, code=1):
    """The CLI refused in one line naming every culprit, with no traceback and nothing generated."""
    got, out, err = result
    assert got == code, (out, err)
    assert out == ""
    line = err.strip()
    assert "\n" not in line and line.startswith("mlxbun generate: error: "), err
    for c in culprits:
        assert c in line, (c, line)
    return line


@pytest.fixture(scope="module")
def llama(zoo):
    import mlxbun
    from mlxbun.tokenizer import load_tokenizer

    path = zoo("llama")
    return path, mlxbun.open_model(path), load_tokenizer(path)


@pytest.fixture(scope="module")
def wide(zoo_root):
    """A tiny qwen3 with head_dim 32 (so group size 32 quantizes it), 2 layers."""
    from mlxbun.zoo import cached_checkpoint

    return cached_checkpoint("qwen3", head_dim=32, root=zoo_root)


# ----------------------------------------------------------------------------- 1. token ids


@pytest.mark.parametrize("ids, bad, pos", [("1,99999", 99999, 1), ("1,512", 512, 1), ("1,-1", -1, 1),
                                           ("-600", -600, 0), ("5,1,99999999999999999999", 99999999999999999999, 2)])
@pytest.mark.parametrize("engine", ["mlxbun", "mlx-lm"])
def test_prompt_ids_outside_the_vocabulary(run, ids, bad, pos, engine):
    refused(run("--model", "zoo:llama", "--engine", engine, f"--prompt-ids={ids}", "--max-tokens", "2"),
            f"--prompt-ids: token {bad} at position {pos} is outside the model's vocabulary", RANGE)


@pytest.mark.parametrize("extra", [("--draft", "ngram"), ("--draft", "self")])
def test_prompt_ids_outside_the_vocabulary_speculative(run, extra):
    refused(run("--model", "zoo:llama", "--prompt-ids", "1,512", *extra), "token 512 at position 1", RANGE)


@pytest.mark.parametrize("arch", ["diffusion_gemma", "llada2_moe"])
def test_prompt_ids_outside_the_vocabulary_diffusion(run, arch):
    refused(run("--model", f"zoo:{arch}", "--prompt-ids", "1,99999", "--max-tokens", "2"),
            "--prompt-ids: token 99999 at position 1", RANGE)


def test_the_segfault_is_an_error_in_a_fresh_process(zoo_root, zoo):
    """The report: `--prompt-ids 1,99999` on zoo:llama died with SIGSEGV (exit 139)."""
    zoo("llama")
    env = {**os.environ, "MLXBUN_ZOO_CACHE": str(zoo_root)}
    p = subprocess.run([sys.executable, "-m", "mlxbun", "generate", "--model", "zoo:llama", "--prompt-ids",
                        "1,99999", "--max-tokens", "2"], capture_output=True, text=True, env=env, timeout=120)
    refused((p.returncode, p.stdout, p.stderr), "token 99999 at position 1", RANGE)


@pytest.mark.parametrize("prompt, bad, pos", [([1, 512], 512, 1), ([-1], -1, 0), ([3, 2, 2**40], 2**40, 2),
                                              (mx.array([[7, 600, 8]]), 600, 1)])
def test_library_entry_points_refuse_ids_before_any_work(llama, prompt, bad, pos):
    from mlxbun.generate import stream_generate
    from mlxbun.speculative import speculative_generate

    _, model, tok = llama
    message = rf"token {bad} at position {pos} is outside the model's vocabulary \(valid ids: 0\.\.511\)"
    with pytest.raises(GenerationError, match=message):
        stream_generate(model, tok, prompt)
    with pytest.raises(GenerationError, match=message):
        speculative_generate(model, tok, prompt, drafter="ngram")


def test_teacher_forcing_and_diffusion_refuse_ids(llama, zoo):
    from mlxbun.diffusion.engine import diffusion_generate
    from mlxbun.diffusion.masked import DiffusionArgumentError, masked_diffusion_generate
    from mlxbun.locate import open_runtime
    from mlxbun.parity.forced import teacher_forced

    _, model, _ = llama
    with pytest.raises(GenerationError, match=r"ids: token 512 at position 2 .*\(valid ids: 0\.\.511\)"):
        teacher_forced(model, [1, 2, 512, 3], prefill=2)
    dgemma = open_runtime(zoo("diffusion_gemma"), "mlxbun")
    with pytest.raises(GenerationError, match=r"prompt: token -3 at position 0"):
        diffusion_generate(dgemma, None, [-3, 1], max_tokens=2)
    with pytest.raises(GenerationError, match=r"decoder_input_ids: token 512 at position 1"):
        diffusion_generate(dgemma, None, [1, 2], max_tokens=2, decoder_input_ids=[4, 512])
    llada = open_runtime(zoo("llada2_moe"), "mlxbun")
    for bad, pos in ((-5, 1), (512, 0)):  # refused when called, before the loop runs any forward
        with pytest.raises(DiffusionArgumentError, match=rf"prompt_ids: token {bad} at position {pos} .*0\.\.511"):
            masked_diffusion_generate(llada, [bad, 1][::1 if pos == 0 else -1], mask_token_id=llada.mask_token_id,
                                      max_tokens=2)


def test_experiment_drivers_check_every_prompt_first(monkeypatch, zoo_root, zoo):
    from mlxbun.experiments.diffusion import diffusion_sweep
    from mlxbun.experiments.spec_acceptance import spec_sweep

    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    with pytest.raises(MlxbunError, match=r"prompt 'bad': prompt: token 600 at position 1"):
        spec_sweep("zoo:llama", ["ngram"], [1], prompts={"fine": "hello", "bad": [1, 600]}, record=False)
    with pytest.raises(MlxbunError, match=r"prompts\[1\]: prompt: token 512 at position 0"):
        diffusion_sweep(str(zoo("diffusion_gemma")), [[1, 2], [512]], steps=[2], record=False, warmup=False)


# the fuzz: --prompt-ids and stream_generate's prompt never crash; bad input is one MlxbunError

IDS_TEXT = st.one_of(
    st.text(max_size=24),
    st.lists(st.integers(-2**70, 2**70) | st.integers(-3, VOCAB + 3), min_size=0, max_size=6).map(
        lambda xs: ",".join(map(str, xs))),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=IDS_TEXT)
def test_fuzz_prompt_ids_flag(run, text):
    code, out, err = run("--model", "zoo:llama", f"--prompt-ids={text}", "--max-tokens", "1", "--json")
    assert "Traceback" not in err and "Traceback" not in out
    if code == 0:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
        assert ids and all(0 <= i < VOCAB for i in ids)
        assert len(json.loads(out)["tokens"]) == 1
    else:
        assert code == 1 and out == "" and err.startswith("mlxbun generate: error: --prompt-ids")
        assert err.count("\n") == 1


@settings(max_examples=60, deadline=None)
@given(ids=st.lists(st.integers(-2**64, 2**64) | st.integers(-2, VOCAB + 2), max_size=6))
def test_fuzz_stream_generate_prompt(llama, ids):
    from mlxbun.generate import stream_generate

    _, model, tok = llama
    first_bad = next(((n, i) for n, i in enumerate(ids) if not 0 <= i < VOCAB), None)
    try:
        out = list(stream_generate(model, tok, ids, max_tokens=1))
    except MlxbunError as e:
        assert isinstance(e, GenerationError)
        if first_bad is None:
            assert not ids and "empty" in str(e)
        else:
            assert f"token {first_bad[1]} at position {first_bad[0]}" in str(e)
        return
    assert first_bad is None and ids and len(out) == 1


# ----------------------------------------------------------------------------- 2. --save-prompt-cache


@pytest.mark.parametrize("target, message", [
    ("nodir/x.safetensors", "directory nodir does not exist"),
    ("adir", "adir: is a directory"),
    ("afile/x.safetensors", "directory afile is not a directory"),
])
def test_save_prompt_cache_path_is_checked_before_generating(run, tmp_path, monkeypatch, target, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "adir").mkdir()
    (tmp_path / "adir" / "keep.txt").write_text("mine")
    (tmp_path / "afile").write_text("mine too")
    before = checksums(tmp_path)
    refused(run("--model", "zoo:llama", "--prompt", "hello", "--max-tokens", "3", "--save-prompt-cache", target),
            f"--save-prompt-cache {target}: ", message)
    assert checksums(tmp_path) == before  # no adir.tmp.safetensors, nothing else


def test_save_prompt_cache_still_saves(run, tmp_path):
    target = tmp_path / "c.safetensors"
    code, _, err = run("--model", "zoo:llama", "--prompt", "hello", "--max-tokens", "3", "--save-prompt-cache",
                       str(target))
    assert code == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.safetensors"]


# ----------------------------------------------------------------------------- 3. a checkpoint's kv_config.json


def _with_plan(src: Path, dst: Path, plan) -> Path:
    shutil.copytree(src, dst)
    (dst / "kv_config.json").write_text(json.dumps(plan))
    return dst


PLAN = [{"layer_idx": 1, "bits": 4, "group_size": 32}]


def test_checkpoint_plan_applies_by_default_and_says_so(run, wide, tmp_path):
    import mlxbun
    from mlxbun.cache.mixed import KVPlan
    from mlxbun.generate import stream_generate
    from mlxbun.tokenizer import load_tokenizer

    ck = _with_plan(wide, tmp_path / "ck", PLAN)
    before = checksums(tmp_path)
    code, out, err = run("--model", str(ck), "--prompt", "Once upon a time", "--max-tokens", "6")
    assert code == 0 and "Traceback" not in err
    assert f"KV: the checkpoint's per-layer plan {ck / 'kv_config.json'} (2 layers, quantized 1:q4/g32); " \
           "--kv-config none to opt out" in err
    got = json.loads(run("--model", str(ck), "--prompt", "Once upon a time", "--max-tokens", "6", "--json")[1])
    assert got["kv_config"] == {"file": str(ck / "kv_config.json"), "from_checkpoint": True, "layers": PLAN}
    off = json.loads(run("--model", str(ck), "--prompt", "Once upon a time", "--max-tokens", "6", "--json",
                         "--kv-config", "none")[1])
    assert off["kv_config"] is None
    assert checksums(tmp_path) == before

    # the library: the default is the checkpoint's plan, exactly as if it were given; "none" is plain
    model, tok = mlxbun.open_model(ck), load_tokenizer(ck)
    default = list(stream_generate(model, tok, "Once upon a time", max_tokens=6))
    given = list(stream_generate(model, tok, "Once upon a time", max_tokens=6,
                                 kv_config=KVPlan.from_kv_config(PLAN, 2)))
    plain = list(stream_generate(model, tok, "Once upon a time", max_tokens=6, kv_config="none"))
    assert [r.token for r in default] == [r.token for r in given] == got["tokens"]
    assert all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(default, given))
    assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(default, plain))
    assert [r.token for r in plain] == off["tokens"]
    # other KV options replace the default plan
    kv8 = json.loads(run("--model", str(ck), "--prompt", "Once upon a time", "--max-tokens", "6", "--json",
                         "--kv-bits", "8", "--kv-group-size", "32")[1])
    assert kv8["kv_config"] is None


def test_checkpoint_plan_past_the_layers_is_refused_naming_file_entry_and_count(run, wide, tmp_path):
    ck = _with_plan(wide, tmp_path / "ck", [{"layer_idx": 0, "bits": 8}, {"layer_idx": 9, "bits": 4}])
    before = checksums(tmp_path)
    refused(run("--model", str(ck), "--prompt", "hi", "--max-tokens", "2"),  # at load
            str(ck / "kv_config.json"), "entry 1", "'layer_idx' 9", "num_hidden_layers 2")
    # mlx-lm's graph runs on mlx-lm's reading of config.json: the plan is checked when generation starts
    refused(run("--model", str(ck), "--engine", "mlx-lm", "--prompt", "hi", "--max-tokens", "2"),
            str(ck / "kv_config.json"), "entry 1", "layer index 9 does not exist", "2 cache layers")
    assert checksums(tmp_path) == before


def test_checkpoint_plan_applies_under_the_mlx_lm_engine_too(run, wide, tmp_path):
    ck = _with_plan(wide, tmp_path / "ck", PLAN)
    argv = ("--model", str(ck), "--prompt", "Once upon a time", "--max-tokens", "6", "--json")
    ours, theirs = (json.loads(run(*argv, "--engine", e)[1]) for e in ("mlxbun", "mlx-lm"))
    assert ours["kv_config"] == theirs["kv_config"] == {"file": str(ck / "kv_config.json"),
                                                        "from_checkpoint": True, "layers": PLAN}
    assert ours["tokens"] == theirs["tokens"]


def test_checkpoint_plan_on_a_sliding_window_layer_is_refused_at_start(run, zoo, tmp_path):
    ck = _with_plan(zoo("gemma3_text"), tmp_path / "ck", [{"layer_idx": 0, "bits": 4, "group_size": 32}])
    refused(run("--model", str(ck), "--prompt", "hi", "--max-tokens", "2"),
            f"{ck / 'kv_config.json'}: layer 0: is a sliding-window layer")


def test_kv_config_object_form_is_refused_showing_the_forms(run, wide, tmp_path):
    from mlxbun.generation_caches import load_kv_plan

    file = tmp_path / "plan.json"
    file.write_text(json.dumps({"kv_config": PLAN}))
    before = checksums(tmp_path)
    line = refused(run("--model", str(wide), "--prompt", "hi", "--kv-config", str(file)), str(file),
                   "got an object with keys ['kv_config']")
    assert '[{"layer_idx": I, "bits": B, "group_size": G}, ...]' in line and '{"layers": [...]}' in line
    assert checksums(tmp_path) == before
    with pytest.raises(MlxbunError, match=r"kv_config: expected a JSON list of layer entries .*keys \['kv_config'\]"):
        load_kv_plan({"kv_config": PLAN}, 2)
    assert load_kv_plan({"layers": PLAN}, 2).layers == load_kv_plan(PLAN, 2).layers == {1: (4, 32)}


# ----------------------------------------------------------------------------- 4. --spec-results


def test_foreign_spec_results_refused_before_generating(run, tmp_path):
    foreign = tmp_path / "notes.db"
    foreign.write_text("my notes, not a results table\n")
    before = checksums(tmp_path)
    refused(run("--model", "zoo:llama", "--prompt", "hello", "--max-tokens", "4", "--draft", "ngram",
                "--spec-results", str(foreign)), str(foreign), "not an SQLite database")
    assert checksums(tmp_path) == before


def test_spec_results_without_draft_is_refused(run, tmp_path):
    refused(run("--model", "zoo:llama", "--prompt", "hello", "--spec-results", str(tmp_path / "r.db")),
            "--spec-results", "--draft")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- 5. quantized KV, narrow heads


@pytest.mark.parametrize("group", ["32", "64"])
def test_narrow_zoo_heads_name_the_fix(run, group):
    line = refused(run("--model", "zoo:llama", "--prompt", "hello", "--max-tokens", "4", "--kv-bits", "4",
                       "--kv-group-size", group, "--quantized-kv-start", "100"),
                   f"head dim 16 is not a multiple of the group size {group}",
                   "below every KV group size (32, 64, 128)", "--kv turboquant:BITS",
                   f"--model zoo:llama,head_dim={group}")
    # the named fix works
    wide = re.search(r"--model (\S+)", line).group(1)
    code, out, err = run("--model", wide, "--prompt", "hello", "--max-tokens", "4", "--kv-bits", "4",
                         "--kv-group-size", group, "--json")
    assert code == 0, err
    assert len(json.loads(out)["tokens"]) == 4


def test_narrow_mla_zoo_heads_say_head_dim_cannot_widen_them(run):
    """An expanded-MLA row (minicpm3: keys dn + dr = 24) has no head_dim to widen: the hint names
    the keys that size its heads instead of a zoo name the build would refuse."""
    line = refused(run("--model", "zoo:minicpm3", "--prompt", "hello", "--max-tokens", "4", "--kv-bits", "4",
                       "--kv-group-size", "64"),
                   "head dim 24 is not a multiple of the group size 64", "--kv turboquant:BITS",
                   "multi-head latent attention sizes its heads by qk_nope_head_dim + qk_rope_head_dim")
    assert "head_dim=64" not in line


def test_a_group_size_that_divides_the_head_dim_is_named():
    from mlxbun.cache.kv import KVCache
    from mlxbun.generation_caches import KVHeadDimError, kv_quantizer

    def filled(dim):
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, 3, dim)), mx.zeros((1, 1, 3, dim)))
        return c

    with pytest.raises(KVHeadDimError, match=r"layer 1: head dim 64 is not a multiple of the group size 128; "
                                             r"use a group size that divides it: 32 or 64") as e:
        kv_quantizer("uniform", 4, 128, 0)([filled(128), filled(64)])
    assert (e.value.head_dim, e.value.group_size) == (64, 128)
    with pytest.raises(KVHeadDimError, match=r"head dim 48 .* not a multiple of any KV group size"):
        kv_quantizer("uniform", 4, 32, 0)([filled(48)])
