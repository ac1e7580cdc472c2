"""The VLM wrappers built from another file's text row (models/universal/table_wrappers.py):
pixtral, qwen2_vl, qwen3_vl, lfm2-vl... Each: a hub-layout checkpoint with the towers' keys runs
bit-exact as mlx-lm's text path; the wrapper's own ModelArgs (defaults, values it sets); keys
the wrapper's sanitize leaves are refused as mlx-lm's strict load refuses them; a call that
needs the vision tower is refused by name. Every zoo variant's logits vs mlx-lm are
tests/test_universal_dense.py's (manifest)."""

import json

import mlx.core as mx
import pytest

from mlxbun.errors import LoadError, UnsupportedModelError
from mlxbun.models.universal.coverage import check_coverage
from mlxbun.models.universal.loader import load_universal
from mlxbun.models.universal.resolve import model_args
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo.archs import get_arch, tiny_config
from tests.dense_oracle import oracle
from tests.wrapper_checkpoints import IDS, rewrite_hub


def _with(weights: dict, extra: dict) -> dict:
    return {**weights, **{k: mx.ones(shape) for k, shape in extra.items()}}


def _build(cfg: dict, out, seed: int = 3):
    """A checkpoint of `cfg` built by mlx-lm's own model (its layout, as mlx-lm saves it)."""
    from mlx_lm.utils import save_config

    from mlxbun.zoo.weights import build_model, save_weights

    out.mkdir()
    save_weights(build_model(cfg, seed=seed), out)
    save_config(cfg, out / "config.json")
    return out


# ---------------------------------------------------------------- every wrapper row

_QWEN_VISUAL = {"visual.patch_embed.proj.weight": (32, 3, 2, 14, 14),
                "visual.merger.mlp.0.weight": (64, 128)}


def _unprefixed(w: dict) -> dict:
    """transformers 4's Qwen-VL layout: model.*, lm_head.* at the top."""
    return {k.removeprefix("language_model."): v for k, v in w.items()}


def _language_model_under_model(w: dict) -> dict:
    """transformers 5's layout: model.language_model.*, lm_head at the top."""
    return {k.replace("language_model.model.", "model.language_model.")
            .replace("language_model.lm_head.", "lm_head."): v for k, v in w.items()}


def _fused_experts(w: dict) -> dict:
    """Qwen3-VL-MoE's HF experts: gate_up_proj [E, D, 2I], down_proj [E, I, D] (transformers 5's
    layout around them)."""
    out = {}
    for k, v in _language_model_under_model(w).items():
        if ".switch_mlp.gate_proj." in k:
            up = w[k.replace("model.language_model.", "language_model.model.").replace("gate_proj", "up_proj")]
            out[k.replace("switch_mlp.gate_proj.weight", "experts.gate_up_proj")] = mx.concatenate(
                [v.swapaxes(-2, -1), up.swapaxes(-2, -1)], axis=-1)
        elif ".switch_mlp.down_proj." in k:
            out[k.replace("switch_mlp.down_proj.weight", "experts.down_proj")] = v.swapaxes(-2, -1)
        elif ".switch_mlp.up_proj." not in k:
            out[k] = v
    return out


def _per_expert(w: dict) -> dict:
    """The HF per-expert layout of the zoo's stacked experts (kimi_vl's sanitize stacks them)."""
    out = {}
    for k, v in w.items():
        if ".switch_mlp." in k:
            out.update({k.replace("switch_mlp.", f"experts.{e}."): v[e] for e in range(v.shape[0])})
        else:
            out[k] = v
    return out


_KIMI_TOWERS = {"vision_tower.encoder.blocks.0.wqkv.weight": (96, 32),
                "multi_modal_projector.linear_1.weight": (64, 128)}

