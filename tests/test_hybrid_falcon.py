"""falcon_h1 beyond the manifest's gate: HF-layout checkpoints (torch conv1d, the muP multipliers
not yet folded) load as mlx-lm loads them, each multiplier changes the logits the same way in
both engines (key_multiplier in neither, as mlx-lm's sanitize never applies it), configs the zoo
does not exercise, the refusals naming the key, the CacheList per layer and the prompt cache."""

import dataclasses
import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.cache_list import CacheList
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import ConfigError
from mlxbun.models.universal.loader import build_model, load_universal
from mlxbun.models.universal.schema import DescriptorError
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo.archs import tiny_config
from tests.hybrid_models import oracle_and_universal as _pair

IDS = mx.array([[5, 9, 2, 77, 31, 8, 400, 12, 3]])
# Falcon-H1's own multipliers (mlx-lm's defaults): none a power of two, so a fold done in
# another order or dtype rounds differently
MULTIPLIERS = {"embedding_multiplier": 5.656854249492381, "lm_head_multiplier": 0.0390625,
               "attention_in_multiplier": 1.0, "attention_out_multiplier": 0.9375,
               "key_multiplier": 0.390625, "ssm_in_multiplier": 1.25,
               "ssm_out_multiplier": 0.23570226039551587,
               "mlp_multipliers": [0.8838834764831844, 0.5859375],
               "ssm_multipliers": [0.3535533905932738, 0.25, 0.3535533905932738, 0.5, 0.3535533905932738]}


