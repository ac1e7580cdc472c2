"""mlxbun.config: normalized TextConfig from real transformers configs and hand-written
old-style configs; every user error names the file and the key."""

import dataclasses
import json
import os

import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import transformers as T  # noqa: E402

from mlxbun import config as C  # noqa: E402
from mlxbun.config import (  # noqa: E402
    ConfigError,
    KVLayerSpec,
    config_from_dict,
    load_model_config,
)
from mlxbun.quant import QuantSpec  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def _write(tmp_path, config, **files):
    """A checkpoint dir: config.json (+ other files given as name=object or name=str)."""
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))
    for name, content in files.items():
        name = name.replace("__", ".")
        (d / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return d


def _expect_types(pattern_fn, n):
    return tuple("full_attention" if pattern_fn(i) else "sliding_attention" for i in range(n))


# ---------------------------------------------------------------- vendored tables


def test_vendored_remapping_equals_mlx_lm():
    from mlx_lm import utils as U

    assert C.MODEL_REMAPPING == U.MODEL_REMAPPING
    assert C.MODEL_ARCHITECTURE_REMAPPING == U.MODEL_ARCHITECTURE_REMAPPING


def test_model_type_is_remapped_source_kept():
    cfg = config_from_dict(T.MistralConfig(**TINY, num_hidden_layers=2).to_dict())
    assert (cfg.source_model_type, cfg.model_type) == ("mistral", "llama")
    d = {**T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict(), "model_type": "bailing_hybrid",
         "architectures": ["BailingMoeV3ForCausalLM"]}
    assert config_from_dict(d).model_type == "bailing_moe_v3"


# ---------------------------------------------------------------- sizes over real configs

DENSE = [
    T.LlamaConfig, T.MistralConfig, T.Qwen2Config, T.Qwen3Config, T.Gemma2Config, T.GemmaConfig,
    T.Gemma3TextConfig, T.Phi3Config, T.Olmo2Config, T.Olmo3Config, T.Glm4Config, T.GraniteConfig,
    T.Starcoder2Config, T.SmolLM3Config, T.CohereConfig, T.Cohere2Config, T.Exaone4Config,
    T.MixtralConfig, T.Ministral3Config,
]


@pytest.mark.parametrize("cls", DENSE, ids=lambda c: c.__name__)
def test_dense_sizes_match_transformers(cls, tmp_path):
    hf = cls()
    cfg = load_model_config(_write(tmp_path, hf.to_dict()))
    assert cfg.model_type == C.MODEL_REMAPPING.get(hf.model_type, hf.model_type)
    assert cfg.vocab_size == hf.vocab_size
    assert cfg.hidden_size == hf.hidden_size
    assert cfg.intermediate_size == hf.intermediate_size
    assert cfg.num_hidden_layers == hf.num_hidden_layers
    assert cfg.num_attention_heads == hf.num_attention_heads
    assert cfg.num_key_value_heads == (hf.num_key_value_heads or hf.num_attention_heads)
    assert cfg.head_dim == (getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads)
    eps = next(getattr(hf, k) for k in ("rms_norm_eps", "layer_norm_eps", "norm_epsilon") if hasattr(hf, k))
    assert cfg.norm_eps == eps
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings
    assert cfg.tie_word_embeddings_raw is hf.tie_word_embeddings
    assert cfg.max_position_embeddings == hf.max_position_embeddings
    assert cfg.layers.types == tuple(getattr(hf, "layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
    assert len(cfg.layers.use_rope) == cfg.num_hidden_layers
    assert not cfg.is_vlm and cfg.weight_prefix == "" and not cfg.has_vision and not cfg.has_audio
    assert cfg.path == tmp_path / "ckpt"


def test_alias_keys_gpt2_style():
    cfg = config_from_dict(T.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100).to_dict())
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (64, 2, 4)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (4, 16)
    assert cfg.norm_eps == 1e-5 and cfg.max_position_embeddings == 1024
    assert cfg.intermediate_size is None  # n_inner: null


def test_head_dim_and_kv_heads_fallbacks_and_defaults():
    d = {"model_type": "llama", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 8, "head_dim": None, "rms_norm_eps": 1e-5}
    cfg = config_from_dict(d)
    assert (cfg.num_key_value_heads, cfg.head_dim) == (8, 8)
    assert cfg.intermediate_size is None and cfg.max_position_embeddings is None
    assert cfg.tie_word_embeddings_raw is None and cfg.tie_word_embeddings is True
    assert cfg.dtype is None and cfg.layers.partial_rotary_factor == 1.0
    assert cfg.layers.attn_logit_softcap is None and cfg.layers.final_logit_softcap is None
    assert cfg.layers.rope_for("full_attention") == {"rope_type": "default", "rope_theta": None}
    assert config_from_dict({**d, "torch_dtype": "bfloat16"}).dtype == "bfloat16"
    assert config_from_dict({**d, "dtype": "float16", "torch_dtype": "bfloat16"}).dtype == "float16"


def test_softcaps_gemma2():
    cfg = config_from_dict(T.Gemma2Config(**TINY, num_hidden_layers=2).to_dict())
    assert (cfg.layers.attn_logit_softcap, cfg.layers.final_logit_softcap) == (50.0, 30.0)


# ---------------------------------------------------------------- layer types


def test_gemma3_text_layer_types_pattern_and_rope_per_type():
    hf = T.Gemma3TextConfig(**TINY, num_hidden_layers=14, sliding_window=32)
    d = hf.to_dict()
    expected = _expect_types(lambda i: (i + 1) % 6 == 0, 14)
    cfg = config_from_dict(d)
    assert cfg.layers.types == expected == tuple(hf.layer_types)
    assert cfg.layers.sliding_window == 32
    assert cfg.layers.rope_for("sliding_attention")["rope_theta"] == 10000.0
    assert cfg.layers.rope_for("full_attention")["rope_theta"] == 1_000_000.0
    # the same checkpoint as written before transformers 5: a pattern and per-kind bases
    old = {k: v for k, v in d.items() if k not in ("layer_types", "_sliding_window_pattern", "rope_parameters")}
    old.update(sliding_window_pattern=6, rope_theta=1_000_000.0, rope_local_base_freq=10000.0)
    old_cfg = config_from_dict(old)
    assert old_cfg.layers.types == expected
    assert dict(old_cfg.layers.rope) == dict(cfg.layers.rope)
    assert old_cfg.fingerprint() == cfg.fingerprint()
    # no pattern at all: mlx-lm's gemma3_text default of 6
    del old["sliding_window_pattern"]
    assert config_from_dict(old).layers.types == expected


def test_gemma3_old_style_scaling_applies_to_global_layers_only():
    d = T.Gemma3TextConfig(**TINY, num_hidden_layers=6).to_dict()
    for k in ("layer_types", "_sliding_window_pattern", "rope_parameters"):
        d.pop(k)
    d.update(sliding_window_pattern=6, rope_theta=1e6, rope_local_base_freq=1e4,
             rope_scaling={"factor": 8.0, "rope_type": "linear"})
    cfg = config_from_dict(d)
    assert cfg.layers.rope_for("full_attention") == {"factor": 8.0, "rope_type": "linear", "rope_theta": 1e6}
    assert cfg.layers.rope_for("sliding_attention") == {"rope_type": "default", "rope_theta": 1e4}
    # the transformers-5 form of the same thing
    new = T.Gemma3TextConfig(**TINY, num_hidden_layers=6, rope_parameters={
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}).to_dict()
    assert dict(config_from_dict(new).layers.rope) == dict(cfg.layers.rope)


def test_gemma2_alternates_like_transformers():
    hf = T.Gemma2Config(**TINY, num_hidden_layers=5, sliding_window=16)
    d = hf.to_dict()
    assert config_from_dict(d).layers.types == tuple(hf.layer_types)
    d.pop("layer_types")  # pre-transformers-5 gemma-2 configs carry no layer_types
    cfg = config_from_dict(d)
    assert cfg.layers.types == tuple(hf.layer_types) == _expect_types(lambda i: i % 2 == 1, 5)
    assert cfg.layers.sliding_window == 16


@pytest.mark.parametrize("cls", [T.Qwen2Config, T.Qwen3Config], ids=lambda c: c.__name__)
def test_qwen_use_sliding_window_and_max_window_layers(cls):
    hf = cls(**TINY, num_hidden_layers=6, use_sliding_window=True, sliding_window=128, max_window_layers=4)
    d = hf.to_dict()
    expected = _expect_types(lambda i: i < 4, 6)
    assert tuple(hf.layer_types) == expected
    d.pop("layer_types")  # derive from use_sliding_window + max_window_layers
    cfg = config_from_dict(d)
    assert cfg.layers.types == expected and cfg.layers.sliding_window == 128
    # the window is declared but switched off (Qwen2.5 ships configs like this)
    off = config_from_dict({**d, "use_sliding_window": False, "sliding_window": 32768})
    assert off.layers.types == ("full_attention",) * 6 and off.layers.sliding_window is None


def test_declared_window_without_sliding_layers_is_none():
    cfg = config_from_dict(T.MistralConfig(**TINY, num_hidden_layers=2, sliding_window=4096).to_dict())
    assert cfg.layers.types == ("full_attention",) * 2 and cfg.layers.sliding_window is None
    assert cfg.raw["sliding_window"] == 4096


def test_cohere2_rope_only_on_sliding_layers():
    hf = T.Cohere2Config(**TINY, num_hidden_layers=8, sliding_window=64)
    d = hf.to_dict()
    for dd in (d, {k: v for k, v in d.items() if k != "layer_types"}):
        cfg = config_from_dict(dd)
        assert cfg.layers.types == tuple(hf.layer_types) == _expect_types(lambda i: (i + 1) % 4 == 0, 8)
        assert cfg.layers.use_rope == tuple(t == "sliding_attention" for t in cfg.layers.types)


def test_exaone4_patterns_int_and_string():
    hf = T.Exaone4Config(**TINY, num_hidden_layers=8, sliding_window=64, sliding_window_pattern=4)
    d = hf.to_dict()
    expected = _expect_types(lambda i: (i + 1) % 4 == 0, 8)
    assert config_from_dict(d).layers.types == expected == tuple(hf.layer_types)
    d.pop("layer_types")
    cfg = config_from_dict({**d, "sliding_window_pattern": "LLLG"})  # the released EXAONE 4.0 form
    assert cfg.layers.types == expected
    assert cfg.layers.use_rope == tuple(t == "sliding_attention" for t in expected)  # global layers are NoPE
    no_window = config_from_dict({**d, "sliding_window": None, "sliding_window_pattern": None})
    assert no_window.layers.types == ("full_attention",) * 8 and all(no_window.layers.use_rope)


def test_olmo3_layer_types_and_rope_parameters_per_type():
    hf = T.Olmo3Config(**TINY, num_hidden_layers=8, sliding_window=32)
    cfg = config_from_dict(hf.to_dict())
    assert cfg.layers.types == tuple(hf.layer_types)
    assert set(cfg.layers.rope) == {"full_attention", "sliding_attention"}
    assert cfg.layers.rope_for("sliding_attention")["rope_theta"] == hf.rope_parameters["sliding_attention"]["rope_theta"]


def test_explicit_layer_types_keep_other_kinds_and_truncate():
    d = {"model_type": "qwen3_next", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 4,
         "num_attention_heads": 4,
         "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention", "x"]}
    cfg = config_from_dict(d)
    assert cfg.layers.types == ("linear_attention",) * 3 + ("full_attention",)
    assert set(cfg.layers.rope) == {"linear_attention", "full_attention"}
    with pytest.raises(ConfigError, match=r"config\.json.*'layer_types'.*3 entries for 4 layers"):
        config_from_dict({**d, "layer_types": d["layer_types"][:3]})


def test_hybrid_block_pattern_nemotron_h():
    d = T.NemotronHConfig().to_dict()
    cfg = config_from_dict(d)
    assert cfg.num_hidden_layers == len(d["layers_block_type"])
    assert cfg.layers.types == tuple(d["layers_block_type"])
    d.pop("layers_block_type")
    cfg = config_from_dict({**d, "hybrid_override_pattern": "M-M*E"})  # the pre-transformers-5 form
    assert cfg.layers.types == ("linear_attention", "mlp", "linear_attention", "full_attention", "moe")
    with pytest.raises(ConfigError, match=r"'hybrid_override_pattern' must be a string of"):
        config_from_dict({**d, "hybrid_override_pattern": "MX"})


def test_smollm3_use_rope_and_sliding_on_nope_layers():
    hf = T.SmolLM3Config(**TINY, num_hidden_layers=8)
    d = hf.to_dict()
    expected = tuple(bool((i + 1) % 4) for i in range(8))
    assert config_from_dict(d).layers.use_rope == expected == tuple(map(bool, hf.no_rope_layers))
    d.pop("no_rope_layers")
    assert config_from_dict(d).layers.use_rope == expected  # from no_rope_layer_interval
    hf = T.SmolLM3Config(**TINY, num_hidden_layers=8, no_rope_layers=[1, 0, 1, 1, 0, 1, 1, 1],
                         use_sliding_window=True, sliding_window=16)
    d = hf.to_dict()
    d.pop("layer_types")
    cfg = config_from_dict(d)
    assert cfg.layers.use_rope == (True, False, True, True, False, True, True, True)
    assert cfg.layers.types == tuple(hf.layer_types)
    assert cfg.layers.types[1] == "sliding_attention" and cfg.layers.sliding_window == 16


# ---------------------------------------------------------------- rope

LLAMA31_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"}


def test_llama31_old_style_equals_transformers5_style():
    new = T.LlamaConfig(**TINY, num_hidden_layers=2, rope_parameters={**LLAMA31_SCALING, "rope_theta": 500000.0}).to_dict()
    old = {k: v for k, v in new.items() if k != "rope_parameters"}
    old.update(rope_theta=500000.0, rope_scaling=dict(LLAMA31_SCALING))
    a, b = config_from_dict(new), config_from_dict(old)
    assert a.layers.rope_for("full_attention") == {**LLAMA31_SCALING, "rope_theta": 500000.0}
    assert dict(a.layers.rope) == dict(b.layers.rope) and a.fingerprint() == b.fingerprint()


def test_phi3_longrope_old_style_with_top_level_original_max():
    d = T.Phi3Config(**TINY, num_hidden_layers=2, max_position_embeddings=131072,
                     original_max_position_embeddings=4096).to_dict()
    d.pop("rope_parameters")
    short, long = [1.0] * 8, [1.5] * 8
    d.update(rope_theta=10000.0, rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long})
    r = config_from_dict(d).layers.rope_for("full_attention")
    assert r["rope_type"] == "longrope" and r["rope_theta"] == 10000.0
    assert r["short_factor"] == tuple(short) and r["long_factor"] == tuple(long)
    assert r["original_max_position_embeddings"] == 4096 and "type" not in r
    d["rope_scaling"]["type"] = "su"  # the older name, kept as written
    assert config_from_dict(d).layers.rope_for("full_attention")["rope_type"] == "su"


