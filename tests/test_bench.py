"""mlxbun bench: rows and statistics, identical weights in both engines, the results table, the
published shapes of `random:`, the timing loops, and one-line argument errors."""

import json
import math

import mlx.core as mx
import pytest

from mlxbun import cli
from mlxbun.bench import run_bench, scale_down, shape_config
from mlxbun.bench import runner as bench_runner
from mlxbun.bench.engines import load_engines
from mlxbun.results import open_results

TINY = ["--prompt-len", "16", "--gen-len", "4", "--trials", "2"]


def _main(argv, monkeypatch):
    """mlxbun's real entry point (the bench command as cli.py registers it)."""
    return cli.main(argv)


@pytest.fixture(scope="session")
def zoo_cli_run(zoo_root, tmp_path_factory):
    """`mlxbun bench --model zoo:llama ... --json` once: (rows, results db path)."""
    import contextlib
    import io

    db = tmp_path_factory.mktemp("bench") / "results.sqlite"
    out = io.StringIO()
    mp = pytest.MonkeyPatch()
    try:
        with contextlib.redirect_stdout(out):
            rc = _main(["bench", "--model", "zoo:llama", *TINY, "--json", "--results", str(db),
                        "--zoo-cache", str(zoo_root)], mp)
    finally:
        mp.undo()
    assert rc == 0
    return json.loads(out.getvalue()), db


# ------------------------------------------------------------------ JSON rows


def test_json_rows_have_fields_and_sensible_values(zoo_cli_run):
    rows, _ = zoo_cli_run
    assert sorted((r["engine"], r["test"]) for r in rows) == [
        ("mlx-lm", "pp16"), ("mlx-lm", "tg4"), ("mlxbun", "pp16"), ("mlxbun", "tg4")]
    for r in rows:
        assert r["model_type"] == "llama" and r["backend"] == "cpu"
        assert math.isfinite(r["tokens_per_s"]) and r["tokens_per_s"] > 0
        assert len(r["samples_tokens_per_s"]) == 2
        assert r["tokens_per_s"] == pytest.approx(sum(r["samples_tokens_per_s"]) / 2, rel=1e-12)
        assert 0 < r["peak_memory_gb"] < 1  # a 0.5 MB model: weights + cache, not gigabytes
        assert r["peak_memory_gb"] * 1e9 >= r["size_bytes"]  # the resident weights count
        if r["test"] == "pp16":
            assert r["ttft_ms"] > 0 and r["bandwidth_gb_s"] is None
            # TTFT is the prefill time: 16 tokens / t/s, as a median over samples
            ttfts = sorted(1e3 * 16 / t for t in r["samples_tokens_per_s"])
            assert r["ttft_ms"] == pytest.approx(sum(ttfts) / 2, rel=1e-9)
        else:
            assert r["ttft_ms"] is None
            assert r["bandwidth_gb_s"] == pytest.approx(r["size_bytes"] * r["tokens_per_s"] / 1e9, rel=1e-12)
    by = {(r["engine"], r["test"]): r for r in rows}
    for test in ("pp16", "tg4"):
        mine, ref = by[("mlxbun", test)], by[("mlx-lm", test)]
        assert mine["ratio_vs_mlx_lm"] == pytest.approx(mine["tokens_per_s"] / ref["tokens_per_s"], rel=1e-12)
        assert "ratio_vs_mlx_lm" not in ref


def test_both_engines_ran_on_identical_weights(zoo_cli_run):
    rows, _ = zoo_cli_run
    checks = rows[0]["checks"]
    assert checks == {"weights_shared": True, "same_greedy_tokens": True, "prefill_logits_bit_exact": True}