# what each wrapper's hub checkpoints hold: (the zoo's language_model.* moved, the towers' keys)
_HUB = {
    "pixtral": (lambda w: w, {"vision_tower.transformer.layers.0.attention.q_proj.weight": (8, 8),
                              "multi_modal_projector.linear_1.weight": (64, 8)}),
    "qwen2_vl": (_unprefixed, _QWEN_VISUAL),
    "qwen2_vl@t5": (_language_model_under_model, {f"model.{k}": s for k, s in _QWEN_VISUAL.items()}),
    "qwen3_vl": (_unprefixed, {**_QWEN_VISUAL, "visual.deepstack_merger_list.0.norm.weight": (128,)}),
    "qwen3_vl@t5": (_language_model_under_model, {f"model.{k}": s for k, s in _QWEN_VISUAL.items()}),
    "mistral3-ministral3@t5": (_language_model_under_model,
                               {"model.vision_tower.transformer.layers.0.attention.q_proj.weight": (8, 8),
                                "model.multi_modal_projector.linear_1.weight": (64, 8)}),
    "qwen3_vl_moe@t5": (_fused_experts, {f"model.{k}": s for k, s in _QWEN_VISUAL.items()}),
    "kimi_vl": (_per_expert, {**_KIMI_TOWERS,
                              "language_model.model.layers.0.self_attn.rotary_emb.inv_freq": (4,)}),
    "kimi_k25": (_per_expert, {**_KIMI_TOWERS, "vision_model.blocks.0.weight": (8,),
                               "mm_projector.proj.0.weight": (64, 128),
                               "language_model.model.layers.61.self_attn.o_proj.weight": (2, 2)}),
    "lfm2-vl": (lambda w: w, {"vision_tower.vision_model.embeddings.patch_embedding.weight": (32, 768),
                              "multi_modal_projector.linear_1.weight": (64, 128)}),
}
_ARCHS = sorted({k.partition("@")[0] for k in _HUB})


@pytest.mark.parametrize("layout", sorted(_HUB))
def test_a_hub_checkpoint_with_the_towers_runs_as_mlx_lms_text_path(layout, zoo, tmp_path):
    move, towers = _HUB[layout]
    src = zoo(layout.partition("@")[0])
    hub = rewrite_hub(src, tmp_path / "hub", lambda w: _with(move(w), towers))
    ours, ref = load_universal(hub), oracle(hub)
    assert set(towers) <= set(ours.audit.dropped)
    assert mx.array_equal(ours(IDS), ref(IDS))
    same = load_universal(src)(IDS)  # the same tensors, moved (qwen3_vl_moe's split experts are
    # transposed views, as mlx-lm's: the matmuls' rounding differs from the zoo's contiguous ones)
    assert mx.array_equal(ours(IDS), same) if "moe" not in layout else mx.allclose(ours(IDS), same, atol=1e-5)


@pytest.mark.parametrize("arch", _ARCHS)
def test_a_vision_request_is_refused_by_name(arch, zoo):
    ours = load_universal(zoo(arch))
    mt = get_arch(arch).model_type or arch
    with pytest.raises(UnsupportedModelError, match=f"{mt}: pixel_values needs the VLM's vision"):
        ours(IDS, pixel_values=mx.zeros((1, 3, 32, 32)))
    with pytest.raises(UnsupportedModelError, match="input_embeddings"):
        ours(IDS, input_embeddings=mx.zeros((1, 12, 64)))
    with pytest.raises(TypeError, match="pixel_valuez"):
        ours(IDS, pixel_valuez=1)
    assert mx.array_equal(ours(IDS, pixel_values=None), ours(IDS))  # a text-only call's None


def test_a_text_row_refuses_media_as_a_text_model(zoo):
    with pytest.raises(UnsupportedModelError, match="llama is a text model"):
        load_universal(zoo("llama"))(IDS, pixel_values=mx.zeros((1, 3, 4, 4)))


# ---------------------------------------------------------------- pixtral


