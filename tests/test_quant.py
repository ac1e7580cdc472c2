"""mlxbun.quant: load-time quantization vs mlx-lm 0.32.2's load_model as the live oracle."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import utils as o_utils
from mlx_lm.models import llama as o_llama

from mlxbun import quant
from mlxbun.errors import ConfigError, LoadError, UnsupportedModelError


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b, equal_nan=True).item()


LLAMA = dict(model_type="llama", hidden_size=128, num_hidden_layers=1, intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256)


def _tiny_llama(tie):
    mx.random.seed(0)
    return o_llama.Model(o_llama.ModelArgs(**LLAMA, tie_word_embeddings=tie))


def _checkpoint(tmp_path, quantization, predicate=None, tie=False):
    """A tiny llama saved as mlx_lm.convert would: packed weights + config['quantization']."""
    model = _tiny_llama(tie)
    qk = {k: quantization[k] for k in ("group_size", "bits", "mode") if k in quantization}
    nn.quantize(model, group_size=qk.get("group_size"), bits=qk.get("bits"), mode=qk.get("mode", "affine"),
                class_predicate=predicate)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    config = {**LLAMA, "tie_word_embeddings": tie, "quantization": quantization}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return weights, config


def _mine(weights, config):
    model = o_llama.Model(o_llama.ModelArgs.from_dict(config))
    w = model.sanitize(dict(weights))
    quant.quantize_model(model, quant.resolve_quantization(config), w)
    model.eval()
    model.load_weights(list(w.items()), strict=True)
    return model


def _assert_same_model(mine, ref):
    def leaves(m):
        return {p: (type(x).__name__, getattr(x, "group_size", None), getattr(x, "bits", None),
                    getattr(x, "mode", None)) for p, x in m.named_modules()}
    assert leaves(mine) == leaves(ref)
    pm, pr = dict(tree_flatten(mine.parameters())), dict(tree_flatten(ref.parameters()))
    assert pm.keys() == pr.keys() and all(same(pm[k], pr[k]) for k in pm)
    ids = mx.array([[1, 5, 200, 7, 64]])
    assert same(mine(ids), ref(ids))


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_quantized_affine_grid(tmp_path, bits, group_size):
    weights, config = _checkpoint(tmp_path, {"group_size": group_size, "bits": bits})
    ref, _ = o_utils.load_model(tmp_path)
    mine = _mine(weights, config)
    _assert_same_model(mine, ref)
    assert isinstance(mine.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert mine.model.layers[0].self_attn.q_proj.bits == bits


@pytest.mark.parametrize("mode", ["mxfp4", "nvfp4", "mxfp8"])
@pytest.mark.parametrize("tie", [False, True])
def test_quantized_fp_modes(tmp_path, mode, tie):
    bits, gs = quant.QUANT_MODES[mode]
    weights, config = _checkpoint(tmp_path, {"group_size": gs, "bits": bits, "mode": mode}, tie=tie)
    ref, _ = o_utils.load_model(tmp_path)
    mine = _mine(weights, config)
    _assert_same_model(mine, ref)
    assert mine.model.embed_tokens.mode == mode


def test_mixed_per_module_and_dense_modules(tmp_path):
    # per-module override, an explicitly dense module, and modules left unquantized
    # in the checkpoint (no .scales: must stay dense without any config entry)
    quantization = {"group_size": 64, "bits": 4,
                    "model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8},
                    "lm_head": False}

    def predicate(p, m):
        if p in quantization:
            return quantization[p]
        return hasattr(m, "to_quantized") and not p.endswith("v_proj") and p != "model.embed_tokens"

    weights, config = _checkpoint(tmp_path, quantization, predicate)
    ref, _ = o_utils.load_model(tmp_path)
    mine = _mine(weights, config)
    _assert_same_model(mine, ref)
    attn = mine.model.layers[0].self_attn
    assert type(attn.v_proj) is nn.Linear and type(mine.model.embed_tokens) is nn.Embedding
    assert type(mine.lm_head) is nn.Linear
    assert mine.model.layers[0].mlp.down_proj.bits == 8 and attn.q_proj.bits == 4


def test_legacy_quantization_config(tmp_path):
    _checkpoint(tmp_path, {"group_size": 32, "bits": 4, "mode": "mxfp4"})
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization"]
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ref, _ = o_utils.load_model(tmp_path)
    weights = mx.load(str(tmp_path / "model.safetensors"))
    _assert_same_model(_mine(weights, config), ref)


def test_quant_for_rule_and_no_weights():
    model = _tiny_llama(False)
    quant.quantize_model(model, {"group_size": 64, "bits": 4},
                          quant_for=lambda p, m: {"group_size": 32, "bits": 8} if "mlp" in p else False)
    assert model.model.layers[0].mlp.up_proj.bits == 8
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    model = _tiny_llama(False)
    quant.quantize_model(model, {"group_size": 64, "bits": 4})  # no weights: every eligible module
    assert all(type(m).__name__.startswith("Quantized") for p, m in model.named_modules()
               if p.endswith(("_proj", "lm_head", "embed_tokens")))


def test_resolve_quantization_maps_like_mlx_lm():
    r = quant.resolve_quantization
    assert r({}) is None
    assert r({"quantization": {"group_size": 64, "bits": 4}}) == {"group_size": 64, "bits": 4}
    assert r({"quantization_config": {"quant_method": "mxfp8"}}) == {"group_size": 32, "bits": 8, "mode": "mxfp8"}
    assert r({"text_config": {"quantization_config": {"quant_method": "mxfp4"}}})["mode"] == "mxfp4"
    assert r({"quantization_config": {"quant_method": "fp8", "scale_fmt": "ue8m0",
                                      "weight_block_size": [32, 32]}})["mode"] == "mxfp8"
    assert r({"quantization_config": {"quant_method": "compressed-tensors",
                                      "format": "nvfp4-pack-quantized"}}) == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    assert r({"quantization_config": {"quant_method": "modelopt",
                                      "quantization": {"quant_algo": "NVFP4"}}})["mode"] == "nvfp4"
    for bad in ({"quant_method": "awq"}, {"quant_method": "bitnet"}, {"quant_method": "fp8"},
                {"quant_method": "compressed-tensors", "format": "float-quantized"},
                {"quant_method": "modelopt", "quant_algo": "FP8"}):
        with pytest.raises(UnsupportedModelError):
            r({"quantization_config": bad})
    with pytest.raises(UnsupportedModelError, match="quantize_activations"):
        r({"quantization": {"group_size": 32, "bits": 8, "mode": "mxfp8"}, "quantize_activations": True})
    with pytest.raises(ConfigError):
        r({"quantization": [4]})


@pytest.mark.parametrize("quantization,match", [
    ({"group_size": 64, "bits": 4, "mode": "fp8"}, "mode 'fp8'"),
    ({"group_size": 64, "bits": 4, "mode": "mxfp4"}, "needs bits=4, group_size=32"),
    ({"group_size": 64, "bits": 7}, "cannot quantize"),
    ({"group_size": 48, "bits": 4}, "cannot quantize"),
])
def test_unsupported_quantization_raises(quantization, match):
    model = _tiny_llama(False)
    with pytest.raises(UnsupportedModelError, match=match) as e:
        quant.quantize_model(model, quantization)
    assert "module '" in str(e.value)


def test_override_on_unquantizable_module_raises():
    model = _tiny_llama(False)
    with pytest.raises(UnsupportedModelError, match="model.norm"):
        quant.quantize_model(model, {"group_size": 64, "bits": 4, "model.norm": {"group_size": 64, "bits": 4}})


def test_infer_quant_config_from_tensor_infos():
    from mlxbun.weights import TensorInfo

    def info(name, dtype, shape):
        return TensorInfo(name=name, file="x", dtype=dtype, shape=shape, offsets=(0, 0))

    lin = nn.Linear(128, 64)
    w = {"a.weight": info("a.weight", "U32", (64, 16)), "a.scales": info("a.scales", "BF16", (64, 2))}
    assert quant.infer_quant_config("a", lin, w) == {"group_size": 64, "bits": 4, "mode": "affine"}
    w = {"a.weight": info("a.weight", "U32", (64, 16)), "a.scales": info("a.scales", "U8", (64, 8))}
    assert quant.infer_quant_config("a", lin, w) == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    w = {"a.weight": info("a.weight", "U32", (64, 24)), "a.scales": info("a.scales", "U8", (64, 8))}
    with pytest.raises(LoadError, match="a: 6 bits"):
        quant.infer_quant_config("a", lin, w)
