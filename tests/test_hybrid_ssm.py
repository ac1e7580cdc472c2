"""The Mamba2 hybrid rows (mamba2, nemotron_h, granitemoehybrid) beyond the manifest's gate:
configs the zoo's tiny ones do not exercise, against mlx-lm built from the same config with the same weights
(a literal block-norm eps, a tied head, biases, the hub's pattern string, legacy block-type
spellings, a null time_step_limit), mlx-lm's cache list without the MLP / MoE layers, HF-layout
checkpoints (torch conv1d, per-expert tensors, MTP heads, shared_mlp), and the refusals
(latent MoE, bad patterns, granite MoE configs, rows)."""

import dataclasses
import json
import shutil

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_unflatten

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache
from mlxbun.errors import ConfigError
from mlxbun.models.universal.loader import build_model, load_universal
from mlxbun.models.universal.schema import DescriptorError
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo.archs import tiny_config
from tests.hybrid_models import oracle_and_universal as _pair


def _same_run(ref, ours, batch: int = 1):
    """A 9-token prefill and three decode steps through each side's own caches."""
    ids = mx.random.randint(1, 512, (batch, 9), key=mx.random.key(5))
    rc, oc = ref.make_cache(), ours.make_cache()
    assert [type(c).__name__ for c in oc] == [type(c).__name__ for c in rc]
    for step in range(4):
        want, got = ref(ids, cache=rc), ours(ids, cache=oc)
        assert mx.array_equal(want, got), f"step {step}: max |diff| {mx.abs(want - got).max()}"
        ids = mx.argmax(want[:, -1:], axis=-1)


@pytest.mark.parametrize("arch, change", [
    ("mamba2", {"layer_norm_epsilon": 1e-3}),  # the block norms keep nn.RMSNorm's 1e-5
    ("mamba2", {"tie_word_embeddings": True, "use_bias": True, "use_conv_bias": False,
                "time_step_limit": [0.05, 2.0], "n_groups": 4}),
    ("mamba2", {"ssm_state_size": 32}),  # read before state_size
    ("nemotron_h", {"hybrid_override_pattern": "M*-M", "layers_block_type": None}),  # hub form
    # one expert group, no renorm, no shared expert, E first
    ("nemotron_h", {"hybrid_override_pattern": "EM*E", "layers_block_type": None, "n_group": 1,
                    "norm_topk_prob": False, "n_shared_experts": None, "num_experts_per_tok": 1}),
    ("nemotron_h", {"layers_block_type": ["mamba", "attention", "mlp", "mamba", "mlp"],
                    "time_step_limit": None, "mamba_proj_bias": True, "attention_bias": True,
                    "mlp_bias": True, "layer_norm_epsilon": 1e-3}),
    ("granitemoehybrid", {"position_embedding_type": "rope", "tie_word_embeddings": True,
                          "mamba_proj_bias": True, "mamba_conv_bias": False,
                          "layer_types": ["attention", "mamba", "mamba"]}),
    ("granitemoehybrid", {"position_embedding_type": None, "time_step_limit": [0.01, 5.0],
                          "rope_parameters": {"rope_type": "default", "rope_theta": 500.0}}),
])
def test_configs_the_zoo_does_not_exercise(arch, change):
    ref, ours = _pair({**tiny_config(arch), **change})
    _same_run(ref, ours)
    _same_run(ref, ours, batch=2)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_nemotron_h_without_experts_in_half_precision(dtype):
    """The zoo's nemotron_h routes (its float16 / bfloat16 run on CUDA only): its M, * and -
    layers in half precision here, cast as mlx_lm.convert casts (A_log kept in float32)."""
    ref, ours = _pair({**tiny_config("nemotron_h"), "layers_block_type": None,
                       "hybrid_override_pattern": "M-*M"})
    keep = ref.cast_predicate
    params = [(k, v.astype(getattr(mx, dtype)) if keep(k) else v)
              for k, v in tree_flatten(ref.parameters())]
    ref.update(tree_unflatten(params))
    ours.load_weights(params, strict=True)
    assert ours.backbone.layers[0].mixer.A_log.dtype == mx.float32
    _same_run(ref, ours)
    _same_run(ref, ours, batch=2)