def test_rows_land_in_the_results_table(zoo_cli_run):
    rows, db = zoo_cli_run
    with open_results(db, create=False) as store:
        df = store.load(experiment="bench", expand_params=True)
    assert len(df["run_id"].unique()) == 1 and (df["model_type"] == "llama").all()
    assert df["model_path"].str.contains("tiny-llama").all()
    means = df[df["metric"] == "tokens_per_s.mean"]
    assert sorted(zip(means["params.engine"], means["params.test"])) == [
        ("mlx-lm", "pp16"), ("mlx-lm", "tg4"), ("mlxbun", "pp16"), ("mlxbun", "tg4")]
    by = {(r["engine"], r["test"]): r for r in rows}
    for _, m in means.iterrows():
        assert m["value"] == pytest.approx(by[(m["params.engine"], m["params.test"])]["tokens_per_s"])
    ratios = df[df["metric"] == "ratio_vs_mlx_lm"]
    assert set(ratios["params.engine"]) == {"mlxbun"} and len(ratios) == 2
    for metric in ("tokens_per_s.median", "tokens_per_s.sd", "peak_memory_gb", "ttft_ms.median", "bandwidth_gb_s"):
        assert metric in set(df["metric"]), metric
    assert (df[df["metric"].str.startswith("check.")]["value"] == 1.0).all()
    assert (df["params.prompt_len"] == 16).all() and (df["params.trials"] == 2).all()


def test_checks_catch_engines_on_different_weights(zoo_root, monkeypatch):
    """Negating mlx-lm's final norm negates its logits: the checks must see it."""
    real = bench_runner.load_engines

    def sabotaged(*args, **kwargs):
        mut = real(*args, **kwargs)
        inner = mut.engines["mlx-lm"].module.model
        inner.norm.weight = -inner.norm.weight
        return mut

    monkeypatch.setattr(bench_runner, "load_engines", sabotaged)
    r = run_bench("zoo:llama", prompt_len=8, gen_len=3, trials=1, warmup=0, zoo_root=zoo_root, record=False)
    assert r.checks == {"weights_shared": False, "same_greedy_tokens": False, "prefill_logits_bit_exact": False}


# ------------------------------------------------------------------ random shapes


