"""MlaAttention (models/universal/mla.py) against mlx-lm's DeepseekV2Attention on the same weights:
prefill and decode through a KVCache, both q branches (q_lora_rank set / None), bit for bit; and
the config values it refuses, each naming its key."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.deepseek_v2 import DeepseekV2Attention, ModelArgs

from mlxbun.cache.kv import KVCache
from mlxbun.errors import MlxbunError
from mlxbun.models.base import create_attention_mask as our_mask
from mlxbun.models.universal.mla import MlaAttention
from mlxbun.models.universal.schema_mla import MlaKnobs

_SCALING = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 32,
            "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}


def _fields(q_lora_rank):
    return dict(model_type="deepseek_v2", hidden_size=64, num_attention_heads=4, q_lora_rank=q_lora_rank,
                kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                rope_theta=10000.0, rope_scaling=_SCALING, attention_bias=False,
                max_position_embeddings=2048)


def _pair(q_lora_rank):
    f = _fields(q_lora_rank)
    ref = DeepseekV2Attention(ModelArgs(**f))
    mx.random.seed(3)
    ref.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.2)
                                        for k, v in tree_flatten(ref.parameters())]))
    ours = MlaAttention(f, MlaKnobs(), "deepseek_v2", 64, 4, False)
    ours.load_weights(tree_flatten(ref.parameters()), strict=True)
    return ref, ours


@pytest.fixture(scope="module", params=[24, None], ids=["q_lora", "q_proj"])
def pair(request):
    return _pair(request.param)


def test_prefill_and_decode_match_mlx_lm(pair):
    ref, ours = pair
    mx.random.seed(5)
    x = mx.random.normal((1, 7, 64))
    rc, oc = mlx_cache.KVCache(), KVCache()
    r = ref(x, create_attention_mask(x, rc), rc)
    o = ours(x, our_mask(x, oc), oc)
    assert mx.array_equal(r, o)
    for step in range(3):
        t = mx.random.normal((1, 1, 64))
        assert mx.array_equal(ref(t, None, rc), ours(t, None, oc)), step
    # the cache holds full per-head keys [nope | rope] and the values, as mlx-lm's
    assert oc.keys[..., :oc.offset, :].shape == (1, 4, 10, 16)
    assert mx.array_equal(rc.keys[..., :rc.offset, :], oc.keys[..., :oc.offset, :])
    assert mx.array_equal(rc.values[..., :rc.offset, :], oc.values[..., :oc.offset, :])


def test_no_cache_matches(pair):
    ref, ours = pair
    x = mx.random.normal((2, 5, 64))
    mask = create_attention_mask(x, None)
    assert mx.array_equal(ref(x, mask), ours(x, mask))


@pytest.mark.parametrize("key,value", [("kv_lora_rank", 0), ("qk_rope_head_dim", 7),
                                       ("v_head_dim", "12"), ("q_lora_rank", -1),
                                       ("rope_scaling", None), ("rope_scaling", {"type": "yarn"})])
def test_bad_values_name_the_key(key, value):
    f = {**_fields(24), key: value}
    with pytest.raises(MlxbunError, match=repr(key)):
        MlaAttention(f, MlaKnobs(), "deepseek_v2", 64, 4, False)


@pytest.mark.parametrize("knobs", [
    {},  # the zoo's: low-rank q, greedy router
    {"q_lora_rank": None, "topk_method": "group_limited_greedy", "n_group": 2, "topk_group": 1,
     "routed_scaling_factor": 2.5},
], ids=["zoo", "q_proj_group_limited"])
def test_the_deepseek_v2_row_matches_mlx_lm_through_prefill_and_decode(knobs):
    from mlxbun.zoo import tiny_config
    from tests.mla_helpers import prefill_and_decode

    prefill_and_decode({**tiny_config("deepseek_v2"), **knobs})


def test_a_bad_topk_method_is_refused_naming_the_key():
    from mlxbun.models.universal.loader import build_model
    from mlxbun.zoo import tiny_config

    with pytest.raises(MlxbunError, match="topk_method"):
        build_model({**tiny_config("deepseek_v2"), "topk_method": "noaux_tc"})
