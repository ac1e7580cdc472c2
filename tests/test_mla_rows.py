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
from tests.mla_helpers import IDS, kv_b_layout, prefill_and_decode


@pytest.mark.parametrize("knobs", [
    {},  # the zoo's: tied, longrope with max / original = 4
    {"tie_word_embeddings": False},  # the head's input divided by hidden_size / dim_model_base
    {"rope_scaling": {"type": "longrope"}, "attention_bias": True},  # factors default to 1.0, 4096
], ids=["zoo", "untied", "default_factors_bias"])
def test_the_minicpm3_row_matches_mlx_lm_throughprefill_and_decode(knobs):
    rc, oc = prefill_and_decode({**tiny_config("minicpm3"), **knobs})
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
def test_the_glm4_moe_lite_row_matches_mlx_lm_throughprefill_and_decode(knobs):
    rc, oc = prefill_and_decode({**tiny_config("glm4_moe_lite"), **knobs})
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
    kv_b_layout(w, cfg, layers=2, heads=4)
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
def test_the_youtu_llm_row_matches_mlx_lm_throughprefill_and_decode(knobs):
    rc, oc = prefill_and_decode({**tiny_config("youtu_llm"), **knobs})
    assert oc[0].values.shape[1:2] == (4,) and oc[0].values[..., :oc[0].offset, :].shape[-1] == 24
    assert mx.array_equal(rc[0].keys[..., :rc[0].offset, :], oc[0].keys[..., :oc[0].offset, :])


def test_youtu_llm_refuses_a_non_bool_rope_traditional_naming_it():
    with pytest.raises(MlxbunError, match="'rope_traditional'"):
        build_model({**tiny_config("youtu_llm"), "rope_traditional": "yes"})


_M4_ROPE = tiny_config("mistral4")["rope_parameters"]


@pytest.mark.parametrize("knobs", [
    {},  # the zoo's: yarn + llama-4 scale (original context 16), grouped routing, traditional rope
    {"rope_interleave": None, "q_lora_rank": None, "n_group": 1, "norm_topk_prob": False,
     "tie_word_embeddings": True, "n_shared_experts": None},
    {"rope_interleave": False, "attention_bias": True, "num_experts_per_tok": 1,
     "rope_parameters": {"type": "default", "mscale_all_dim": 1.0, "factor": 4.0,  # no mscale: type default
                         "llama_4_scaling_beta": 0.3, "original_max_position_embeddings": 4}},  # theta 1e5
], ids=["zoo", "interleave_none_q_proj_tied", "not_interleaved_default_rope"])
def test_the_mistral4_row_matches_mlx_lm_through_prefill_chunks_and_decode(knobs):
    ref, ours = oracle_and_universal({**tiny_config("mistral4"), **knobs})
    rc, oc = mlx_cache.make_prompt_cache(ref), ours.make_cache()
    assert mx.array_equal(ref(IDS, cache=rc), ours(IDS, cache=oc))
    chunk = mx.array([[17, 3, 200]])  # a second prefill: the causal mask over an offset cache
    assert mx.array_equal(ref(chunk, cache=rc), ours(chunk, cache=oc))
    for t in (11, 250, 3):
        step = mx.array([[t]])
        assert mx.array_equal(ref(step, cache=rc), ours(step, cache=oc)), t
    assert mx.array_equal(rc[1].keys[..., :rc[1].offset, :], oc[1].keys[..., :oc[1].offset, :])
    assert mx.array_equal(rc[1].values[..., :rc[1].offset, :], oc[1].values[..., :oc[1].offset, :])


@pytest.mark.parametrize("rope_parameters", [None, {k: v for k, v in _M4_ROPE.items() if k != "llama_4_scaling_beta"}])
def test_mistral4_needs_the_llama4_keys_of_rope_parameters(rope_parameters):
    with pytest.raises(MlxbunError, match="rope_parameters lacks 'llama_4_scaling_beta'"):
        build_model({**tiny_config("mistral4"), "rope_parameters": rope_parameters})


