"""The MLA rows beyond deepseek_v2 / v3 (minicpm3, ...) against mlx-lm's model files on the same
weights, through prefill and decode, bit for bit, with the variants of their configs the zoo does
not build; and the config values each refuses where mlx-lm would fail, naming the key."""

import mlx.core as mx
import pytest
from mlx_lm.models import cache as mlx_cache

from mlxbun.errors import MlxbunError
from mlxbun.models.universal.loader import build_model
from mlxbun.zoo import tiny_config
from tests.hybrid_models import oracle_and_universal

IDS = mx.array([[5, 9, 2, 77, 31, 8, 100, 4]])


def _prefill_and_decode(cfg):
    ref, ours = oracle_and_universal(cfg)
    rc, oc = mlx_cache.make_prompt_cache(ref), ours.make_cache()
    assert mx.array_equal(ref(IDS, cache=rc), ours(IDS, cache=oc))
    for t in (11, 250, 3):
        step = mx.array([[t]])
        assert mx.array_equal(ref(step, cache=rc), ours(step, cache=oc)), t
    return rc, oc


@pytest.mark.parametrize("knobs", [
    {},  # the zoo's: tied, longrope with max / original = 4
    {"tie_word_embeddings": False},  # the head's input divided by hidden_size / dim_model_base
    {"rope_scaling": {"type": "longrope"}, "attention_bias": True},  # factors default to 1.0, 4096
], ids=["zoo", "untied", "default_factors_bias"])
def test_the_minicpm3_row_matches_mlx_lm_through_prefill_and_decode(knobs):
    rc, oc = _prefill_and_decode({**tiny_config("minicpm3"), **knobs})
    # the cache holds full per-head keys [nope | rope] and values of hidden // heads, as mlx-lm's
    assert oc[0].keys[..., :oc[0].offset, :].shape == (1, 4, 11, 24)
    assert mx.array_equal(rc[0].values[..., :rc[0].offset, :], oc[0].values[..., :oc[0].offset, :])


@pytest.mark.parametrize("key,value", [("q_lora_rank", None), ("rope_scaling", None), ("kv_lora_rank", 0)])
def test_minicpm3_refuses_what_mlx_lm_cannot_build_naming_the_key(key, value):
    with pytest.raises(MlxbunError, match=repr(key)):
        build_model({**tiny_config("minicpm3"), key: value})
