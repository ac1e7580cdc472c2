"""gemma4_text (models/universal/gemma4.py) vs mlx-lm 0.32.2: the config switches the zoo leaves at
one value, the MoE block, HF-layout checkpoints through the sanitize rule, layer taps and the
localizer, and the refusals of configs mlx-lm cannot wire."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxbun.errors import ConfigError, MlxbunError
from mlxbun.models.universal.loader import build_model, load_universal
from tests.dense_oracle import assert_parity, oracle, random_checkpoint

_S, _F = "sliding_attention", "full_attention"
_MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=64)

# each case flips switches the zoo's config holds at one value
CASES = {
    "moe": _MOE,
    "moe-unshared-untied": dict(_MOE, num_kv_shared_layers=0, tie_word_embeddings=False),
    # mlx-lm's own defaults: layer_types from sliding_window_pattern, the default rope dicts
    "defaults": dict(layer_types=None, rope_parameters=None, sliding_window_pattern=3, global_head_dim=32,
                     num_kv_shared_layers=2),
    "plain": dict(num_kv_shared_layers=0, hidden_size_per_layer_input=0, attention_k_eq_v=False,
                  tie_word_embeddings=False, final_logit_softcapping=None, use_double_wide_mlp=False),
    # k = v without global kv heads (the sliding count), no global_head_dim (head_dim everywhere)
    "k_eq_v-no-globals": dict(num_global_key_value_heads=None, global_head_dim=None),
}
_VARIANTS = [(c, v) for c in CASES for v in ("float32", "bfloat16", "q4")
             if not (v == "bfloat16" and CASES[c].get("enable_moe_block"))]  # gather_mm: float32 only


def _config(**overrides) -> dict:
    from mlxbun.zoo import tiny_config

    # per-layer inputs 32 wide: the q4 variants' group of 32 divides per_layer_projection's input
    cfg = {**tiny_config("gemma4_text"), "hidden_size_per_layer_input": 32, **overrides}
    cfg.pop("per_layer_config")  # transformers' view of the zoo's layer shapes (mlx-lm ignores it)
    return cfg


@pytest.mark.parametrize("case,variant", _VARIANTS, ids=[f"{c}-{v}" for c, v in _VARIANTS])
def test_switches_bit_exact(tmp_path, case, variant):
    dtype = "float32" if variant == "q4" else variant
    assert_parity(random_checkpoint(tmp_path / case, _config(**CASES[case]), dtype,
                                      4 if variant == "q4" else None))


def test_the_zoo_exercises_every_layer_shape():
    from mlxbun.zoo import tiny_config

    specs = build_model(tiny_config("gemma4_text"))._specs
    assert [(s.layer_type, s.head_dim, s.n_kv_heads, s.has_kv, s.previous_kv, s.k_eq_v, s.mlp_width)
            for s in specs] == [
        (_S, 16, 2, True, 0, False, 128), (_S, 16, 2, True, 1, False, 128), (_F, 64, 1, True, 2, True, 128),
        (_S, 16, 2, False, 1, False, 256), (_S, 16, 2, False, 1, False, 256), (_F, 64, 1, False, 2, True, 256)]
    assert "v_proj" not in build_model(tiny_config("gemma4_text")).layers[2].self_attn  # k = v


def _hf_layout(src, dst, cfg):
    """A checkpoint as transformers writes gemma4: fused experts.gate_up_proj / down_proj, the
    KV-shared layers' k_proj / v_proj / k_norm present, rope tables and activation-range buffers."""
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    out = {}
    for k, v in weights.items():
        if k.endswith(".experts.switch_glu.gate_proj.weight"):
            base = k.removesuffix(".switch_glu.gate_proj.weight")
            up = weights[f"{base}.switch_glu.up_proj.weight"]
            out[f"{base}.gate_up_proj"] = mx.concatenate([v, up], axis=-2)
        elif k.endswith(".experts.switch_glu.down_proj.weight"):
            out[k.removesuffix(".switch_glu.down_proj.weight") + ".down_proj"] = v
        elif not k.endswith(".experts.switch_glu.up_proj.weight"):
            out[k] = v
    first = cfg["num_hidden_layers"] - cfg["num_kv_shared_layers"]
    for i in range(first, cfg["num_hidden_layers"]):
        out[f"model.layers.{i}.self_attn.k_proj.weight"] = mx.zeros((32, 64))
        out[f"model.layers.{i}.self_attn.v_proj.weight"] = mx.zeros((32, 64))
        out[f"model.layers.{i}.self_attn.k_norm.weight"] = mx.ones((16,))
    out["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.ones((8,))
    out["model.layers.0.mlp.input_max"] = mx.ones((1,))
    dst.mkdir()
    mx.save_safetensors(str(dst / "model.safetensors"), out, metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_hf_layout_checkpoint_loads_like_mlx_lm(tmp_path):
    cfg = _config(**_MOE)
    src = random_checkpoint(tmp_path / "mlx", cfg, "float32", None)
    path = _hf_layout(src, tmp_path / "hf", cfg)
    assert_parity(path)
    dropped = load_universal(path).audit.dropped
    assert {n for n in dropped if "k_proj" in n} == {f"model.layers.{i}.self_attn.k_proj.weight" for i in (3, 4, 5)}
    assert "model.layers.0.self_attn.rotary_emb.inv_freq" in dropped and "model.layers.0.mlp.input_max" in dropped
    assert "KV-shared" in str(dropped)


def test_taps_and_the_localizer(zoo, tmp_path):
    """Every tapped module output equals mlx-lm's through prefill and decode (the shared layers'
    tuples included); a perturbed KV-shared layer is named by the localizer."""
    from mlxbun.parity.localize import first_divergence

    path = zoo("gemma4_text")
    ours, ref = load_universal(path), oracle(path)
    prompt, decode = list(range(3, 43)), [5, 6, 7]
    assert first_divergence(ours, ref, prompt, decode) is None  # (paths="all": the root module
    # `model` is never called by the universal graphs, as for every row)
    with ours.layers_tap() as taps:
        ours(mx.array([prompt]))
    assert "model.layers.5" in taps and "model.layers.5.self_attn.q_proj" not in taps  # default: layers
    q = ours.layers[4].self_attn.q_proj
    q.weight = q.weight * 1.01
    div = first_divergence(ours, ref, prompt, decode)
    assert div is not None and div.path == "model.layers.4.self_attn" and div.step == 0


@pytest.mark.parametrize("overrides,needle", [
    (dict(num_kv_shared_layers=6), "must leave a layer projecting"),
    (dict(layer_types=[_S, _S, _S, _S, _S, _F]), "no earlier layer of their type"),
    (dict(layer_types=[_S, _F, "chunked_attention", _S, _S, _F]), "'layer_types' must list 6 layers"),
    (dict(_MOE, top_k_experts=None), "'top_k_experts' must be an integer"),
    (dict(rope_parameters={_F: "proportional", _S: {}}), "'rope_parameters' must map"),
])
def test_configs_mlx_lm_cannot_wire_refuse_by_name(overrides, needle):
    with pytest.raises((ConfigError, MlxbunError), match=needle):
        build_model(_config(**overrides))


def test_coverage_takes_vision_bidirectionality_and_refuses_all():
    from mlxbun.models.universal.coverage import require_coverage

    require_coverage("gemma4_text", _config(use_bidirectional_attention="vision"))
    with pytest.raises(MlxbunError, match="use_bidirectional_attention"):
        require_coverage("gemma4_text", _config(use_bidirectional_attention="all"))


# ----------------------------------------------------------------- the gemma4 VLM wrapper


def test_a_hub_layout_wrapper_checkpoint_runs_as_mlx_lm_s_text_path(zoo, tmp_path):
    """transformers' Gemma 4 layout: model.language_model.* (fused experts, the KV-shared layers'
    k / v projections), the vision and audio towers and their embedders: dropped, as mlx-lm."""
    src = zoo("gemma4")
    cfg = json.loads((src / "config.json").read_text())
    mlx_layout = tmp_path / "flat"
    text = {k.replace("language_model.", "", 1): v for k, v in _load_all(src).items()}
    mlx_layout.mkdir()
    mx.save_safetensors(str(mlx_layout / "model.safetensors"), text, metadata={"format": "mlx"})
    hf = _hf_layout(mlx_layout, tmp_path / "hf", cfg["text_config"])
    weights = {f"model.language_model.{k.removeprefix('model.')}": v for k, v in _load_all(hf).items()}
    towers = {"model.vision_tower.encoder.weight": mx.ones((4, 4)), "model.audio_tower.conv.weight": mx.ones((4,)),
              "model.embed_vision.embedding_projection.weight": mx.ones((4, 4)),
              "model.embed_audio.embedding_projection.weight": mx.ones((4, 4))}
    mx.save_safetensors(str(hf / "model.safetensors"), {**weights, **towers}, metadata={"format": "pt"})
    (hf / "config.json").write_text(json.dumps(cfg))
    assert_parity(hf)
    dropped = load_universal(hf).audit.dropped
    assert set(towers) <= set(dropped) and "audio towers" in dropped["model.audio_tower.conv.weight"]
    assert "model.language_model.layers.5.self_attn.k_proj.weight" in dropped


def _load_all(path) -> dict:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def test_the_wrapper_reads_text_config_and_its_own_vocab_size():
    from mlxbun.models.universal.coverage import require_coverage
    from mlxbun.models.universal.resolve import descriptor_for, resolve_args
    from mlxbun.zoo import tiny_config

    cfg = tiny_config("gemma4")
    report = require_coverage("gemma4", cfg)
    for key in ("vision_config", "audio_config", "image_token_id"):
        assert "outside text_config" in report.ignored[key]
    assert resolve_args(descriptor_for("gemma4"), cfg).vocab == 512
    del cfg["vocab_size"]  # mlx-lm's wrapper default, written over text_config's
    assert resolve_args(descriptor_for("gemma4"), cfg).vocab == 262144
    params = dict(tree_flatten(build_model(tiny_config("gemma4")).parameters()))
    assert "language_model.model.layers.0.experts.switch_glu.gate_proj.weight" in params


def test_explain_lists_gemma4_s_own_forward():
    from mlxbun.explain import explain

    text = explain("gemma4_text").text()
    assert "k, v, offset = intermediates[previous_kvs[i]]" in text
    assert "layers 3-4: sliding window 16, hd_i 16, KV_i 2" in text and "cache none (reads layer 1's" in text
    assert "layer 2: global, hd_i 64, KV_i 1, k = v; proportional rope, base 1000000.0, 16 of 64 dims" in text
    moe = explain("gemma4").text()
    assert "wrapper (language_model)" in moe and "E = num_experts = 4, k = top_k_experts = 2" in moe
