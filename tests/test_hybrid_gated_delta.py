"""The gated DeltaNet rows (qwen3_next, qwen3_5, qwen3_5_moe) as whole models: transformers-layout
checkpoints load as mlx-lm loads them, each layer gets its mixer's cache, generation and the
recurrent state match mlx-lm, the layer rule's refusals. The logits of every variant against
mlx-lm are tests/test_universal_dense.py's (manifest); the mixer alone is test_mixer_gated_delta.py's."""


import mlx.core as mx
import pytest

from mlxbun.cache.arrays import ArraysCache
from mlxbun.cache.kv import KVCache
from mlxbun.errors import ConfigError
from mlxbun.models.universal.coverage import check_coverage
from mlxbun.models.universal.kinds_hybrid import (
    MixerKind,
)
from mlxbun.models.universal.loader import build_model, load_universal
from mlxbun.zoo.archs import tiny_config
from tests.checkpoint_edits import rewrite_checkpoint

_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
          ".q_norm.weight", ".k_norm.weight")


def _oracle(path):
    from mlx_lm.utils import load_model

    return load_model(path)[0]


@pytest.fixture(scope="module")
def qwen3_next(zoo):
    return zoo("qwen3_next")


def _rewrite(src, dst, edit):
    """A copy of checkpoint `src` as one safetensors file (the hub's metadata), its weights passed through `edit`."""
    return rewrite_checkpoint(src, dst, edit, fmt="pt")


def _qwen3_next_hf(weights: dict) -> dict:
    """The transformers layout: per-expert MLPs, torch conv1d [C, 1, K], (1 + w) norms as w,
    a multi-token-prediction tensor."""
    out = {}
    for k, v in weights.items():
        if ".switch_mlp." in k:
            for e in range(v.shape[0]):
                out[k.replace(".switch_mlp.", f".experts.{e}.")] = v[e]
            continue
        if k.endswith("conv1d.weight"):
            v = v.swapaxes(1, 2)
        elif k.endswith(_NORMS):
            v = v - 1.0
        out[k] = v
    out["mtp.fc.weight"] = mx.ones((4, 4))
    return out


def test_a_transformers_checkpoint_loads_as_mlx_lm_loads_it(qwen3_next, tmp_path):
    hf = _rewrite(qwen3_next, tmp_path / "hf", _qwen3_next_hf)
    ids = mx.array([[5, 9, 2, 77, 31, 8, 100, 4]])
    ours, ref = load_universal(hf), _oracle(hf)
    assert mx.array_equal(ours(ids), ref(ids))
    # the + 1 reached the norms: the HF copy runs like the zoo checkpoint, to float32 rounding
    assert mx.allclose(ours(ids), load_universal(qwen3_next)(ids), atol=1e-4)
    assert not mx.array_equal(ours(ids), _oracle(_rewrite(
        qwen3_next, tmp_path / "no-plus-one", lambda w: {k: (v - 1.0 if k.endswith(_NORMS) else v)
                                                         for k, v in w.items()}))(ids))


def _qwen3_5_hf(weights: dict) -> dict:
    """Qwen3.5's transformers layout: the text model under model.language_model, lm_head at the
    top, torch conv1d, (1 + w) norms as w, fused experts gate_up_proj / down_proj, a vision
    tower and a multi-token-prediction tensor."""
    out = {"model.visual.patch_embed.proj.weight": mx.ones((4, 4)), "mtp.fc.weight": mx.ones((4, 4))}
    for k, v in weights.items():
        k = k.replace("language_model.model.", "model.language_model.").replace(
            "language_model.lm_head.", "lm_head.")
        if ".switch_mlp.up_proj." in k or ".switch_mlp.gate_proj." in k:
            if ".gate_proj." in k:
                up = weights[k.replace("model.language_model.", "language_model.model.")
                             .replace(".gate_proj.", ".up_proj.")]
                out[k.replace(".switch_mlp.gate_proj.weight", ".experts.gate_up_proj")] = (
                    mx.concatenate([v, up], axis=1))
            continue
        if ".switch_mlp.down_proj." in k:
            out[k.replace(".switch_mlp.down_proj.weight", ".experts.down_proj")] = v
            continue
        if k.endswith("conv1d.weight"):
            v = v.swapaxes(1, 2)
        elif k.endswith(_NORMS):
            v = v - 1.0
        out[k] = v
    return out


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_a_transformers_qwen3_5_checkpoint_loads_as_mlx_lm_loads_it(zoo, arch, tmp_path):
    src = zoo(arch)
    hf = _rewrite(src, tmp_path / "hf", _qwen3_5_hf)
    ids = mx.array([[5, 9, 2, 77, 31, 8, 100, 4]])
    ours, ref = load_universal(hf), _oracle(hf)
    assert "model.visual.patch_embed.proj.weight" in ours.audit.dropped
    assert mx.array_equal(ours(ids), ref(ids))
    assert mx.allclose(ours(ids), load_universal(src)(ids), atol=1e-4)  # the + 1 reached the norms