def _hf_layout(src, dst, tied: bool):
    """The zoo checkpoint as HF ships falcon_h1: conv1d in torch's [C, 1, K], Falcon-H1's
    multipliers in the config (folded by the loaders), an lm_head when untied."""
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = {name: dict(mx.load(str(dst / name))) for name in set(index["weight_map"].values())}
    mx.eval(shards)  # read before the files are rewritten
    for shard in shards.values():
        for k in [k for k in shard if k.endswith("conv1d.weight")]:
            shard[k] = shard[k].swapaxes(1, 2)
    if not tied:
        first = sorted(shards)[0]
        embed = shards[index["weight_map"]["model.embed_tokens.weight"]]["model.embed_tokens.weight"]
        shards[first]["lm_head.weight"] = 0.5 * embed[::-1]
        index["weight_map"]["lm_head.weight"] = first
    for name, w in shards.items():
        mx.save_safetensors(str(dst / name), w, metadata={"format": "mlx"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    _write_config(dst, {**MULTIPLIERS, "tie_word_embeddings": tied})
    return dst


def _write_config(path, changes: dict):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def _variant(base, dst, changes: dict):
    """`base` with a changed config.json (the weights linked, not copied)."""
    dst.mkdir()
    for p in base.iterdir():
        if p.name != "config.json":
            (dst / p.name).symlink_to(p)
    shutil.copy(base / "config.json", dst / "config.json")
    _write_config(dst, changes)
    return dst


def _both(path):
    from mlx_lm.utils import load_model

    ours = load_universal(path)(IDS)
    ref = load_model(path)[0](IDS)
    return ours, ref


@pytest.fixture(scope="module", params=[("float32", True), ("bfloat16", True), ("float32", False)],
                ids=["f32-tied", "bf16-tied", "f32-untied"])
def hf(request, zoo, tmp_path_factory):
    dtype, tied = request.param
    return _hf_layout(zoo("falcon_h1", dtype=dtype), tmp_path_factory.mktemp("hf") / "ckpt", tied)


def test_hf_layout_loads_as_mlx_lm_loads_it(hf, zoo):
    ours, ref = _both(hf)
    assert mx.array_equal(ours, ref)
    # the multipliers were folded: the same tensors read as already folded give other logits
    folded = load_universal(zoo("falcon_h1"))(IDS)
    assert not mx.array_equal(ours.astype(mx.float32), folded)


def test_headers_only_audit_of_an_hf_layout_checkpoint(hf):
    from mlxbun.models.universal.loader import audit_checkpoint

    assert audit_checkpoint(hf).ok


@pytest.mark.parametrize("key, value", [
    ("embedding_multiplier", 2.3), ("lm_head_multiplier", 0.07), ("attention_in_multiplier", 1.7),
    ("attention_out_multiplier", 0.6), ("ssm_out_multiplier", 1.9),
    # bfloat16: mlx-lm casts the muP vector before the product; the other order rounds
    # differently at this value
    ("ssm_in_multiplier", 0.113),
    *((("mlp_multipliers", i), 1.6) for i in range(2)),
    *((("ssm_multipliers", i), 1.8) for i in range(5)),
    ("key_multiplier", 3.0),  # mlx-lm folds it into key_proj.weight only, which falcon_h1 lacks
])
def test_each_multiplier_changes_the_logits_as_in_mlx_lm(hf, tmp_path, key, value):
    if isinstance(key, tuple):
        key, i = key
        value = [value if j == i else m for j, m in enumerate(MULTIPLIERS[key])]
    base, _ = _both(hf)
    ours, ref = _both(_variant(hf, tmp_path / "v", {key: value}))
    assert mx.array_equal(ours, ref)
    assert mx.array_equal(ours, base) == (key == "key_multiplier")


@pytest.mark.parametrize("change", [
    {"mamba_rms_norm": False},  # y = swiglu(gate, y), no norm module
    {"mamba_norm_before_gate": True},
    {"tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True, "mamba_proj_bias": True,
     "projectors_bias": True, "mamba_conv_bias": False},
    {"rope_traditional": True, "rope_theta": 500.0, "rms_norm_eps": 1e-3, "mamba_n_groups": 1,
     "mamba_d_conv": 3, "time_step_limit": [0.01, 2.0]},  # the limit: mlx-lm's mixer fixes (0, inf)
])
def test_configs_the_zoo_does_not_exercise(change):
    ref, ours = _pair({**tiny_config("falcon_h1"), **change})
    for batch in (1, 2):
        ids = mx.random.randint(1, 512, (batch, 9), key=mx.random.key(5))
        rc, oc = ref.make_cache(), ours.make_cache()
        for step in range(4):
            want, got = ref(ids, cache=rc), ours(ids, cache=oc)
            assert mx.array_equal(want, got), f"step {step}: max |diff| {mx.abs(want - got).max()}"
            ids = mx.argmax(want[:, -1:], axis=-1)
    assert mx.array_equal(ref(IDS), ours(IDS))  # no cache: both masks None


def test_each_layer_holds_a_cache_list_of_the_mixer_and_attention_caches(zoo):
    model = load_universal(zoo("falcon_h1"))
    caches = model.make_cache()
    assert len(caches) == model.args.n_layers == 2
    assert all(type(c) is CacheList and [type(x) for x in c.caches] == [ArraysCache, KVCache] for c in caches)
    model(IDS, cache=caches)
    conv, state = caches[1][0].cache
    assert conv.shape == (1, 3, 128 + 2 * 2 * 16) and state.shape == (1, 8, 16, 16)
    assert caches[1][1].offset == IDS.shape[1] == caches[1].tokens_seen
    bounded = model.make_cache(max_kv_size=16)  # max_kv_size bounds the attention child only
    assert [type(x) for x in bounded[0].caches] == [ArraysCache, RotatingKVCache]


def test_prompt_cache_round_trips_the_cache_lists(zoo, tmp_path):
    from mlxbun.cache.prompt_cache import PromptCacheError, cached_tokens, reuse_prefix, save_prompt_cache
    from mlxbun.generation_caches import load_prompt_cache_for, model_identity_of

    model = load_universal(zoo("falcon_h1"))
    a, b = [5, 9, 2, 77, 31, 8, 400], [100, 200, 3]
    mem = model.make_cache()
    model(mx.array([a]), cache=mem)
    path = tmp_path / "p.safetensors"
    save_prompt_cache(path, mem, model_identity=model_identity_of(model), tokens=a)
    loaded, meta = load_prompt_cache_for(model, path)
    for x, y in zip(loaded, mem, strict=True):
        assert type(x) is CacheList and [type(c) for c in x.caches] == [type(c) for c in y.caches]
        for cx, cy in zip(x.caches, y.caches):
            px, py = tree_flatten(cx.state), tree_flatten(cy.state)
            assert [k for k, _ in px] == [k for k, _ in py] and any(p is not None for _, p in px)
            assert all(p is q is None or mx.array_equal(p, q) for (_, p), (_, q) in zip(px, py))
    assert reuse_prefix(loaded, cached_tokens(meta), a + b) == len(a)
    ids = mx.array([b])
    assert mx.array_equal(model(ids, cache=loaded), model(ids, cache=mem))
    with pytest.raises(PromptCacheError, match=r"CacheList\) cannot drop"):
        reuse_prefix(load_prompt_cache_for(model, path)[0], a, a[:4] + b)


@pytest.mark.parametrize("change, msg", [
    ({"embedding_multiplier": 0}, "'embedding_multiplier' is 0"),
    ({"lm_head_multiplier": "0.04"}, "'lm_head_multiplier' must be a number"),
    ({"mamba_d_ssm": 96}, "'mamba_d_ssm' \\(96\\) is not 'mamba_n_heads' \\* 'mamba_d_head'"),
    ({"mamba_rms_norm": "yes"}, "'mamba_rms_norm' must be true or false"),
    ({"mamba_n_groups": 3}, "'mamba_n_heads' \\(8\\) is not a multiple of 'mamba_n_groups'"),
])
def test_bad_config_values_refused_naming_the_key(change, msg):
    with pytest.raises(ConfigError, match=f"falcon_h1.*{msg}"):
        build_model({**tiny_config("falcon_h1"), **change})


@pytest.mark.parametrize("change, msg", [
    ({"ssm_multipliers": [1.0, 1.0]}, "'ssm_multipliers' must list at least 5 numbers"),
    ({"mlp_multipliers": [1.0, True]}, "'mlp_multipliers\\[1\\]' must be a number"),
    ({"ssm_out_multiplier": None}, "'ssm_out_multiplier' must be a number"),
])
def test_bad_multipliers_refused_when_folded(hf, tmp_path, change, msg):
    with pytest.raises(ConfigError, match=f"falcon_h1.*{msg}"):
        load_universal(_variant(hf, tmp_path / "v", change))


@pytest.mark.parametrize("change, msg", [
    (dict(layers="index_list", field="full_attn_idxs"), "block 'parallel' runs the mixer and attention"),
    (dict(block="sideways"), "sideways"),
])
def test_parallel_rows_refused_when_built(change, msg):
    d = DESCRIPTORS["falcon_h1"]
    with pytest.raises(DescriptorError, match=msg):
        dataclasses.replace(d, hybrid=dataclasses.replace(d.hybrid, **change))


@pytest.mark.parametrize("rollback", ["mixers", "model"])
def test_speculative_greedy_equals_plain_over_the_cache_lists(zoo, rollback):
    """Each layer's CacheList rolls its ArraysCache and KVCache back together: greedy speculative
    output is plain decoding's, token for token, for each drafter kind (a falcon_h1 draft too)."""
    import mlxbun
    from mlxbun.generate import stream_generate
    from mlxbun.speculative import DraftModelDrafter, LayerSkipDrafter, NGramDrafter, speculative_generate
    from tests.hybrid_models import IdTokenizer

    target, draft = mlxbun.open_model(zoo("falcon_h1")), mlxbun.open_model(zoo("falcon_h1", seed=1))
    prompt, tok = [(7 * i * i + 3 * i) % 256 for i in range(12)] * 2, IdTokenizer()
    plain = [r.token for r in stream_generate(target, tok, prompt, max_tokens=12)]
    for make in (NGramDrafter, lambda: LayerSkipDrafter(1), lambda: DraftModelDrafter(draft)):
        for k in (2, 5):
            spec = list(speculative_generate(target, tok, prompt, drafter=make(), num_draft=k,
                                             max_tokens=12, rollback=rollback))
            assert [r.token for r in spec] == plain, (type(make()).__name__, k)
    assert spec[-1].stats.replays > 0  # the seed-1 draft is rejected somewhere: a replay ran


def test_a_hub_style_config_is_covered():
    """The keys Falcon-H1 checkpoints carry (transformers 4.5x era: rope_theta, the time_step_*
    initialization settings, mamba_use_mlp, mlp_expansion_factor) are understood or ignored as
    mlx-lm ignores them."""
    from mlxbun.models.universal.coverage import check_coverage

    hub = {**DESCRIPTORS["falcon_h1"].fields, "tie_word_embeddings": False,
           "architectures": ["FalconH1ForCausalLM"], "hidden_act": "silu", "initializer_range": 0.02,
           "mamba_chunk_size": 128, "mamba_expand": 2, "mamba_use_mlp": True, "mlp_expansion_factor": 8,
           "num_logits_to_keep": 1, "time_step_min": 0.001, "time_step_max": 0.1,
           "time_step_floor": 0.0001, "torch_dtype": "bfloat16", "use_cache": True}
    report = check_coverage("falcon_h1", hub)
    assert report.ok and not report.unknown, report.describe()
    assert set(report.ignored) == {"hidden_act", "num_logits_to_keep", "time_step_min", "time_step_max",
                                   "time_step_floor"}
    assert {"mamba_chunk_size", "mamba_expand", "mamba_use_mlp", "mlp_expansion_factor"} <= set(report.understood)
    assert not check_coverage("falcon_h1", {**hub, "attn_layer_indices": [1, 3]}).ok  # unknown: refused


def test_state_diffing_reads_the_mixer_state_inside_each_cache_list(zoo):
    """The layer diff's recurrent-state records reach the ArraysCache inside each CacheList."""
    from mlx_lm.utils import load_model

    from mlxbun.parity.states import state_records

    path = zoo("falcon_h1")
    ours, ref = load_universal(path), load_model(path)[0]
    oc, rc = ours.make_cache(), ref.make_cache()
    ours(IDS, cache=oc), ref(IDS, cache=rc)
    records = state_records(oc, rc, step=0)
    assert [(r["layer"], r["slot"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["equal"] for r in records)
    oc[1][0][1] = oc[1][0][1] * 1.5  # a drifted SSM state shows in its slot only
    assert [r["equal"] for r in state_records(oc, rc, step=0)] == [True, True, True, False]


@pytest.mark.parametrize("arrays", ["mlx-lm", "mlxbun"])
def test_left_padded_batch_through_batched_cache_lists(zoo, arrays):
    """Two prompts, the first left-padded by 3, in CacheList(ArraysCache(left_padding),
    BatchKVCache) per layer (mlx-lm's batch generation): prefill and three decode steps give
    mlx-lm's logits bit for bit (the ssm mask and the attention mask from layer 0's children)."""
    from mlx_lm.models import cache as o_cache
    from mlx_lm.utils import load_model

    path = zoo("falcon_h1")
    ours, ref = load_universal(path), load_model(path)[0]
    pad, cls = [3, 0], o_cache.ArraysCache if arrays == "mlx-lm" else ArraysCache

    def caches(arrays_cls):
        return [o_cache.CacheList(arrays_cls(2, left_padding=pad), o_cache.BatchKVCache(pad)) for _ in range(2)]

    rc, oc = caches(o_cache.ArraysCache), caches(cls)
    ids = mx.array([[0, 0, 0, 5, 9, 2, 77], [4, 8, 15, 16, 23, 42, 7]])
    for step in range(4):
        want, got = ref(ids, cache=rc), ours(ids, cache=oc)
        assert mx.array_equal(want, got), step
        ids = mx.argmax(want[:, -1:], axis=-1)
