"""`mlxbun generate`: run in-process through `mlxbun.cli.main` (the real parser and error path)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxbun import cli
from mlxbun.generate import stream_generate

PROMPT = "Once upon a time"


@pytest.fixture
def run(monkeypatch, zoo_root, capsys):
    """`run(*argv) -> (exit code, stdout, stderr)`; `zoo:ARCH` resolves in the test zoo."""
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    if "generate" not in cli.COMMAND_MODULES:
        monkeypatch.setattr(cli, "COMMAND_MODULES", [*cli.COMMAND_MODULES, "generate"])

    def go(*argv):
        capsys.readouterr()
        try:
            code = cli.main(["generate", *argv])
        except SystemExit as e:  # argparse errors
            code = e.code
        out, err = capsys.readouterr()
        return code, out, err

    return go


@pytest.fixture(scope="session")
def qwen3(zoo):
    import mlxbun
    from mlxbun.tokenizer import load_tokenizer

    path = zoo("qwen3")
    return path, mlxbun.open_model(path), load_tokenizer(path)


def _json(run, *argv):
    code, out, err = run(*argv, "--json")
    assert code == 0, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    return json.loads(lines[0])


def test_json_output_is_the_library_stream(run, qwen3):
    _, model, tok = qwen3
    got = _json(run, "--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", "10")
    ref = list(stream_generate(model, tok, PROMPT, max_tokens=10))
    assert got["tokens"] == [r.token for r in ref]
    assert got["text"] == "".join(r.text for r in ref)
    assert got["finish_reason"] == "length"
    assert got["generation_tokens"] == 10
    assert got["prompt_tokens"] == len(tok.encode_prompt(PROMPT))
    assert got["prompt_tps"] > 0 and got["generation_tps"] > 0 and got["peak_memory_gb"] > 0
    assert set(got) == {"text", "tokens", "finish_reason", "prompt_tokens", "prompt_tps",
                        "generation_tokens", "generation_tps", "peak_memory_gb", "kv", "kv_config", "kv_layers"}
    assert got["kv"] == "plain" and got["kv_config"] is None  # the zoo ships no per-layer KV plan
    assert got["kv_layers"] == []  # and nothing asked for KV quantization


def test_checkpoint_path_sampling_and_backends(run, qwen3):
    path, model, tok = qwen3
    argv = ("--model", str(path), "--prompt", PROMPT, "--max-tokens", "8", "--temp", "0.8",
            "--top-p", "0.9", "--top-k", "40", "--min-p", "0.05", "--seed", "7",
            "--repetition-penalty", "1.3")
    got = _json(run, *argv)
    ref = list(stream_generate(model, tok, PROMPT, max_tokens=8, temperature=0.8, top_p=0.9, top_k=40,
                               min_p=0.05, seed=7, repetition_penalty=1.3))
    assert got["tokens"] == [r.token for r in ref]
    assert _json(run, *argv, "--backend", "mlx-lm")["tokens"] == got["tokens"]


def test_prompt_ids_chat_and_system(run, qwen3):
    _, model, tok = qwen3
    ids = tok.encode_prompt(PROMPT)
    by_ids = _json(run, "--model", "zoo:qwen3", "--prompt-ids", ",".join(map(str, ids)), "--max-tokens", "6")
    by_text = _json(run, "--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", "6")
    assert by_ids["tokens"] == by_text["tokens"]

    chat = _json(run, "--model", "zoo:qwen3", "--prompt", PROMPT, "--chat", "--system", "Be brief.",
                 "--max-tokens", "6")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    chat_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert chat_ids.count(tok.bos_token_id) == 1  # BOS from the template only
    ref = list(stream_generate(model, tok, chat_ids, max_tokens=6))
    assert chat["prompt_tokens"] == len(chat_ids)
    assert chat["tokens"] == [r.token for r in ref]


def test_stop_strings(run, qwen3):
    full = _json(run, "--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", "20")["text"]
    stop = full[5:8]
    got = _json(run, "--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", "20",
                "--stop", "\x01nope", "--stop", stop)
    assert got["text"] == full[: full.index(stop)]
    assert got["finish_reason"] == "stop"


def test_streaming_output_and_stats_on_stderr(run):
    got = _json(run, "--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", "8")
    code, out, err = run("--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", "8")
    assert code == 0
    assert out == got["text"] + "\n"
    assert "Prompt: " in err and "Generation: 8 tokens" in err and "Peak memory:" in err


def test_max_kv_size_and_turboquant_run(run):
    bounded = _json(run, "--model", "zoo:gemma3_text", "--prompt", PROMPT * 3, "--max-tokens", "5",
                    "--max-kv-size", "8")
    assert bounded["generation_tokens"] == 5
    tq = _json(run, "--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", "5",
               "--kv-bits", "3.5", "--kv-scheme", "turboquant")
    assert tq["generation_tokens"] == 5


def test_prompt_cache_save_and_continue(run, qwen3, tmp_path):
    _, model, tok = qwen3
    cache_file = tmp_path / "turn1.safetensors"
    first = _json(run, "--model", "zoo:qwen3", "--prompt", PROMPT, "--max-tokens", "4",
                  "--save-prompt-cache", str(cache_file))
    assert cache_file.is_file()
    second = _json(run, "--model", "zoo:qwen3", "--prompt", " and then", "--max-tokens", "5",
                   "--prompt-cache", str(cache_file))
    # the same as one run over the whole history, continued token by token in one cache
    from mlxbun.generation_caches import make_generation_cache

    cache = make_generation_cache(model)
    list(stream_generate(model, tok, PROMPT, max_tokens=4, prompt_cache=cache))
    cont = tok.encode(" and then", add_special_tokens=False)
    ref = list(stream_generate(model, tok, cont, max_tokens=5, prompt_cache=cache))
    assert second["tokens"] == [r.token for r in ref]
    assert second["prompt_tokens"] == len(cont)
    assert first["generation_tokens"] == 4
    # the file records what it holds; a second save continues the record
    from mlxbun.cache.prompt_cache import cached_tokens, load_prompt_cache

    history = tok.encode_prompt(PROMPT) + first["tokens"]
    assert cached_tokens(load_prompt_cache(cache_file)[1]) == history
    third_file = tmp_path / "turn2.safetensors"
    _json(run, "--model", "zoo:qwen3", "--prompt", " and then", "--max-tokens", "5",
          "--prompt-cache", str(cache_file), "--save-prompt-cache", str(third_file))
    caches, meta = load_prompt_cache(third_file)
    assert cached_tokens(meta) == history + cont + second["tokens"]
    assert caches[0].offset == len(cached_tokens(meta))
    # a cache from another model is refused
    code, _, err = run("--model", "zoo:llama", "--prompt", "x", "--prompt-cache", str(cache_file))
    assert code == 1 and "another model" in err and err.count("\n") == 1


def test_kv_config_file(run, wide_qwen3, tmp_path):
    import mlxbun
    from mlxbun.tokenizer import load_tokenizer

    model, tok = mlxbun.open_model(wide_qwen3), load_tokenizer(wide_qwen3)
    file = tmp_path / "kv_config.json"
    file.write_text(json.dumps({"layers": [{"layer_idx": 1, "bits": 8, "group_size": 32}]}))
    got = _json(run, "--model", str(wide_qwen3), "--prompt", PROMPT, "--max-tokens", "6",
                "--kv-config", str(file))
    ref = list(stream_generate(model, tok, PROMPT, max_tokens=6, kv_config=file))
    assert got["tokens"] == [r.token for r in ref]
    code, _, err = run("--model", str(wide_qwen3), "--prompt", PROMPT, "--kv-config", str(file),
                       "--kv-bits", "4")
    assert code == 1 and "kv_config" in err


@pytest.mark.parametrize("argv, match", [
    (("--prompt", PROMPT, "--max-tokens", "-1"), "max_tokens"),
    (("--prompt", PROMPT, "--top-p", "0"), "top_p"),
    (("--prompt", PROMPT, "--kv-bits", "7"), "kv_bits"),
    (("--prompt", PROMPT, "--kv-scheme", "nf4"), "kv_scheme"),
    (("--prompt", PROMPT, "--system", "hi"), "--system needs --chat"),
    (("--prompt-ids", "1,x,3"), "--prompt-ids"),
    (("--prompt-ids", "1,2", "--chat"), "--chat"),
    (("--prompt", PROMPT, "--backend", "torch"), "--backend"),
    (("--prompt", PROMPT, "--prompt-cache", "/nonexistent.safetensors"), "prompt-cache"),
])
def test_bad_arguments_are_one_line_errors(run, argv, match):
    code, out, err = run("--model", "zoo:qwen3", *argv)
    assert code == 1
    assert err.count("\n") == 1 and err.startswith("mlxbun generate: error:"), err
    assert match in err


@pytest.mark.parametrize("model, match", [("/nonexistent/ckpt", "no such checkpoint"),
                                          ("zoo:not_an_arch", "unknown zoo arch")])
def test_bad_model(run, model, match):
    code, _, err = run("--model", model, "--prompt", PROMPT)
    assert code == 1 and match in err and err.count("\n") == 1


def test_argparse_errors_are_one_line(run):
    code, _, err = run("--model", "zoo:qwen3")  # neither --prompt nor --prompt-ids
    assert code == 2 and err.count("\n") == 1
    code, _, err = run("--model", "zoo:qwen3", "--prompt", "x", "--prompt-ids", "1")
    assert code == 2 and "not allowed with" in err


def test_quantized_kv(run, wide_qwen3):
    import mlxbun
    from mlxbun.tokenizer import load_tokenizer

    model, tok = mlxbun.open_model(wide_qwen3), load_tokenizer(wide_qwen3)
    got = _json(run, "--model", str(wide_qwen3), "--prompt", PROMPT, "--max-tokens", "6",
                "--kv-bits", "4", "--kv-group-size", "32")
    ref = list(stream_generate(model, tok, PROMPT, max_tokens=6, kv_bits=4, kv_group_size=32))
    plain = list(stream_generate(model, tok, PROMPT, max_tokens=6))
    assert got["tokens"] == [r.token for r in ref]
    assert not all(mx.array_equal(a.logprobs, b.logprobs).item() for a, b in zip(ref, plain))
    code, _, err = run("--model", "zoo:qwen3", "--prompt", PROMPT, "--kv-bits", "4", "--kv-group-size", "32")
    assert code == 1 and "head dim 16" in err and err.count("\n") == 1


def test_kv_quantization_says_which_layers_it_touches(run, zoo_root):
    """TurboQuant converts full-attention caches only, and not the last layer (mlx-vlm's rule):
    on a sliding-window model most layers stay full precision, and the output says which."""
    code, out, err = run("--model", "zoo:gemma3_text,head_dim=32", "--prompt", PROMPT, "--max-tokens", "2",
                         "--kv", "turboquant:3.5")
    assert code == 0, err
    assert "KV: quantized on 1 layer(s) 2 of 4; full precision: 3 sliding-window layers" in err
    code, out, _ = run("--model", "zoo:llama,head_dim=32", "--prompt", PROMPT, "--max-tokens", "2",
                       "--kv", "turboquant:3.5", "--json")
    assert code == 0 and json.loads(out)["kv_layers"] == [0, 1]  # 2 layers: the last is converted too
    code, out, _ = run("--model", "zoo:llama,head_dim=32", "--prompt", PROMPT, "--max-tokens", "2",
                       "--kv", "uniform:4,group=32", "--json")
    assert code == 0 and json.loads(out)["kv_layers"] == [0, 1]