def test_a_converted_checkpoint_keeps_its_norms(qwen3_next, tmp_path):
    """Without per-expert weights mlx-lm's sanitize leaves everything alone (no + 1)."""
    shifted = _rewrite(qwen3_next, tmp_path / "shifted",
                       lambda w: {k: (v - 1.0 if k.endswith(_NORMS) else v) for k, v in w.items()})
    ids = mx.array([[3, 1, 4, 1, 5]])
    assert mx.array_equal(load_universal(shifted)(ids), _oracle(shifted)(ids))


def test_every_layer_gets_the_cache_of_its_mixer_and_the_state_is_mlx_lms(qwen3_next):
    model, ref = load_universal(qwen3_next), _oracle(qwen3_next)
    assert [s.mixer for s in model.args.layers] == [MixerKind.GATED_DELTA, MixerKind.ATTENTION,
                                                    MixerKind.GATED_DELTA]
    ours, theirs = model.make_cache(), ref.make_cache()
    assert [type(c) for c in ours] == [ArraysCache, KVCache, ArraysCache]
    ids = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    for step in (ids, ids[:, :1], ids[:, 1:2]):
        assert mx.array_equal(model(step, cache=ours), ref(step, cache=theirs))
    conv, state = ours[0][0], ours[0][1]
    assert conv.shape == (1, 3, 2 * 2 * 32 + 4 * 16)  # the last K - 1 inputs of q | k | v
    assert state.shape == (1, 4, 16, 32) and state.dtype == mx.float32  # [Hv, Dv, Dk]
    for c, r in ((ours[0], theirs[0]), (ours[2], theirs[2])):
        assert all(mx.array_equal(x, y) for x, y in zip(c.cache, r.cache, strict=True))


def test_layer_types_that_disagree_with_the_interval_are_refused():
    cfg = {**tiny_config("qwen3_next"), "full_attention_interval": 3}
    report = check_coverage("qwen3_next", cfg)
    assert not report.ok and "full_attention_interval=3" in report.offending["layer_types"]
    assert check_coverage("qwen3_next", tiny_config("qwen3_next")).ok


@pytest.mark.parametrize("change,needle", [
    ({"full_attention_interval": 1}, "leaves no gated_delta layer"),
    ({"full_attention_interval": 0}, "'full_attention_interval' must be a positive integer"),
    ({"linear_num_value_heads": 3}, "'linear_num_value_heads' (3) must be divisible by"),
    ({"linear_key_head_dim": None}, "'linear_key_head_dim' must be a positive integer"),
])
def test_bad_gated_delta_configs_refuse_naming_the_key(change, needle):
    cfg = {**tiny_config("qwen3_next"), **change}
    with pytest.raises(ConfigError) as e:
        build_model(cfg)
    assert needle in str(e.value)