def test_type_key_wins_over_rope_type_like_mlx_lm():
    cfg = config_from_dict(T.Ministral3Config(**TINY, num_hidden_layers=2).to_dict())
    r = cfg.layers.rope_for("full_attention")
    assert r["rope_type"] == "yarn" and r["factor"] == 16.0 and r["rope_theta"] == 1e6
    d = {**T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict(),
         "rope_scaling": {"type": "linear", "rope_type": "default", "factor": 2.0}}
    assert config_from_dict(d).layers.rope_for("full_attention")["rope_type"] == "linear"


def test_partial_rotary_factor_sources():
    base = {"model_type": "x", "vocab_size": 32, "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}
    assert config_from_dict(T.Glm4Config(**TINY, num_hidden_layers=2).to_dict()).layers.partial_rotary_factor == 0.5
    assert config_from_dict({**base, "partial_rotary_factor": 0.4}).layers.partial_rotary_factor == 0.4
    assert config_from_dict({**base, "rotary_pct": 0.25}).layers.partial_rotary_factor == 0.25
    assert config_from_dict({**base, "rope_pct": 0.5}).layers.partial_rotary_factor == 0.5
    assert config_from_dict({**base, "rotary_dim": 4}).layers.partial_rotary_factor == 0.25


def test_rope_for_unknown_kind_names_it():
    cfg = config_from_dict(T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict())
    with pytest.raises(ConfigError, match="sliding_attention"):
        cfg.layers.rope_for("sliding_attention")


# ---------------------------------------------------------------- VLM wrappers


def test_gemma3_vlm_wrapper(tmp_path):
    hf = T.Gemma3Config(text_config=dict(TINY, num_hidden_layers=7, sliding_window=16))
    d = hf.to_dict()
    d["quantization"] = {"group_size": 64, "bits": 4,
                         "language_model.model.layers.0.mlp.down_proj": {"group_size": 32, "bits": 8}}
    cfg = load_model_config(_write(tmp_path, d))
    assert (cfg.source_model_type, cfg.model_type, cfg.text_model_type) == ("gemma3", "gemma3", "gemma3_text")
    assert cfg.is_vlm and cfg.has_vision and not cfg.has_audio
    assert cfg.weight_prefix == "language_model."
    assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 7 and cfg.raw["hidden_size"] == 64
    assert "text_config" in cfg.raw_full and "text_config" not in cfg.raw
    # gemma3.py overrides the text vocab with the top level's (default 262208)
    assert cfg.vocab_size == 262208
    assert cfg.layers.types == _expect_types(lambda i: (i + 1) % 6 == 0, 7)
    spec = QuantSpec(8, 32)
    assert cfg.quant_for("language_model.model.layers.0.mlp.down_proj") == spec
    assert cfg.quant_for("model.layers.0.mlp.down_proj") == spec
    assert cfg.quant_for("model.layers.1.mlp.down_proj") == QuantSpec(4, 64)


def test_mistral3_and_qwen2_vl_and_gemma3n_wrappers():
    m = config_from_dict(T.Mistral3Config(text_config=dict(TINY, num_hidden_layers=2, model_type="mistral")).to_dict())
    assert m.model_type == "mistral3" and m.weight_prefix == "language_model."
    raw = T.Mistral3Config().to_dict()
    raw["text_config"].pop("tie_word_embeddings")
    assert raw["tie_word_embeddings"] is True  # the wrapper's own flag must not leak in
    assert config_from_dict(raw).tie_word_embeddings is False  # mistral3.py default
    q = T.Qwen2VLConfig(text_config=dict(TINY, num_hidden_layers=3)).to_dict()
    qc = config_from_dict(q)
    assert qc.weight_prefix == "language_model." and qc.num_hidden_layers == 3 and qc.has_vision
    flat = {**q.pop("text_config"), "model_type": "qwen2_vl", "vision_config": q["vision_config"]}
    assert config_from_dict(flat).hidden_size == 64  # old flat Qwen2-VL layout
    g = config_from_dict(T.Gemma3nConfig().to_dict())
    assert g.weight_prefix == "model.language_model." and g.has_audio and g.has_vision


def test_vision_sidecar_detected(tmp_path):
    d = _write(tmp_path, T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict())
    assert not load_model_config(d).has_vision
    (d / "optiq").mkdir()
    (d / "optiq" / "optiq_vision.safetensors").write_bytes(b"")
    cfg = load_model_config(d)
    assert cfg.has_vision and not cfg.is_vlm and cfg.vision_sidecar == d / "optiq" / "optiq_vision.safetensors"


# ---------------------------------------------------------------- EOS / special tokens

TOKCFG = {
    "eos_token": "<end_of_turn>",
    "bos_token": {"content": "<bos>", "lstrip": False, "normalized": False, "rstrip": False,
                  "single_word": False, "special": True, "__type": "AddedToken"},
    "added_tokens_decoder": {"0": {"content": "<pad>", "special": True},
                             "2": {"content": "<bos>", "special": True},
                             "106": {"content": "<end_of_turn>", "special": True}},
}


def test_eos_union_across_three_files(tmp_path):
    d = T.LlamaConfig(**TINY, num_hidden_layers=2, eos_token_id=[1, 2], bos_token_id=None).to_dict()
    cfg = load_model_config(_write(tmp_path, d, generation_config__json={"eos_token_id": [2, 107], "bos_token_id": 2},
                                   tokenizer_config__json=TOKCFG))
    assert cfg.eos_token_ids == (1, 2, 107, 106)
    assert cfg.bos_token_id == 2 and cfg.unresolved_eos_tokens == ()
    assert cfg.generation_config["eos_token_id"] == (2, 107)
    assert cfg.tokenizer_config["eos_token"] == "<end_of_turn>"


def test_eos_in_text_config_and_resolution_through_tokenizer_json(tmp_path):
    d = T.Gemma3Config(text_config=dict(TINY, num_hidden_layers=2, eos_token_id=[1, 106])).to_dict()
    d["eos_token_id"] = 1
    tok_json = {"added_tokens": [{"id": 50, "content": "<|im_end|>"}],
                "model": {"type": "BPE", "vocab": {"a": 3, "</s>": 7}}}
    cfg = load_model_config(_write(tmp_path, d, tokenizer_config__json={"eos_token": {"content": "</s>"}, "pad_token": "<|im_end|>"},
                                   tokenizer__json=tok_json))
    assert cfg.eos_token_ids == (1, 106, 7)
    assert cfg.pad_token_id == 0  # the text config declares pad 0 first


def test_unresolvable_eos_string_is_reported(tmp_path):
    d = T.LlamaConfig(**TINY, num_hidden_layers=2, eos_token_id=2).to_dict()
    cfg = load_model_config(_write(tmp_path, d, tokenizer_config__json={"eos_token": "<|eot|>"}))
    assert cfg.eos_token_ids == (2,) and cfg.unresolved_eos_tokens == ("<|eot|>",)
    (tmp_path / "other").mkdir()
    empty = load_model_config(_write(tmp_path / "other", {**d, "eos_token_id": None}))
    assert empty.eos_token_ids == () and dict(empty.generation_config) == {} and dict(empty.tokenizer_config) == {}


# ---------------------------------------------------------------- quantization

QUANT = {
    "group_size": 32, "bits": 4,
    "model.layers.0.self_attn.q_proj": {"group_size": 64, "bits": 8},
    "model.layers.0.mlp.down_proj": {"bits": 6},          # group_size: the affine default (64)
    "model.layers.1.mlp.up_proj": {"bits": 4, "group_size": 32, "mode": "mxfp4"},
    "model.layers.1.self_attn.o_proj": True,               # the global parameters
    "lm_head": False,                                      # left unquantized
}


def test_quant_for_overrides():
    cfg = config_from_dict({**T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict(), "quantization": QUANT})
    assert cfg.quantization == QuantSpec(4, 32, "affine") and cfg.quant_method is None
    assert cfg.quant_for("model.layers.0.self_attn.q_proj") == QuantSpec(8, 64)
    assert cfg.quant_for("model.layers.0.mlp.down_proj") == QuantSpec(6, 64)
    assert cfg.quant_for("model.layers.1.mlp.up_proj") == QuantSpec(4, 32, "mxfp4")
    assert cfg.quant_for("model.layers.1.self_attn.o_proj") == QuantSpec(4, 32)
    assert cfg.quant_for("lm_head") is None
    assert cfg.quant_for("model.layers.1.mlp.gate_proj") == QuantSpec(4, 32)
    assert set(cfg.quant_overrides) == set(QUANT) - {"group_size", "bits"}
    assert config_from_dict(T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()).quant_for("lm_head") is None


def test_quant_for_matches_mlx_nn_quantize():
    """quant_for agrees with what nn.quantize builds from the same block and mlx-lm's predicate."""
    import mlx.nn as nn
    from mlx_lm.models import llama

    d = {**T.LlamaConfig(**TINY, num_hidden_layers=2, tie_word_embeddings=False).to_dict(), "quantization": QUANT}
    d.pop("rope_parameters")
    cfg = config_from_dict(d)
    model = llama.Model(llama.ModelArgs.from_dict(d))
    block = json.loads(json.dumps(QUANT))

    def class_predicate(p, m):  # mlx-lm load_model's override lookup, then "quantize if it can"
        return block[p] if p in block else hasattr(m, "to_quantized")

    nn.quantize(model, group_size=QUANT["group_size"], bits=QUANT["bits"], class_predicate=class_predicate)
    seen = 0
    for path, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding)):
            got = QuantSpec(m.bits, m.group_size, m.mode) if hasattr(m, "bits") else None
            assert cfg.quant_for(path) == got, path
            seen += 1
    assert seen == 2 * 7 + 2


