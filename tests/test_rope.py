"""mlxbun.models.rope vs mlx-lm 0.32.2 (live oracle): frequency tables and outputs bit-exact."""

import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import hunyuan_v1_dense as o_hunyuan
from mlx_lm.models import ministral3 as o_ministral3
from mlx_lm.models import nanochat as o_nanochat
from mlx_lm.models import rope_utils as o_rope
from mlx_lm.models import smollm3 as o_smollm3

from mlxbun.errors import ConfigError, MlxbunError, UnsupportedModelError
from mlxbun.models import rope

# Real configs (values as shipped in the checkpoints' config.json).
LLAMA31 = {  # Llama-3.1-8B-Instruct
    "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}
LLAMA32 = {  # Llama-3.2-1B: factor 32
    "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192, "rope_type": "llama3",
}
# Phi-3-mini-128k / Phi-3.5-mini style longrope (head_dim 96 -> 48 factors).
PHI_LONG = [1.0800000429153442, 1.1100000143051147, 1.1399999856948853, 1.340000033378601, 1.5899999141693115, 1.600000023841858, 1.6200000047683716, 2.620000123977661, 3.2300000190734863, 3.2300000190734863, 4.789999961853027, 7.400000095367432, 7.700000286102295, 9.09000015258789, 12.199999809265137, 17.670000076293945, 24.46000099182129, 28.57000160217285, 30.420001983642578, 30.840002059936523, 32.590003967285156, 32.93000411987305, 42.320003509521484, 44.96000289916992, 50.340003967285156, 50.45000457763672, 57.55000305175781, 57.93000411987305, 58.21000289916992, 60.1400032043457, 62.61000442504883, 62.62000274658203, 62.71000289916992, 63.1400032043457, 63.1400032043457, 63.77000427246094, 63.93000411987305, 63.96000289916992, 63.970001220703125, 64.02999877929688, 64.06999969482422, 64.08000183105469, 64.12000274658203, 64.41000366210938, 64.4800033569336, 64.51000213623047, 64.52999877929688, 64.83999633789062]  # noqa: E501
PHI_SHORT = [1.0, 1.0199999809265137, 1.0299999713897705, 1.0299999713897705, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0499999523162842, 1.0699999332427979, 1.0999999046325684, 1.1099998950958252, 1.1599998474121094, 1.1599998474121094, 1.1699998378753662, 1.2899998426437378, 1.339999794960022, 1.679999828338623, 1.7899998426437378, 1.8199998140335083, 1.8499997854232788, 1.8799997568130493, 1.9099997282028198, 1.9399996995925903, 1.9899996519088745, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0199997425079346, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0299997329711914, 2.0799996852874756, 2.0899996757507324, 2.189999580383301, 2.2199995517730713, 2.5899994373321533, 2.729999542236328, 2.749999523162842, 2.8399994373321533]  # noqa: E501
PHI35 = {"type": "longrope", "long_factor": PHI_LONG, "short_factor": PHI_SHORT,
         "original_max_position_embeddings": 4096}
LONG16 = {"rope_type": "longrope", "original_max_position_embeddings": 64,
          "long_factor": [1.0, 1.5, 2.25, 3.0, 4.5, 8.0, 16.0, 31.5],
          "short_factor": [1.0] * 8}
QWEN25_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
GPT_OSS_YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "original_max_position_embeddings": 4096, "truncate": False}
DEEPSEEK_YARN = {"type": "deepseek_yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1,
                 "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}
MSCALE_YARN = {"rope_type": "telechat3-yarn", "factor": 16.0, "mscale": 0.707,
               "original_max_position_embeddings": 64}

# (id, dims, base, traditional, scaling_config, max_position_embeddings, big offset)
CASES = [
    ("default", 16, 10000.0, False, None, None, 70000),
    ("default-trad", 16, 500000.0, True, None, None, 70000),
    ("default-partial", 8, 10000.0, False, None, None, 300),
    ("default-explicit", 16, 1e6, False, {"rope_type": "default"}, 4096, 5000),
    ("linear", 16, 10000.0, False, {"type": "linear", "factor": 2.0}, 4096, 5000),
    ("linear-int", 16, 10000, True, {"rope_type": "linear", "factor": 4}, 4096, 5000),
    ("dynamic", 16, 10000.0, False, {"type": "dynamic", "factor": 2.0}, 32, 100),
    ("dynamic-trad", 16, 10000.0, True, {"rope_type": "dynamic", "factor": 4.0}, 64, 100),
    ("llama3.1", 16, 500000.0, False, LLAMA31, 131072, 9000),
    ("llama3.2", 16, 500000.0, False, LLAMA32, 131072, 9000),
    ("llama3-trad", 16, 10000.0, True, {**LLAMA31, "original_max_position_embeddings": 64}, 256, 100),
    ("yarn-qwen2.5", 16, 1000000.0, False, QWEN25_YARN, 131072, 40000),
    ("yarn-gpt-oss", 16, 150000.0, False, GPT_OSS_YARN, 131072, 5000),
    ("yarn-deepseek", 16, 10000.0, True, DEEPSEEK_YARN, 163840, 5000),
    ("yarn-mscale", 16, 10000.0, False, MSCALE_YARN, 1024, 100),
    ("longrope-16", 16, 10000.0, False, LONG16, 4096, 100),
    ("longrope-phi", 96, 10000.0, False, PHI35, 131072, 5000),
    ("longrope-phi-partial", 16, 10000.0, False, {**PHI35, "long_factor": PHI_LONG[:8]}, 131072, 5000),
    ("proportional", 16, 10000.0, False, {"rope_type": "proportional", "partial_rotary_factor": 0.25}, None, 500),
    ("proportional-factor", 16, 1e6, True,
     {"rope_type": "proportional", "partial_rotary_factor": 0.5, "factor": 8.0}, None, 500),
    ("mrope", 16, 10000.0, False, {"type": "mrope", "mrope_section": [2, 3, 3]}, None, 500),
]
IDS = [c[0] for c in CASES]


def _pair(case):
    _, dims, base, trad, sc, maxpos, _ = case
    return (rope.initialize_rope(dims, base, trad, sc, maxpos),
            o_rope.initialize_rope(dims, base, trad, sc, maxpos))


def _x(dims, L, dtype, seed):
    width = dims if dims >= 16 else 16  # partial rotary: rotate the first `dims` of 16
    return mx.random.normal((1, 4, L, width), key=mx.random.key(seed)).astype(dtype)


def _same_module(mine, ref):
    assert type(mine).__name__ == type(ref).__name__
    mine_vars = {k: v for k, v in vars(mine).items() if not k.startswith("_") or k in ("_freqs", "_scale")}
    for k, v in vars(ref).items():
        if k.startswith("_") and k not in ("_freqs", "_scale"):
            continue
        assert k in mine_vars, k
        if isinstance(v, mx.array):
            assert v.dtype == mine_vars[k].dtype, k
            assert mx.array_equal(v, mine_vars[k]).item(), k
        elif isinstance(v, float) and math.isnan(v):
            assert math.isnan(mine_vars[k])
        elif k != "_parameters":
            assert v == mine_vars[k], k


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_same_class_and_tables(case):
    mine, ref = _pair(case)
    _same_module(mine, ref)
    if hasattr(ref, "_freqs"):
        assert mine._freqs.dtype == ref._freqs.dtype == mx.float32
        assert mx.array_equal(mine._freqs, ref._freqs).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_apply_bit_exact(case, dtype):
    mine, ref = _pair(case)
    big = case[6]
    for i, (L, offset) in enumerate([(7, 0), (1, 0), (1, 13), (7, big), (1, big + 7)]):
        x = _x(case[1], L, dtype, seed=i)
        a, b = mine(x, offset=offset), ref(x, offset=offset)
        assert a.dtype == b.dtype == dtype
        assert mx.array_equal(a, b).item(), (L, offset)
    # mlx-lm passes cache.offset, sometimes an mx.array
    x = _x(case[1], 3, dtype, seed=9)
    if not isinstance(ref, (o_rope.DynamicNTKScalingRoPE,)):
        off = mx.array(big)
        assert mx.array_equal(mine(x, offset=off), ref(x, offset=off)).item()


def test_rope_not_identity():
    # guards against a vacuous comparison: the oracle rope really changes x at offset > 0
    mine, _ = _pair(CASES[8])
    x = _x(16, 3, mx.float32, 0)
    assert not mx.array_equal(mine(x, offset=9000), x).item()


@pytest.mark.parametrize("case", [c for c in CASES if c[0].startswith("yarn")], ids=lambda c: c[0])
def test_yarn_inverse_and_scale(case):
    mine, ref = _pair(case)
    x = _x(16, 5, mx.float32, 3)
    for kw in ({"inverse": True}, {"scale": 0.5}, {"inverse": True, "offset": 77}):
        assert mx.array_equal(mine(x, **kw), ref(x, **kw)).item(), kw
    assert mine.mscale == ref.mscale


@pytest.mark.parametrize("dims", [16, 64, 96, 128])
@pytest.mark.parametrize("name,kwargs", [
    ("llama3", dict(base=500000.0, traditional=False, scaling_config=LLAMA31, max_position_embeddings=131072)),
    ("yarn", dict(base=1e6, traditional=False, scaling_config=QWEN25_YARN, max_position_embeddings=131072)),
    ("gptoss", dict(base=150000.0, traditional=False, scaling_config=GPT_OSS_YARN, max_position_embeddings=131072)),
    ("prop", dict(base=1e6, traditional=False,
                  scaling_config={"rope_type": "proportional", "partial_rotary_factor": 0.25},
                  max_position_embeddings=None)),
])
def test_tables_at_real_head_dims(dims, name, kwargs):
    mine = rope.initialize_rope(dims, **kwargs)
    ref = o_rope.initialize_rope(dims, **kwargs)
    assert mx.array_equal(mine._freqs, ref._freqs).item()


def test_phi3_direct_suscaled_matches():
    # phi3 builds SuScaledRoPE itself (type "su"/"longrope"), with head_dim*partial dims
    kw = dict(base=10000.0, max_position_embeddings=131072, original_max_position_embeddings=4096,
              short_factor=PHI_SHORT, long_factor=PHI_LONG)
    mine, ref = rope.SuScaledRoPE(96, **kw), o_rope.SuScaledRoPE(96, **kw)
    assert mine._scale == ref._scale and mx.array_equal(mine._freqs, ref._freqs).item()
    x = _x(96, 4, mx.bfloat16, 1)
    assert mx.array_equal(mine(x, offset=5000), ref(x, offset=5000)).item()
    # long_mscale overrides the default scale
    kw["long_mscale"] = 1.19
    assert rope.SuScaledRoPE(96, **kw)._scale == o_rope.SuScaledRoPE(96, **kw)._scale == 1.19


@pytest.mark.parametrize("alpha", [1.0, 1000.0])
def test_hunyuan_ntk_alpha(alpha):
    mine = rope.DynamicNTKAlphaRoPE(16, base=10000.0, scaling_alpha=alpha)
    ref = o_hunyuan.DynamicNTKAlphaRoPE(16, base=10000.0, scaling_alpha=alpha)
    assert mx.array_equal(mine._freqs, ref._freqs).item()
    for dtype in (mx.float32, mx.bfloat16):
        x = _x(16, 5, dtype, 2)
        assert mx.array_equal(mine(x, offset=40), ref(x, offset=40)).item()


@pytest.mark.parametrize("theta", [10000.0, 1e6])
def test_nanochat_rope(theta):
    mine = rope.NanochatRoPE(16, base=theta)
    half = 8
    ref_freqs = -mx.exp(mx.arange(0.0, half, dtype=mx.float32) * (math.log(theta) / half))
    assert mx.array_equal(mine._freqs, ref_freqs).item()
    for offset in (0, 33):
        x = _x(16, 5, mx.float32, offset)
        ref = o_nanochat.apply_rotary_emb(x, offset=offset, base=theta, freqs=ref_freqs)
        assert mx.array_equal(mine(x, offset=offset), ref).item()
        # and its fallback (freqs=None) path builds the same table
        ref2 = o_nanochat.apply_rotary_emb(x, offset=offset, base=theta)
        assert mx.array_equal(mine(x, offset=offset), ref2).item()


def test_nope():
    x = _x(16, 3, mx.float32, 0)
    assert rope.NoPE()(x, offset=5) is x
    assert o_smollm3.NoPE()(x, offset=5) is x


@pytest.mark.parametrize("offset", [0, 3, 9000, "array"])
@pytest.mark.parametrize("size", [1, 7])
def test_llama4_attn_scale(size, offset):
    if offset == "array":
        offset = mx.array([0, 8191, 20000])
    a = rope.llama4_attn_scale(size, offset, 0.1, 8192)
    b = o_ministral3._get_llama_4_attn_scale(size, offset, 0.1, 8192)
    assert a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.mark.parametrize("sc", [None, {}, QWEN25_YARN, DEEPSEEK_YARN, LLAMA31,
                                {"type": "yarn", "factor": 1.0, "mscale_all_dim": 1.0},
                                {"rope_type": "yarn", "factor": 8.0, "mscale_all_dim": 0.707}])
def test_apply_yarn_mscale(sc):
    assert rope.apply_yarn_mscale(0.125, sc) == o_rope.apply_yarn_mscale(0.125, sc)


def test_rope_type_of():
    assert rope.rope_type_of(None) == "default"
    assert rope.rope_type_of({"type": "linear", "rope_type": "x"}) == "linear"
    assert rope.rope_type_of({"rope_type": "llama3"}) == "llama3"
    assert rope.rope_type_of({"factor": 2.0}) == "default"
    assert set(rope.ROPE_TYPES) >= {"default", "linear", "dynamic", "llama3", "yarn", "longrope", "proportional"}


def test_errors_are_mlxbun_errors():
    with pytest.raises(UnsupportedModelError, match="'su'"):
        rope.initialize_rope(16, 10000.0, False, {"type": "su", "short_factor": [1.0], "long_factor": [1.0]})
    with pytest.raises(ConfigError, match="'factor'"):
        rope.initialize_rope(16, 10000.0, False, {"type": "linear"})
    with pytest.raises(ConfigError, match="original_max_position_embeddings"):
        rope.initialize_rope(16, 10000.0, False, {"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]})
    with pytest.raises(MlxbunError, match="3 sections"):
        rope.initialize_rope(16, 10000.0, False, {"type": "mrope", "mrope_section": [8, 8]})


def test_default_is_nn_rope():
    r = rope.initialize_rope(16, 10000.0, False)
    assert type(r) is nn.RoPE and r.scale == 1.0
    r = rope.initialize_rope(16, 10000.0, False, {"type": "linear", "factor": 4.0})
    assert r.scale == 0.25
