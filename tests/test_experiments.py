"""mlxbun.experiments: what the standard notebooks compute and draw; mlxbun.parity.forced (teacher
forcing under KV settings) and mlxbun.lab.plots, which they are built on."""

import json
import math
import shutil

import matplotlib

matplotlib.use("Agg")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from mlxbun.errors import MlxbunError  # noqa: E402
from mlxbun.experiments import benchmark, kv_quant  # noqa: E402
from mlxbun.experiments.common import model_path, same_weights  # noqa: E402
from mlxbun.experiments.logit_diff import Side, logit_diff  # noqa: E402
from mlxbun.experiments.port_bringup import bringup  # noqa: E402
from mlxbun.lab import plots  # noqa: E402
from mlxbun.locate import locate, open_runtime  # noqa: E402
from mlxbun.names import KVSettings, parse_kv  # noqa: E402
from mlxbun.parity.forced import cache_nbytes, eval_ids, teacher_forced  # noqa: E402
from mlxbun.results import open_results  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _zoo_env(zoo_root):
    """The experiments resolve zoo:ARCH through the default zoo root: point it at the test zoo."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    mp.delenv("MLXBUN_LAB_RUN", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def wide(zoo_root):
    return locate("zoo:llama,head_dim=64", zoo_root=zoo_root)


@pytest.fixture(scope="module")
def tok(wide):
    from mlxbun.tokenizer import load_tokenizer

    return load_tokenizer(wide)


def _rows(path, **filters):
    with open_results(path) as store:
        return store.load(expand_params=True, **filters)


# ---------------------------------------------------------------- models


def test_model_path_zoo_variants_and_refusals(zoo):
    assert model_path("zoo:llama") == zoo("llama")
    assert model_path("zoo:llama", variant="q4") == zoo("llama", quant=4)
    assert model_path(str(zoo("llama"))) == zoo("llama")
    with pytest.raises(MlxbunError, match="head_dim"):
        model_path(str(zoo("llama")), head_dim=32)
    with pytest.raises(MlxbunError, match="variant"):
        model_path("zoo:llama", variant="q3")
    with pytest.raises(MlxbunError, match="zoo:ARCH"):
        model_path("no/such/dir/here/x")


def test_zoo_head_dim_option_builds_once(wide, zoo_root):
    cfg = json.loads((wide / "config.json").read_text())
    assert cfg["head_dim"] == 64 and cfg["model_type"] == "llama"
    mtime = (wide / "config.json").stat().st_mtime_ns
    assert locate("zoo:llama,head_dim=64", zoo_root=zoo_root) == wide
    assert (wide / "config.json").stat().st_mtime_ns == mtime
    q = locate("zoo:llama@q8,head_dim=32", zoo_root=zoo_root)
    qcfg = json.loads((q / "config.json").read_text())
    assert qcfg["head_dim"] == 32 and qcfg["quantization"]["bits"] == 8
    with pytest.raises(MlxbunError, match="head_dim"):
        locate("zoo:llama,head_dim=7", zoo_root=zoo_root)


def test_eval_ids_repeat_the_text(tok):
    ids = eval_ids(tok, 50, text="the keeper climbed the stairs")
    once = tok.encode("the keeper climbed the stairs")
    assert len(ids) == 50 and ids[: len(once)] == once and ids[len(once): 2 * len(once)] == once
    assert len(eval_ids(tok, 300)) == 300  # the zoo corpus
    with pytest.raises(MlxbunError):
        eval_ids(tok, 1)


@pytest.mark.parametrize("args, match", [
    (("plain", 4), "plain"), (("turboquant", 3.5, 64), "group size"), (("uniform", 7, 64), "kv_bits"),
    (("uniform", 4, 16), "kv_group_size"), (("lossy", 4), "scheme"), (("turboquant", None), "kv_bits"),
])
def test_kv_settings_refuses_what_no_cache_supports(args, match):
    with pytest.raises(MlxbunError, match=match):
        KVSettings(*args)


def test_kv_settings_labels_and_of():
    assert KVSettings().label == "plain"
    assert KVSettings("uniform", 4, 32).label == "uniform 4-bit g32"
    assert KVSettings.of("turboquant", 3.5, 64) == KVSettings("turboquant", 3.5)  # no groups: dropped
    assert KVSettings.of("uniform", 8, 64).group_size == 64


def test_teacher_forced_plain_matches_a_full_forward(wide, tok):
    model = open_runtime(wide)
    ids = eval_ids(tok, 40)
    run = teacher_forced(model, ids, prefill=16)
    assert run.logits.shape == (24, 512) and run.next_tokens == ids[16:]
    full = model(mx.array([ids]), cache=None)[0, 15:-1]  # position i predicts ids[i + 1]
    assert mx.allclose(run.logits, full, atol=1e-4, rtol=1e-4).item()
    # the cache holds ids[:-1]: 39 tokens x 2 layers x (K + V) x 2 kv heads x 64 dims x 4 bytes
    assert run.kv_bytes == 39 * 2 * 2 * 2 * 64 * 4
    assert run.kv_bytes_allocated == 256 * 2 * 2 * 2 * 64 * 4  # buffers grow in steps of 256
    assert run.decode_tps > 0 and run.peak_memory > 0
    with pytest.raises(MlxbunError, match="prefill"):
        teacher_forced(model, ids, prefill=40)


def test_teacher_forced_quantized_kv_drifts_and_is_smaller(wide, tok):
    from mlxbun.cache.quantized import QuantizedKVCache

    model = open_runtime(wide)
    ids = eval_ids(tok, 40)
    plain = teacher_forced(model, ids, prefill=16)
    q4 = teacher_forced(model, ids, prefill=16, kv=KVSettings("uniform", 4, 64))
    q8 = teacher_forced(model, ids, prefill=16, kv=KVSettings("uniform", 8, 64))
    d4 = float(mx.abs(q4.logits - plain.logits).max())
    d8 = float(mx.abs(q8.logits - plain.logits).max())
    assert 0 < d8 < d4
    # 4-bit, group 64: per 64 values 32 bytes of codes + float32 scale and bias (8 bytes)
    assert q4.kv_bytes == 39 * 2 * 2 * 2 * (32 + 8) and q4.kv_bytes < q8.kv_bytes < plain.kv_bytes
    cache = [QuantizedKVCache(group_size=64, bits=4)]
    assert cache_nbytes(cache) == (0, 0)
    with pytest.raises(MlxbunError, match="group size"):
        teacher_forced(model, ids, prefill=16, kv=KVSettings("uniform", 4, 128))  # 128 does not divide 64


# ---------------------------------------------------------------- port bring-up


@pytest.fixture(scope="module")
def bringup_pass(tmp_path_factory):
    db = tmp_path_factory.mktemp("bringup") / "r.sqlite"
    return bringup("zoo:llama", decode_steps=4, prompt_len=12, results_path=db), db


def test_bringup_passes_with_every_table(bringup_pass):
    b, db = bringup_pass
    assert b.verdict == "pass" and b.port.max_abs_diff == 0.0
    cov = b.coverage_table()
    assert {"head_dim", "hidden_size"} <= set(cov.loc[cov.status == "understood", "key"])
    audit = b.audit_table()
    assert (audit.status == "consumed").sum() == len(b.audit.consumed) > 0
    assert "lm_head.weight" in set(audit.tensor)
    heat = b.heatmap()
    assert list(heat.index[:3]) == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert np.nanmax(heat.to_numpy()) == 0.0 and heat.notna().to_numpy().any()
    assert b.trajectory.identical and len(b.trajectory.steps) == 5
    assert b.manifest["identity"]["model_type"] == "llama" and b.manifest["gate"]["verdict"] == "pass"
    assert b.manifest_path is None  # goldens_dir=None: shown, not kept
    assert b.steps_table().loc["verdict", "result"] == "pass"
    rows = _rows(db, experiment="port_bringup")
    got = dict(zip(rows.metric, rows.value))
    assert got["verdict_pass"] == 1.0 and got["max_abs_diff"] == 0.0 and got["layer_diff_max"] == 0.0
    assert got["modules_differing"] == 0 and got["tensors_consumed"] == len(b.audit.consumed)
    assert set(rows.run_id) == {b.run_id} and set(rows.model_type) == {"llama"}


def test_bringup_of_a_diverging_graph_localizes_it(zoo, monkeypatch, tmp_path):
    import mlxbun.factory

    real_open = mlxbun.factory.open_model

    def open_perturbed(path, **kwargs):
        model = real_open(path, **kwargs)
        w = model.model.layers[1].mlp.down_proj.weight
        model.model.layers[1].mlp.down_proj.weight = w + mx.array(1e-3, dtype=w.dtype)
        return model

    monkeypatch.setattr(mlxbun.factory, "open_model", open_perturbed)
    b = bringup("zoo:llama", decode_steps=3, prompt_len=12, goldens_dir=tmp_path / "g",
                          results_path=tmp_path / "r.sqlite")
    assert b.verdict == "fail" and b.port.first_divergence["path"] == "model.layers.1.mlp"
    assert b.explanation.model_type == "llama" and "q_proj" in b.explanation.text()
    with pytest.raises(MlxbunError, match=r"port fail: .*\(first divergence: model.layers.1.mlp\)"):
        b.require_pass()
    heat = b.heatmap()
    assert (heat.loc["model.layers.0"].fillna(0) == 0).all()
    assert heat.loc["model.layers.1", "mlp"] > 0 and heat.loc["logits", "output"] > 0
    assert heat.loc["model.layers.1", "attention"] == 0  # before the perturbed module
    assert b.manifest_path and (tmp_path / "g").is_dir()
    rows = _rows(tmp_path / "r.sqlite", experiment="port_bringup")
    got = dict(zip(rows.metric, rows.value))
    assert got["verdict_pass"] == 0.0 and got["max_abs_diff"] > 0 and got["modules_differing"] > 0
    fig = plots.heatmap_plot(heat)
    texts = {t.get_text() for t in fig.axes[0].texts}
    assert "0" in texts and any("e-" in t for t in texts)


def test_bringup_on_moe_passes_then_localizes_a_perturbed_expert(zoo, monkeypatch, tmp_path):
    """The bring-up notebook on a mixture of experts: bit-exact as is; one expert's weights
    nudged in layer 1, the first divergence is that layer's MoE block."""
    import mlxbun.factory

    b = bringup("zoo:qwen3_moe", decode_steps=3, prompt_len=12, goldens_dir=tmp_path / "g", record=False)
    assert b.verdict == "pass" and b.port.max_abs_diff == 0.0 and b.trajectory.identical
    assert np.nanmax(b.heatmap().to_numpy()) == 0.0
    real_open = mlxbun.factory.open_model

    def open_perturbed(path, **kwargs):
        model = real_open(path, **kwargs)
        experts = model.model.layers[1].mlp.switch_mlp.down_proj
        experts.weight = experts.weight + mx.array(1e-3, dtype=experts.weight.dtype)
        return model

    monkeypatch.setattr(mlxbun.factory, "open_model", open_perturbed)
    b = bringup("zoo:qwen3_moe", decode_steps=3, prompt_len=12, goldens_dir=tmp_path / "g2", record=False)
    assert b.verdict == "fail" and b.port.first_divergence["path"] == "model.layers.1.mlp"
    heat = b.heatmap()
    assert (heat.loc["model.layers.0"].fillna(0) == 0).all() and heat.loc["model.layers.1", "mlp"] > 0