def test_quantization_config_legacy_methods():
    base = T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()
    awq = config_from_dict({**base, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}})
    assert awq.quantization == QuantSpec(4, 128) and awq.quant_method == "awq"
    assert config_from_dict({**base, "quantization_config": {"quant_method": "mxfp4"}}).quantization == QuantSpec(4, 32, "mxfp4")
    fp8 = config_from_dict({**base, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}})
    assert fp8.quantization is None and fp8.quant_method == "fp8"
    mlx_dup = config_from_dict({**base, "quantization_config": {"group_size": 64, "bits": 8}})
    assert mlx_dup.quantization == QuantSpec(8, 64)
    with pytest.raises(ConfigError, match=r"config\.json.*'quantization_config\.format'"):
        config_from_dict({**base, "quantization_config": {"quant_method": "compressed-tensors", "format": "float-quantized"}})


def test_quantization_errors_name_key():
    base = T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()
    with pytest.raises(ConfigError, match=r"config\.json: key 'quantization\.group_size' must be an integer, got missing"):
        config_from_dict({**base, "quantization": {"bits": 4}})
    with pytest.raises(ConfigError, match=r"'quantization\.lm_head\.bits' must be an integer"):
        config_from_dict({**base, "quantization": {"bits": 4, "group_size": 64, "lm_head": {"bits": "8"}}})


