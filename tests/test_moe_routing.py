"""mlxbun.experiments.moe_routing: routing statistics checked by hand and against the routers'
own taps, agreement of two configurations, its results rows, plots and refusals."""

import math

import matplotlib

matplotlib.use("Agg")

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402

import mlxbun.cli as cli  # noqa: E402
from mlxbun.errors import MlxbunError  # noqa: E402
from mlxbun.experiments.moe_routing import ROUTER_PROBS, LayerRouting, RoutingStats, Side, agreement, moe_routing  # noqa: E402
from mlxbun.lab import plots  # noqa: E402
from mlxbun.locate import open_runtime  # noqa: E402
from mlxbun.models.universal.kinds import GateAct, RouterKind, ScoreFunc  # noqa: E402
from mlxbun.models.universal.moe import Router  # noqa: E402
from mlxbun.parity.forced import eval_ids  # noqa: E402
from mlxbun.results import open_results  # noqa: E402
from mlxbun.tokenizer import load_tokenizer  # noqa: E402

N_TOKENS = 48


@pytest.fixture(scope="module", autouse=True)
def _zoo_env(zoo_root):
    """Side(...) resolves zoo:ARCH through the default zoo root: point it at the test zoo."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    mp.delenv("MLXBUN_LAB_RUN", raising=False)
    yield
    mp.undo()


@pytest.fixture(scope="module")
def q4_run(tmp_path_factory):
    """zoo:qwen3_moe float32 vs q4, recorded."""
    db = tmp_path_factory.mktemp("routing") / "results.sqlite"
    return moe_routing(Side("zoo:qwen3_moe"), Side("zoo:qwen3_moe", "q4"), n_tokens=N_TOKENS, results_path=db), db


def _layer(kind, experts, logits, weights=None) -> LayerRouting:
    experts = np.asarray(experts, dtype=np.int64)
    return LayerRouting(layer=0, path="model.layers.0.mlp.gate", kind=RouterKind(kind), experts=experts,
                        weights=np.ones(experts.shape) if weights is None else np.asarray(weights, float),
                        logits=np.asarray(logits, dtype=np.float64))


# ----------------------------------------------------------------- by hand


def test_statistics_of_a_hand_made_layer():
    r = _layer("softmax_topk", [[0, 1], [1, 0], [1, 3]],
               [[0.0, 0.0, 0.0, 0.0], [math.log(3), 0.0, 0.0, 0.0], [0.0, 100.0, 0.0, 0.0]],
               weights=[[0.5, 0.5], [0.75, 0.25], [1.0, 0.0]])
    assert r.load().tolist() == [2, 3, 0, 1]  # each of the k slots counted: sums to 3 tokens x 2
    # uniform: ln 4; p = (1/2, 1/6, 1/6, 1/6); nearly one-hot: ~0
    h = r.entropy()
    assert h[0] == pytest.approx(math.log(4), abs=1e-12)
    assert h[1] == pytest.approx(0.5 * math.log(2) + 3 * (math.log(6) / 6), abs=1e-12)
    assert 0 <= h[2] < 1e-40
    assert r.topk_mass().tolist() == pytest.approx([0.5, 2 / 3, 1.0])
    assert r.weight_sum().tolist() == pytest.approx([1.0, 1.0, 1.0])
    row = RoutingStats(Side(), [r]).table().iloc[0]
    assert row.entropy_max == pytest.approx(math.log(4)) and row.experts_unused == 1
    assert row.load_imbalance == pytest.approx(3 / 1.5)


def test_a_sigmoid_router_s_distribution_is_its_normalized_scores():
    r = _layer("noaux_tc", [[0, 1]], [[0.0, 0.0, 0.0, 0.0]])
    assert r.probs()[0].tolist() == pytest.approx([0.25] * 4) and r.entropy()[0] == pytest.approx(math.log(4))
    s = 1 / (1 + np.exp(-np.array([2.0, -1.0, 0.5, 0.0])))
    r = _layer("noaux_tc", [[0, 2]], [[2.0, -1.0, 0.5, 0.0]])
    assert r.topk_mass()[0] == pytest.approx((s[0] + s[2]) / s.sum())


def test_every_router_kind_gives_a_distribution():
    logits = np.random.default_rng(0).normal(size=(5, 8)) * 4
    for kind in RouterKind:
        for params in ({"score": "sigmoid", "score_func": "sigmoid", "act": GateAct.SIGMOID,
                        "softcap": 0.0, "score_fn": ScoreFunc.SIGMOID},
                       {"score": "softmax", "score_func": "softmax", "act": GateAct.SOFTMAX,
                        "softcap": 2.0, "score_fn": ScoreFunc.SQRTSOFTPLUS}):
            p = ROUTER_PROBS[kind](logits, params)
            assert p.shape == logits.shape and (p >= 0).all() and np.allclose(p.sum(-1), 1.0), kind
    grouped = ROUTER_PROBS[RouterKind.GROUPED_SCORE]
    assert np.allclose(grouped(logits, {"score": "softmax"}), ROUTER_PROBS[RouterKind.SOFTMAX_TOPK](logits))
    assert np.allclose(grouped(logits, {"score": "sigmoid"}), ROUTER_PROBS[RouterKind.NOAUX_TC](logits))
    scored = ROUTER_PROBS[RouterKind.SCORED_GROUPED]
    assert np.allclose(scored(logits, {"score_func": "softmax"}), ROUTER_PROBS[RouterKind.SOFTMAX_TOPK](logits))
    assert np.allclose(scored(logits, {"score_func": "sigmoid"}), ROUTER_PROBS[RouterKind.NOAUX_TC](logits))
    activated = ROUTER_PROBS[RouterKind.F32_ACT_TOPK]
    assert np.allclose(activated(logits, {"act": GateAct.SOFTMAX}), ROUTER_PROBS[RouterKind.SOFTMAX_TOPK](logits))
    assert np.allclose(activated(logits, {"act": GateAct.SIGMOID}), ROUTER_PROBS[RouterKind.NOAUX_TC](logits))
    capped = ROUTER_PROBS[RouterKind.CAPPED_SCORE]  # no cap, sigmoid: the normalized sigmoid
    assert np.allclose(capped(logits, {"softcap": 0.0, "score_fn": ScoreFunc.SIGMOID}),
                       ROUTER_PROBS[RouterKind.NOAUX_TC](logits))
    root = capped(logits, {"softcap": 2.0, "score_fn": ScoreFunc.SQRTSOFTPLUS})
    want = np.sqrt(np.log1p(np.exp(np.tanh(logits / 2.0) * 2.0)))
    assert np.allclose(root, want / want.sum(-1, keepdims=True))


def test_agreement_of_hand_made_sides():
    logits = np.zeros((3, 4))
    a = RoutingStats(Side(), [_layer("softmax_topk", [[0, 1], [1, 0], [2, 3]], logits)])
    b = RoutingStats(Side(), [_layer("softmax_topk", [[1, 0], [0, 2], [3, 2]], logits)])
    row = agreement(a, b).iloc[0]
    # sets {0,1}={0,1}, {0,1} vs {0,2}: Jaccard 1/3, {2,3}={2,3}: order ignored
    assert row.same_set == pytest.approx(2 / 3) and row.jaccard_mean == pytest.approx((1 + 1 / 3 + 1) / 3)
    assert row.first_flip == 1
    assert pd.isna(agreement(a, a).iloc[0].first_flip)
    c = RoutingStats(Side(), [_layer("softmax_topk", [[0], [1], [2]], logits)])
    with pytest.raises(MlxbunError, match="route differently"):
        agreement(a, c)


# ----------------------------------------------------------------- on the zoo


def _tapped(arch: str, variant: str = "float32"):
    """The routers' own taps over the experiment's ids, without the experiment."""
    path = Side(f"zoo:{arch}", variant).path
    model = open_runtime(path)
    ids = eval_ids(load_tokenizer(path), N_TOKENS)
    with model.layers_tap(lambda p, m: isinstance(m, Router)) as taps:
        mx.eval(model(mx.array([ids])))
    return {p: taps.tuples[p][0] for p in taps}


@pytest.mark.parametrize("arch, scores", [("qwen3_moe", "softmax"), ("mixtral", "softmax"),
                                          ("granitemoe", "softmax"), ("olmoe", "softmax"),
                                          ("glm4_moe", "sigmoid"), ("bailing_moe", "sigmoid"),
                                          ("phimoe", "softmax"), ("ernie4_5_moe", "softmax"),
                                          ("minimax_m2", "sigmoid"), ("Klear", "sigmoid"),
                                          ("step3p5", "sigmoid"), ("afmoe", "sigmoid"),
                                          ("mellum", "softmax")])
def test_statistics_match_the_routers_taps(arch, scores):
    out = moe_routing(Side(f"zoo:{arch}"), n_tokens=N_TOKENS, record=False)
    table = out.base.table().set_index("layer")
    taps = _tapped(arch)
    assert sorted(table.index) == sorted(int(p.split(".")[2]) for p in taps)
    load = out.base.load()
    for path, routing in taps.items():
        layer = int(path.split(".")[2])
        k, E = routing.experts.shape[-1], routing.logits.shape[-1]
        row = table.loc[layer]
        assert (row.tokens, row.top_k, row.experts) == (N_TOKENS, k, E)
        assert load.loc[layer].sum() == N_TOKENS * k
        chosen = np.array(routing.experts).reshape(-1)
        assert load.loc[layer].tolist() == [float((chosen == e).sum()) for e in range(E)]
        logits = routing.logits.astype(mx.float32)
        if scores == "softmax":
            p = mx.softmax(logits, axis=-1)
        else:
            s = mx.sigmoid(logits)
            p = s / s.sum(axis=-1, keepdims=True)
        assert row.entropy_mean == pytest.approx((-(p * mx.log(p)).sum(axis=-1)).mean().item(), abs=1e-5)
        mass = mx.take_along_axis(p.reshape(-1, E), routing.experts.reshape(-1, k), axis=-1).sum(axis=-1)
        assert row.topk_mass_mean == pytest.approx(mass.mean().item(), abs=1e-5)
        assert row.weight_sum_mean == pytest.approx(routing.weights.sum(axis=-1).mean().item(), abs=1e-5)
        assert 0 < row.entropy_mean < row.entropy_max
        if scores == "softmax":  # these routers choose p's top k: at least k/E of the mass
            assert row.topk_mass_mean >= k / E
    if arch == "glm4_moe":  # routed_scaling_factor 2.5 after renormalizing
        assert table.weight_sum_mean.tolist() == pytest.approx([2.5])


def test_a_model_agrees_with_itself_and_not_with_its_q4_weights(q4_run):
    self_run = moe_routing(Side("zoo:qwen3_moe"), Side("zoo:qwen3_moe"), n_tokens=N_TOKENS, allow_identical=True,
                           record=False)
    same = self_run.agreement()
    assert (same.same_set == 1.0).all() and (same.jaccard_mean == 1.0).all() and same.first_flip.isna().all()
    assert self_run.flip_order().empty
    out, _ = q4_run
    t = out.agreement()
    assert list(t.layer) == [0, 1] and (t.same_set < 1.0).any()
    assert ((t.jaccard_mean >= t.same_set) & (t.jaccard_mean <= 1)).all()
    order = out.flip_order()
    assert list(order.same_set) == sorted(order.same_set) and set(order.layer) == set(t.layer[t.same_set < 1])
    both = out.layers()
    assert list(both.side) == ["base", "base", "new", "new"]
    lines = out.per_layer("entropy_mean")
    assert list(lines.columns) == ["base: zoo:qwen3_moe/float32", "new: zoo:qwen3_moe/q4"]


def test_results_rows(q4_run):
    out, db = q4_run
    with open_results(db, create=False) as store:
        rows = store.load(expand_params=True)
    assert set(rows.experiment) == {"moe_routing"} and set(rows.run_id) == {out.run_id}
    assert rows["params.comparison"].iloc[0] == "zoo:qwen3_moe/float32 vs zoo:qwen3_moe/q4"
    loads = rows[rows.metric == "expert_load"]
    assert len(loads) == 2 * 2 * 4  # sides x layers x experts
    for (side, layer), g in loads.groupby(["params.side", "params.layer"]):
        assert g.value.sum() == N_TOKENS * 2
    ent = rows[(rows.metric == "router_entropy") & (rows["params.side"] == "new")].sort_values("params.layer")
    assert ent.value.tolist() == pytest.approx(out.new.table().entropy_mean.tolist())
    assert set(ent.unit) == {"nats"}
    same = rows[rows.metric == "same_expert_set"].sort_values("params.layer")
    assert same.value.tolist() == pytest.approx(out.agreement().same_set.tolist())
    for metric in ("topk_mass", "weight_sum", "load_imbalance", "experts_unused", "expert_jaccard"):
        assert (rows.metric == metric).any(), metric


def test_plots(q4_run):
    out, _ = q4_run
    fig = plots.expert_load_heatmap(out.base.load())
    shares = fig.axes[0].images[0].get_array()
    assert shares.shape == (2, 4) and np.allclose(shares.sum(axis=1), 1.0)
    fig = plots.layer_lines_plot(out.per_layer("entropy_mean"), reference=math.log(4), reference_label="ln E")
    assert len(fig.axes[0].lines) == 3


# ----------------------------------------------------------------- refusals


def test_bad_input_is_refused(q4_run):
    with pytest.raises(MlxbunError, match="no MoE layers"):
        moe_routing(Side("zoo:llama"), record=False)
    with pytest.raises(MlxbunError, match="nothing would be compared"):
        moe_routing(Side("zoo:qwen3_moe"), Side("zoo:qwen3_moe"), record=False)
    with pytest.raises(MlxbunError, match="route differently"):  # glm4_moe's layer 0 is dense
        moe_routing(Side("zoo:qwen3_moe"), Side("zoo:glm4_moe"), n_tokens=8, record=False)
    with pytest.raises(MlxbunError, match="n_tokens must be >= 2"):
        moe_routing(Side("zoo:qwen3_moe"), n_tokens=1, record=False)
    one = moe_routing(Side("zoo:qwen3_moe"), n_tokens=8, record=False)
    with pytest.raises(MlxbunError, match="one side only"):
        one.agreement()
    with pytest.raises(MlxbunError, match="per_layer"):
        q4_run[0].per_layer("tokens")


def test_the_notebook_refuses_a_dense_model_headless(tmp_path, zoo_root, monkeypatch, capsys):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    code = cli.main(["lab", "run", "moe_routing", "-p", "model", "zoo:llama", "--out", str(tmp_path / "out"),
                     "--results", str(tmp_path / "r.sqlite"), "--no-progress", "--timeout", "120"])
    err = capsys.readouterr().err
    assert code == 1 and "no MoE layers" in err, err
