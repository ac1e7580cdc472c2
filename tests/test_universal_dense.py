"""UniversalDense vs mlx-lm 0.32.2: bit-exact logits, identical module trees, refusals.

mlx-lm is the oracle and is imported only here. Checkpoints come from the zoo
(tiny HF-layout checkpoints with every knob of the arch kept, sliding window 16).
"""

import dataclasses
import importlib
import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxbun.errors import ConfigError, LoadError, UnsupportedModelError
from mlxbun.models.universal.coverage import check_coverage, require_coverage
from mlxbun.models.universal.kinds import BlockKind, FinalSoftcap, PostInit, QKNormAt
from mlxbun.models.universal.loader import audit_checkpoint, build_model, load_universal
from mlxbun.models.universal.not_covered import NOT_COVERED
from mlxbun.models.universal.schema import (
    REQUIRED,
    ArchDescriptor,
    BlockKnobs,
    DescriptorError,
    HeadKnobs,
    MlpKnobs,
    QKNormKnobs,
    RopeKnobs,
    SanitizeRule,
)
from mlxbun.models.universal.table import DESCRIPTORS
from mlxbun.zoo.archs import get_arch, tiny_config
from tests.checkpoint_edits import rewrite_checkpoint
from tests.dense_oracle import (
    PROMPT_LEN,
    assert_parity,
    oracle,
    oracle_cache,
    prompt_ids,
    random_checkpoint,
)
from tests.universal_manifest import MANIFEST, universal_archs

ARCHS = universal_archs()  # every row's arch (+ mistral, which mlx-lm remaps to llama); the
# dedicated L1 graphs (gemma3n) have their own tests and share test_universal_parity's gate
VARIANTS = {
    "float32": dict(dtype="float32"),
    "float16": dict(dtype="float16"),
    "bfloat16": dict(dtype="bfloat16"),
    "q4": dict(quant=4),
    "q8": dict(quant=8),
    "mixed": dict(quant="mixed"),
    "mxfp4": dict(quant="mxfp4"),  # opt-in (gpt_oss)
}


_CASES = [(a, v) for a in ARCHS for v in MANIFEST[a].variants]


@pytest.mark.parametrize("arch,variant", _CASES, ids=[f"{a}-{v}" for a, v in _CASES])
def test_logits_bit_exact_prefill_decode_and_batch(zoo, arch, variant):
    assert_parity(zoo(arch, **VARIANTS[variant]))