# ---------------------------------------------------------------- kv_config


def test_kv_config_list_and_layers_dict(tmp_path):
    base = T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()
    entries = [{"layer_idx": 0, "bits": 8, "group_size": 64}, {"layer_idx": 1, "bits": 4.5, "group_size": 32}]
    cfg = load_model_config(_write(tmp_path, base, kv_config__json=entries))
    assert cfg.kv_config == (KVLayerSpec(0, 8, 64), KVLayerSpec(1, 4.5, 32))
    assert config_from_dict(base, kv_config={"layers": [{"layer_idx": 1, "bits": 0}]}).kv_config == (KVLayerSpec(1, 0, 64),)
    assert config_from_dict(base).kv_config is None


def test_kv_config_layer_past_the_model_is_refused_at_load(tmp_path):
    d = _write(tmp_path, T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict(),
               kv_config__json=[{"layer_idx": 0, "bits": 8}, {"layer_idx": 9, "bits": 4}])
    with pytest.raises(ConfigError, match=r"kv_config\.json: entry 1: key 'layer_idx' 9 is not a layer of this "
                                          r"model \(num_hidden_layers 2: layers 0\.\.1\)") as e:
        load_model_config(d)
    assert str(d / "kv_config.json") in str(e.value)


def test_checkpoint_kv_config_reads_either_place(tmp_path):
    from mlxbun.config import checkpoint_kv_config

    d = _write(tmp_path, "not json {")  # a config.json mlxbun cannot read: the plan is still found
    assert checkpoint_kv_config(d) is None
    (d / "optiq").mkdir()
    (d / "optiq" / "kv_config.json").write_text(json.dumps({"layers": [{"layer_idx": 7, "bits": 4}]}))
    assert checkpoint_kv_config(d) == ((KVLayerSpec(7, 4, 64),), d / "optiq" / "kv_config.json")
    (d / "kv_config.json").write_text(json.dumps([{"layer_idx": 1, "bits": "4"}]))
    with pytest.raises(ConfigError, match=r"kv_config\.json: entry 0: key 'bits'"):
        checkpoint_kv_config(d)