def test_mistral4_sanitize_matches_mlx_lm():
    """An HF-layout checkpoint: fused experts.gate_up_proj / down_proj, fp8 weights with a
    per-tensor, a per-expert and a 128-block scale, a static activation scale, kv_b_proj (one layer
    quantized), an int4-packed projection and a rotary buffer."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.mistral4 import Model, ModelArgs

    from mlxbun.models.universal.resolve import descriptor_for
    from mlxbun.models.universal.sanitize import Meta, sanitize_weights

    cfg = tiny_config("mistral4")
    mx.random.seed(0)
    w = {k: mx.random.normal(v.shape) for k, v in tree_flatten(Model(ModelArgs.from_dict(cfg)).parameters())}
    kv_b_layout(w, cfg, layers=2, heads=4)
    moe = "model.layers.1.mlp"
    gate, up = w.pop(f"{moe}.switch_mlp.gate_proj.weight"), w.pop(f"{moe}.switch_mlp.up_proj.weight")
    w[f"{moe}.experts.gate_up_proj"] = mx.concatenate([gate, up], axis=1)
    w[f"{moe}.experts.down_proj"] = mx.to_fp8(w.pop(f"{moe}.switch_mlp.down_proj.weight"))
    w[f"{moe}.experts.down_proj_scale_inv"] = mx.array([0.5, 1.0, 2.0, 0.25]).reshape(4, 1, 1)
    for name, scale in (("model.layers.0.mlp.up_proj", mx.array(0.125)),
                        ("model.layers.0.mlp.down_proj", mx.array([[0.5]]))):
        w[f"{name}.weight"] = mx.to_fp8(w[f"{name}.weight"])
        w[f"{name}.weight_scale_inv"] = scale
        w[f"{name}.activation_scale"] = mx.array(1.0)
    o = "model.layers.1.self_attn.o_proj"  # [64, 64]: one 128 block, padded
    w[f"{o}.weight"] = mx.to_fp8(w[f"{o}.weight"])
    w[f"{o}.weight_scale_inv"] = mx.array([[0.75]])
    q_a = "model.layers.1.self_attn.q_a_proj."
    packed, scales, _ = mx.quantize(w.pop(q_a + "weight"), group_size=32, bits=4)
    w.update({q_a + "weight_packed": packed.view(mx.int32), q_a + "weight_scale": scales,
              q_a + "weight_shape": mx.array(packed.shape)})
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.zeros((4,))
    want = Model(ModelArgs.from_dict(cfg)).sanitize(dict(w))
    fields = build_model(cfg).args.fields
    d = descriptor_for("mistral4")
    got, dropped = sanitize_weights(d, w, False, fields)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]), k
    assert "model.layers.0.mlp.up_proj.activation_scale" in dropped
    meta, _ = sanitize_weights(d, {k: Meta(v.shape, v.dtype) for k, v in w.items()}, False, fields)
    assert {k: (v.shape, v.dtype) for k, v in meta.items()} == {k: (v.shape, v.dtype) for k, v in got.items()}


def test_mistral4_refuses_quantized_kv_for_its_latent_cache_like_the_absorbed_kind(zoo):
    """mlx-lm's mistral4 reads the rope key as an array (prefill and decode): a QuantizedKVCache
    fails there, so mlxbun refuses uniform KV quantization by name; TurboQuant runs."""
    from mlxbun.errors import GenerationError
    from mlxbun.generate import stream_generate
    from mlxbun.models.universal.loader import load_universal
    from mlxbun.tokenizer import load_tokenizer

    path = zoo("mistral4")
    model, tok = load_universal(path), load_tokenizer(path)
    with pytest.raises(GenerationError, match="MLA latent"):
        list(stream_generate(model, tok, "hello", max_tokens=2, kv_bits=8))
    assert len(list(stream_generate(model, tok, "hello", max_tokens=2, kv_bits=4, kv_scheme="turboquant"))) == 2


LONG = mx.array([[(7 * i * i + 3 * i) % 500 for i in range(14)]])  # past the zoo's index_topk (8)


@pytest.mark.parametrize("knobs", [
    {},  # the zoo's: index_topk 8, so the prefill masks and the decode steps gather
    {"indexer_rope_interleave": True, "index_topk": 12, "n_group": 1, "rope_scaling": None},
], ids=["zoo", "interleaved_topk12_plain_rope"])
def test_the_deepseek_v32_row_matches_mlx_lm_through_prefill_chunks_and_decode(knobs):
    ref, ours = oracle_and_universal({**tiny_config("deepseek_v32"), **knobs})
    rc, oc = mlx_cache.make_prompt_cache(ref), ours.make_cache()
    assert type(rc[0]).__name__ == type(oc[0]).__name__ == "CacheList"
    assert mx.array_equal(ref(LONG, cache=rc), ours(LONG, cache=oc))
    chunk = mx.array([[17, 3, 200]])
    assert mx.array_equal(ref(chunk, cache=rc), ours(chunk, cache=oc))
    for t in (11, 250, 3):
        step = mx.array([[t]])
        assert mx.array_equal(ref(step, cache=rc), ours(step, cache=oc)), t
    for i in (0, 1):  # the latent / rope key, and the indexer's keys
        r, o = rc[1][i], oc[1][i]
        assert mx.array_equal(r.keys[..., :r.offset, :], o.keys[..., :o.offset, :]), i


def test_deepseek_v32_attends_to_the_indexers_choice_past_index_topk():
    """The sparse path runs: past index_topk positions the logits differ from a top-k no prompt
    reaches (the dense attention), and below it they are the same."""
    cfg = tiny_config("deepseek_v32")
    _, sparse = oracle_and_universal(cfg)
    _, dense = oracle_and_universal({**cfg, "index_topk": 4096})
    assert mx.array_equal(sparse(LONG[:, :8]), dense(LONG[:, :8]))
    assert not mx.array_equal(sparse(LONG), dense(LONG))


def test_deepseek_v32_refuses_max_kv_size_and_quantized_kv(zoo):
    from mlxbun.errors import GenerationError
    from mlxbun.generate import stream_generate
    from mlxbun.models.universal.loader import load_universal
    from mlxbun.tokenizer import load_tokenizer

    path = zoo("deepseek_v32")
    model, tok = load_universal(path), load_tokenizer(path)
    with pytest.raises(MlxbunError, match="max_kv_size"):
        model.make_cache(max_kv_size=16)
    with pytest.raises(GenerationError, match="MLA latent"):
        list(stream_generate(model, tok, "hello", max_tokens=2, kv_bits=8))


def test_deepseek_v32_sanitize_matches_mlx_lm():
    """An HF-layout checkpoint: per-expert tensors, kv_b_proj, an fp8 block-scaled projection and
    two MTP layers past N."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.deepseek_v32 import Model, ModelArgs

    from mlxbun.models.universal.resolve import descriptor_for
    from mlxbun.models.universal.sanitize import sanitize_weights

    cfg = tiny_config("deepseek_v32")
    mx.random.seed(0)
    w = {k: mx.random.normal(v.shape) for k, v in tree_flatten(Model(ModelArgs.from_dict(cfg)).parameters())}
    kv_b_layout(w, cfg, layers=2, heads=4, quantize_first=False)
    for name in ("gate_proj", "up_proj", "down_proj"):
        stacked = w.pop(f"model.layers.1.mlp.switch_mlp.{name}.weight")
        w.update({f"model.layers.1.mlp.experts.{e}.{name}.weight": stacked[e] for e in range(4)})
    wq = "model.layers.0.self_attn.indexer.wq_b"
    w[f"{wq}.weight"] = mx.to_fp8(w[f"{wq}.weight"])
    w[f"{wq}.weight_scale_inv"] = mx.array([[0.5]])
    w["model.layers.2.self_attn.o_proj.weight"] = mx.zeros((2, 2))
    w["model.layers.3.eh_proj.weight"] = mx.zeros((2, 2))
    want = Model(ModelArgs.from_dict(cfg)).sanitize(dict(w))
    got, dropped = sanitize_weights(descriptor_for("deepseek_v32"), w, False, build_model(cfg).args.fields)
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]), k
    assert {"model.layers.2.self_attn.o_proj.weight", "model.layers.3.eh_proj.weight"} <= set(dropped)


@pytest.mark.parametrize("knobs", [{}, {"indexer_rope_interleave": False, "index_topk": 100}],
                         ids=["zoo", "not_interleaved_dense"])
def test_the_glm_moe_dsa_row_is_deepseek_v32s_graph_under_its_args(knobs):
    ref, ours = oracle_and_universal({**tiny_config("glm_moe_dsa"), **knobs})
    rc, oc = mlx_cache.make_prompt_cache(ref), ours.make_cache()
    assert mx.array_equal(ref(LONG, cache=rc), ours(LONG, cache=oc))
    for t in (11, 250):
        step = mx.array([[t]])
        assert mx.array_equal(ref(step, cache=rc), ours(step, cache=oc)), t


def test_glm_moe_dsa_needs_rope_theta_in_rope_parameters():
    with pytest.raises(MlxbunError, match="rope_parameters must be a dict holding 'rope_theta'"):
        build_model({**tiny_config("glm_moe_dsa"), "rope_parameters": {"rope_type": "default"}})