def test_bringup_on_a_hybrid_compares_its_recurrent_states(tmp_path):
    """The bring-up notebook on a hybrid (lfm2: short convs on layers 0 and 2): its conv states
    are compared after every diffed step, and the largest state difference is recorded."""
    db = tmp_path / "r.sqlite"
    b = bringup("zoo:lfm2", decode_steps=3, prompt_len=12, diff_decode_steps=1, goldens_dir=tmp_path / "g",
                results_path=db)
    assert b.verdict == "pass" and b.trajectory.identical
    states = b.states()
    assert sorted(set(zip(states.step, states.layer))) == [(0, 0), (0, 2), (1, 0), (1, 2)]
    assert states.equal.all() and (states.norm_a > 0).all()
    rows = _rows(db, experiment="port_bringup")
    assert rows.loc[rows.metric == "state_diff_max", "value"].tolist() == [0.0]


def test_bringup_of_a_refused_checkpoint_records_the_refusal(zoo, tmp_path):
    odd = tmp_path / "odd"
    shutil.copytree(zoo("llama"), odd)
    cfg = json.loads((odd / "config.json").read_text())
    cfg["model_type"] = "kimi_linear"
    (odd / "config.json").write_text(json.dumps(cfg))
    b = bringup(str(odd), results_path=tmp_path / "r.sqlite")
    assert b.verdict == "refused" and "kimi_linear" in b.port.reason
    assert b.layer_diff is None and b.trajectory is None and b.manifest is None and b.explanation is None
    with pytest.raises(MlxbunError, match="refused"):
        b.heatmap()
    with pytest.raises(MlxbunError, match="port refused.*kimi_linear"):
        b.require_pass()
    rows = _rows(tmp_path / "r.sqlite", experiment="port_bringup")
    assert list(rows.metric) == ["verdict_pass"] and rows.value[0] == 0.0
    assert "kimi_linear" in rows["params.reason"][0] and rows["params.verdict"][0] == "refused"