@pytest.mark.parametrize("data, got", [
    ({"kv_config": [{"layer_idx": 0, "bits": 4}]}, r"an object with keys \['kv_config'\]"),
    ({"layers": {"layer_idx": 0}}, r"an object whose 'layers' is an object"),
])
def test_kv_config_other_shapes_show_the_forms(tmp_path, data, got):
    d = _write(tmp_path, T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict(), kv_config__json=data)
    with pytest.raises(ConfigError, match=r"kv_config\.json: expected a JSON list of layer entries "
                                          r'\[\{"layer_idx": I, "bits": B, "group_size": G\}, \.\.\.\].* or an object '
                                          r'\{"layers": \[\.\.\.\]\}, got ' + got):
        load_model_config(d)


@pytest.mark.parametrize("entries, key", [
    ([{"layer_idx": 0, "bits": 8}, {"layer_idx": "1", "bits": 4}], "layer_idx"),
    ([{"layer_idx": 0, "bits": 8}, {"layer_idx": 1, "bits": "4"}], "bits"),
    ([{"layer_idx": 0, "bits": 8}, {"layer_idx": 1, "bits": 4, "group_size": 0}], "group_size"),
    ([{"layer_idx": 0, "bits": 8}, {"layer_idx": 0, "bits": 4}], "layer_idx"),
])
def test_kv_config_bad_entry_names_file_entry_and_key(tmp_path, entries, key):
    d = _write(tmp_path, T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict(), kv_config__json=entries)
    with pytest.raises(ConfigError, match=rf"kv_config\.json: entry 1: key '{key}'") as e:
        load_model_config(d)
    assert str(d / "kv_config.json") in str(e.value)


