"""Layer-by-layer diff of a tiny mlx-lm llama against itself and against a copy with one perturbed MLP weight."""

import json
import math

import mlx.core as mx
import pytest

from mlxbun.models.mlxlm import MlxLmRuntimeModel
from mlxbun.parity.layer_diff import layer_diff, summarize
from mlxbun.parity.localize import first_divergence

IDS = [1, 5, 9, 200, 33, 7, 480]


def _tiny_llama(seed: int):
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           tie_word_embeddings=False)
    mx.random.seed(seed)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model, args


@pytest.fixture(scope="session")
def models():
    from mlx_lm.models import llama

    base, args = _tiny_llama(0)
    perturbed = llama.Model(args)
    perturbed.update(base.parameters())
    mlp = perturbed.model.layers[1].mlp
    mlp.down_proj.weight = mlp.down_proj.weight + 0.01
    mx.eval(perturbed.parameters())
    return MlxLmRuntimeModel(base), MlxLmRuntimeModel(perturbed)


@pytest.fixture(scope="session")
def self_diff(models):
    return layer_diff(models[0], models[0], IDS)


@pytest.fixture(scope="session")
def mlp_diff(models):
    return layer_diff(models[1], models[0], IDS)


def test_against_itself_everything_is_zero(self_diff):
    t = self_diff.table
    assert (t["max_abs_diff"] == 0.0).all() and t["equal"].all()
    assert self_diff.first_difference() is None
    # Every module of the tree was tapped: attention projections, rope (called for q and k), mlp parts, head.
    paths = set(t["path"])
    assert {"model.embed_tokens", "model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj",
            "model.norm", "lm_head", "logits"} <= paths
    assert t.loc[t["path"] == "model.layers.0.self_attn.rope", "call"].tolist() == [0, 1]
    assert (t["mean_a"] == t["mean_b"]).all() and (t["shape_a"] == t["shape_b"]).all()
    heat = self_diff.heatmap()
    assert (heat.fillna(0.0) == 0.0).all().all()
    assert list(heat.index[:3]) == ["model.embed_tokens", "model.layers.0", "model.layers.1"]
    assert heat.index[-1] == "logits" and heat.columns[-1] == "output"
    assert {"norm", "attention", "mlp"} <= set(heat.columns)


def test_statistics_are_the_tensors_own(models, self_diff):
    model = models[0].module
    emb = model.model.embed_tokens(mx.array([IDS]))
    row = self_diff.table.set_index("path").loc["model.embed_tokens"]
    assert row["shape_a"] == (1, len(IDS), 64) and row["dtype_a"] == "float32"
    assert row["mean_a"] == pytest.approx(mx.mean(emb).item(), rel=1e-6)
    assert row["std_a"] == pytest.approx(mx.std(emb).item(), rel=1e-6)
    assert row["min_a"] == mx.min(emb).item() and row["max_a"] == mx.max(emb).item()
    logits = self_diff.table.set_index("path").loc["logits"]
    assert logits["shape_a"] == (1, len(IDS), 512)
    assert summarize(None) is None and summarize(mx.zeros((0, 3)))["mean"] is None


def test_perturbed_layer1_mlp_zero_before_nonzero_from_it_on(mlp_diff):
    t = mlp_diff.table.sort_values("order")
    diffs = t["max_abs_diff"].tolist()
    first = next(i for i, d in enumerate(diffs) if d != 0.0)
    assert t["path"].iloc[first].startswith("model.layers.1.mlp")
    assert all(d == 0.0 for d in diffs[:first]) and t["equal"].iloc[:first].all()
    assert all(d > 0.0 for d in diffs[first:])  # mlp, layer 1's output, final norm, inner model, head, logits
    later = t["path"].iloc[first:].tolist()
    assert {"model.layers.1.mlp", "model.layers.1", "model.norm", "lm_head", "logits"} <= set(later)
    # The layer-0 and layer-1 attention records, all before the MLP, are bit-equal.
    before = t.iloc[:first]
    assert before["path"].str.startswith("model.layers.0").sum() > 5
    assert before["path"].str.startswith("model.layers.1.self_attn").sum() >= 5

    heat = mlp_diff.heatmap()
    assert heat.loc["model.embed_tokens", "output"] == 0.0
    assert (heat.loc["model.layers.0"].fillna(0.0) == 0.0).all()
    assert heat.loc["model.layers.1", "attention"] == 0.0 and heat.loc["model.layers.1", "norm"] == 0.0
    assert heat.loc["model.layers.1", "mlp"] > 0.0 and heat.loc["model.layers.1", "output"] > 0.0
    assert heat.loc["model.norm", "output"] > 0.0 and heat.loc["logits", "output"] > 0.0
    assert mlp_diff.first_difference()["path"] == t["path"].iloc[first]