# Knob settings the zoo's configs leave at one value: each row flips some (arch, overrides).
_LT = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
KNOBS = {
    "cohere-qknorm-lnbias": ("cohere", dict(use_qk_norm=True, layer_norm_bias=True, attention_bias=True)),
    "stablelm-parallel-qkln": ("stablelm", dict(qk_layernorm=True, use_parallel_residual=True)),
    "stablelm-sequential-qkln": ("stablelm", dict(qk_layernorm=True, use_qkv_bias=False)),
    "gpt_neox-sequential": ("gpt_neox", dict(use_parallel_residual=False)),
    "hunyuan-noqknorm-tied": ("hunyuan_v1_dense", dict(use_qk_norm=False, attention_bias=True,
                                                       tie_word_embeddings=True)),
    "llama-sliding-biases-tied": ("llama", dict(layer_types=_LT, sliding_window=16, num_hidden_layers=4,
                                                attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "smollm3-sliding": ("smollm3", dict(layer_types=_LT, sliding_window=16)),
    "ministral3-sliding-untied": ("ministral3", dict(layer_types=_LT, sliding_window=16,
                                                     num_hidden_layers=4, tie_word_embeddings=False)),
    "qwen3-rope_parameters-yarn": ("qwen3", dict(rope_theta=None, rope_scaling=None, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64})),
    "exaone4-nopattern-tied": ("exaone4", dict(sliding_window_pattern=None, layer_types=None,
                                               tie_word_embeddings=True)),
    "seed_oss-tied-biases": ("seed_oss", dict(tie_word_embeddings=True, attention_out_bias=True, mlp_bias=True)),
    "helium-tied-biases": ("helium", dict(tie_word_embeddings=True, attention_bias=True, mlp_bias=True)),
    "phi3-linear": ("phi3", dict(rope_scaling={"type": "linear", "factor": 2.0, "long_factor": [1.0]})),
    "phi3-plain-tied": ("phi3", dict(rope_scaling=None, partial_rotary_factor=1.0, tie_word_embeddings=True)),
    "nemotron-linear-biases": ("nemotron", dict(rope_scaling={"type": "linear", "factor": 2.0},
                                                attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "internlm3-linear-biases": ("internlm3", dict(rope_scaling={"rope_type": "linear", "factor": 2.0},
                                                  qkv_bias=True, bias=True)),
    "olmo3-yarn-bias": ("olmo3", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                    "original_max_position_embeddings": 64},
                                      attention_bias=True)),
    "olmo2-biases-tied": ("olmo2", dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True)),
    "granite-untied-biases": ("granite", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
    "ernie4_5-bias-tied": ("ernie4_5", dict(use_bias=True, tie_word_embeddings=True)),
    "gemma3_text-period2-llama3": ("gemma3_text", dict(sliding_window_pattern=2, layer_types=None,
                                                       rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                     "original_max_position_embeddings": 64,
                                                                     "low_freq_factor": 1.0,
                                                                     "high_freq_factor": 4.0})),
    "cohere2-period2-biases": ("cohere2", dict(sliding_window_pattern=2, layer_types=None,
                                               attention_bias=True, layer_norm_bias=True)),
    "apertus-bias-tied": ("apertus", dict(mlp_bias=True, tie_word_embeddings=True)),
    "qwen2-untied-dynamic": ("qwen2", dict(tie_word_embeddings=False,
                                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "glm4-nobias-fullrope": ("glm4", dict(attention_bias=False, partial_rotary_factor=1.0)),
    "starcoder2-untied": ("starcoder2", dict(tie_word_embeddings=False)),
    "minicpm-scales": ("minicpm", dict(scale_emb=10.5, scale_depth=1.1, dim_model_base=32)),
    "lille-130m-mha": ("lille-130m", dict(n_kv_heads=4)),
    "phi-fullrope-gqa": ("phi", dict(partial_rotary_factor=1.0, num_key_value_heads=2)),
    "gemma-traditional": ("gemma", dict(rope_traditional=True)),
    "gemma2-caps-scalar": ("gemma2", dict(attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                          query_pre_attn_scalar=20)),
    "nanochat-theta": ("nanochat", dict(rope_theta=500.0)),
    "qwen-biases": ("qwen", dict(no_bias=False)),
    "muse_glimmer-nested-tied": ("muse_glimmer", dict(text_config=dict(tie_word_embeddings=True, rope_parameters={
        "rope_theta": 1000.0}, layer_types=["full_attention", "sliding_attention"] * 2, layer_rope_theta=[0, 1, 1, 0]))),
    "llama4_text-tied-no-qknorm": ("llama4_text", dict(tie_word_embeddings=True, use_qk_norm=False)),
    "nemotron-nas-llama3-biases": ("nemotron-nas", dict(attention_bias=True, mlp_bias=True, rope_scaling={
        "factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0, "original_max_position_embeddings": 64,
        "rope_type": "llama3"})),
    "spark2_5-biases-default-layers": ("spark2_5", dict(attention_bias=True, mlp_bias=True, layer_types=None,
                                                        num_hidden_layers=4)),
    "nanbeige-loss-weights-skip-norm": ("nanbeige", dict(num_loops=1, loop_loss_weights=[0.5, 0.5],
                                                         skip_loop_final_norm=True)),  # the c_proj / MLP / lm_head biases (not no_bias)
    "gpt_bigcode-mha-untied": ("gpt_bigcode", dict(multi_query=False, tie_word_embeddings=False,
                                                   mlp_bias=False)),
    # mixture of experts: the layer rules, routers and shared-expert switches the zoo leaves alone
    "qwen3_moe-dense-layers": ("qwen3_moe", dict(num_hidden_layers=4, mlp_only_layers=[0],
                                                 decoder_sparse_step=2, norm_topk_prob=False)),
    "qwen3_moe-tied": ("qwen3_moe", dict(tie_word_embeddings=True)),
    "qwen2_moe-top1": ("qwen2_moe", dict(num_experts_per_tok=1, rope_traditional=True)),
    "mixtral-tied-top1": ("mixtral", dict(tie_word_embeddings=True, num_experts_per_tok=1)),
    "olmoe-renorm-biases-tied": ("olmoe", dict(norm_topk_prob=True, mlp_bias=True, attention_bias=True,
                                               tie_word_embeddings=True)),
    "granitemoe-tied-top1": ("granitemoe", dict(tie_word_embeddings=True, num_experts_per_tok=1,
                                                attention_bias=True)),
    "glm4_moe-groups-qknorm": ("glm4_moe", dict(n_routed_experts=8, n_group=2, topk_group=1,
                                                use_qk_norm=True, first_k_dense_replace=0)),
    "glm4_moe-noshared-norenorm": ("glm4_moe", dict(n_shared_experts=None, norm_topk_prob=False,
                                                    num_experts_per_tok=1)),
    "dots1-groups-biases-tied": ("dots1", dict(n_routed_experts=8, n_group=4, topk_group=2, mlp_bias=True,
                                               tie_word_embeddings=True)),
    "deepseek-freq-noshared": ("deepseek", dict(num_hidden_layers=4, moe_layer_freq=2, n_shared_experts=None,
                                                attention_bias=True,
                                                rope_scaling={"type": "linear", "factor": 2.0})),
    # default layer pattern, head_dim 24 (1 / sqrt(24) != 24**-0.5 in float), plain rope
    "gpt_oss-default-layers-hd24": ("gpt_oss", dict(layer_types=None, head_dim=24, rope_scaling=None)),
    "gpt_oss-full-first-top1": ("gpt_oss", dict(layer_types=_LT[::-1], num_experts_per_tok=1,
                                                sliding_window=8)),
    "phimoe-plain-rope-top3": ("phimoe", dict(rope_scaling=None, num_experts_per_tok=3,
                                              router_jitter_noise=0.2)),
    "ernie4_5_moe-sigmoid-untied-biases": ("ernie4_5_moe", dict(moe_gate_act="sigmoid",
                                                                tie_word_embeddings=False, use_bias=True,
                                                                moe_layer_interval=2)),
    "minimax-noqknorm-tied-top1": ("minimax_m2", dict(use_qk_norm=False, tie_word_embeddings=True,
                                                      num_experts_per_tok=1, rotary_dim=16)),
}
# mlx-lm itself cannot run these (its tied seed_oss head multiplies by the packed weight)
_ORACLE_BROKEN = {("seed_oss-tied-biases", "q4"), ("llama4_text-tied-no-qknorm", "q4")}  # (llama4_text's too)


def _remap(model_type: str) -> str:
    from mlxbun.config import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)


# unquantized half-precision experts do not run on mlx's CPU gather_mm (tests/universal_manifest.py)
_KNOB_CASES = [(c, v) for c in KNOBS for v in ("float32", "bfloat16", "q4")
               if not (v == "bfloat16" and DESCRIPTORS[_remap(KNOBS[c][0])].moe is not None)]


@pytest.mark.parametrize("case,variant", _KNOB_CASES, ids=[f"{c}-{v}" for c, v in _KNOB_CASES])
def test_knob_variants_bit_exact(tmp_path, case, variant):
    from mlxbun.zoo import tiny_config

    if (case, variant) in _ORACLE_BROKEN:
        pytest.skip("mlx-lm cannot run this combination")
    arch, overrides = KNOBS[case]
    cfg = {**tiny_config(arch), **overrides}
    if "rope_parameters" not in DESCRIPTORS[_remap(cfg["model_type"])].fields:
        cfg.pop("rope_parameters", None)  # keep the overridden legacy rope keys authoritative
    require_coverage(cfg["model_type"], cfg)
    dtype = "float32" if variant == "q4" else variant
    path = random_checkpoint(tmp_path / case, cfg, dtype, 4 if variant == "q4" else None)
    assert_parity(path)


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_caches_and_surface_match_mlx_lm(zoo, arch):
    path = zoo(arch) if get_arch(arch).unquantizable else zoo(arch, quant=4)  # (afm7: mlx-lm cannot quantize)
    ref, ours = oracle(path), load_universal(path)
    # same parameter names/shapes/dtypes (quantized modules included) and same module paths
    ref_params = {k: (v.shape, v.dtype) for k, v in tree_flatten(ref.parameters())}
    assert {k: (v.shape, v.dtype) for k, v in tree_flatten(ours.parameters())} == ref_params
    # module paths too, but for the parameter-free routers mlx-lm's inline routing has no module for
    observers = {n for n, m in ours.named_modules() if getattr(m, "observer", False)}
    assert all(n.endswith(f".{ours.descriptor.moe.names.router}") for n in observers)
    assert sorted(n for n, _ in ours.named_modules() if n not in observers) == sorted(
        n for n, _ in ref.named_modules())
    assert len(ours.layers) == len(ref.layers)
    # the cache kinds of the mlx-lm file (its make_cache, else make_prompt_cache's default)
    kinds = lambda caches: [(type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None))
                            for c in caches]
    assert kinds(ours.make_cache()) == kinds(oracle_cache(ref))
    ids = prompt_ids(20)
    h = ours.forward_hidden(ids)
    assert h.shape == (1, 20, ours.args.hidden)
    assert mx.array_equal(ours.logits_from_hidden(h), ours(ids))
    assert ours.weights_bytes == sum(v.nbytes for _, v in tree_flatten(ref.parameters()))
    assert ours.model_type == DESCRIPTORS[ours.model_type].model_type
    assert ours.config.model_type == ours.model_type
    assert ours.raw_config["model_type"] == (get_arch(arch).model_type or arch)