def test_kv_config_not_a_list(tmp_path):
    d = _write(tmp_path, T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict(), kv_config__json={"bits": 4})
    with pytest.raises(ConfigError, match=r"kv_config\.json: expected a JSON list"):
        load_model_config(d)


# ---------------------------------------------------------------- errors


def test_missing_config_json(tmp_path):
    with pytest.raises(ConfigError, match=r"config\.json: file not found"):
        load_model_config(tmp_path)
    with pytest.raises(ConfigError, match=r"nope[/\\]config\.json"):
        load_model_config(tmp_path / "nope")


def test_non_json_and_non_object(tmp_path):
    d = _write(tmp_path, "{not json")
    with pytest.raises(ConfigError, match=rf"{d / 'config.json'}: not valid JSON"):
        load_model_config(d)
    _write(tmp_path, "[1, 2]")
    with pytest.raises(ConfigError, match=r"config\.json: expected a JSON object at the top level, got a list"):
        load_model_config(d)
    with pytest.raises(ConfigError, match=r"config\.json: expected a JSON object"):
        config_from_dict([1, 2])


def test_missing_required_key(tmp_path):
    d = T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()
    d.pop("hidden_size")
    ck = _write(tmp_path, d)
    with pytest.raises(ConfigError, match=r"config\.json: required key 'hidden_size' is missing") as e:
        load_model_config(ck)
    assert str(ck / "config.json") in str(e.value)
    with pytest.raises(ConfigError, match=r"required key 'model_type'"):
        config_from_dict({"hidden_size": 64})


