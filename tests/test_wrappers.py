"""The multimodal wrappers' text paths (gemma3, mistral3): hub-layout checkpoints with the vision
tower's keys load and run as mlx-lm's text path, the wrappers' own ModelArgs (gemma3: heads 8 /
kv 4 by default, the top-level vocab_size over text_config's; mistral3: untied unless
text_config ties, its llama row refusing other text models: a ministral3 text_config picks the
ministral3 row, tests/test_wrappers_text.py) and coverage of the wrapper's keys. The
logits of every zoo variant against mlx-lm are tests/test_universal_dense.py's (manifest)."""

import dataclasses
import json

import mlx.core as mx
import pytest

from mlxbun.errors import ConfigError, LoadError
from mlxbun.models.universal.coverage import check_coverage
from mlxbun.models.universal.loader import load_universal
from mlxbun.models.universal.resolve import model_args
from mlxbun.models.universal.schema import DescriptorError, Names
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo.archs import tiny_config
from tests.dense_oracle import oracle
from tests.wrapper_checkpoints import IDS, rewrite_hub

_VISION = {  # what a Gemma 3 hub checkpoint holds beside language_model.*
    "vision_tower.vision_model.embeddings.patch_embedding.weight": (8, 3, 4, 4),
    "vision_tower.vision_model.post_layernorm.weight": (8,),
    "multi_modal_projector.mm_input_projection_weight": (8, 64),
    "multi_modal_projector.mm_soft_emb_norm.weight": (8,),
}


def _hub(weights: dict) -> dict:
    """Gemma 3's hub layout: language_model.* with the head tied (no lm_head), the vision tower."""
    out = {k: v for k, v in weights.items() if k != "language_model.lm_head.weight"}
    out.update({k: mx.ones(shape) for k, shape in _VISION.items()})
    return out


@pytest.fixture(scope="module")
def gemma3(zoo):
    return zoo("gemma3")


def test_a_hub_checkpoint_with_the_vision_tower_runs_as_mlx_lms_text_path(gemma3, tmp_path):
    hub = rewrite_hub(gemma3, tmp_path / "hub", _hub)
    ours, ref = load_universal(hub), oracle(hub)
    assert set(_VISION) <= set(ours.audit.dropped)
    assert ours.tied and ref.language_model.tie_word_embeddings  # no head: the embedding
    assert "lm_head" not in ours.text_model
    assert mx.array_equal(ours(IDS), ref(IDS))
    untied = load_universal(gemma3)  # the zoo checkpoint keeps language_model.lm_head.weight
    assert not untied.tied and not mx.array_equal(untied(IDS), ours(IDS))


def test_the_wrappers_defaults_run_as_mlx_lm(tmp_path):
    """Hub text_configs leave the head counts out (mlx-lm's wrapper: 8 / 4); the top-level
    vocab_size wins over text_config's."""
    from mlx_lm.utils import save_config

    from mlxbun.zoo.weights import build_model, save_weights

    cfg = tiny_config("gemma3")
    for key in ("num_attention_heads", "num_key_value_heads"):
        del cfg["text_config"][key]
    cfg["text_config"]["vocab_size"] = 100000  # overwritten by the top-level 512
    out = tmp_path / "defaults"
    out.mkdir()
    save_weights(build_model(cfg, seed=3), out)
    save_config(cfg, out / "config.json")
    ours, ref = load_universal(out), oracle(out)
    assert (ours.args.n_heads, ours.args.n_kv_heads, ours.args.vocab) == (8, 4, 512)
    assert mx.array_equal(ours(IDS), ref(IDS))


def test_the_top_level_vocab_size_defaults_as_in_mlx_lm():
    from mlx_lm.models import gemma3, gemma3_text

    cfg = tiny_config("gemma3")
    del cfg["vocab_size"]
    a = model_args(DESCRIPTORS["gemma3"], cfg)
    ref = gemma3_text.ModelArgs.from_dict(gemma3.ModelArgs.from_dict(json.loads(json.dumps(cfg)))
                                          .text_config)
    assert a["vocab_size"] == ref.vocab_size == 262208
    assert (a["num_attention_heads"], a["num_key_value_heads"]) == (4, 2)