# VLM wrappers around another file's text model: the file mlx-lm builds it from (mistral3: the
# llama text model, the one its row runs)
_WRAPPED = {"gemma3": "gemma3_text", "mistral3": "llama", "gemma4": "gemma4_text", "pixtral": "llama",
            "qwen2_vl": "qwen2", "qwen3_vl": "qwen3", "lfm2-vl": "lfm2", "qwen3_vl_moe": "qwen3_moe",
            "kimi_vl": "kimi_vl.TextArgs", "kimi_k25": "deepseek_v3"}


def test_descriptor_fields_are_mlx_lm_model_args():
    """Every row reads exactly its ModelArgs fields, with the same defaults."""
    for mt, d in DESCRIPTORS.items():
        args_cls = importlib.import_module(f"mlx_lm.models.{mt}").ModelArgs
        injected = {}
        if mt in _WRAPPED:  # gemma3, mistral3, gemma4: the wrapped file's args
            injected = args_cls(model_type=mt, text_config={}).text_config  # the wrapper's defaults
            injected = injected if isinstance(injected, dict) else {}  # (kimi: already its args)
            module, _, cls = _WRAPPED[mt].partition(".")  # the file's ModelArgs, else the class named
            args_cls = getattr(importlib.import_module(f"mlx_lm.models.{module}"), cls or "ModelArgs")
            names = {f.name for f in dataclasses.fields(args_cls)}  # from_dict keeps its fields only
            injected = {k: v for k, v in injected.items() if k in names}
        elif d.names.wrapper:  # a VLM wrapper (qwen3_5): the text model's args, from its file
            model_cls = importlib.import_module(f"mlx_lm.models.{mt}").Model
            args_cls = next(vars(importlib.import_module(c.__module__))["TextModelArgs"]
                            for c in model_cls.__mro__ if "TextModelArgs" in vars(importlib.import_module(c.__module__)))
        want = {}
        for f in dataclasses.fields(args_cls):
            missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if missing:
                want[f.name] = REQUIRED
            else:  # a default_factory field (ernie4_5_moe's moe_capacity, mellum's
                # rope_parameters={}): its fresh value
                want[f.name] = f.default_factory() if f.default is dataclasses.MISSING else f.default
        want.update(injected)
        assert dict(d.fields) == want, mt
        assert mt not in NOT_COVERED