def test_pixtral_is_untied_whatever_text_config_says(zoo, tmp_path):
    def tie(cfg):
        cfg["text_config"]["tie_word_embeddings"] = True

    tied = rewrite_hub(zoo("pixtral"), tmp_path / "tied", lambda w: w, tie)
    ours, ref = load_universal(tied), oracle(tied)
    assert not ours.tied and mx.array_equal(ours(IDS), ref(IDS))
    report = check_coverage("pixtral", json.loads((tied / "config.json").read_text()))
    assert report.ok and "sets tie_word_embeddings=False" in report.ignored["text_config.tie_word_embeddings"]
    headless = rewrite_hub(zoo("pixtral"), tmp_path / "headless",
                           lambda w: {k: v for k, v in w.items() if "lm_head" not in k}, tie)
    with pytest.raises(LoadError, match="language_model.lm_head.weight"):
        load_universal(headless)  # mlx-lm: a missing parameter (strict load)


def test_pixtral_heads_default_to_32(tmp_path):
    cfg = tiny_config("pixtral")
    del cfg["text_config"]["num_attention_heads"]
    out = _build(cfg, tmp_path / "heads")
    ours, ref = load_universal(out), oracle(out)
    assert ours.args.n_heads == ref.language_model.args.num_attention_heads == 32
    assert mx.array_equal(ours(IDS), ref(IDS))


def test_pixtral_keeps_what_its_sanitize_keeps(zoo, tmp_path):
    """pixtral's sanitize pops the towers only (llama's rotary buffers and transformers 5's
    model.language_model stay): mlx-lm's strict load refuses them, so does the audit."""
    buffer = "language_model.model.layers.0.self_attn.rotary_emb.inv_freq"
    extra = rewrite_hub(zoo("pixtral"), tmp_path / "buffer", lambda w: _with(w, {buffer: (8,)}))
    with pytest.raises(ValueError, match="rotary_emb"):
        oracle(extra)
    with pytest.raises(LoadError, match="rotary_emb"):
        load_universal(extra)


def test_wrapper_sets_need_a_wrapper_and_fields_of_the_row():
    import dataclasses

    from mlxbun.models.universal.schema import DescriptorError

    row = DESCRIPTORS["pixtral"]
    with pytest.raises(DescriptorError, match="wrapper_sets"):
        dataclasses.replace(row, names=dataclasses.replace(row.names, wrapper=None))
    with pytest.raises(DescriptorError, match="wrapper_sets"):
        dataclasses.replace(row, wrapper_sets={"not_a_field": 1})
    with pytest.raises(DescriptorError, match="wrapper_sets"):
        dataclasses.replace(row, wrapper_fields={"tie_word_embeddings": True})
    assert model_args(row, {**tiny_config("pixtral"), "tie_word_embeddings": True})[
        "tie_word_embeddings"] is False


# ---------------------------------------------------------------- qwen2_vl, qwen3_vl


def test_qwen2_vl_reads_a_config_without_text_config_as_mlx_lm(zoo, tmp_path):
    """Qwen2-VL's hub configs are flat (the text keys at the top beside vision_config): mlx-lm's
    from_dict hands the whole config to qwen2; the VLM's own keys are ignored."""
    def flatten(cfg):
        text = cfg.pop("text_config")
        cfg.update(text, model_type="qwen2_vl",  # the hub's, which mlx-lm's save_config drops
                   vision_config=tiny_config("qwen2_vl")["vision_config"])

    flat = rewrite_hub(zoo("qwen2_vl"), tmp_path / "flat", _unprefixed, flatten)
    ours, ref = load_universal(flat), oracle(flat)
    assert mx.array_equal(ours(IDS), ref(IDS))
    report = check_coverage("qwen2_vl", json.loads((flat / "config.json").read_text()))
    assert report.ok and "the VLM's own" in report.ignored["vision_config"]
    assert "rope_scaling" in report.understood


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen3_vl"])
def test_qwen_vl_refuses_what_the_text_models_sanitize_would_drop(arch, zoo, tmp_path):
    """The wrapper's sanitize does not call qwen2's / qwen3's: a tied text_config with the head
    still in the checkpoint fails mlx-lm's strict load, and the audit names the head."""
    def tie(cfg):
        cfg["text_config"]["tie_word_embeddings"] = True

    tied = rewrite_hub(zoo(arch), tmp_path / "tied", lambda w: w, tie)
    with pytest.raises(ValueError, match="lm_head"):
        oracle(tied)
    with pytest.raises(LoadError, match="language_model.lm_head.weight"):
        load_universal(tied)
    headless = rewrite_hub(zoo(arch), tmp_path / "headless",
                           lambda w: {k: v for k, v in w.items() if "lm_head" not in k}, tie)
    ours, ref = load_universal(headless), oracle(headless)
    assert ours.tied and mx.array_equal(ours(IDS), ref(IDS))


