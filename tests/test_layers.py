"""mlxbun.models.layers (and attention.softcapped_attention) vs mlx-lm 0.32.2 as the live oracle."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import activations as o_act
from mlx_lm.models import cohere as o_cohere
from mlx_lm.models import gemma as o_gemma
from mlx_lm.models import gemma2 as o_gemma2
from mlx_lm.models import gemma3_text as o_gemma3
from mlx_lm.models import nanochat as o_nanochat
from mlx_lm.models import nemotron as o_nemotron
from mlx_lm.models import phi as o_phi
from mlx_lm.models import stablelm as o_stablelm
from mlx_lm.models import starcoder2 as o_starcoder2

from mlxbun.attention import softcapped_attention
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