def test_first_difference_agrees_with_the_localizer(models, mlp_diff):
    div = first_divergence(models[1], models[0], IDS, paths="all")
    first = mlp_diff.first_difference()
    assert div.path == first["path"] and div.max_abs_diff == pytest.approx(first["max_abs_diff"])


def test_tree_nests_by_module_path_like_the_hf_debugger(mlp_diff):
    tree = json.loads(mlp_diff.to_json())
    assert tree["module_path"] == "Model (top-level)"
    assert [o["step"] for o in tree["outputs"]] == [0] and tree["outputs"][0]["max_abs_diff"] > 0  # logits
    top = {c["module_path"]: c for c in tree["children"]}
    assert set(top) == {"model", "lm_head"}
    inner = {c["module_path"]: c for c in top["model"]["children"]}
    assert list(inner) == ["model.embed_tokens", "model.layers.0", "model.layers.1", "model.norm"]
    layer1 = {c["module_path"]: c for c in inner["model.layers.1"]["children"]}
    assert list(layer1) == ["model.layers.1.input_layernorm", "model.layers.1.self_attn",
                            "model.layers.1.post_attention_layernorm", "model.layers.1.mlp"]
    mlp = {c["module_path"]: c for c in layer1["model.layers.1.mlp"]["children"]}
    assert mlp["model.layers.1.mlp.gate_proj"]["max_abs_diff"] == 0.0
    assert mlp["model.layers.1.mlp.down_proj"]["max_abs_diff"] > 0.0
    leaf = mlp["model.layers.1.mlp.down_proj"]
    assert "children" not in leaf and leaf["layer"] == 1 and leaf["substep"] == "mlp"
    out = leaf["outputs"][0]
    assert out["a"]["shape"] == [1, len(IDS), 64] and out["a"]["dtype"] == "float32"
    assert set(out["a"]) == {"shape", "dtype", "mean", "std", "min", "max"}
    assert out["a"]["mean"] != out["b"]["mean"]
    rope = inner["model.layers.0"]["children"][1]["children"]
    assert [len(c["outputs"]) for c in rope if c["module_path"].endswith("rope")] == [2]


def test_decode_steps_and_coarser_selection(models):
    d = layer_diff(models[1], models[0], IDS, decode_ids=[3, 4], paths=None)
    t = d.table
    assert sorted(t["step"].unique()) == [0, 1, 2]
    assert (t.loc[t["step"] > 0, "shape_a"].map(lambda s: s[1]) == 1).all()  # one-token decode forwards
    assert "model.layers.0.self_attn.q_proj" not in set(t["path"])  # paths=None: blocks and their children
    heat0, heat2 = d.heatmap(step=0), d.heatmap(step=2)
    assert heat0.loc["model.layers.1", "mlp"] > 0 and heat2.loc["model.layers.1", "mlp"] > 0
    assert heat0.loc["model.layers.0", "output"] == 0.0 and heat2.loc["model.layers.0", "output"] == 0.0
    assert d.heatmap().loc["logits", "output"] == pytest.approx(
        max(heat0.loc["logits", "output"], d.heatmap(step=1).loc["logits", "output"], heat2.loc["logits", "output"]))
    assert not math.isnan(heat2.loc["model.layers.1", "attention"])