# ---------------------------------------------------------------- logit diff


def test_logit_diff_of_identical_sides_is_zero(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXBUN_LAB_RUN", "lab-run-123")
    side = Side("zoo:llama")
    d = logit_diff(side, side, n_tokens=40, prefill=16, allow_identical=True, results_path=tmp_path / "r.sqlite")
    assert d.stats.count == 24 and d.stats.kld_max == 0.0 and d.stats.same_top_p == 1.0
    assert d.stats.dp_values is not None and not d.stats.dp_values.any()
    rows = _rows(tmp_path / "r.sqlite", experiment="logit_diff")
    assert set(rows["params.lab_run"]) == {"lab-run-123"}
    assert {"kld_mean", "same_top_p", "ppl_ratio"} <= set(rows.metric)
    assert len(rows) == len(d.stats.as_rows())


def test_logit_diff_refuses_to_compare_a_model_with_itself(zoo):
    with pytest.raises(MlxbunError, match="both sides are .* nothing would be compared"):
        logit_diff(Side("zoo:llama"), Side("zoo:llama"), n_tokens=40, prefill=16, record=False)
    real = str(zoo("llama"))  # a directory: the zoo's variants and head width do not apply to it
    assert Side(real, "q4", head_dim=32).path == Side(real).path == zoo("llama")
    with pytest.raises(MlxbunError, match="both sides are"):
        logit_diff(Side(real, "float32"), Side(real, "q4"), n_tokens=40, prefill=16, record=False)


def test_logit_diff_refuses_two_directories_holding_the_same_bytes(zoo, tmp_path):
    """A copy of a checkpoint (or a GGUF import whose --quant changed nothing) is the same model."""
    import shutil

    copy = shutil.copytree(zoo("llama"), tmp_path / "copy")
    with pytest.raises(MlxbunError, match="byte-identical config.json and weights"):
        logit_diff(Side(str(zoo("llama"))), Side(str(copy)), n_tokens=40, prefill=16, record=False)
    d = logit_diff(Side(str(zoo("llama"))), Side(str(copy)), n_tokens=40, prefill=16, allow_identical=True,
                   record=False)
    assert d.stats.kld_max == 0.0
    shards = sorted(copy.glob("*.safetensors"))
    shards[0].write_bytes(shards[0].read_bytes()[:-1] + b" ")  # one byte of padding / data differs
    assert not same_weights(zoo("llama"), copy)
    config = json.loads((copy / "config.json").read_text())
    shutil.copyfile(zoo("llama") / shards[0].name, shards[0])
    assert same_weights(zoo("llama"), copy)
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-3}))
    assert not same_weights(zoo("llama"), copy)


