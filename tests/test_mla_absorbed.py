"""The absorbed MLA (mla.py's MlaAbsorbedAttention, the deepseek_v3 row) against mlx-lm's
deepseek_v3 on the same weights: the attention alone through prefill and decode (both q branches,
with and without yarn scaling), the whole row, and the load-time splits (kv_b_proj dense and
quantized, int4-packed weights) against mlx-lm's Model.sanitize, tensor for tensor."""

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import cache as mlx_cache
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.deepseek_v3 import DeepseekV3Attention, Model, ModelArgs

from mlxbun.cache.kv import KVCache
from mlxbun.models.base import create_attention_mask as our_mask
from mlxbun.models.universal.loader import build_model
from mlxbun.models.universal.mla import MlaAbsorbedAttention
from mlxbun.models.universal.resolve import descriptor_for
from mlxbun.models.universal.sanitize import sanitize_weights
from mlxbun.zoo import tiny_config
from tests.hybrid_models import oracle_and_universal
from tests.mla_helpers import kv_b_layout, prefill_and_decode

_YARN = {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 32,
         "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _fields(q_lora_rank, rope_scaling):
    return dict(model_type="deepseek_v3", hidden_size=64, num_attention_heads=4, q_lora_rank=q_lora_rank,
                kv_lora_rank=32, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
                rope_theta=10000.0, rope_scaling=rope_scaling, attention_bias=False,
                max_position_embeddings=128)


@pytest.fixture(scope="module", params=[(24, _YARN), (None, None)], ids=["q_lora_yarn", "q_proj_plain"])
def pair(request):
    f = _fields(*request.param)
    ref = DeepseekV3Attention(ModelArgs(**f))
    mx.random.seed(3)
    ref.update(tree_unflatten([(k, mx.random.normal(v.shape) * 0.2) for k, v in tree_flatten(ref.parameters())]))
    d = descriptor_for("deepseek_v3")
    ours = MlaAbsorbedAttention(f, d.mla, "deepseek_v3", 64, 4, False)
    ours.load_weights(tree_flatten(ref.parameters()), strict=True)
    return ref, ours


def test_prefill_and_decode_match_mlx_lm(pair):
    ref, ours = pair
    mx.random.seed(5)
    x = mx.random.normal((1, 7, 64))
    rc, oc = mlx_cache.KVCache(), KVCache()
    r = ref(x, create_attention_mask(x, rc, return_array=True), rc)
    o = ours(x, our_mask(x, oc, return_array=True), oc)
    assert mx.array_equal(r, o)
    for step in range(3):
        t = mx.random.normal((1, 1, 64))
        assert mx.array_equal(ref(t, create_attention_mask(t, rc, return_array=True), rc),
                              ours(t, our_mask(t, oc, return_array=True), oc)), step
    # the cache holds the latent (one head, kv wide) and the rope key, as mlx-lm's
    assert oc.keys[..., :oc.offset, :].shape == (1, 1, 10, 32)
    assert oc.values[..., :oc.offset, :].shape == (1, 1, 10, 8)
    assert mx.array_equal(rc.keys[..., :rc.offset, :], oc.keys[..., :oc.offset, :])
    assert mx.array_equal(rc.values[..., :rc.offset, :], oc.values[..., :oc.offset, :])


@pytest.mark.parametrize("knobs", [
    {},  # the zoo's: low-rank q, grouped routing, yarn
    {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "rope_scaling": None, "norm_topk_prob": False},
], ids=["zoo", "q_proj_ungrouped_plain_rope"])
def test_the_deepseek_v3_row_matches_mlx_lm_through_prefill_and_decode(knobs):
    prefill_and_decode({**tiny_config("deepseek_v3"), **knobs})


@pytest.fixture(scope="module")
def hf_weights():
    """deepseek_v3 weights as a transformers checkpoint holds them: kv_b_proj per layer (layer 0's
    4-bit quantized), layer 1's q_a_proj int4-packed, a layer-61 and a rotary buffer to drop.
    Head dims 32: mlx-lm requantizes the split halves with kv_b_proj's group size."""
    cfg = {**tiny_config("deepseek_v3"), "qk_nope_head_dim": 32, "v_head_dim": 32}
    mx.random.seed(7)
    w = {k: mx.random.normal(v.shape) for k, v in tree_flatten(Model(ModelArgs.from_dict(cfg)).parameters())}
    kv_b_layout(w, cfg, layers=cfg["num_hidden_layers"], heads=cfg["num_attention_heads"])
    q_a = "model.layers.1.self_attn.q_a_proj."
    packed, scales, _ = mx.quantize(w.pop(q_a + "weight"), group_size=32, bits=4)
    w.update({q_a + "weight_packed": packed.view(mx.int32), q_a + "weight_scale": scales,
              q_a + "weight_shape": mx.array(packed.shape)})
    w["model.layers.61.self_attn.o_proj.weight"] = mx.zeros((2, 2))
    w["model.layers.0.self_attn.rotary_emb.inv_freq"] = mx.zeros((4,))
    return cfg, w


def test_load_time_splits_match_mlx_lm_sanitize(hf_weights):
    cfg, w = hf_weights
    want = Model(ModelArgs.from_dict(cfg)).sanitize(dict(w))
    ours = build_model(cfg)
    got, dropped = sanitize_weights(descriptor_for("deepseek_v3"), w, False, ours.args.fields)
    assert sorted(got) == sorted(want)
    assert "model.layers.0.self_attn.embed_q.scales" in got  # the quantized split requantized
    for k in want:
        assert got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]), k
    assert "model.layers.61.self_attn.o_proj.weight" in dropped