def test_an_mrope_section_list_of_another_length_is_refused_as_mlx_lm_asserts():
    from mlxbun.models.universal.loader import build_model

    cfg = tiny_config("qwen2_vl")
    cfg["text_config"]["rope_scaling"]["mrope_section"] = [4, 4]
    with pytest.raises(UnsupportedModelError, match="MRoPE currently only supports 3 sections"):
        build_model(cfg)


# ---------------------------------------------------------------- lfm2-vl


def test_lfm2_vl_ties_and_keeps_lfm2s_caches(zoo):
    ours, ref = load_universal(zoo("lfm2-vl")), oracle(zoo("lfm2-vl"))
    assert ours.tied and "lm_head" not in ours.text_model
    assert [type(c).__name__ for c in ours.make_cache()] == [type(c).__name__ for c in ref.make_cache()]
    cache, ref_cache = ours.make_cache(), ref.make_cache()
    assert mx.array_equal(ours(IDS, cache), ref(IDS, cache=ref_cache))
    step = mx.array([[7]])
    assert mx.array_equal(ours(step, cache), ref(step, cache=ref_cache))


def test_lfm2_vl_refuses_a_torch_layout_conv_as_mlx_lm(zoo, tmp_path):
    """lfm2-vl's sanitize does not call lfm2's (which transposes a [C, 1, K] conv weight)."""
    def torch_conv(w):
        return {k: (v.swapaxes(1, 2) if k.endswith("conv.conv.weight") else v) for k, v in w.items()}

    moved = rewrite_hub(zoo("lfm2-vl"), tmp_path / "torch", torch_conv)
    with pytest.raises(ValueError, match="conv"):
        oracle(moved)
    with pytest.raises(LoadError, match="conv.conv.weight"):
        load_universal(moved)


# ---------------------------------------------------------------- mistral3's text rows


def test_mistral3_picks_its_text_row_by_text_config_model_type(zoo):
    from mlxbun.models.universal.resolve import descriptor_for

    cfg = tiny_config("mistral3-ministral3")
    row = descriptor_for("mistral3", cfg)
    assert row is DESCRIPTORS["mistral3"].text_rows["ministral3"] and row.model_type == "mistral3"
    assert descriptor_for("llava", cfg) is row  # llava remaps to mistral3
    assert descriptor_for("mistral3", tiny_config("mistral3")) is DESCRIPTORS["mistral3"]
    ours = load_universal(zoo("mistral3-ministral3"))
    assert ours.descriptor is row and not ours.tied
    assert check_coverage("mistral3", cfg).ok


def test_the_text_rows_are_the_text_files_model_args_with_the_wrappers_defaults():
    import dataclasses
    import importlib

    from mlx_lm.models import mistral3

    injected = mistral3.ModelArgs(model_type="mistral3", text_config={}).text_config
    for text, row in DESCRIPTORS["mistral3"].text_rows.items():
        args = importlib.import_module(f"mlx_lm.models.{text}").ModelArgs
        want = {f.name: f.default for f in dataclasses.fields(args)}
        assert set(row.fields) == set(want) and row.fields["tie_word_embeddings"] is injected[
            "tie_word_embeddings"] is False
        assert row.sanitize[0] == DESCRIPTORS["mistral3"].sanitize[0]  # the wrapper's, then the text's
        assert row.sanitize[1:] == DESCRIPTORS[text].sanitize


