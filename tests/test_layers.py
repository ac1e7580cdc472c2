"""mlxbun.models.layers (and attention.softcapped_attention) vs mlx-lm 0.32.2 as the live oracle."""

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm import utils as o_utils
from mlx_lm.models import activations as o_act
from mlx_lm.models import cohere as o_cohere
from mlx_lm.models import gemma as o_gemma
from mlx_lm.models import gemma2 as o_gemma2
from mlx_lm.models import gemma3_text as o_gemma3
from mlx_lm.models import llama as o_llama
from mlx_lm.models import nanochat as o_nanochat
from mlx_lm.models import nemotron as o_nemotron
from mlx_lm.models import phi as o_phi
from mlx_lm.models import stablelm as o_stablelm
from mlx_lm.models import starcoder2 as o_starcoder2

from mlxbun.attention import softcapped_attention
from mlxbun.errors import ConfigError, LoadError, UnsupportedModelError
from mlxbun.models import base, layers

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
DT_IDS = ["f32", "f16", "bf16"]


def rnd(shape, seed, dtype=mx.float32, scale=1.0):
    return (scale * mx.random.normal(shape, key=mx.random.key(seed))).astype(dtype)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b, equal_nan=True).item()


def copy_params(dst, src, dtype=None):
    params = tree_flatten(src.parameters())
    if dtype is not None:
        params = [(k, v.astype(dtype)) for k, v in params]
    dst.load_weights(params, strict=True)
    return dst


def randomize(module, seed, dtype=None):
    params = [(k, rnd(v.shape, seed + i, dtype or v.dtype)) for i, (k, v) in enumerate(tree_flatten(module.parameters()))]
    module.load_weights(params, strict=True)
    return module


# ------------------------------------------------------------------ norms