def test_table_manifest_and_zoo_agree():
    """A new arch that fits the knobs is one row + one zoo entry + one manifest entry."""
    from mlxbun.config import MODEL_REMAPPING
    from mlxbun.zoo import ARCHS as ZOO_ARCHS

    assert set(MANIFEST) == set(ZOO_ARCHS), (
        f"zoo archs without a manifest entry: {sorted(set(ZOO_ARCHS) - set(MANIFEST))}; "
        f"manifest entries without a zoo arch: {sorted(set(MANIFEST) - set(ZOO_ARCHS))}")
    from mlxbun.profile import L1_DEDICATED_TYPES

    remapped = {MODEL_REMAPPING.get(a, a) for a in ARCHS if get_arch(a).model_type is None}
    assert {a for a in MANIFEST if a not in ARCHS} == set(L1_DEDICATED_TYPES)
    assert remapped == set(DESCRIPTORS), (
        f"rows without a manifest/zoo entry: {sorted(set(DESCRIPTORS) - remapped)}; "
        f"entries without a row: {sorted(remapped - set(DESCRIPTORS))}")
    assert len(DESCRIPTORS) >= 30
    # a wrapper's second text model (text_rows): a zoo arch of its own whose config picks it
    variants = {(get_arch(a).model_type, tiny_config(a)["text_config"]["model_type"])
                for a in MANIFEST if get_arch(a).model_type is not None}
    assert variants == {(mt, t) for mt, d in DESCRIPTORS.items() for t in d.text_rows}