def test_coverage_reads_text_config_and_the_wrappers_vocab_size():
    report = check_coverage("gemma3", tiny_config("gemma3"))
    assert report.ok
    for key in ("vision_config", "boi_token_index", "image_token_index", "mm_tokens_per_image"):
        assert "outside text_config" in report.ignored[key]
    assert "vocab_size" in report.understood and "vocab_size" not in report.ignored
    assert "writes its own vocab_size" in report.ignored["text_config.vocab_size"]
    assert "sliding_window_pattern" in report.understood
    bad = tiny_config("gemma3")
    bad["text_config"]["hidden_activation"] = "relu"
    assert "hidden_activation" in check_coverage("gemma3", bad).offending


def test_a_transformers_5_layout_is_refused_as_mlx_lm_refuses_it(gemma3, tmp_path):
    """model.language_model.* (transformers 5's module paths): mlx-lm's sanitize leaves them
    where they are and its strict load refuses them; the weight audit names them."""
    moved = rewrite_hub(gemma3, tmp_path / "t5", lambda w: {
        k.replace("language_model.model.", "model.language_model."): v for k, v in w.items()})
    with pytest.raises(ValueError, match="model.language_model.layers"):
        oracle(moved)
    with pytest.raises(LoadError, match="model.language_model.layers"):
        load_universal(moved)


def test_wrapper_fields_need_a_wrapper():
    row = DESCRIPTORS["gemma3"]
    with pytest.raises(DescriptorError, match="wrapper_fields"):
        dataclasses.replace(row, names=dataclasses.replace(row.names, wrapper=None))
    with pytest.raises(DescriptorError, match="wrapper_fields"):
        dataclasses.replace(row, wrapper_fields={"not_a_field": 1})
    assert DESCRIPTORS["gemma3_text"].names == dataclasses.replace(row.names, wrapper=None)
    assert Names().wrapper is None


def _mistral3_hf(weights: dict) -> dict:
    """transformers 5's Mistral3 layout: model.language_model.*, lm_head at the top, the vision
    tower and projector under model."""
    out = {k.replace("language_model.model.", "model.language_model.")
            .replace("language_model.lm_head.", "lm_head."): v for k, v in weights.items()}
    out.update({f"model.{k}": mx.ones(shape) for k, shape in _VISION.items()})
    out["model.language_model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,))
    return out


@pytest.fixture(scope="module")
def mistral3(zoo):
    return zoo("mistral3")


def test_a_transformers_mistral3_checkpoint_runs_as_mlx_lms_text_path(mistral3, tmp_path):
    hf = rewrite_hub(mistral3, tmp_path / "hf", _mistral3_hf)
    ours, ref = load_universal(hf), oracle(hf)
    assert {f"model.{k}" for k in _VISION} <= set(ours.audit.dropped)
    assert not ours.tied and mx.array_equal(ours(IDS), ref(IDS))
    assert mx.array_equal(ours(IDS), load_universal(mistral3)(IDS))  # the same tensors, moved


def test_a_tied_text_config_drops_the_head_under_the_wrapper(mistral3, tmp_path):
    def tie(cfg):
        cfg["text_config"]["tie_word_embeddings"] = True

    tied = rewrite_hub(mistral3, tmp_path / "tied", lambda w: w, tie)
    ours, ref = load_universal(tied), oracle(tied)
    assert ours.tied and "language_model.lm_head.weight" in ours.audit.dropped
    assert mx.array_equal(ours(IDS), ref(IDS))
    assert not mx.array_equal(ours(IDS), load_universal(mistral3)(IDS))


def test_mistral3_is_untied_unless_text_config_ties():
    cfg = tiny_config("mistral3")
    del cfg["text_config"]["tie_word_embeddings"]
    assert model_args(DESCRIPTORS["mistral3"], {**cfg, "tie_word_embeddings": True})[
        "tie_word_embeddings"] is False  # the top-level key is not read
    report = check_coverage("mistral3", tiny_config("mistral3"))
    assert report.ok and "outside text_config" in report.ignored["vision_config"]


@pytest.mark.parametrize("text", ["ministral3", "mistral4"])
def test_mistral3_refuses_a_text_model_other_than_llamas(text):
    cfg = tiny_config("mistral3")
    cfg["text_config"]["model_type"] = text
    with pytest.raises(ConfigError, match=f"text_config.model_type '{text}'"):
        model_args(DESCRIPTORS["mistral3"], cfg)


def test_explain_names_the_wrapper_and_where_its_args_come_from():
    from mlxbun.explain import explain

    gemma = explain("gemma3").text()
    assert "language_model.model, language_model.lm_head" in gemma
    assert "vocab_size the top-level one (default 262208)" in gemma
    assert "top-level" not in explain("mistral3").text()