def test_logit_diff_of_weights_and_of_kv(tmp_path):
    weights = logit_diff(Side("zoo:llama"), Side("zoo:llama", "q4"),
                                   n_tokens=40, prefill=16, record=False)
    assert weights.stats.kld_mean > 0 and weights.run_id is None
    assert weights.new.label == "zoo:llama/q4 [mlxbun] kv=plain"
    base = Side("zoo:llama", head_dim=64)
    kv = logit_diff(base, Side("zoo:llama", head_dim=64, kv=KVSettings("uniform", 4, 64)),
                              n_tokens=40, prefill=16, comparison="kv", results_path=tmp_path / "r.sqlite")
    assert 0 < kv.stats.kld_mean < weights.stats.kld_mean * 10
    rows = _rows(tmp_path / "r.sqlite")
    assert set(rows["params.comparison"]) == {"kv"} and set(rows["params.new.kv"]) == {"uniform 4-bit g64"}
    per = kv.per_position()
    assert len(per) == 24 and {"kld", "delta_p"} <= set(per.columns)
    for fig in (plots.kld_per_position_plot(kv.stats), plots.delta_p_hist(kv.stats)):
        assert fig.axes and fig.axes[0].get_title()


# ---------------------------------------------------------------- KV sweep


def test_kv_grid():
    specs = kv_quant.kv_grid([4, 8], [32, 64], [3.5])
    assert [s.label for s in specs] == ["uniform 4-bit g32", "uniform 4-bit g64", "uniform 8-bit g32",
                                        "uniform 8-bit g64", "turboquant 3.5-bit"]
    # a TurboQuant entry may be a [key_bits, value_bits] split: generation's setting of that name
    tq = kv_quant.kv_grid([], [], [3.5, [4, 3]])
    assert [s.label for s in tq] == ["turboquant 3.5-bit", "turboquant K4/V3"]
    assert tq[1] == parse_kv("turboquant:3.5,keys=4")
    with pytest.raises(MlxbunError, match=r"\[key_bits, value_bits\]"):
        kv_quant.kv_grid([], [], [[4, 3, 2]])


