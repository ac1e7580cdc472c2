"""mlxbun.cache.mixed: per-layer KV plans (optiq kv_config / args), their refusals, a mixed
2-layer plan giving the same logits as the same caches built by hand (and as mlx-lm's own
caches) in a tiny mlx-lm llama, and generation under a plan token for token and logprob for
logprob as mlx-optiq 0.7.7's own mixed-KV hook (`optiq.serve.install_mixed_kv`) drives mlx-lm."""

import mlx.core as mx
import pytest
from mlx_lm.models import cache as o_cache
from mlx_lm.models import llama as o_llama

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.cache.mixed import KVPlan, KVPlanError
from mlxbun.cache.quantized import QuantizedKVCache
from mlxbun.config import KVLayerSpec, config_from_dict
from mlxbun.errors import ConfigError, MlxbunError

LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
             vocab_size=256, tie_word_embeddings=False)
MIXED = [{"layer_idx": 0, "bits": 4, "group_size": 32}, {"layer_idx": 1, "bits": 0}]


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


@pytest.fixture(scope="session")
def llama():
    mx.random.seed(3)
    model = o_llama.Model(o_llama.ModelArgs(**LLAMA))
    mx.eval(model.parameters())
    return model


def ids(n, seed):
    return mx.random.randint(0, 256, (1, n), key=mx.random.key(seed))


CHUNKS = [7] + [1] * 5 + [3, 1, 1]


def test_from_parsed_kv_config():
    cfg = config_from_dict(LLAMA, kv_config=MIXED)
    plan = KVPlan.from_kv_config(cfg.kv_config, cfg.num_hidden_layers)
    assert plan.layers == {0: (4, 32)} and plan.spec(0) == (4, 32) and plan.spec(1) is None
    assert "0:q4/g32" in plan.describe()
    # raw optiq entries work as well, group_size defaulting to 64
    raw = KVPlan.from_kv_config([{"layer_idx": 1, "bits": 8}], 2)
    assert raw.layers == {1: (8, 64)}


def test_from_args():
    assert KVPlan.from_args(bits=8, num_layers=3).layers == {0: (8, 64), 1: (8, 64), 2: (8, 64)}
    assert KVPlan.from_args(bits=4, group_size=32, layers=[2], num_layers=3).layers == {2: (4, 32)}


@pytest.mark.parametrize("entries,match", [
    ([{"layer_idx": 5, "bits": 4}], r"entry 0 \(layer_idx=5.*does not exist .*2 cache layers"),
    ([{"layer_idx": 0, "bits": 7}], r"entry 0 \(layer_idx=0, bits=7.*bits=7 is not supported"),
    ([{"layer_idx": 1, "bits": 4, "group_size": 16}], r"entry 0 \(layer_idx=1.*group_size=16 is not supported"),
    ([{"layer_idx": 0, "bits": 4}, {"layer_idx": 1, "bits": 4.5}], r"entry 1 .*bits=4.5 is not supported"),
    ([{"layer_idx": 0, "bits": 4}, {"layer_idx": 0, "bits": 8}], r"entry 1 .*layer 0 appears twice"),
    ([{"layer_idx": -1, "bits": 4}], r"layer index -1 does not exist"),
    ([{"bits": 4}], r"entry 0: needs keys 'layer_idx' and 'bits'"),
])
def test_kv_config_refusals(entries, match):
    with pytest.raises(KVPlanError, match=match) as e:
        KVPlan.from_kv_config(entries, 2)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, MlxbunError)


def test_kv_config_refusal_on_parsed_specs():
    with pytest.raises(KVPlanError, match=r"entry 0 \(layer_idx=3"):
        KVPlan.from_kv_config([KVLayerSpec(layer_idx=3, bits=4, group_size=64)], 2)
    with pytest.raises(KVPlanError, match="layer 4"):
        KVPlan.from_args(bits=4, layers=[4], num_layers=2)
    with pytest.raises(KVPlanError, match="bits=1 is not supported"):
        KVPlan.from_args(bits=1, num_layers=2)


def test_make_caches_refusals():
    plan = KVPlan.from_kv_config(MIXED, 2)
    with pytest.raises(KVPlanError, match="layer 0: is a sliding-window layer .*RotatingKVCache"):
        plan.make_caches([RotatingKVCache(16), KVCache()])
    with pytest.raises(KVPlanError, match="layer 0: holds a ArraysCache"):
        plan.make_caches([ArraysCache(1), KVCache()])
    with pytest.raises(KVPlanError, match="plan is for 2 cache layers, got 3"):
        plan.make_caches([KVCache() for _ in range(3)])
    with pytest.raises(KVPlanError, match="already quantized with bits=8"):
        plan.make_caches([QuantizedKVCache(64, 8), KVCache()])
    # a layer without an entry may be anything (here: a sliding-window layer at full precision)
    out = plan.make_caches([KVCache(), RotatingKVCache(16)])
    assert isinstance(out[0], QuantizedKVCache) and isinstance(out[1], RotatingKVCache)
    with pytest.raises(KVPlanError, match="head dim 48 is not a multiple"):
        c = KVCache()
        c.update_and_fetch(mx.zeros((1, 1, 2, 48)), mx.zeros((1, 1, 2, 48)))
        plan.make_caches([c, KVCache()])