def test_nemotron_h_cache_list_skips_the_mlp_layers():
    cfg = {**tiny_config("nemotron_h"), "layers_block_type": None,
           "hybrid_override_pattern": ["-", "M", "-", "*", "M"]}
    ref, ours = _pair(cfg)
    caches = ours.make_cache()
    assert [type(c) for c in caches] == [ArraysCache, KVCache, ArraysCache]
    assert [s.ffn_only for s in ours.args.layers] == [True, False, True, False, False]
    _same_run(ref, ours)


@pytest.mark.parametrize("pattern, msg", [
    ("M*+M", "one of M, \\*, -, E"),
    (["M", "*", 7], "one of M, \\*, -, E"),
    ("*--*", "has no M"),
])
def test_nemotron_h_patterns_refused_with_the_key(pattern, msg):
    cfg = {**tiny_config("nemotron_h"), "layers_block_type": None, "hybrid_override_pattern": pattern}
    with pytest.raises(ConfigError, match=f"nemotron_h.*'hybrid_override_pattern'.*{msg}"):
        build_model(cfg)


def test_hf_checkpoint_layout_loads_as_mlx_lm_loads_it(zoo, tmp_path):
    """torch's [C, 1, K] depthwise conv1d, per-expert tensors and the mtp.* heads, as HF ships
    nemotron_h."""
    from mlx_lm.utils import load_model

    src = zoo("nemotron_h")
    dst = tmp_path / "hf-layout"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shard = sorted(dst.glob("*.safetensors"))[0]
    shards = {p.name: dict(mx.load(str(p))) for p in dst.glob("*.safetensors")}
    mx.eval(shards)  # read before the files are rewritten
    weights = shards[shard.name]
    for k in [k for k in weights if k.endswith("conv1d.weight")]:
        weights[k] = weights[k].swapaxes(1, 2)
    weights["mtp.layers.0.norm.weight"] = mx.ones((64,))
    index["weight_map"]["mtp.layers.0.norm.weight"] = shard.name
    for hf, ours in (("up_proj", "fc1"), ("down_proj", "fc2")):  # per-expert HF tensors
        key = f"backbone.layers.1.mixer.switch_mlp.{ours}.weight"
        stacked = shards[index["weight_map"].pop(key)].pop(key)
        for e in range(stacked.shape[0]):
            weights[f"backbone.layers.1.mixer.experts.{e}.{hf}.weight"] = stacked[e]
            index["weight_map"][f"backbone.layers.1.mixer.experts.{e}.{hf}.weight"] = shard.name
    for name, w in shards.items():
        mx.save_safetensors(str(dst / name), w, metadata={"format": "mlx"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = mx.array([[5, 9, 2, 77, 31, 8]])
    ours = load_universal(dst)
    assert mx.array_equal(ours(ids), load_model(dst)[0](ids))
    assert mx.array_equal(ours(ids), load_universal(src)(ids))


def test_granitemoehybrid_hf_layout_loads_as_mlx_lm_loads_it(zoo, tmp_path):
    """HF's Granite 4.0 H dense checkpoints keep the MLP as shared_mlp.input_linear (gate | up)
    and output_linear; both loaders rename and split them."""
    from mlx_lm.utils import load_model

    src = zoo("granitemoehybrid")
    dst = tmp_path / "hf-layout"
    shutil.copytree(src, dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    shards = {name: dict(mx.load(str(dst / name))) for name in set(index["weight_map"].values())}
    mx.eval(shards)  # read before the files are rewritten
    weights = {k: v for shard in shards.values() for k, v in shard.items()}
    first = sorted(shards)[0]
    for layer in range(3):
        p = f"model.layers.{layer}"
        gate, up, down = (weights.pop(f"{p}.mlp.{m}.weight") for m in ("gate_proj", "up_proj", "down_proj"))
        for name in ("gate_proj", "up_proj", "down_proj"):
            key = f"{p}.mlp.{name}.weight"
            shards[index["weight_map"].pop(key)].pop(key)
        shards[first][f"{p}.shared_mlp.input_linear.weight"] = mx.concatenate([gate, up])
        shards[first][f"{p}.shared_mlp.output_linear.weight"] = down
        for k in ("input_linear", "output_linear"):
            index["weight_map"][f"{p}.shared_mlp.{k}.weight"] = first
    for name, shard in shards.items():
        mx.save_safetensors(str(dst / name), shard, metadata={"format": "mlx"})
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    ids = mx.array([[5, 9, 2, 77, 31, 8]])
    ours = load_universal(dst)
    assert mx.array_equal(ours(ids), load_model(dst)[0](ids))
    assert mx.array_equal(ours(ids), load_universal(src)(ids))


def test_nemotron_h_latent_moe_refused():
    from mlxbun.errors import UnsupportedModelError
    from mlxbun.models.universal.coverage import require_coverage

    with pytest.raises(UnsupportedModelError, match="'moe_latent_size' .*runs only None"):
        require_coverage("nemotron_h", {**tiny_config("nemotron_h"), "moe_latent_size": 32})


_NEW_SPELLING = {"layer_types": ["linear_attention", "full_attention", "linear_attention"]}


@pytest.mark.parametrize("change, msg", [
    ({"num_local_experts": 4, "num_experts_per_tok": 2}, "'num_local_experts' .*runs only 0"),
    (_NEW_SPELLING, "'layer_types' .*'linear_attention' are not supported"),
])
def test_granitemoehybrid_refusals_name_the_key(change, msg):
    """mlx-lm 0.32.2 builds neither: its MoE configs are not a covered shape, and it refuses
    transformers 5's layer_types spelling (mlxbun's graph too, naming the spellings it takes)."""
    from mlxbun.errors import UnsupportedModelError
    from mlxbun.models.universal.coverage import require_coverage

    cfg = {**tiny_config("granitemoehybrid"), **change}
    with pytest.raises(UnsupportedModelError, match=msg):
        require_coverage("granitemoehybrid", cfg)
    if change is _NEW_SPELLING:
        with pytest.raises(ConfigError, match="'layer_types' must give each of the 3 layers one of "
                                              "'mamba', 'attention'"):
            build_model(cfg)


@pytest.mark.parametrize("change, msg", [
    (dict(block="paired"), "'pattern' .* goes with block 'single'"),
    (dict(norm_eps=1e-5, block="paired", layers="all", field=""), "norm_eps"),
    (dict(layers="all"), "field"),
])
def test_hybrid_rows_refused_when_built(change, msg):
    d = DESCRIPTORS["nemotron_h"]
    with pytest.raises(DescriptorError, match=msg):
        dataclasses.replace(d, hybrid=dataclasses.replace(d.hybrid, **change))


def test_single_op_block_refuses_what_it_does_not_run():
    from mlxbun.models.universal.schema import BlockKnobs

    d = DESCRIPTORS["mamba2"]
    with pytest.raises(DescriptorError, match="'single' is x \\+ op\\(norm\\(x\\)\\)"):
        dataclasses.replace(d, block=BlockKnobs(residual="clip_f16"))


def test_nemotron_h_prompt_cache_round_trips_its_short_cache_list(zoo, tmp_path):
    """A saved prompt cache holds one entry per cache of mlx-lm's list (M and * layers only)."""
    from mlxbun.cache.prompt_cache import save_prompt_cache
    from mlxbun.generation_caches import load_prompt_cache_for, model_identity_of

    model = load_universal(zoo("nemotron_h"))
    caches = model.make_cache()
    assert len(caches) == 3 and model_identity_of(model)["num_layers"] == "3"
    model(mx.array([[5, 9, 2, 77, 31, 8]]), cache=caches)
    save_prompt_cache(tmp_path / "p.safetensors", caches, model_identity=model_identity_of(model))
    loaded, _ = load_prompt_cache_for(model, tmp_path / "p.safetensors")
    ids = mx.array([[100, 200, 3]])
    assert mx.array_equal(model(ids, cache=loaded), model(ids, cache=caches))


def test_the_state_diff_names_model_layers_where_the_cache_list_skips_some(zoo):
    """nemotron_h's cache list leaves out its MLP / MoE layers: the state records still name the
    model's layer index of each recurrent state (its M layers), not the cache list's position."""
    from mlxbun.parity.layer_diff import layer_diff

    path = zoo("nemotron_h")
    ours = load_universal(path)
    mamba = [i for i, s in enumerate(ours.args.layers) if s.mixer.value == "mamba2"]
    assert ours.cache_layers != list(range(len(ours.args.layers)))  # it does skip layers
    from mlx_lm.utils import load_model

    diff = layer_diff(ours, load_model(path)[0], [4, 8, 15, 16], [7])
    assert sorted(set(diff.state_table["layer"])) == mamba and diff.state_table["equal"].all()