def test_pareto_front():
    df = pd.DataFrame({"kv_bytes": [10, 20, 30, 15, 15, np.nan], "kld_mean": [5, 2, 0, 6, 5, 0]})
    assert kv_quant.pareto_front(df).tolist() == [True, True, True, False, False, False]


def test_kv_sweep_table_and_rows(tmp_path):
    specs = [KVSettings("uniform", 4, 64), KVSettings("uniform", 8, 64), KVSettings("uniform", 4, 128),
             KVSettings("turboquant", 3.5)]
    db = tmp_path / "r.sqlite"
    df = kv_quant.kv_sweep("zoo:llama", specs, context_lengths=(24,), n_eval=8, results_path=db)
    assert list(df.columns) == kv_quant.KV_COLUMNS and len(df) == 5
    plain = df.iloc[0]
    assert plain.label == "plain" and plain.kld_mean == 0 and plain.kv_bytes_ratio == 1 and plain.top1_agreement == 1
    q4, q8, bad, tq = (df.iloc[i] for i in range(1, 5))
    assert 0 < q8.kld_mean < q4.kld_mean and q4.kv_bytes < q8.kv_bytes < plain.kv_bytes
    assert 0 < tq.kv_bytes_ratio < 1 and tq.kld_mean > 0
    assert list(df.layers) == ["0/2", "2/2", "2/2", "2/2", "2/2"]  # plain quantizes none; 2 layers: all
    assert math.isnan(bad.kld_mean) and "group size" in bad.error
    rows = _rows(db, experiment="kv_quant")
    fail = rows[rows.metric == "error"]
    assert len(fail) == 1 and fail["params.kv_group_size"].iloc[0] == 128 and math.isnan(fail.value.iloc[0])
    assert "group size" in fail["params.error"].iloc[0]
    kld = rows[(rows.metric == "kld_mean") & (rows["params.kv"] == "uniform 4-bit g64")]
    assert kld.value.iloc[0] == pytest.approx(q4.kld_mean)
    assert kv_quant.pareto_front(df).iloc[0]  # plain: KLD 0, nothing beats it on KLD
    assert kv_quant.pareto_plot(df).axes and kv_quant.kv_metric_plot(df, "decode_tps").axes


# ---------------------------------------------------------------- benchmark


def test_benchmark_table_and_wall(tmp_path):
    db = tmp_path / "r.sqlite"
    b = benchmark.benchmark("zoo:llama", prompt_len=16, gen_len=4, trials=1, warmup=0, bandwidth_mb=8,
                            results_path=db)
    t = b.table()
    assert list(t.index) == ["mlxbun", "mlx-lm"] and (t.decode_tps > 0).all() and (t.prefill_tps > 0).all()
    assert b.device_bandwidth_gb_s > 0
    assert t.wall_tps.iloc[0] == pytest.approx(b.device_bandwidth_gb_s * 1e9 / b.weights_bytes)
    assert t.decode_bandwidth_gb_s.iloc[0] == pytest.approx(b.weights_bytes * t.decode_tps.iloc[0] / 1e9)
    assert t.wall_fraction.iloc[0] == pytest.approx(t.decode_bandwidth_gb_s.iloc[0] / b.device_bandwidth_gb_s)
    rows = _rows(db)
    assert {"bench", "benchmark"} <= set(rows.experiment)
    mine = rows[rows.experiment == "benchmark"]
    assert set(mine["params.bench_run"]) == {b.result.run_id}
    assert set(mine[mine.metric == "wall_fraction"]["params.engine"]) == {"mlxbun", "mlx-lm"}
    assert benchmark.bench_bars(t).axes[0].get_title() == "prefill_tps"
    assert benchmark.bandwidth_plot(b.weights_bytes, b.device_bandwidth_gb_s * 1e9, t.decode_tps.to_dict()).axes


# ---------------------------------------------------------------- plots and widgets


