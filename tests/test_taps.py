"""Layer taps on mlx-lm module trees: selection, recording, and leaving the model untouched."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import gemma3_text, llama
from mlx_lm.models.cache import make_prompt_cache

from mlxbun.errors import MlxbunError
from mlxbun.models.taps import TapError, block_paths, capture, layer_index_of, select_paths, substep_of

IDS = mx.array([[300, 301, 302, 303, 304]])


@pytest.fixture(scope="session")
def llama_model():
    mx.random.seed(1)
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512,
                           tie_word_embeddings=False)
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


@pytest.fixture(scope="session")
def gemma3_model():
    mx.random.seed(2)
    args = gemma3_text.ModelArgs(model_type="gemma3_text", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
                                 sliding_window=16, sliding_window_pattern=2)
    m = gemma3_text.Model(args)
    mx.eval(m.parameters())
    return m


def _classes(model):
    return {p: type(m) for p, m in model.named_modules()}


def test_default_selection_is_layers_and_substeps(llama_model):
    per_layer = ["input_layernorm", "self_attn", "post_attention_layernorm", "mlp"]
    expected = {"model.embed_tokens", "model.norm", "lm_head"}
    for i in range(2):
        expected |= {f"model.layers.{i}"} | {f"model.layers.{i}.{c}" for c in per_layer}
    assert set(select_paths(llama_model)) == expected
    assert set(select_paths(llama_model, "layers")) == {"model.embed_tokens", "model.norm", "lm_head",
                                                        "model.layers.0", "model.layers.1"}
    assert set(select_paths(llama_model, "all")) == {p for p, _ in llama_model.named_modules() if p}
    assert select_paths(llama_model, ["model.layers.1.mlp.down_proj"]) == ["model.layers.1.mlp.down_proj"]
    assert set(select_paths(llama_model, lambda p, m: isinstance(m, nn.Linear) and p.endswith("o_proj"))) == {
        "model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"}


def test_bad_selections_refuse_naming_the_path(llama_model):
    with pytest.raises(TapError, match="model.layers.7.mlp"):
        select_paths(llama_model, ["model.layers.0.mlp", "model.layers.7.mlp"])
    with pytest.raises(MlxbunError, match="tap selection 'blocks'"):
        select_paths(llama_model, "blocks")
    with pytest.raises(TapError):
        with capture(object()):
            pass


def test_records_in_execution_order_with_exact_values(llama_model):
    with capture(llama_model) as taps:
        logits = llama_model(IDS)
    assert taps.called() == [
        "model.embed_tokens",
        "model.layers.0.input_layernorm", "model.layers.0.self_attn",
        "model.layers.0.post_attention_layernorm", "model.layers.0.mlp", "model.layers.0",
        "model.layers.1.input_layernorm", "model.layers.1.self_attn",
        "model.layers.1.post_attention_layernorm", "model.layers.1.mlp", "model.layers.1",
        "model.norm", "lm_head",
    ]
    assert all(len(v) == 1 for v in taps.values())
    assert mx.array_equal(taps["lm_head"][0], logits)
    assert mx.array_equal(taps["model.norm"][0], llama_model.model(IDS))
    assert mx.array_equal(taps["model.embed_tokens"][0], llama_model.model.embed_tokens(IDS))
    h = taps["model.layers.0"][0]
    assert mx.array_equal(taps["model.layers.1.input_layernorm"][0], llama_model.model.layers[1].input_layernorm(h))


def test_one_entry_per_call_across_prefill_and_decode(llama_model):
    cache = make_prompt_cache(llama_model)
    with capture(llama_model) as taps:
        llama_model(IDS, cache=cache)
        llama_model(mx.array([[5]]), cache=cache)
        llama_model(mx.array([[6]]), cache=cache)
    shapes = [tuple(a.shape) for a in taps["model.layers.1.mlp"]]
    assert shapes == [(1, 5, 64), (1, 1, 64), (1, 1, 64)]
    assert [k for p, k in taps.order if p == "lm_head"] == [0, 1, 2]


def test_taps_change_neither_parameters_nor_outputs(llama_model):
    before = tree_flatten(llama_model.parameters())
    classes = _classes(llama_model)
    plain = llama_model(IDS)
    with capture(llama_model, "all") as taps:
        tapped = llama_model(IDS)
        # While tapped, the tree is the same too: same names, same array objects.
        during = tree_flatten(llama_model.parameters())
    after = tree_flatten(llama_model.parameters())
    for other in (during, after):
        assert [k for k, _ in other] == [k for k, _ in before]
        assert all(a is b for (_, a), (_, b) in zip(other, before))
    assert _classes(llama_model) == classes
    assert mx.array_equal(plain, tapped)
    assert len(taps) == len(classes) - 1 and all(taps.values())


def test_classes_restored_after_an_exception(llama_model):
    classes = _classes(llama_model)
    with pytest.raises(RuntimeError, match="boom"):
        with capture(llama_model):
            assert type(llama_model.model.layers[0].mlp) is not classes["model.layers.0.mlp"]
            raise RuntimeError("boom")
    assert _classes(llama_model) == classes
    # An exception raised inside a tapped module's call (wrong input rank) restores too.
    with pytest.raises(Exception):
        with capture(llama_model):
            llama_model(mx.zeros((2, 3, 4, 5), dtype=mx.int32))
    assert _classes(llama_model) == classes
    assert type(llama_model.model.layers[0].mlp) is llama.MLP


def test_nested_captures_both_record(llama_model):
    classes = _classes(llama_model)
    with capture(llama_model, "layers") as outer:
        with capture(llama_model, ["model.layers.0", "model.layers.0.mlp"]) as inner:
            llama_model(IDS)
        llama_model(IDS)
    assert len(outer["model.layers.0"]) == 2 and len(inner["model.layers.0"]) == 1
    assert mx.array_equal(outer["model.layers.0"][0], inner["model.layers.0"][0])
    assert "model.layers.0.mlp" not in outer and len(inner["model.layers.0.mlp"]) == 1
    assert _classes(llama_model) == classes


def test_in_place_ops_after_the_call_do_not_reach_the_record(gemma3_model):
    # gemma3 scales the embedding in place (`h *= sqrt(hidden)`): the tap keeps the module's own output.
    with capture(gemma3_model, ["model.embed_tokens"]) as taps:
        gemma3_model(IDS)
    assert mx.array_equal(taps["model.embed_tokens"][0], gemma3_model.model.embed_tokens(IDS))


class _Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def __call__(self, x):
        y = self.proj(x)
        return y, y * 2


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        shared = nn.Linear(4, 4)
        self.blocks = [_Pair(), _Pair()]
        self.head = shared
        self.tail = shared  # one instance at two paths

    def __call__(self, x):
        for b in self.blocks:
            x, _ = b(x)
        return self.tail(self.head(x))


def test_generic_trees_tuples_and_shared_instances():
    net = _Net()
    x = mx.ones((1, 4))
    assert block_paths(net.named_modules()) == ["blocks.0", "blocks.1"]
    assert set(select_paths(net)) == {"blocks.0", "blocks.1", "blocks.0.proj", "blocks.1.proj", "head", "tail"}
    with capture(net) as taps:
        out = net(x)
    assert mx.array_equal(taps["blocks.0"][0], net.blocks[0].proj(x))  # first element of the tuple
    assert len(taps["head"]) == 2 and len(taps["tail"]) == 2  # the shared instance ran twice
    assert mx.array_equal(taps["tail"][1], out)


@pytest.mark.parametrize("path,substep,layer", [
    ("model.embed_tokens", "embedding", None),
    ("model.layers.3", "layer", 3),
    ("model.layers.3.self_attn", "attention", 3),
    ("model.layers.3.self_attn.o_proj", "attention", 3),
    ("model.layers.3.post_attention_layernorm", "norm", 3),
    ("model.layers.3.mlp", "mlp", 3),
    ("model.norm", "norm", None),
    ("lm_head", "head", None),
    ("transformer.ln_f", "norm", None),
    ("model.embed_out", "head", None),
    ("transformer.h.0.attn", "attention", 0),
])
def test_labels(path, substep, layer):
    assert substep_of(path) == substep
    assert layer_index_of(path) == layer