def test_mistral3_picks_mistral4s_text_model_by_text_config(zoo):
    import mlx_lm

    from mlxbun.models.universal.loader import build_model

    assert set(DESCRIPTORS["mistral3"].text_rows) == {"ministral3", "mistral4"}
    cfg = tiny_config("mistral3-mistral4")
    assert cfg["model_type"] == "mistral3" and cfg["text_config"]["model_type"] == "mistral4"
    ours = build_model(cfg)
    theirs, _ = mlx_lm.load(str(zoo("mistral3-mistral4")))
    assert type(theirs.language_model).__module__ == "mlx_lm.models.mistral4"
    assert type(ours.language_model.model.layers[0].self_attn).__name__ == "MlaAbsorbedDecodeAttention"


def test_text_rows_are_checked_with_the_row():
    import dataclasses

    from mlxbun.models.universal.schema import DescriptorError

    row = DESCRIPTORS["mistral3"]
    with pytest.raises(DescriptorError, match="text_rows"):
        dataclasses.replace(row, text_rows={"ministral3": DESCRIPTORS["ministral3"]})  # another model_type
    with pytest.raises(DescriptorError, match="text_rows"):
        dataclasses.replace(DESCRIPTORS["llama"], text_rows=row.text_rows)  # no wrapper
    with pytest.raises(DescriptorError, match="text_config_required needs names.wrapper"):
        dataclasses.replace(DESCRIPTORS["llama"], text_config_required=True)


def test_explain_shows_the_text_row_a_zoo_arch_picks():
    from mlxbun.explain import explain

    text = explain("mistral3-ministral3").text()
    assert "mistral3 with a ministral3 text_config" in text and "language_model.model" in text
    assert explain("mistral3-ministral3").descriptor["text_rows"] == []
    assert explain("mistral3").descriptor["text_rows"] == ["ministral3", "mistral4"]


# ---------------------------------------------------------------- qwen3_vl_moe


def test_qwen3_vl_moe_splits_hfs_fused_experts_from_the_headers_too(zoo, tmp_path):
    from mlxbun.models.universal.loader import audit_checkpoint

    hub = rewrite_hub(zoo("qwen3_vl_moe"), tmp_path / "hub",
                      lambda w: _with(_fused_experts(w), {"model.visual.merger.mlp.0.weight": (64, 128)}))
    report = audit_checkpoint(hub)
    assert report.ok and "model.visual.merger.mlp.0.weight" in report.dropped
    assert "language_model.model.layers.1.mlp.switch_mlp.up_proj.weight" in load_universal(hub).audit.consumed


def test_split_gate_up_experts_takes_a_gate_up_layout():
    import dataclasses

    from mlxbun.models.universal.schema import DescriptorError, SanitizeRule

    row = DESCRIPTORS["qwen3_vl_moe"]
    with pytest.raises(DescriptorError, match="GateUpLayout"):
        dataclasses.replace(row, sanitize=(SanitizeRule("split_gate_up_experts", "last"),))


# ---------------------------------------------------------------- kimi_vl, kimi_k25


def _kv_b(w: dict, cfg: dict) -> dict:
    """deepseek_v3's attention as a transformers checkpoint holds it: kv_b_proj per layer."""
    text = cfg["text_config"]
    heads, dn, dv, kv = (text["num_attention_heads"], text["qk_nope_head_dim"], text["v_head_dim"],
                         text["kv_lora_rank"])
    out = {k: v for k, v in w.items() if not k.endswith(("embed_q.weight", "unembed_out.weight"))}
    mx.random.seed(5)
    for layer in range(text["num_hidden_layers"]):
        out[f"language_model.model.layers.{layer}.self_attn.kv_b_proj.weight"] = mx.random.normal(
            (heads * (dn + dv), kv))
    return out


