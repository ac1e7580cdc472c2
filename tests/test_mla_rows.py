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


_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("knobs", [
    {},  # the zoo's: low-rank q, grouped routing, plain rope
    {"q_lora_rank": None, "n_group": 1, "rope_scaling": _YARN, "num_experts_per_tok": 1},
], ids=["zoo", "q_proj_yarn_top1"])
def test_the_glm4_moe_lite_row_matches_mlx_lm_through_prefill_and_decode(knobs):
    rc, oc = _prefill_and_decode({**tiny_config("glm4_moe_lite"), **knobs})
    # the cache holds the normed latent (one head) and the rope key, as mlx-lm's
    assert mx.array_equal(rc[0].keys[..., :rc[0].offset, :], oc[0].keys[..., :oc[0].offset, :])
    assert oc[0].keys.shape[1] == 1 and oc[0].values.shape[-1] == 8


def test_glm4_moe_lite_sanitize_matches_mlx_lm():
    """An HF-layout checkpoint: per-expert tensors, kv_b_proj (one layer quantized), two MTP layers
    past N (mlx-lm drops every index >= N, not only N)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.glm4_moe_lite import Model, ModelArgs

    from mlxbun.models.universal.resolve import descriptor_for
    from mlxbun.models.universal.sanitize import sanitize_weights

    cfg = tiny_config("glm4_moe_lite")
    mx.random.seed(0)
    w = {k: mx.random.normal(v.shape) for k, v in tree_flatten(Model(ModelArgs.from_dict(cfg)).parameters())}
    H, dn, dv, kv = 4, cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    for layer in range(2):
        p = f"model.layers.{layer}.self_attn"
        del w[f"{p}.embed_q.weight"], w[f"{p}.unembed_out.weight"]
        kv_b = mx.random.normal((H * (dn + dv), kv))
        if layer == 0:
            (w[f"{p}.kv_b_proj.weight"], w[f"{p}.kv_b_proj.scales"],
             w[f"{p}.kv_b_proj.biases"]) = mx.quantize(kv_b, group_size=32, bits=4)
        else:
            w[f"{p}.kv_b_proj.weight"] = kv_b
    for name in ("gate_proj", "up_proj", "down_proj"):
        stacked = w.pop(f"model.layers.1.mlp.switch_mlp.{name}.weight")
        w.update({f"model.layers.1.mlp.experts.{e}.{name}.weight": stacked[e] for e in range(4)})
    w["model.layers.2.self_attn.o_proj.weight"] = mx.zeros((2, 2))
    w["model.layers.3.eh_proj.weight"] = mx.zeros((2, 2))
    want = Model(ModelArgs.from_dict(cfg)).sanitize(dict(w))
    got, dropped = sanitize_weights(descriptor_for("glm4_moe_lite"), w, False, build_model(cfg).args.fields)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]), k
    assert {"model.layers.2.self_attn.o_proj.weight", "model.layers.3.eh_proj.weight"} <= set(dropped)


@pytest.mark.parametrize("knobs", [
    {},  # the zoo's: tied, traditional rope, v_head_dim != qk_nope_head_dim
    {"tie_word_embeddings": False, "rope_traditional": False, "q_lora_rank": None, "attention_bias": True,
     "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                      "mscale_all_dim": 1.0}},  # yarn rope, still the plain softmax scale
], ids=["zoo", "untied_q_proj_yarn"])
def test_the_youtu_llm_row_matches_mlx_lm_through_prefill_and_decode(knobs):
    rc, oc = _prefill_and_decode({**tiny_config("youtu_llm"), **knobs})
    assert oc[0].values.shape[1:2] == (4,) and oc[0].values[..., :oc[0].offset, :].shape[-1] == 24
    assert mx.array_equal(rc[0].keys[..., :rc[0].offset, :], oc[0].keys[..., :oc[0].offset, :])


def test_youtu_llm_refuses_a_non_bool_rope_traditional_naming_it():
    with pytest.raises(MlxbunError, match="'rope_traditional'"):
        build_model({**tiny_config("youtu_llm"), "rope_traditional": "yes"})