_OLMO2_FIELDS = DESCRIPTORS["olmo2"].fields


@pytest.mark.parametrize("build, knob, accepted", [
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, mlp=MlpKnobs(act="geluu")),
     "mlp.act = 'geluu'", "'gelu_approx'"),
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, qk_norm=QKNormKnobs("rms", "flatt")),
     "qk_norm.at = 'flatt'", "'heads_transposed'"),
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, attention="sdpaa"),
     "attention = 'sdpaa'", "'sdpa_qk_f32'"),
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, post_init=("kv_head_default",)),
     "post_init[0] = 'kv_head_default'", "'kv_heads_default'"),
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, sanitize=(SanitizeRule("drop"),)),
     "sanitize[0].op = 'drop'", "'drop_containing'"),
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, mlp=MlpKnobs("plain", act="silu")),
     "mlp.act = 'silu' with mlp.kind 'plain'", "'relu2'"),
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, rope=RopeKnobs(theta="rope_thetaa")),
     "rope.theta reads the field 'rope_thetaa'", "rope_theta"),
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, head=HeadKnobs(tie="weights")),
     "head.tie = 'weights'", "'checkpoint'"),
    (lambda: ArchDescriptor("my_arch", _OLMO2_FIELDS, block=BlockKnobs("post")),
     "norm slot(s) post_attn, post_mlp", "unnamed"),
])
def test_a_bad_row_fails_when_built_naming_the_row_knob_and_accepted_values(build, knob, accepted):
    with pytest.raises(DescriptorError) as e:
        build()
    msg = str(e.value)
    assert msg.startswith("descriptor 'my_arch': ") and knob in msg and accepted in msg