def test_wrong_type_names_key(tmp_path):
    d = T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()
    ck = _write(tmp_path, {**d, "hidden_size": "64"})
    with pytest.raises(ConfigError, match=r"config\.json: key 'hidden_size' must be an integer, got a string '64'"):
        load_model_config(ck)
    with pytest.raises(ConfigError, match=r"key 'num_hidden_layers' must be an integer, got a boolean"):
        config_from_dict({**d, "num_hidden_layers": True})
    with pytest.raises(ConfigError, match=r"key 'rms_norm_eps' must be a number"):
        config_from_dict({**d, "rms_norm_eps": "1e-6"})
    with pytest.raises(ConfigError, match=r"key 'rope_scaling\.factor' must be a number"):
        config_from_dict({**d, "rope_scaling": {"rope_type": "linear", "factor": "8"}})
    with pytest.raises(ConfigError, match=r"key 'tie_word_embeddings' must be a boolean"):
        config_from_dict({**d, "tie_word_embeddings": "yes"})
    with pytest.raises(ConfigError, match=r"config\.json: key 'eos_token_id' must be an integer or a list"):
        config_from_dict({**d, "eos_token_id": ["2"]})
    with pytest.raises(ConfigError, match=r"config\.json: key 'text_config' must be an object"):
        config_from_dict({**d, "text_config": "llama"})
    g = T.Gemma3Config(text_config=dict(TINY, num_hidden_layers=2)).to_dict()
    g["text_config"]["rope_parameters"]["full_attention"]["rope_theta"] = "1e6"
    with pytest.raises(ConfigError, match=r"key 'text_config\.rope_parameters\.full_attention\.rope_theta' must be a number"):
        config_from_dict(g)
    g = T.Gemma3Config(text_config=dict(TINY, num_hidden_layers=2)).to_dict()
    g["text_config"]["num_hidden_layers"] = 2.5
    with pytest.raises(ConfigError, match=r"key 'text_config\.num_hidden_layers' must be an integer"):
        config_from_dict(g)


def test_malformed_generation_config(tmp_path):
    d = T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()
    ck = _write(tmp_path, d, generation_config__json={"eos_token_id": "</s>"})
    with pytest.raises(ConfigError, match=r"generation_config\.json: key 'eos_token_id' must be an integer") as e:
        load_model_config(ck)
    assert str(ck / "generation_config.json") in str(e.value)
    _write(tmp_path, d, generation_config__json="{oops")
    with pytest.raises(ConfigError, match=r"generation_config\.json: not valid JSON"):
        load_model_config(ck)
    _write(tmp_path, d, generation_config__json=[2])
    with pytest.raises(ConfigError, match=r"generation_config\.json: expected a JSON object"):
        load_model_config(ck)


def test_malformed_tokenizer_config(tmp_path):
    d = T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()
    ck = _write(tmp_path, d, tokenizer_config__json={"eos_token": 5})
    with pytest.raises(ConfigError, match=r"tokenizer_config\.json: key 'eos_token' must be a string"):
        load_model_config(ck)


# ---------------------------------------------------------------- immutability, identity


def test_immutable_and_json_roundtrip(tmp_path):
    cfg = config_from_dict(T.Gemma3Config(text_config=dict(TINY, num_hidden_layers=2)).to_dict())
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1
    for m in (cfg.raw, cfg.raw_full, cfg.raw_full["text_config"], cfg.layers.rope, cfg.layers.rope["full_attention"],
              cfg.quant_overrides, cfg.generation_config):
        with pytest.raises(TypeError):
            m["x"] = 1
        with pytest.raises(TypeError):
            m.update(x=1)
    assert isinstance(cfg.raw_full["text_config"]["layer_types"], tuple)
    again = load_model_config(_write(tmp_path, json.loads(json.dumps(dict(cfg.raw_full)))))
    assert again.fingerprint() == cfg.fingerprint()
    assert config_from_dict(cfg.raw_full) == cfg  # a frozen raw dict feeds back in
    assert hash(again) != hash(cfg)  # different path; same structure