def test_kimi_k25_splits_kv_b_proj_under_the_wrapper_as_mlx_lm(zoo, tmp_path):
    """kimi_k25's sanitize runs deepseek_v3's on language_model's keys: kv_b_proj split."""
    cfg = tiny_config("kimi_k25")
    hf = rewrite_hub(zoo("kimi_k25"), tmp_path / "kv_b", lambda w: _kv_b(_per_expert(w), cfg))
    ours, ref = load_universal(hf), oracle(hf)
    assert "language_model.model.layers.0.self_attn.embed_q.weight" in ours.audit.consumed
    assert mx.array_equal(ours(IDS), ref(IDS))


def test_kimi_vl_refuses_kv_b_proj_as_mlx_lms_strict_load(zoo, tmp_path):
    """kimi_vl's sanitize does not run deepseek_v3's: a kv_b_proj checkpoint does not load."""
    cfg = tiny_config("kimi_vl")
    hf = rewrite_hub(zoo("kimi_vl"), tmp_path / "kv_b", lambda w: _kv_b(w, cfg))
    with pytest.raises(ValueError, match="kv_b_proj|embed_q"):
        oracle(hf)
    with pytest.raises(LoadError, match="kv_b_proj"):
        load_universal(hf)


def test_kimi_vl_reads_deepseek_v3s_fields_but_model_type():
    from mlx_lm.models import kimi_vl

    row = DESCRIPTORS["kimi_vl"]
    import dataclasses

    assert dict(row.fields) == {f.name: f.default for f in dataclasses.fields(kimi_vl.TextArgs)}
    assert "model_type" in row.ignored_keys and check_coverage("kimi_vl", tiny_config("kimi_vl")).ok


@pytest.mark.parametrize("arch", ["gemma3", "mistral3", "pixtral", "lfm2-vl", "qwen3_vl_moe", "kimi_vl",
                                  "kimi_k25", "qwen2_vl", "qwen3_vl"])
def test_a_config_without_text_config_is_refused_where_mlx_lm_requires_one(arch):
    """The wrappers whose ModelArgs have a text_config field without a default refuse a flat
    config, as mlx-lm's do; qwen2_vl's / qwen3_vl's from_dict read it as the text config."""
    import importlib

    from mlxbun.errors import ConfigError
    from mlxbun.models.universal.loader import build_model

    cfg = tiny_config(arch)
    flat = {**cfg.pop("text_config"), **cfg}
    args = importlib.import_module(f"mlx_lm.models.{arch}").ModelArgs
    if DESCRIPTORS[arch].text_config_required:
        with pytest.raises(TypeError, match="text_config"):
            args.from_dict(flat)
        with pytest.raises(ConfigError, match=f"{arch}.*missing required key 'text_config'"):
            build_model(flat)
    else:
        assert args.from_dict(flat).text_config == flat and build_model(flat).args.vocab == 512


@pytest.mark.parametrize("keep_head", [True, False])
def test_a_tied_qwen3_vl_moe_is_refused_as_mlx_lm_cannot_load_one(keep_head, zoo, tmp_path):
    """qwen3_vl_moe's sanitize reads an lm_head (a KeyError without one) that a tied qwen3_moe
    does not build (the strict load refuses it): no tied checkpoint loads in mlx-lm."""
    from mlxbun.errors import UnsupportedModelError as Refused

    def tie(cfg):
        cfg["text_config"]["tie_word_embeddings"] = True

    drop = (lambda w: w) if keep_head else (lambda w: {k: v for k, v in w.items() if "lm_head" not in k})
    tied = rewrite_hub(zoo("qwen3_vl_moe"), tmp_path / "tied", drop, tie)
    with pytest.raises((ValueError, KeyError), match="lm_head"):
        oracle(tied)
    with pytest.raises(Refused, match="tie_word_embeddings"):
        load_universal(tied)