def test_rows_hold_enums_after_construction():
    d = DESCRIPTORS["olmo2"]
    assert d.block.kind is BlockKind.POST and d.qk_norm.at is QKNormAt.FLAT
    assert all(isinstance(step, PostInit) for step in d.post_init)
    assert DESCRIPTORS["nanochat"].head.softcap is FinalSoftcap.COMPILED


def test_gemma3_text_ties_when_the_checkpoint_has_no_head(zoo, tmp_path):
    src = zoo("gemma3_text")
    path = rewrite_checkpoint(src, tmp_path / "tied", lambda w: {k: v for k, v in w.items() if k != "lm_head.weight"})
    ref, ours = oracle(path), load_universal(path)
    assert ours.tied and "lm_head" not in ours and "lm_head" not in ref
    ids = prompt_ids(PROMPT_LEN)
    assert mx.array_equal(ref(ids), ours(ids))
    assert not load_universal(src).tied


# ----------------------------------------------------------------- refusals


def test_unknown_model_type_refuses_naming_supported_types():
    with pytest.raises(UnsupportedModelError) as e:
        build_model({"model_type": "definitely_not_an_arch", "hidden_size": 64})
    msg = str(e.value)
    assert "definitely_not_an_arch" in msg
    assert all(t in msg for t in ("llama", "qwen3", "gemma2", "nanochat"))


def test_not_covered_type_refuses_with_its_reason():
    with pytest.raises(UnsupportedModelError) as e:
        build_model({"model_type": "kimi_linear"})
    assert "kimi_linear" in str(e.value) and NOT_COVERED["kimi_linear"] in str(e.value)


def test_missing_required_field_is_a_config_error():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        build_model({"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
                     "intermediate_size": 128, "num_attention_heads": 4, "rms_norm_eps": 1e-6,
                     "vocab_size": 512})


def _config(zoo, arch):
    return json.loads((Path(zoo(arch)) / "config.json").read_text())


@pytest.mark.parametrize("arch", ARCHS)
def test_zoo_configs_are_fully_covered(zoo, arch):
    cfg = _config(zoo, arch)
    report = require_coverage(cfg["model_type"], cfg)
    assert report.ok and {"hidden_size", "n_embd", "model_dim", "d_model", "hidden_dim"} & set(report.understood)


def test_unknown_numerics_key_refuses_naming_it(zoo, tmp_path):
    cfg = _config(zoo, "llama")
    with pytest.raises(UnsupportedModelError, match="attention_temperature"):
        require_coverage("llama", {**cfg, "attention_temperature": 2.0})
    # neutral values of unknown keys cannot change numerics
    report = check_coverage("llama", {**cfg, "attention_temperature": None, "use_magic": False})
    assert report.ok and set(report.unknown) == {"attention_temperature", "use_magic"}
    # and the loader refuses too, before any weight is read
    path = rewrite_checkpoint(zoo("llama"), tmp_path / "temp", lambda w: w,
                              config=lambda c: {**c, "attention_temperature": 2.0})
    with pytest.raises(UnsupportedModelError, match="attention_temperature"):
        load_universal(path)


@pytest.mark.parametrize("change, key", [
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(rope_parameters={"rope_type": "default", "rope_theta": 1234.0}), "rope_parameters"),
    (dict(layer_types=["full_attention", "chunked_attention"]), "layer_types"),
])
def test_values_mlx_lm_would_not_honour_refuse(zoo, change, key):
    cfg = {**_config(zoo, "llama"), **change}
    with pytest.raises(UnsupportedModelError, match=key):
        require_coverage("llama", cfg)


def test_alias_and_pattern_disagreements_refuse(zoo):
    neox = {**_config(zoo, "gpt_neox")}
    neox["rope_theta"] = neox["rotary_emb_base"] * 2
    with pytest.raises(UnsupportedModelError, match="rope_theta"):
        require_coverage("gpt_neox", neox)
    gemma3 = _config(zoo, "gemma3_text")
    gemma3["layer_types"] = ["full_attention"] * len(gemma3["layer_types"])
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        require_coverage("gemma3_text", gemma3)
    internlm = {**_config(zoo, "internlm3"), "head_dim": 32}
    with pytest.raises(UnsupportedModelError, match="head_dim"):
        require_coverage("internlm3", internlm)