def test_random_llama_3_2_1b_config_is_the_published_one():
    cfg = shape_config("llama-3.2-1b")
    assert {k: cfg[k] for k in (
        "model_type", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
        "head_dim", "num_hidden_layers", "vocab_size", "rope_theta", "rms_norm_eps", "tie_word_embeddings",
        "max_position_embeddings")} == {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 16, "vocab_size": 128256,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "tie_word_embeddings": True,
        "max_position_embeddings": 131072}
    assert cfg["rope_scaling"] == {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    cfg8 = shape_config("llama-3-8b")
    assert (cfg8["hidden_size"], cfg8["intermediate_size"], cfg8["num_hidden_layers"], cfg8["num_attention_heads"],
            cfg8["num_key_value_heads"], cfg8["vocab_size"], cfg8["tie_word_embeddings"], cfg8["rope_scaling"],
            cfg8["max_position_embeddings"]) == (4096, 14336, 32, 32, 8, 128256, False, None, 8192)
    q = shape_config("qwen3-0.6b")
    assert (q["hidden_size"], q["intermediate_size"], q["num_hidden_layers"], q["num_attention_heads"],
            q["num_key_value_heads"], q["head_dim"], q["vocab_size"], q["tie_word_embeddings"], q["rope_theta"]) == (
        1024, 3072, 28, 16, 8, 128, 151936, True, 1000000)
    shape_config("llama-3.2-1b")["hidden_size"] = 1  # a copy: the table cannot be edited through it
    assert shape_config("llama-3.2-1b")["hidden_size"] == 2048


@pytest.mark.parametrize("name, params", [
    ("llama-3.2-1b", 1_235_814_400), ("llama-3.2-3b", 3_212_749_824), ("llama-3-8b", 8_030_261_248),
    ("llama-3.1-8b", 8_030_261_248), ("qwen3-0.6b", 596_049_920), ("qwen3-4b", 4_022_468_096),
    ("qwen3-8b", 8_190_735_360), ("qwen3-30b-a3b", 30_532_122_624)])
def test_random_shapes_have_the_published_parameter_counts(name, params):
    """mlx-lm's model of each shape (built lazily: nothing is allocated) counts the real models' params."""
    from mlx_lm.utils import _get_classes, get_total_parameters

    from mlxbun.models.universal.coverage import require_coverage

    cfg = shape_config(name)
    require_coverage(cfg["model_type"], cfg)
    model_class, args_class = _get_classes(cfg)
    assert get_total_parameters(model_class(args_class.from_dict(cfg))) == params


def test_random_gpt_oss_20b_config_is_the_published_one():
    """openai/gpt-oss-20b's config.json; mlx-lm counts its parameters from leaf modules, which
    leaves out the attention sinks (24 layers x 64 heads): the published total is 20,914,757,184."""
    from mlx_lm.utils import _get_classes, get_total_parameters

    from mlxbun.models.universal.coverage import require_coverage

    cfg = shape_config("gpt-oss-20b")
    assert {k: cfg[k] for k in (
        "model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "num_local_experts", "num_experts_per_tok", "sliding_window",
        "vocab_size", "rope_theta", "tie_word_embeddings")} == {
        "model_type": "gpt_oss", "num_hidden_layers": 24, "hidden_size": 2880, "intermediate_size": 2880,
        "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "sliding_window": 128, "vocab_size": 201088, "rope_theta": 150000,
        "tie_word_embeddings": False}
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 12
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 32.0
    require_coverage(cfg["model_type"], cfg)
    model_class, args_class = _get_classes(cfg)
    assert get_total_parameters(model_class(args_class.from_dict(cfg))) + 24 * 64 == 20_914_757_184


def test_random_gpt_oss_20b_scaled_down_end_to_end():
    """`mlxbun bench --model random:gpt-oss-20b` at 1/15 (widths 192, a multiple of the group 64,
    so the experts quantize: mlx's CPU gather_mm takes no bfloat16): sliding / full layers, sinks,
    32 experts top-4, mlx-lm's tokens and logits."""
    from mlxbun.bench.shapes import scale_down

    small = scale_down(shape_config("gpt-oss-20b"), 15)
    assert (small["hidden_size"], small["num_hidden_layers"], small["layer_types"], small["num_local_experts"]) == (
        192, 2, ["sliding_attention", "full_attention"], 32)
    r = run_bench("random:gpt-oss-20b", scale_down=15, quant=4, prompt_len=16, gen_len=4, trials=1,
                  record=False, progress=False)
    assert r.checks == {"weights_shared": True, "same_greedy_tokens": True, "prefill_logits_bit_exact": True}
    assert (r.model_type, r.kind) == ("gpt_oss", "random")


def test_random_model_end_to_end_quantized():
    r = run_bench("random:llama-3.2-1b", scale_down=32, quant=4, prompt_len=16, gen_len=4, trials=2,
                  record=False, progress=False)
    assert r.checks == {"weights_shared": True, "same_greedy_tokens": True, "prefill_logits_bit_exact": True}
    assert (r.model_type, r.dtype, r.quant, r.kind) == ("llama", "bfloat16", "affine 4-bit g64", "random")
    assert r.identity["model_fingerprint"].startswith("random:")
    assert len(r.tokens["mlxbun"]) == 4 and r.tokens["mlxbun"] == r.tokens["mlx-lm"]
    assert all(t.mean > 0 for t in r.tests) and r.ratio("tg4") > 0
    assert "| random:llama-3.2-1b/32 bfloat16 affine 4-bit g64 |" in r.to_markdown()


def test_random_moe_shape_end_to_end():
    """Qwen3-30B-A3B scaled down keeps its structure (top-8 of fewer, narrower experts) and runs
    mlxbun's MoE graph bit for bit with mlx-lm's (float32: mlx's CPU gather_mm takes no other)."""
    cfg = scale_down(shape_config("qwen3-30b-a3b"), 32)
    assert (cfg["num_experts"], cfg["num_experts_per_tok"], cfg["moe_intermediate_size"]) == (8, 8, 24)
    assert scale_down(shape_config("qwen3-30b-a3b"), 4)["num_experts"] == 32
    r = run_bench("random:qwen3-30b-a3b", scale_down=32, dtype="float32", prompt_len=16, gen_len=4, trials=1,
                  warmup=0, record=False, progress=False)
    assert r.model_type == "qwen3_moe"
    assert r.checks == {"weights_shared": True, "same_greedy_tokens": True, "prefill_logits_bit_exact": True}
    # top-8 of 8 experts: a decoded token reads every weight
    assert r.read_bytes == r.weights_bytes and "the routed experts' top-k share" not in r.to_markdown()


def test_moe_bandwidth_wall_counts_the_experts_a_token_reads():
    """A decoded token reads top_k / E of each MoE layer's fused experts: the bandwidth wall is
    computed from those bytes, not from every weight (Qwen3-30B-A3B's 3B active parameters)."""
    from mlx.utils import tree_flatten

    from mlxbun.bench.engines import unread_expert_bytes

    mut = load_engines("random:qwen3-30b-a3b", scale_down=8, dtype="float32", engines=("mlx-lm",))
    cfg = mut.config
    experts = {k: v for k, v in tree_flatten(mut.engines["mlx-lm"].module.parameters()) if ".switch_mlp." in k}
    E, k = cfg["num_experts"], cfg["num_experts_per_tok"]
    assert (E, k) == (16, 8) and len(experts) == 3 * cfg["num_hidden_layers"]
    unread = sum(v.nbytes for v in experts.values()) * (E - k) // E
    assert unread_expert_bytes(mut.engines["mlx-lm"].module) == 0  # mlx-lm's tree: no universal MoE blocks
    assert mut.decode_bytes == mut.weights_bytes - unread


def test_random_weights_are_shared_quantized_and_seeded():
    from mlx.utils import tree_flatten

    mut = load_engines("random:llama-3.2-1b", scale_down=32, quant=8, dtype="float16", seed=3)
    mb, lm = mut.engines["mlxbun"].module, mut.engines["mlx-lm"].module
    pb, pl = dict(tree_flatten(mb.parameters())), dict(tree_flatten(lm.parameters()))
    assert pb.keys() == pl.keys() and all(pb[k] is pl[k] for k in pb)
    assert "model.layers.0.self_attn.q_proj.scales" in pb  # quantized, as mlx-lm's quantize_model does
    assert pb["model.layers.0.self_attn.q_proj.weight"].dtype == mx.uint32
    assert pb["model.layers.0.self_attn.q_proj.scales"].dtype == mx.float16
    assert mut.config["quantization"] == {"group_size": 64, "bits": 8, "mode": "affine"}
    again = load_engines("random:llama-3.2-1b", scale_down=32, quant=8, dtype="float16", seed=3, engines=("mlx-lm",))
    other = load_engines("random:llama-3.2-1b", scale_down=32, quant=8, dtype="float16", seed=4, engines=("mlx-lm",))
    w = "model.layers.1.mlp.up_proj.weight"
    pa, po = dict(tree_flatten(again.engines["mlx-lm"].module.parameters())), dict(
        tree_flatten(other.engines["mlx-lm"].module.parameters()))
    assert mx.array_equal(pa[w], pl[w]) and not mx.array_equal(po[w], pl[w])


def test_random_custom_config_path(tmp_path):
    """random:PATH runs any config.json the universal graph covers (here a tiny qwen3, tied)."""
    from mlxbun.zoo import tiny_config

    cfg = tiny_config("qwen3")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    r = run_bench(f"random:{tmp_path / 'config.json'}", dtype="float32", prompt_len=8, gen_len=3, trials=1,
                  warmup=0, record=False, progress=False)
    assert r.model_type == "qwen3" and r.checks["same_greedy_tokens"] and r.checks["prefill_logits_bit_exact"]


# ------------------------------------------------------------------ timing loops


@pytest.fixture(scope="module")
def zoo_engine(zoo_root):
    return load_engines("zoo:llama", zoo_root=zoo_root, engines=("mlxbun",)).engines["mlxbun"]


def test_decode_loop_matches_plain_greedy_and_counts_steps(zoo_engine):
    calls = []
    real_forward = zoo_engine.forward

    def counting(ids, cache):
        calls.append(ids.shape[1])
        return real_forward(ids, cache)

    ctx = mx.array([5, 17, 42, 7, 99], dtype=mx.int32)
    stream = mx.new_stream(mx.default_device())
    engine = type(zoo_engine)(zoo_engine.name, zoo_engine.module, counting, zoo_engine.make_cache)
    sample, toks = bench_runner.time_decode(engine, ctx, 6, stream)
    assert calls == [5] + [1] * 6 and sample.seconds > 0 and sample.peak_memory_bytes > 0
    cache = zoo_engine.make_cache()
    y = mx.argmax(real_forward(ctx[None], cache)[:, -1], axis=-1)
    plain = []
    for _ in range(6):
        y = mx.argmax(real_forward(y[:, None], cache)[:, -1], axis=-1)
        plain.append(y.item())
    assert toks == plain


def test_prefill_chunks_and_first_token(zoo_engine):
    prompt = mx.arange(3, 40, dtype=mx.int32)
    stream = mx.new_stream(mx.default_device())
    full = zoo_engine.forward(prompt[None], zoo_engine.make_cache())[:, -1]
    _, first_whole, _ = bench_runner.time_prefill(zoo_engine, prompt, stream, prefill_step=2048)
    _, first_chunked, logits = bench_runner.time_prefill(zoo_engine, prompt, stream, prefill_step=5)
    assert first_whole == first_chunked == mx.argmax(full, axis=-1).item()
    assert logits.shape == full.shape


def test_measure_copy_bandwidth():
    assert bench_runner.measure_copy_bandwidth(size_mb=8, reps=3) > 0.1  # GB/s; any machine copies faster


def test_progress_bar_appears_only_after_the_delay(monkeypatch):
    bar = bench_runner._LazyProgress(3, enabled=True)
    bar.advance("a")
    assert bar._bar is None  # a fast run never shows one
    monkeypatch.setattr(bench_runner, "PROGRESS_AFTER_S", 0.0)
    bar.advance("b")
    assert bar._bar is not None
    bar.close()
    assert bar._bar is None


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("argv, code, needle", [
    (["--model", "zoo:nope"], 1, "nope"),
    (["--model", "random:llama-9b"], 1, "llama-3.2-1b"),
    (["--model", "/nonexistent/ckpt"], 1, "/nonexistent/ckpt"),
    (["--model", "zoo:llama", "--trials", "0"], 1, "trials"),
    (["--model", "zoo:llama", "--prompt-len", "0", "--gen-len", "0"], 1, "nothing to run"),
    (["--model", "zoo:llama", "--scale-down", "4"], 1, "random:"),
    (["--model", "random:llama-3.2-1b", "--scale-down", "0"], 1, "scale-down"),
    (["--model", "zoo:llama", "--bandwidth-mb", "-1"], 1, "bandwidth-mb"),
    (["--model", "zoo:llama", "--quant", "3"], 2, "--quant"),
    (["--model", "zoo:llama", "--dtype", "float64"], 2, "--dtype"),
    (["--model", "zoo:llama", "--vs", "llama.cpp"], 2, "--vs"),
    (["--trials", "2"], 2, "--model"),
])
def test_bad_arguments_error_in_one_line(argv, code, needle, monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("MLXBUN_RESULTS", str(tmp_path / "results.sqlite"))  # never the user's table
    try:
        rc = _main(["bench", *argv], monkeypatch)
    except SystemExit as e:
        rc = e.code
    assert rc == code
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error" in err and needle in err, err


def test_checkpoint_refuses_dtype_and_quant(zoo, monkeypatch, capsys):
    rc = _main(["bench", "--model", str(zoo("llama")), "--dtype", "bfloat16", "--no-record"], monkeypatch)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "own dtype" in err


def test_bad_results_file_fails_before_running(tmp_path, monkeypatch, capsys):
    bad = tmp_path / "notes.txt"
    bad.write_text("not a database")
    monkeypatch.setattr(bench_runner, "load_engines", lambda *a, **k: pytest.fail("ran before checking --results"))
    rc = _main(["bench", "--model", "zoo:llama", "--results", str(bad)], monkeypatch)
    err = capsys.readouterr().err
    assert rc == 1 and err.count("\n") == 1 and "notes.txt" in err
    assert bad.read_text() == "not a database"