def test_header_only_splits_give_the_tensors_shapes_and_dtypes(hf_weights):
    from mlxbun.models.universal.sanitize import Meta

    cfg, w = hf_weights
    fields = build_model(cfg).args.fields
    d = descriptor_for("deepseek_v3")
    real, _ = sanitize_weights(d, w, False, fields)
    meta, _ = sanitize_weights(d, {k: Meta(v.shape, v.dtype) for k, v in w.items()}, False, fields)
    assert sorted(meta) == sorted(real)
    for k, v in real.items():
        assert (meta[k].shape, meta[k].dtype) == (v.shape, v.dtype), k


@pytest.mark.parametrize("key,value", [("rope_scaling", [4.0]), ("rope_scaling", {"mscale_all_dim": 1.0}),
                                       ("kv_lora_rank", None), ("qk_nope_head_dim", 2.5)])
def test_bad_values_name_the_key(key, value):
    from mlxbun.errors import MlxbunError

    with pytest.raises(MlxbunError, match=repr(key)):
        MlaAbsorbedAttention({**_fields(24, _YARN), key: value}, descriptor_for("deepseek_v3").mla,
                             "deepseek_v3", 64, 4, False)


def test_quantized_kv_refuses_the_latent_cache_like_mlx_lm(zoo):
    """mlx-lm's deepseek_v3 fails on a QuantizedKVCache (its rope key comes back as a packed tuple);
    mlxbun refuses uniform and per-layer-plan KV quantization before the prefill. TurboQuant runs."""
    from mlx_lm.models.cache import QuantizedKVCache as MlxLmQuantized

    from mlxbun.errors import GenerationError
    from mlxbun.generate import stream_generate
    from mlxbun.models.universal.loader import load_universal
    from mlxbun.tokenizer import load_tokenizer

    cfg = {**tiny_config("deepseek_v3"), "qk_rope_head_dim": 64}  # quantizable widths
    ref, _ = oracle_and_universal(cfg)
    with pytest.raises(AttributeError):
        ref(mx.array([[1, 2, 3]]), cache=[MlxLmQuantized(group_size=64, bits=8) for _ in ref.layers])
    path = zoo("deepseek_v3")
    model, tok = load_universal(path), load_tokenizer(path)
    for kv in (dict(kv_bits=8, quantized_kv_start=1000),
               dict(kv_config=[{"layer_idx": 1, "bits": 4, "group_size": 32}])):
        with pytest.raises(GenerationError, match="MLA latent"):
            list(stream_generate(model, tok, "hello", max_tokens=2, **kv))
    assert len(list(stream_generate(model, tok, "hello", max_tokens=2, kv_bits=4, kv_scheme="turboquant"))) == 2
