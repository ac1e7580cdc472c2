"""The gemma3n port (models/gemma3n/) against mlx-lm 0.32.2: the module tree, layer taps, the
profile, and refusals of configs and checkpoints mlx-lm could not run (or would run wrong).
Bit-exact logits in six variants: tests/test_universal_parity.py (the manifest's gate);
caches: tests/test_gemma3n_kv_sharing.py."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlxbun
from mlxbun.errors import ConfigError, LoadError, UnsupportedModelError
from mlxbun.models.gemma3n.config import check_coverage, gemma3n_args, require_coverage
from mlxbun.zoo import tiny_config
from tests.checkpoint_edits import rewrite_checkpoint


def _oracle(path):
    from mlx_lm.utils import load_model

    return load_model(Path(path))[0]


def test_tree_surface_and_taps_match_mlx_lm(zoo):
    path = zoo("gemma3n", quant=4)
    ref, ours = _oracle(path), mlxbun.open_model(path)
    # before any forward: mlx-lm's AltUp writes float32 coefficient weights back on its first call
    assert ours.weights_bytes == sum(v.nbytes for _, v in tree_flatten(ref.parameters()))
    ref_params = {k: (v.shape, v.dtype) for k, v in tree_flatten(ref.parameters())}
    assert {k: (v.shape, v.dtype) for k, v in tree_flatten(ours.parameters())} == ref_params
    assert sorted(n for n, _ in ours.named_modules()) == sorted(n for n, _ in ref.named_modules())
    assert len(ours.layers) == len(ref.layers) == 5
    assert ours.profile.id == "gemma3n-dedicated" and str(ours.profile.fidelity) == "L1 (bit-exact vs mlx-lm)"
    assert ours.model_type == "gemma3n" and ours.config.model_type == "gemma3n"
    ids = mx.random.randint(0, 512, (1, 20), key=mx.random.key(3))  # ids past 384: per-layer row 0
    assert mx.array_equal(ours.logits_from_hidden(ours.forward_hidden(ids)), ours(ids)).item()
    # every module output mlx-lm's tree records, at the same path, bit for bit
    from mlxbun.models.taps import capture

    with capture(ref) as theirs:
        ref(ids)
    with ours.layers_tap() as mine:
        ours(ids)
    assert [p for p, _ in mine.order] == [p for p, _ in theirs.order]
    for p, i in theirs.order:
        assert mx.array_equal(theirs[p][i], mine[p][i]).item(), p
    assert "model.language_model.layers.4.self_attn" in mine  # a KV-shared layer's attention


def test_gemma3n_resolves_to_the_dedicated_graph_and_ports(zoo):
    from mlxbun.config import load_model_config
    from mlxbun.factory import audit_dry_run, check_target_coverage
    from mlxbun.profile import L1_DEDICATED_TYPES, resolve_model_profile, supported_model_types

    path = zoo("gemma3n")
    config = load_model_config(path)
    assert resolve_model_profile(config, path).execution.graph == "gemma3n"
    assert supported_model_types()["gemma3n"] == "targeted" and L1_DEDICATED_TYPES == ("gemma3n",)
    assert check_target_coverage(config, path).ok
    assert len(audit_dry_run(path, config, check_values=True).consumed) == 131


def _text(change=None, drop=()):
    cfg = copy.deepcopy(tiny_config("gemma3n"))
    cfg["text_config"].update(change or {})
    for k in drop:
        cfg["text_config"].pop(k)
    return cfg


@pytest.mark.parametrize("change, drop, error, match", [
    (dict(hidden_activation="gelu"), (), UnsupportedModelError, "text_config.hidden_activation"),
    (dict(attention_temperature=2.0), (), UnsupportedModelError, "text_config.attention_temperature"),
    (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                           "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}),
     (), UnsupportedModelError, "rope type 'linear'"),
    ({}, ("laurel_rank",), ConfigError, "required key 'laurel_rank'"),
    ({}, ("model_type",), ConfigError, "required key 'model_type'"),  # mlx-lm's TextConfig needs it too
    (dict(num_kv_shared_layers=5), (), ConfigError, "num_kv_shared_layers"),
    (dict(layer_types=["sliding_attention"] * 3 + ["full_attention"] * 2), (), UnsupportedModelError,
     "before the 2 KV-shared ones must hold both"),
    (dict(layer_types=["sliding_attention", "chunked_attention"] * 3), (), UnsupportedModelError,
     "'chunked_attention'"),
    (dict(activation_sparsity_pattern=[0.95, 1.0, 0, 0, 0]), (), ConfigError, "activation_sparsity_pattern"),
    (dict(altup_active_idx=4), (), ConfigError, "altup_active_idx"),
])
def test_configs_mlx_lm_would_not_run_as_written_refuse_naming_the_key(change, drop, error, match):
    with pytest.raises(error, match=match):
        require_coverage(_text(change, drop))


def test_coverage_sorts_wrapper_and_text_keys():
    report = check_coverage(tiny_config("gemma3n"))
    assert report.ok
    assert {"text_config.altup_num_inputs", "text_config.num_kv_shared_layers",
            "text_config.rope_parameters"} <= set(report.understood)
    assert "vision_config" in report.ignored and "audio_config" in report.ignored
    assert "text_config.tie_word_embeddings" in report.ignored
    # keys Gemma 3n hub configs carry that transformers' class does not write
    hub = _text(dict(altup_lr_multiplier=1.0, query_pre_attn_scalar=256, torch_dtype="bfloat16"))
    assert check_coverage(hub).ok
    # no text_config at all: mlx-lm's ModelArgs requires it
    with pytest.raises(ConfigError, match="'text_config'"):
        gemma3n_args({"model_type": "gemma3n"})


def test_the_towers_are_dropped_by_name_and_stray_tensors_refused(zoo, tmp_path):
    towers = {"model.vision_tower.timm_model.conv_stem.weight": mx.zeros((4, 3)),
              "model.audio_tower.subsample_conv_projection.weight": mx.zeros((2,)),
              "model.embed_vision.embedding.weight": mx.zeros((2, 2))}
    path = rewrite_checkpoint(zoo("gemma3n"), tmp_path / "towers", lambda w: {**w, **towers})
    model = mlxbun.open_model(path)
    assert set(model.audit.dropped) == set(towers)
    assert "vision tower" in model.audit.dropped["model.vision_tower.timm_model.conv_stem.weight"]
    stray = rewrite_checkpoint(zoo("gemma3n"), tmp_path / "stray",
                     lambda w: {**w, "model.language_model.layers.0.extra.weight": mx.zeros((2,))})
    with pytest.raises(LoadError, match="layers.0.extra.weight"):
        mlxbun.open_model(stray)
    missing = rewrite_checkpoint(zoo("gemma3n"), tmp_path / "missing",
                       lambda w: {k: v for k, v in w.items() if "laurel.linear_left" not in k})
    with pytest.raises(LoadError, match="laurel.linear_left"):
        mlxbun.open_model(missing)


def test_quantized_altup_coefficients_refuse(zoo, tmp_path):
    """mlx-lm casts the AltUp coefficient weights to float32 on every call: packed ones cannot be."""
    def pack(w):
        name = "model.language_model.layers.0.altup.prediction_coefs"
        return {**w, f"{name}.scales": mx.ones((16, 1)), f"{name}.biases": mx.zeros((16, 1))}

    path = rewrite_checkpoint(zoo("gemma3n", quant=4), tmp_path / "packed", pack)
    with pytest.raises(UnsupportedModelError, match="altup.prediction_coefs.scales"):
        mlxbun.open_model(path)


def test_zoo_config_exercises_every_feature():
    text = tiny_config("gemma3n")["text_config"]
    a = gemma3n_args(tiny_config("gemma3n"))
    shared = a.layer_types[a.first_kv_shared:]
    assert set(shared) == {"full_attention", "sliding_attention"}  # both kinds shared
    assert 0 < sum(p > 0 for p in a.activation_sparsity_pattern) < a.num_hidden_layers
    assert a.altup_num_inputs > 1 and a.laurel_rank > 0 and a.altup_coef_clip is not None
    assert a.vocab_size_per_layer_input < a.vocab_size and len(set(a.intermediate_size)) > 1
    assert json.loads(json.dumps(text))["model_type"] == "gemma3n_text"


def test_the_released_sizes_resolve_as_mlx_lm_computes_them():
    """transformers' default Gemma3nConfig (the released E4B text sizes): 35 layers, the last 15
    KV-shared, reading layer 19's (full) and 18's (sliding) caches. transformers 5 writes rope as
    rope_parameters only; mlx-lm requires the legacy keys hub configs carry, so without them the
    config refuses naming the key."""
    from mlxbun.zoo.hf_configs import quiet_transformers, transformers_config_class

    with quiet_transformers():
        cfg = transformers_config_class("Gemma3nConfig")().to_dict()
    with pytest.raises(ConfigError, match="required key 'rope_local_base_freq'"):
        gemma3n_args(cfg)
    cfg["text_config"].update(rope_local_base_freq=10000.0, rope_theta=1000000.0)
    assert check_coverage(cfg).ok
    a = gemma3n_args(cfg)
    assert a.first_kv_shared == 20 and a.cache_idx[20:] == tuple(19 if t == "full_attention" else 18
                                                                  for t in a.layer_types[20:])
    assert (a.layer_types[19], a.layer_types[18]) == ("full_attention", "sliding_attention")


def test_a_tower_input_is_refused_by_name(zoo):
    from mlxbun.models.gemma3n.loader import load_gemma3n

    model = load_gemma3n(zoo("gemma3n"))
    ids = mx.array([[1, 2, 3]])
    for name in ("pixel_values", "input_features"):
        with pytest.raises(UnsupportedModelError, match=f"gemma3n: {name} needs the VLM's vision / audio tower"):
            model(ids, **{name: mx.zeros((1, 3, 4, 4))})
    assert model(ids, pixel_values=None).shape == (1, 3, json.loads((zoo("gemma3n") / "config.json").read_text())["text_config"]["vocab_size"])  # nothing given: text only