def test_headless_detection(monkeypatch):
    for name in (plots.HEADLESS_ENV, plots.INTERACTIVE_ENV, *plots.FRONTEND_ENV):
        monkeypatch.delenv(name, raising=False)
    assert not plots.interactive()  # plain Python: no kernel
    monkeypatch.setattr(plots, "_ipython", lambda: type("Kernel", (), {"kernel": object()})())
    assert not plots.interactive()  # a kernel nobody marked as a frontend's: papermill, nbclient
    monkeypatch.setenv("JPY_SESSION_NAME", "/home/u/port_bringup.ipynb")  # what jupyter_server sets
    assert plots.interactive()
    monkeypatch.setenv(plots.HEADLESS_ENV, "1")
    assert not plots.interactive()
    monkeypatch.setenv(plots.HEADLESS_ENV, "0")
    monkeypatch.delenv("JPY_SESSION_NAME")
    monkeypatch.setenv(plots.INTERACTIVE_ENV, "1")
    assert plots.interactive()


def test_explorers_render_static_headless(bringup_pass, monkeypatch):
    shown = []
    monkeypatch.setattr(plots, "_ipython", lambda: object())  # a notebook without a live frontend
    monkeypatch.setattr(plots, "display", shown.append)
    monkeypatch.setenv(plots.HEADLESS_ENV, "1")
    b, _ = bringup_pass
    assert plots.trajectory_explorer(b.trajectory, ("mlx-lm", "mlxbun")) is None
    assert len(shown) == 2 and isinstance(shown[1], pd.DataFrame) and len(shown[1]) == 5
    assert plots.layer_explorer(b.layer_diff) is None
    assert isinstance(shown[2], pd.DataFrame) and "max_abs_diff" in shown[2].columns


def test_explorers_build_widgets_with_a_frontend(bringup_pass, monkeypatch):
    import ipywidgets

    monkeypatch.setattr(plots, "interactive", lambda: True)
    monkeypatch.setattr(plots, "display", lambda obj: None)
    b, _ = bringup_pass
    box = plots.trajectory_explorer(b.trajectory)
    slider = box.children[0]
    assert isinstance(slider, ipywidgets.IntSlider) and slider.max == len(b.trajectory.steps) - 1
    slider.value = 0  # re-renders without error
    box = plots.layer_explorer(b.layer_diff)
    assert "model.layers.1" in box.children[0].options
    box.children[0].value = "model.layers.1"
    fig = plots.heatmap_plot(b.heatmap(), highlight="model.layers.1")
    assert len(fig.axes[0].patches) == 1


def test_topk_plot_marks_the_chosen_ids(bringup_pass):
    b, _ = bringup_pass
    step = b.trajectory.steps[0]
    fig = plots.topk_plot(step, ("mlx-lm", "mlxbun"), tokenizer=b.tokenizer)
    left, right = fig.axes
    assert left.get_title() == f"mlx-lm: chose {step.id_a}" and len(left.patches) == 5
    top_label = left.get_yticklabels()[-1].get_text()  # the most probable: drawn last, on top
    assert top_label == f"{step.id_a} {b.tokenizer.decode([step.id_a])!r}"
    assert left.patches[-1].get_facecolor() != left.patches[0].get_facecolor()  # the chosen one in red
    assert plots.trajectory_plot(b.trajectory).axes[0].get_title().endswith("identical")


def test_kv_sweep_of_a_checkpoint_directory_keeps_its_heads(zoo):
    df = kv_quant.kv_sweep(str(zoo("llama")), [KVSettings("turboquant", 3.5), KVSettings("uniform", 4, 32)],
                            context_lengths=(16,), n_eval=4, record=False)  # head_dim=64 applies to zoo: only
    assert df.label.tolist() == ["plain", "turboquant 3.5-bit", "uniform 4-bit g32"]
    assert df.kld_mean.iloc[1] > 0 and "group size" in df.error.iloc[2]  # the zoo's head_dim is 16


def test_kv_sweep_takes_per_layer_plans():
    plan = [{"layer_idx": 0, "bits": 4, "group_size": 64}]  # optiq's kv_config entries
    df = kv_quant.kv_sweep("zoo:llama", [KVSettings("uniform", 4, 64)], plans={"layer 0 at 4 bits": plan},
                           context_lengths=(24,), n_eval=8, record=False)
    plain, q4, mixed = (df.iloc[i] for i in range(3))
    assert mixed.scheme == "mixed" and mixed.label == "layer 0 at 4 bits" and mixed.layers == "1/2"
    assert 0 < mixed.kld_mean and q4.kv_bytes < mixed.kv_bytes < plain.kv_bytes  # half the layers at 4 bits
    assert plain.ppl_ratio == 1.0 and q4.ppl_ratio > 0 and q4.kld_p999 >= q4.kld_p99
