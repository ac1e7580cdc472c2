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
from mlxbun.models.universal.kinds import MixerKind
from mlxbun.models.universal.loader import load_universal
from mlxbun.models.universal.mixers.short_conv import ShortConvKnobs
from mlxbun.models.universal.resolve import resolve_args
from mlxbun.models.universal.schema import DescriptorError
from mlxbun.models.universal.schema_hybrid import HybridKnobs
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo.archs import tiny_config

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


def test_generation_on_a_hybrid_equals_mlx_lm(lfm2):
    from mlx_lm.generate import generate_step

    from mlxbun.generate import generate_step as our_step

    prompt = mx.array([7, 3, 99, 12, 5])
    ref = [int(t) for t, _ in generate_step(prompt, _oracle(lfm2), max_tokens=12)]
    model = load_universal(lfm2)
    ours = [int(t) for t, _ in our_step(prompt, model, prompt_cache=model.make_cache(), max_tokens=12)]
    assert ours == ref and len(ours) == 12


def test_the_zoo_config_is_a_real_lfm2_config():
    cfg = tiny_config("lfm2")
    assert json.loads(json.dumps(cfg))["layer_types"] == ["conv", "full_attention", "conv"]
    assert cfg["block_dim"] == cfg["hidden_size"]
