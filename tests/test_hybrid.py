"""The hybrid foundation of the universal graph (recurrent mixers on some layers): torch-layout
conv weights, the layer rule's refusals, the caches each layer gets, the rows' checks.
The logits of every hybrid row against mlx-lm are tests/test_universal_dense.py's (manifest)."""

import dataclasses
import json
import shutil

import mlx.core as mx
import pytest

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache, RotatingKVCache
from mlxbun.errors import ConfigError
from mlxbun.models.universal.coverage import check_coverage
from mlxbun.models.universal.kinds_hybrid import (
    MixerKind,
)
from mlxbun.models.universal.loader import load_universal
from mlxbun.models.universal.mixers.short_conv import ShortConvKnobs
from mlxbun.models.universal.resolve import resolve_args
from mlxbun.models.universal.schema import DescriptorError, SanitizeRule
from mlxbun.models.universal.schema_hybrid import HybridKnobs
from mlxbun.models.universal.resolve import descriptor_for
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo.archs import hybrid_archs, tiny_config

LFM2 = DESCRIPTORS["lfm2"]


def _oracle(path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


@pytest.fixture(scope="module")
def lfm2(zoo):
    return zoo("lfm2")


def test_torch_layout_conv_weights_load_as_mlx_lm_loads_them(lfm2, tmp_path):
    """HF checkpoints store the depthwise conv as [C, 1, K]; both loaders move it to [C, K, 1]."""
    dst = tmp_path / "torch-layout"
    shutil.copytree(lfm2, dst)
    convs = 0
    for shard in sorted(dst.glob("*.safetensors")):
        weights = dict(mx.load(str(shard)))
        for k in [k for k in weights if k.endswith("conv.conv.weight")]:
            assert weights[k].shape == (64, 3, 1)
            weights[k] = weights[k].swapaxes(1, 2)
            convs += 1
        mx.save_safetensors(str(shard), weights, metadata={"format": "mlx"})
    assert convs == 2
    ids = mx.array([[5, 9, 2, 77, 31, 8]])
    ours, ref = load_universal(dst), _oracle(dst)
    assert mx.array_equal(ours(ids), ref(ids))
    assert mx.array_equal(ours(ids), load_universal(lfm2)(ids))


def test_every_layer_gets_the_cache_of_its_mixer(lfm2):
    model = load_universal(lfm2)
    assert [s.mixer for s in model.args.layers] == [MixerKind.SHORT_CONV, MixerKind.ATTENTION,
                                                    MixerKind.SHORT_CONV]
    assert [type(c) for c in model.make_cache()] == [ArraysCache, KVCache, ArraysCache]
    bounded = model.make_cache(max_kv_size=32)  # the state is constant-size; attention is bounded
    assert [type(c) for c in bounded] == [ArraysCache, RotatingKVCache, ArraysCache]
    assert bounded[1].max_size == 32


def test_the_conv_state_is_what_mlx_lm_keeps(lfm2):
    model, ref = load_universal(lfm2), _oracle(lfm2)
    ours, theirs = model.make_cache(), ref.make_cache()
    ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    model(ids, cache=ours), ref(ids, cache=theirs)
    assert ours[0][0].shape == (1, 2, 64)  # the last conv_L_cache - 1 inputs
    assert mx.array_equal(ours[0][0], theirs[0][0]) and mx.array_equal(ours[2][0], theirs[2][0])


@pytest.mark.parametrize("change,needle", [
    ({"full_attn_idxs": [7], "layer_types": None}, "'full_attn_idxs' = [7] names no layer"),
    ({"full_attn_idxs": [0, 1, 2], "layer_types": None}, "leaves no short_conv layer"),
    ({"full_attn_idxs": "1", "layer_types": None}, "'full_attn_idxs' must list"),
    ({"full_attn_idxs": None, "layer_types": None}, "needs 'full_attn_idxs' or a 'layer_types' list"),
    ({"block_ff_dim": None, "intermediate_size": None}, "either 'block_ff_dim' or 'intermediate_size'"),
    ({"block_multiple_of": 0}, "'block_multiple_of' must be a positive integer"),
])
def test_bad_hybrid_configs_refuse_naming_the_key(change, needle):
    cfg = {**tiny_config("lfm2"), **change}
    with pytest.raises(ConfigError) as e:
        resolve_args(LFM2, cfg)
    assert needle in str(e.value)


def test_layer_types_that_disagree_with_the_index_list_are_refused():
    cfg = {**tiny_config("lfm2"), "full_attn_idxs": [0]}  # layer_types says layer 1 attends
    report = check_coverage("lfm2", cfg)
    assert not report.ok and "full_attn_idxs" in report.offending["layer_types"]
    odd = {**tiny_config("lfm2"), "layer_types": ["conv", "full_attention", "mamba"]}
    assert "'mamba'" in check_coverage("lfm2", odd).offending["layer_types"]
    assert check_coverage("lfm2", tiny_config("lfm2")).ok


def test_hybrid_rows_are_checked_when_built():
    def row(**hybrid):
        return dataclasses.replace(LFM2, hybrid=dataclasses.replace(LFM2.hybrid, **hybrid))

    with pytest.raises(DescriptorError, match="'attention' is every other layer's"):
        row(mixer="attention")
    with pytest.raises(DescriptorError, match="is not one of"):
        row(layers="every_other")
    with pytest.raises(DescriptorError, match="must be a ShortConvKnobs"):
        row(knobs=HybridKnobs("short_conv", "interval"))
    with pytest.raises(DescriptorError, match="reads the field 'conv_kernel'"):
        row(knobs=ShortConvKnobs(kernel="conv_kernel"))
    with pytest.raises(DescriptorError, match="already the attention's"):
        row(name="self_attn")


@pytest.mark.parametrize("arch", hybrid_archs())
def test_generation_on_every_hybrid_equals_mlx_lm(zoo, arch):
    from mlx_lm.generate import generate_step

    from mlxbun.generate import generate_step as our_step

    path = zoo(arch)
    prompt = mx.array([7, 3, 99, 12, 5])
    ref = [int(t) for t, _ in generate_step(prompt, _oracle(path), max_tokens=10)]
    model = load_universal(path)
    ours = [int(t) for t, _ in our_step(prompt, model, prompt_cache=model.make_cache(), max_tokens=10)]
    assert ours == ref and len(ours) == 10


def test_the_zoo_config_is_a_real_lfm2_config():
    cfg = tiny_config("lfm2")
    assert json.loads(json.dumps(cfg))["layer_types"] == ["conv", "full_attention", "conv"]
    assert cfg["block_dim"] == cfg["hidden_size"]


@pytest.mark.parametrize("bias,norm", [(True, True), (False, True), (True, False)])
def test_lfm2_moe_router_is_mlx_lm_s(bias, norm):
    """The sigmoid_scaled router and block against mlx-lm's Lfm2MoeSparseMoeBlock, the branches the
    zoo row does not take included (no expert bias, no renorm)."""
    from mlx.utils import tree_flatten
    from mlx_lm.models import lfm2_moe

    from mlxbun.models.universal.moe import MoEBlock

    cfg = {**tiny_config("lfm2_moe"), "use_expert_bias": bias, "norm_topk_prob": norm}
    d = DESCRIPTORS["lfm2_moe"]
    ref = lfm2_moe.Lfm2MoeSparseMoeBlock(lfm2_moe.ModelArgs.from_dict(cfg))
    if bias:
        ref.expert_bias = mx.random.normal((cfg["num_experts"],), key=mx.random.key(3))
    ours = MoEBlock(resolve_args(d, cfg), d, 1)
    ours.load_weights(tree_flatten(ref.parameters()), strict=True)
    for dtype in (mx.float32, mx.bfloat16):
        x = mx.random.normal((2, 7, cfg["hidden_size"]), key=mx.random.key(5)).astype(dtype)
        assert mx.array_equal(ours(x), ref(x))


def test_hf_layout_lfm2_moe_checkpoints_load_as_mlx_lm_loads_them(zoo, tmp_path):
    """HF checkpoints: per-expert w1 / w2 / w3 tensors, torch-layout convs; the rename and stack
    rules bring them to the zoo's (mlx-lm's) layout, as mlx-lm's sanitize does."""
    src = zoo("lfm2_moe")
    dst = tmp_path / "hf-layout"
    shutil.copytree(src, dst)
    names = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    for shard in sorted(dst.glob("*.safetensors")):
        out = {}
        for k, v in mx.load(str(shard)).items():
            if k.endswith("conv.conv.weight"):
                out[k] = v.swapaxes(1, 2)
            elif ".switch_mlp." in k:
                head, proj = k.split(".switch_mlp.")[0], k.split(".")[-2]
                for e in range(v.shape[0]):
                    out[f"{head}.experts.{e}.{names[proj]}.weight"] = v[e]
            elif ".feed_forward." in k and k.split(".")[-2] in names:
                out[k.replace(k.split(".")[-2], names[k.split(".")[-2]])] = v
            else:
                out[k] = v
        mx.save_safetensors(str(shard), out, metadata={"format": "mlx"})
    index = dst / "model.safetensors.index.json"
    if index.is_file():  # the weight map names the new keys
        shard_of = {k: s.name for s in dst.glob("*.safetensors") for k in mx.load(str(s))}
        meta = json.loads(index.read_text())
        index.write_text(json.dumps({**meta, "weight_map": shard_of}))
    ids = mx.array([[5, 9, 2, 77, 31, 8, 100, 4]])
    ours = load_universal(dst)
    assert mx.array_equal(ours(ids), _oracle(dst)(ids))
    assert mx.array_equal(ours(ids), load_universal(src)(ids))


def test_layer_diff_reports_the_recurrent_states_step_by_step(lfm2):
    from mlxbun.parity.layer_diff import layer_diff

    prompt, decode = [4, 8, 15, 16, 23, 42], [7, 9]
    diff = layer_diff(load_universal(lfm2), _oracle(lfm2), prompt, decode)
    t = diff.state_table
    assert sorted(set(zip(t["step"], t["layer"]))) == [(s, layer) for s in range(3) for layer in (0, 2)]
    assert t["equal"].all() and (t["max_abs_diff"] == 0).all()
    assert (t["norm_a"] > 0).all() and (t["norm_a"] == t["norm_b"]).all()
    assert t["shape_a"].tolist() == [(1, 2, 64)] * 6
    assert diff.state_heatmap().shape == (2, 3)
    assert json.loads(diff.to_json())["recurrent_states"][0]["layer"] == 0


def test_a_state_that_differs_while_the_outputs_agree_is_localized(lfm2):
    """The conv's output never reads the state it writes in the same forward: a corrupted write
    shows in no output of the step, only in the state (and at the next step's outputs)."""
    from mlxbun.parity.layer_diff import layer_diff
    from mlxbun.parity.localize import first_divergence

    class Skewed(ArraysCache):
        def __setitem__(self, idx, value):
            super().__setitem__(idx, value * 1.001)

    candidate = load_universal(lfm2)
    candidate.make_cache = lambda: [Skewed(1) if isinstance(c, ArraysCache) else c
                                    for c in type(candidate).make_cache(candidate)]
    found = first_divergence(candidate, _oracle(lfm2), [4, 8, 15, 16], [7])
    assert (found.path, found.step, found.layer_index, found.substep) == ("cache[0].state[0]", 0, 0, "state")
    assert found.max_abs_diff > 0
    heat = layer_diff(candidate, _oracle(lfm2), [4, 8, 15, 16], [7]).state_heatmap()
    assert (heat > 0).all().all()


def test_the_zoo_knows_its_hybrids():
    from mlxbun.zoo.archs import has_recurrent_layers, hybrid_archs

    assert {"lfm2", "lfm2_moe"} <= set(hybrid_archs()) and "llama" not in hybrid_archs()
    assert has_recurrent_layers("lfm2_moe") and not has_recurrent_layers("qwen3_moe")
    assert all(descriptor_for(a).hybrid is not None for a in hybrid_archs())  # falcon_mamba: mamba's row


def test_a_conv_layout_rule_names_its_test_as_a_member():
    """A layout test spelled as a string would never match the enum in the loader: refused."""
    bad = SanitizeRule("conv1d_layout", ("conv.weight", "last_gt_middle"), "")
    with pytest.raises(DescriptorError, match="'conv1d_layout' takes"):
        dataclasses.replace(LFM2, sanitize=(bad,))