def test_mixed_plan_equals_hand_built_mlxbun_caches_and_mlx_lm_caches(llama):
    """mlxbun's plan vs the same mlxbun caches built by hand, and vs mlx-lm's own cache classes
    (all inside mlx-lm's llama); optiq's own plan code is the oracle of the next test."""
    cfg = config_from_dict(LLAMA, kv_config=MIXED)
    plan = KVPlan.from_kv_config(cfg.kv_config, cfg.num_hidden_layers)
    base = [KVCache(), KVCache()]
    planned = plan.make_caches(base)
    assert [type(c) for c in planned] == [QuantizedKVCache, KVCache]
    assert (planned[0].bits, planned[0].group_size) == (4, 32) and planned[1] is base[1]
    by_hand = [QuantizedKVCache(group_size=32, bits=4), KVCache()]
    oracle = [o_cache.QuantizedKVCache(group_size=32, bits=4), o_cache.KVCache()]
    full = [KVCache(), KVCache()]
    differs = False
    for i, n in enumerate(CHUNKS):
        a = llama(ids(n, i), cache=planned)
        assert same(a, llama(ids(n, i), cache=by_hand)), i
        assert same(a, llama(ids(n, i), cache=oracle)), i
        differs |= not same(a, llama(ids(n, i), cache=full))
    assert differs  # the 4-bit layer really is quantized


@pytest.mark.parametrize("start", [0, 8])
def test_maybe_quantize_matches_per_layer_to_quantized(llama, start):
    """optiq's per-layer hook: convert listed, non-empty layers once offset >= start;
    the oracle is mlx-lm's KVCache.to_quantized applied to the same layer."""
    plan = KVPlan.from_args(bits=8, group_size=64, layers=[1], num_layers=2)
    mine, ref = [KVCache(), KVCache()], [o_cache.KVCache(), o_cache.KVCache()]
    plan.maybe_quantize(mine, start)
    assert all(type(c) is KVCache for c in mine)  # empty caches are not converted
    for i, n in enumerate(CHUNKS):
        assert same(llama(ids(n, i), cache=mine), llama(ids(n, i), cache=ref)), i
        plan.maybe_quantize(mine, start)
        if ref[1].offset >= start and type(ref[1]) is o_cache.KVCache:
            ref[1] = ref[1].to_quantized(group_size=64, bits=8)
        assert [type(c).__name__ for c in mine] == [type(c).__name__ for c in ref]
    assert isinstance(mine[1], QuantizedKVCache) and isinstance(mine[0], KVCache)
    with pytest.raises(KVPlanError, match="layer 1: is a sliding-window"):
        plan.maybe_quantize([KVCache(), RotatingKVCache(8)], start)


# -- against optiq's own code --------------------------------------------------------------

_OPTIQ_RUN = """
import json, sys
import mlx.core as mx
import mlx_lm.generate
from mlx_lm import load
from optiq.serve import _LayerQuantConfig, install_mixed_kv  # patches mlx-lm: this process only

path, plan, start, n, prompt = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
install_mixed_kv([_LayerQuantConfig(e["layer_idx"], e["bits"], e["group_size"]) for e in plan], start)
model, tok = load(path)
out = []
# kv_bits only has to be non-None for mlx-lm to call the (patched) hook; optiq's map decides
for r in sys.modules["mlx_lm.generate"].stream_generate(model, tok, prompt, max_tokens=n, kv_bits=8,
                                                     quantized_kv_start=start):
    out.append([r.token, r.logprobs.astype(mx.float32).tolist()])
print(json.dumps(out))
"""


@pytest.mark.parametrize("start", [0, 12])
def test_generation_under_a_plan_equals_optiq_install_mixed_kv(zoo_root, tmp_path, start):
    """mlxbun's `stream_generate(kv_config=...)` vs mlx-lm driven by optiq's per-layer hook, in a
    subprocess (importing optiq patches mlx-lm): same tokens, bit-identical logprobs."""
    import json
    import subprocess
    import sys

    from mlxbun.factory import open_model
    from mlxbun.generate import stream_generate
    from mlxbun.locate import locate
    from mlxbun.tokenizer import load_tokenizer

    path = locate("zoo:llama,head_dim=32", zoo_root=zoo_root)
    plan = [{"layer_idx": 0, "bits": 4, "group_size": 32}]
    (tmp_path / "kv_config.json").write_text(json.dumps(plan))
    prompt, n = "The quick brown fox jumps over the lazy dog. Once upon a time", 10
    proc = subprocess.run([sys.executable, "-c", _OPTIQ_RUN, str(path), json.dumps(plan), str(start), str(n), prompt],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    model, tok = open_model(path), load_tokenizer(path)

    def run(**kv):
        return [(r.token, r.logprobs.astype(mx.float32).tolist())
                for r in stream_generate(model, tok, prompt, max_tokens=n, quantized_kv_start=start, **kv)]

    ours = run(kv_config=tmp_path / "kv_config.json")
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert [lp for _, lp in ours] == [lp for _, lp in theirs]  # float32 values, compared exactly
    assert [lp for _, lp in run()] != [lp for _, lp in ours]  # layer 0 really is 4-bit