# ----------------------------------------------------------------- weight audit


def test_clean_audit_and_dry_run_agree(zoo):
    path = zoo("llama", quant=4)
    report = audit_checkpoint(path)
    assert report.ok and not report.dropped
    model = load_universal(path)
    assert model.audit.consumed == report.consumed
    assert set(report.consumed) == {k for k, _ in tree_flatten(model.parameters())}


@pytest.mark.parametrize("edit, name, what", [
    (lambda w: {k: v for k, v in w.items() if k != "model.layers.1.mlp.up_proj.weight"},
     "model.layers.1.mlp.up_proj.weight", "missing"),
    (lambda w: {**w, "model.layers.0.self_attn.extra.weight": mx.zeros((4,))},
     "model.layers.0.self_attn.extra.weight", "unconsumed"),
    (lambda w: {**w, "model.norm.weight": mx.ones((65,))}, "model.norm.weight", "mismatched"),
    (lambda w: {**w, "model.norm.weight": mx.ones((64,), dtype=mx.int32)}, "model.norm.weight",
     "non-float"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_bad_checkpoints_are_load_errors_naming_the_tensor(zoo, tmp_path, edit, name, what, dry_run):
    path = rewrite_checkpoint(zoo("llama"), tmp_path / "bad", edit)
    with pytest.raises(LoadError) as e:
        audit_checkpoint(path) if dry_run else load_universal(path)
    assert name in str(e.value) and what in str(e.value) and str(path) in str(e.value)


def test_drop_rules_follow_the_mlx_lm_sanitize(zoo, tmp_path):
    inv = {"model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((8,))}
    llama = rewrite_checkpoint(zoo("llama"), tmp_path / "llama", lambda w: {**w, **inv})
    report = audit_checkpoint(llama)
    assert report.ok and set(report.dropped) == set(inv)
    load_universal(llama)
    # qwen3's sanitize keeps inv_freq, so mlx-lm's strict load refuses it: so do we
    qwen3 = rewrite_checkpoint(zoo("qwen3"), tmp_path / "qwen3", lambda w: {**w, **inv})
    with pytest.raises(LoadError, match="inv_freq"):
        load_universal(qwen3)
    with pytest.raises(ValueError):
        oracle(qwen3)


def test_gpt_neox_hub_names_are_renamed_like_mlx_lm(zoo, tmp_path):
    """A transformers-named gpt_neox checkpoint (gpt_neox.layers.N..., embed_out) loads."""
    def to_hub(w):
        out = {}
        for k, v in w.items():
            k = k.replace("model.h.", "gpt_neox.layers.").replace("model.embed_out", "embed_out")
            out[k.replace("model.", "gpt_neox.")] = v
        out["gpt_neox.layers.0.attention.masked_bias"] = mx.array(0.0)
        return out

    path = rewrite_checkpoint(zoo("gpt_neox"), tmp_path / "neox", to_hub)
    report = audit_checkpoint(path)
    assert report.ok and list(report.dropped) == ["gpt_neox.layers.0.attention.masked_bias"]
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(PROMPT_LEN)
    assert mx.array_equal(ref(ids), ours(ids))


def test_gpt2_hub_conv1d_layout_is_sanitized_like_mlx_lm(zoo, tmp_path):
    """A transformers-layout gpt2 checkpoint (no model. prefix, Conv1D [in, out] weights, the
    causal-mask buffer h.N.attn.bias) loads as mlx-lm's sanitize makes it."""
    conv1d = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")

    def to_hub(w):
        out = {k.removeprefix("model."): (v.T if k.endswith(conv1d) else v) for k, v in w.items()}
        out["h.0.attn.bias"] = mx.ones((1, 1, 8, 8))
        return out

    path = rewrite_checkpoint(zoo("gpt2"), tmp_path / "gpt2", to_hub)
    report = audit_checkpoint(path)
    assert report.ok and list(report.dropped) == ["h.0.attn.bias"]
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(PROMPT_LEN)
    assert mx.array_equal(ref(ids), ours(ids))


def test_gptj_hub_names_are_renamed_like_mlx_lm(zoo, tmp_path):
    """A transformers-named gptj checkpoint (transformer.*, the attention buffers) loads."""
    buffers = {"transformer.h.1.attn.bias": mx.ones((1, 1, 8, 8)), "transformer.h.0.attn.masked_bias": mx.array(0.0)}
    path = rewrite_checkpoint(zoo("gptj"), tmp_path / "gptj",
                              lambda w: {**{k.replace("model.", "transformer."): v for k, v in w.items()}, **buffers})
    report = audit_checkpoint(path)
    assert report.ok and set(report.dropped) == set(buffers)
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(PROMPT_LEN)
    assert mx.array_equal(ref(ids), ours(ids))


def test_phixtral_per_expert_tensors_are_stacked_like_mlx_lm(zoo, tmp_path):
    """A phixtral checkpoint with per-expert moe.mlp.N.fc1 / fc2 tensors loads as mlx-lm stacks them."""
    def unstack(w):
        out = {}
        for k, v in w.items():
            if ".moe.switch_mlp." in k:
                for e in range(v.shape[0]):
                    out[k.replace(".switch_mlp.", f".mlp.{e}.")] = v[e]
            else:
                out[k] = v
        return out

    path = rewrite_checkpoint(zoo("phixtral"), tmp_path / "phixtral", unstack)
    assert audit_checkpoint(path).ok
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(PROMPT_LEN)
    assert mx.array_equal(ref(ids), ours(ids))


def test_dbrx_fused_expert_matrices_are_split_like_mlx_lm(zoo, tmp_path):
    """A transformers-layout dbrx checkpoint (ffn.experts.mlp.w1 / v1 / w2 fused over the experts, w2
    transposed) loads as mlx-lm's sanitize splits it."""
    def fuse(w):
        out, experts = {}, {}
        for k, v in w.items():
            head, sep, tail = k.partition(".ffn.experts.")
            if not sep:
                out[k] = v
                continue
            e, name, _ = tail.split(".")
            experts.setdefault((head, name), {})[int(e)] = v.T if name == "w2" else v
        for (head, name), parts in experts.items():
            out[f"{head}.ffn.experts.mlp.{name}"] = mx.concatenate([parts[e] for e in sorted(parts)], axis=0)
        return out

    path = rewrite_checkpoint(zoo("dbrx"), tmp_path / "dbrx", fuse)
    assert audit_checkpoint(path).ok
    ref, ours = oracle(path), load_universal(path)
    ids = prompt_ids(PROMPT_LEN)
    assert mx.array_equal(ref(ids), ours(ids))


def test_make_cache_honours_max_kv_size_where_mlx_lm_ignores_it(zoo):
    """llama with sliding layers and gemma3_text define their own make_cache in mlx-lm, which
    drops max_kv_size; mlxbun bounds every full-attention layer instead of ignoring it."""
    from mlxbun.cache.kv import KVCache, RotatingKVCache
    from mlxbun.models.universal.loader import load_universal

    model = load_universal(zoo("gemma3_text"))
    kinds = [s.sliding for s in model.args.layers]
    assert True in kinds and False in kinds
    unbounded = model.make_cache()
    assert any(type(c) is KVCache for c in unbounded)
    bounded = model.make_cache(max_kv_size=24)
    assert all(isinstance(c, RotatingKVCache) for c in bounded)
    assert {c.max_size for c, s in zip(bounded, kinds) if not s} == {24}
    ids = mx.array([list(range(10, 50))])
    model(ids, cache=bounded)
    for _ in range(4):
        model(ids[:, -1:], cache=bounded)
    assert all(c.size() <= max(24, model.args.sliding_window) for c in bounded)