def test_config_json_path_and_tagged_floats(tmp_path):
    d = {**T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict(), "final_logit_softcapping": {"__float__": "Infinity"}}
    ck = _write(tmp_path, d)
    cfg = load_model_config(ck / "config.json")
    assert cfg.path == ck and cfg.layers.final_logit_softcap == float("inf")


def test_fingerprint_structural_only():
    d = T.LlamaConfig(**TINY, num_hidden_layers=2).to_dict()
    fp = config_from_dict(d).fingerprint()
    assert len(fp) == 64 and fp == config_from_dict(dict(d)).fingerprint()
    same = [{**d, "eos_token_id": 7}, {**d, "dtype": "bfloat16"}, {**d, "_name_or_path": "elsewhere"}]
    assert all(config_from_dict(x).fingerprint() == fp for x in same)
    assert config_from_dict(d, path="/tmp/x").fingerprint() == fp
    changed = [{**d, "num_hidden_layers": 3}, {**d, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
               {**d, "quantization": {"group_size": 64, "bits": 4}}, {**d, "model_type": "qwen3"},
               {**d, "quantization": {"group_size": 64, "bits": 4, "lm_head": False}}]
    fps = {config_from_dict(x).fingerprint() for x in changed}
    assert fp not in fps and len(fps) == len(changed)


def test_config_error_reexported():
    from mlxbun import errors

    assert C.ConfigError is errors.ConfigError


# ---------------------------------------------------------------- realistic checkpoints vs mlx-lm's ModelArgs

FIXTURES = os.path.join(os.path.dirname(__file__), "data", "configs")


def _fixture(name):
    path = os.path.join(FIXTURES, name)
    with open(os.path.join(path, "config.json")) as f:
        return load_model_config(path), json.load(f)


def test_gemma3_4b_sparse_text_config_matches_mlx_lm_args():
    from mlx_lm.models import gemma3, gemma3_text

    cfg, d = _fixture("gemma-3-4b-it")
    wrapper = gemma3.ModelArgs.from_dict(json.loads(json.dumps(d)))
    args = gemma3_text.ModelArgs.from_dict(wrapper.text_config)
    for ours, theirs in [("vocab_size", "vocab_size"), ("hidden_size", "hidden_size"),
                         ("num_hidden_layers", "num_hidden_layers"), ("intermediate_size", "intermediate_size"),
                         ("num_attention_heads", "num_attention_heads"), ("num_key_value_heads", "num_key_value_heads"),
                         ("head_dim", "head_dim"), ("norm_eps", "rms_norm_eps"),
                         ("max_position_embeddings", "max_position_embeddings")]:
        assert getattr(cfg, ours) == getattr(args, theirs), ours
    assert cfg.layers.sliding_window == args.sliding_window
    p = args.sliding_window_pattern
    assert cfg.layers.types == _expect_types(lambda i: (i + 1) % p == 0, args.num_hidden_layers)
    assert cfg.layers.rope_for("full_attention") == {**args.rope_scaling, "rope_theta": args.rope_theta}
    assert cfg.layers.rope_for("sliding_attention") == {"rope_type": "default", "rope_theta": args.rope_local_base_freq}
    assert cfg.eos_token_ids == (1, 106) and cfg.bos_token_id == 2 and cfg.pad_token_id == 0
    assert cfg.weight_prefix == "language_model." and cfg.dtype == "bfloat16" and cfg.has_vision


def test_llama32_mlx_community_4bit_matches_mlx_lm_args():
    from mlx_lm.models import llama

    cfg, d = _fixture("Llama-3.2-1B-Instruct-4bit")
    args = llama.ModelArgs.from_dict(d)
    assert (cfg.head_dim, cfg.num_key_value_heads, cfg.norm_eps) == (args.head_dim, args.num_key_value_heads, args.rms_norm_eps)
    assert cfg.layers.rope_for("full_attention") == {**args.rope_scaling, "rope_theta": args.rope_theta}
    assert cfg.tie_word_embeddings is args.tie_word_embeddings is True
    assert cfg.quantization == QuantSpec(4, 64) and dict(cfg.quant_overrides) == {}
    assert cfg.eos_token_ids == (128001, 128008, 128009) and cfg.bos_token_id == 128000


def test_qwen25_declared_window_off_and_tokenizer_specials():
    from mlx_lm.models import qwen2

    cfg, d = _fixture("Qwen2.5-0.5B-Instruct")
    args = qwen2.ModelArgs.from_dict(d)
    assert cfg.layers.rope_for("full_attention") == {"rope_type": "default", "rope_theta": args.rope_theta}
    assert cfg.layers.types == ("full_attention",) * 24 and cfg.layers.sliding_window is None
    assert cfg.head_dim == args.hidden_size // args.num_attention_heads == 64
    assert cfg.eos_token_ids == (151645, 151643)
    assert (cfg.bos_token_id, cfg.pad_token_id) == (151643, 151643)