@pytest.mark.parametrize("wdtype", ["same", "f32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("oracle", [o_gemma.RMSNorm, o_gemma2.RMSNorm, o_gemma3.RMSNorm])
def test_gemma_rmsnorm(oracle, dtype, wdtype):
    wd = dtype if wdtype == "same" else mx.float32
    ref = randomize(oracle(64, eps=1e-6), 1, wd)
    mine = copy_params(layers.GemmaRMSNorm(64, eps=1e-6), ref)
    x = rnd((2, 5, 64), 2, dtype, scale=3.0)
    assert same(mine(x), ref(x))
    assert layers.GemmaRMSNorm(8).weight.tolist() == oracle(8).weight.tolist()


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_nemotron_layernorm1p(dtype, bias):
    ref = randomize(o_nemotron.NemotronLayerNorm1P(64, eps=1e-5, bias=bias), 3, dtype)
    mine = copy_params(layers.NemotronLayerNorm1P(64, eps=1e-5, bias=bias), ref)
    x = rnd((2, 5, 64), 4, dtype, scale=2.0)
    assert same(mine(x), ref(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_cohere_layernorm2d(dtype):
    ref = randomize(o_cohere.LayerNorm2D(4, 16, eps=1e-5), 5, dtype)
    mine = copy_params(layers.LayerNorm2D(4, 16, eps=1e-5), ref)
    x = rnd((1, 3, 4, 16), 6, dtype)  # [B, L, heads, head_dim] as cohere applies it
    assert same(mine(x), ref(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_stablelm_layernorm_per_head(dtype):
    ref = randomize(o_stablelm.LayerNormPerHead(16, 4, eps=1e-5), 7, dtype)
    mine = copy_params(layers.LayerNormPerHead(16, 4, eps=1e-5), ref)
    assert [k for k, _ in tree_flatten(mine.parameters())] == [k for k, _ in tree_flatten(ref.parameters())]
    x = rnd((1, 3, 4, 16), 8, dtype)  # [B, L, heads, head_dim] as stablelm applies it
    assert same(mine(x), ref(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_nanochat_rms_norm(dtype):
    x = rnd((2, 3, 64), 9, dtype, scale=4.0)
    assert same(layers.rms_norm_no_weight(x), o_nanochat.rms_norm(x))


def test_mlx_nn_classes_are_reexported():
    assert layers.Linear is nn.Linear and layers.Embedding is nn.Embedding
    assert layers.QuantizedLinear is nn.QuantizedLinear and layers.QuantizedEmbedding is nn.QuantizedEmbedding
    assert layers.RMSNorm is nn.RMSNorm and layers.LayerNorm is nn.LayerNorm
    assert layers.gelu is nn.gelu and layers.gelu_approx is nn.gelu_approx and layers.relu2 is nn.relu2


# ------------------------------------------------------------------ activations


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_swiglu_family(dtype):
    g, u = rnd((2, 7, 96), 10, dtype, 3.0), rnd((2, 7, 96), 11, dtype, 3.0)
    assert same(layers.swiglu(g, u), o_act.swiglu(g, u))
    assert same(layers.precise_swiglu(u, g, u), o_act.precise_swiglu(u, g, u))
    assert same(layers.swiglu_oai(g, u), o_act.swiglu_oai(g, u))
    assert same(layers.SwigluOAI(alpha=1.5, limit=3.0)(u, g), o_act.SwigluOAI(alpha=1.5, limit=3.0)(u, g))
    assert same(layers.relu_squared(g), o_nemotron.relu_squared(g))


def test_swiglu_is_compiled_like_oracle():
    # eager silu(g)*u may differ from the compiled kernel; we must match the compiled one
    g, u = rnd((4, 256), 12, mx.bfloat16, 4.0), rnd((4, 256), 13, mx.bfloat16, 4.0)
    assert same(layers.swiglu(g, u), o_act.swiglu(g, u))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_xielu(dtype):
    ref = o_act.XieLU()
    ref.alpha_p, ref.alpha_n = rnd((), 14), rnd((), 15)  # checkpoint-loaded values
    mine = layers.XieLU()
    for k in ("alpha_p", "alpha_n", "beta", "eps"):
        assert same(getattr(mine, k), getattr(o_act.XieLU(), k))
    mine.alpha_p, mine.alpha_n = ref.alpha_p, ref.alpha_n
    x = rnd((2, 5, 64), 16, dtype, 3.0)
    assert same(mine(x), ref(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_mlp_forms(dtype):
    x = rnd((1, 5, 32), 17, dtype)
    # gemma: gelu(gate) * up
    ref = randomize(o_gemma.MLP(32, 64), 20, dtype)
    assert same(ref.down_proj(layers.gelu_mul(ref.gate_proj(x), ref.up_proj(x))), ref(x))
    # gemma2 / gemma3_text: gelu_approx(gate) * up
    for cls in (o_gemma2.MLP, o_gemma3.MLP):
        ref = randomize(cls(32, 64), 30, dtype)
        assert same(ref.down_proj(layers.gelu_approx_mul(ref.gate_proj(x), ref.up_proj(x))), ref(x))
    # starcoder2: gelu; nemotron: relu_squared (its own compiled fn)
    ref = randomize(o_starcoder2.MLP(32, 64), 40, dtype)
    assert same(ref.c_proj(layers.gelu(ref.c_fc(x))), ref(x))
    args = o_nemotron.ModelArgs(model_type="nemotron", hidden_size=32, hidden_act="relu2",
                                num_hidden_layers=1, intermediate_size=64, num_attention_heads=4,
                                norm_eps=1e-5, vocab_size=64, num_key_value_heads=4)
    ref = randomize(o_nemotron.MLP(args), 50, dtype)
    assert same(ref.down_proj(layers.relu_squared(ref.up_proj(x))), ref(x))
    # nanochat: nn.relu2; phi: gelu_approx
    nargs = o_nanochat.ModelArgs(model_type="nanochat", hidden_size=32, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=4, vocab_size=64,
                                 max_position_embeddings=64, intermediate_size=64)
    ref = randomize(o_nanochat.MLP(nargs), 60, dtype)
    assert same(ref.c_proj(layers.relu2(ref.c_fc(x))), ref(x))
    pargs = o_phi.ModelArgs(hidden_size=32, intermediate_size=64)
    ref = randomize(o_phi.PhiMLP(pargs), 70, dtype)
    assert same(ref.fc2(layers.gelu_approx(ref.fc1(x))), ref(x))


# ------------------------------------------------------------------ residual / softcaps


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_clip_residual(dtype):
    x = rnd((2, 5, 64), 80, dtype, 40000.0)  # fp16 overflow territory
    y = rnd((2, 5, 64), 81, dtype, 40000.0)
    assert same(layers.clip_residual(x, y), o_gemma3.clip_residual(x, y))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_logit_softcap_gemma2(dtype):
    x = rnd((1, 3, 257), 82, dtype, 60.0)
    cap = 30.0
    out = mx.tanh(x / cap)  # gemma2.Model.__call__, verbatim
    out = out * cap
    assert same(layers.logit_softcap(x, cap), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
def test_nanochat_softcap_compiled(dtype):
    x = rnd((1, 3, 257), 83, dtype, 60.0)
    assert same(layers.softcap_compiled(x), o_nanochat.softcap(x))
    assert same(layers.softcap_compiled(x, 7.5), o_nanochat.softcap(x, 7.5))


@pytest.mark.parametrize("dtype", DTYPES, ids=DT_IDS)
@pytest.mark.parametrize("n_kv", [1, 4])
def test_softcapped_attention_gemma2(n_kv, dtype):
    args = o_gemma2.ModelArgs(model_type="gemma2", hidden_size=64, num_hidden_layers=1,
                              intermediate_size=128, num_attention_heads=4, head_dim=16,
                              rms_norm_eps=1e-6, vocab_size=64, num_key_value_heads=n_kv,
                              query_pre_attn_scalar=16.0)
    attn = randomize(o_gemma2.Attention(args), 90, dtype)
    x = rnd((1, 6, 64), 91, dtype)
    mask = base.create_attention_mask(x, None, return_array=True)
    B, L, _ = x.shape
    q = attn.rope(attn.q_proj(x).reshape(B, L, 4, -1).transpose(0, 2, 1, 3))
    k = attn.rope(attn.k_proj(x).reshape(B, L, n_kv, -1).transpose(0, 2, 1, 3))
    v = attn.v_proj(x).reshape(B, L, n_kv, -1).transpose(0, 2, 1, 3)
    o = softcapped_attention(q, k, v, attn.scale, attn.attn_logit_softcapping, mask)
    mine = attn.o_proj(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
    assert same(mine, attn(x, mask))


# ------------------------------------------------------------------ quantization

LLAMA = dict(model_type="llama", hidden_size=128, num_hidden_layers=1, intermediate_size=256,
             num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=256)


def _tiny_llama(tie):
    mx.random.seed(0)
    return o_llama.Model(o_llama.ModelArgs(**LLAMA, tie_word_embeddings=tie))


def _checkpoint(tmp_path, quantization, predicate=None, tie=False):
    """A tiny llama saved as mlx_lm.convert would: packed weights + config['quantization']."""
    model = _tiny_llama(tie)
    qk = {k: quantization[k] for k in ("group_size", "bits", "mode") if k in quantization}
    nn.quantize(model, qk.get("group_size"), qk.get("bits"), mode=qk.get("mode", "affine"),
                class_predicate=predicate)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), weights)
    config = {**LLAMA, "tie_word_embeddings": tie, "quantization": quantization}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return weights, config


def _mine(weights, config):
    model = o_llama.Model(o_llama.ModelArgs.from_dict(config))
    w = model.sanitize(dict(weights))
    layers.quantize_model(model, layers.resolve_quantization(config), w)
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
    bits, gs = layers.QUANT_MODES[mode]
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
    layers.quantize_model(model, {"group_size": 64, "bits": 4},
                          quant_for=lambda p, m: {"group_size": 32, "bits": 8} if "mlp" in p else False)
    assert model.model.layers[0].mlp.up_proj.bits == 8
    assert type(model.model.layers[0].self_attn.q_proj) is nn.Linear
    model = _tiny_llama(False)
    layers.quantize_model(model, {"group_size": 64, "bits": 4})  # no weights: every eligible module
    assert all(type(m).__name__.startswith("Quantized") for p, m in model.named_modules()
               if p.endswith(("_proj", "lm_head", "embed_tokens")))


def test_resolve_quantization_maps_like_mlx_lm():
    r = layers.resolve_quantization
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
        layers.quantize_model(model, quantization)
    assert "module '" in str(e.value)


def test_override_on_unquantizable_module_raises():
    model = _tiny_llama(False)
    with pytest.raises(UnsupportedModelError, match="model.norm"):
        layers.quantize_model(model, {"group_size": 64, "bits": 4, "model.norm": {"group_size": 64, "bits": 4}})


def test_infer_quant_config_from_tensor_infos():
    from mlxbun.weights import TensorInfo

    def info(name, dtype, shape):
        return TensorInfo(name=name, file="x", dtype=dtype, shape=shape, offsets=(0, 0))

    lin = nn.Linear(128, 64)
    w = {"a.weight": info("a.weight", "U32", (64, 16)), "a.scales": info("a.scales", "BF16", (64, 2))}
    assert layers.infer_quant_config("a", lin, w) == {"group_size": 64, "bits": 4, "mode": "affine"}
    w = {"a.weight": info("a.weight", "U32", (64, 16)), "a.scales": info("a.scales", "U8", (64, 8))}
    assert layers.infer_quant_config("a", lin, w) == {"group_size": 16, "bits": 4, "mode": "nvfp4"}
    w = {"a.weight": info("a.weight", "U32", (64, 24)), "a.scales": info("a.scales", "U8", (64, 8))}
    with pytest.raises(LoadError, match="a: 6 bits"):
        layers.infer_quant_config("a", lin, w)