def test_the_wrapper_reads_text_config_and_ignores_the_rest():
    cfg = tiny_config("qwen3_5")
    report = check_coverage("qwen3_5", cfg)
    assert report.ok and "outside text_config" in report.ignored["tie_word_embeddings"]
    assert "linear_num_value_heads" in report.understood
    experts = {**cfg, "text_config": {**cfg["text_config"], "num_experts": 4}}
    assert "qwen3_5 runs only 0" in check_coverage("qwen3_5", experts).offending["num_experts"]
    with pytest.raises(ConfigError, match="'text_config' must be an object"):
        build_model({**cfg, "text_config": [1, 2]})
    model = build_model(cfg)
    assert model.text_model is model["language_model"] and "model" in model.text_model
    assert model.args.layers[1].rope.base == 10000000.0  # read from rope_parameters
    assert model.args.layers[1].rope.dims == 4  # int(16 * 0.25): plain partial rope, no mrope


def test_gated_delta_knobs_are_checked_with_the_row():
    import dataclasses

    from mlxbun.models.universal.mixers.gated_delta import GatedDeltaKnobs
    from mlxbun.models.universal.schema import DescriptorError, SanitizeRule
    from mlxbun.models.universal.table import DESCRIPTORS

    row = DESCRIPTORS["qwen3_5"]
    with pytest.raises(DescriptorError, match="reads the field 'linear_k_dim'"):
        dataclasses.replace(row, hybrid=dataclasses.replace(
            row.hybrid, knobs=GatedDeltaKnobs("qkv_z_b_a", head_k_dim="linear_k_dim")))
    with pytest.raises(DescriptorError, match="query_sigmoid take separate q/k/v"):
        dataclasses.replace(row, qkv="fused")
    with pytest.raises(DescriptorError, match="'norm_plus_one' takes \\(suffixes, HfCheckpoint\\)"):
        dataclasses.replace(row, sanitize=(SanitizeRule("norm_plus_one", ((".norm.weight",), "hf")),))
    with pytest.raises(DescriptorError, match="'wrapper_keys' needs names.wrapper"):
        dataclasses.replace(row, names=dataclasses.replace(row.names, wrapper=None))
    with pytest.raises(DescriptorError, match="'split_gate_up_experts' needs moe knobs"):
        dataclasses.replace(row, sanitize=(SanitizeRule("split_gate_up_experts"),))


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_next"])
def test_a_tied_head_runs_as_mlx_lm_runs_it(arch):
    """Qwen3.5's small checkpoints tie the head to the embedding (no lm_head in either tree)."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.utils import _get_classes

    cfg = tiny_config(arch)
    text = cfg.get("text_config", cfg)
    text["tie_word_embeddings"] = True
    model_cls, args_cls = _get_classes(cfg)
    ref = model_cls(args_cls.from_dict(cfg))
    ours = build_model(cfg)
    params = tree_flatten(ref.parameters())
    assert {k for k, _ in tree_flatten(ours.parameters())} == {k for k, _ in params}
    assert not any("lm_head" in k for k, _ in params)
    ours.update(tree_unflatten(params))
    ref.eval(), ours.eval()
    ids = mx.array([[5, 9, 2, 77, 31, 8]])
    assert mx.array_equal(ours(ids), ref(ids))


def test_a_rejected_draft_is_rolled_back_by_replay(zoo):
    """The spec-round contract on a gated DeltaNet model: after a round of 4 drafted tokens with
    2 accepted, restore + replay of the 2 leaves every cache (conv and delta states, KV) and the
    next logits exactly as plain decoding of the 2 would."""
    from mlxbun.cache.arrays import begin_spec_round, commit_spec_round

    model = load_universal(zoo("qwen3_5"))
    prompt, draft = mx.array([[3, 1, 4, 1, 5, 9]]), mx.array([[2, 6, 5, 3]])
    spec, plain = model.make_cache(), model.make_cache()
    model(prompt, cache=spec), model(prompt, cache=plain)
    begin_spec_round(spec)
    model(draft, cache=spec)
    replay = commit_spec_round(spec, 2)
    assert replay == 2
    model(draft[:, :replay], cache=spec)
    model(draft[:, :2], cache=plain)
    nxt = mx.array([[7]])
    assert mx.array_equal(model(nxt, cache=spec), model(nxt, cache=plain))
    for s, p in zip(spec, plain):
        if isinstance(s, ArraysCache):
            assert all(mx.array_equal(x, y) for x, y in zip(s.cache, p.cache, strict=True))
        else:
            assert s.offset == p.offset
