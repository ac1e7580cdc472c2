"""mlxbun.names (the naming grammar) and mlxbun.locate (a name -> a directory -> a model):
every form parses and prints back, every bad name quotes the token and lists the forms, and the
CLI's `--kv NAME` is the same cache as the four --kv-* flags."""

import json

import pytest

from mlxbun import cli
from mlxbun.errors import GenerationError, MlxbunError
from mlxbun.locate import locate, open_runtime
from mlxbun.names import (
    DRAFTER_FORMS,
    KV_FORMS,
    MODEL_FORMS,
    DrafterSpec,
    KVSettings,
    ModelSpec,
    NamingError,
    parse_drafter,
    parse_engine,
    parse_kv,
    parse_model,
)


@pytest.mark.parametrize("text, spec, canonical", [
    ("zoo:llama", ModelSpec("zoo", "llama"), "zoo:llama"),
    ("zoo:llama@q4", ModelSpec("zoo", "llama", "q4"), "zoo:llama@q4"),
    ("zoo:llama@bf16", ModelSpec("zoo", "llama", "bfloat16"), "zoo:llama@bfloat16"),
    ("zoo:llama@q8,seed=1,head_dim=32", ModelSpec("zoo", "llama", "q8", 1, 32), "zoo:llama@q8,seed=1,head_dim=32"),
    ("zoo:llama,head_dim=64", ModelSpec("zoo", "llama", head_dim=64), "zoo:llama,head_dim=64"),
    ("zoo:llama@seed1", ModelSpec("zoo", "llama", seed=1), "zoo:llama,seed=1"),  # the first wave's form
    ("zoo:llama@q8,seed1", ModelSpec("zoo", "llama", "q8", 1), "zoo:llama@q8,seed=1"),
    ("random:llama-3-8b", ModelSpec("random", "llama-3-8b"), "random:llama-3-8b"),
    ("HuggingFaceTB/SmolLM2-135M", ModelSpec("hub", "HuggingFaceTB/SmolLM2-135M"), "HuggingFaceTB/SmolLM2-135M"),
    ("model.gguf", ModelSpec("gguf", "model.gguf"), "model.gguf"),
    ("real:smollm2", ModelSpec("real", "smollm2"), "real:smollm2"),
    ("./some/dir", ModelSpec("dir", "./some/dir"), "./some/dir"),
])
def test_model_names_parse_and_print_back(text, spec, canonical):
    assert parse_model(text) == spec
    assert str(spec) == canonical and parse_model(canonical) == spec


def test_an_existing_directory_wins_over_a_repo_id(tmp_path, monkeypatch):
    (tmp_path / "org" / "repo").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert parse_model("org/repo").kind == "dir"
    assert parse_model("other/repo").kind == "hub"


@pytest.mark.parametrize("text, why", [
    ("zoo:", "no arch after 'zoo:'"),
    ("zoo:llama@q5", "unknown zoo variant 'q5'"),
    ("zoo:llama@q4@q8", "zoo option 'variant' given twice"),
    ("zoo:llama,depth=3", "unknown zoo option 'depth=3'"),
    ("zoo:llama,head_dim=0", "head_dim must be a positive whole number"),
    ("zoo:llama,seed=-1", "seed must be a whole number >= 0"),
    ("random:", "no shape after 'random:'"),
    ("real:", "no name after 'real:'"),
    ("", "empty name"),
])
def test_bad_model_names_quote_the_token_and_list_the_forms(text, why):
    with pytest.raises(NamingError) as e:
        parse_model(text)
    assert f"model {text!r}: {why}" in str(e.value) and MODEL_FORMS in str(e.value)


def test_zoo_options_and_with_options():
    assert parse_model("zoo:llama@q4,seed=2").zoo_options == {"quant": 4, "seed": 2}
    assert parse_model("zoo:llama").zoo_options == {"dtype": "float32"}
    spec = parse_model("zoo:llama").with_options(variant="fp16", head_dim=32)
    assert spec == ModelSpec("zoo", "llama", "float16", None, 32)
    assert parse_model("zoo:llama@q8").with_options(variant="q4").variant == "q8"  # the name wins
    with pytest.raises(NamingError, match="only applies to zoo models"):
        parse_model("/some/dir").with_options(head_dim=32)
    with pytest.raises(NamingError, match="not a zoo model"):
        parse_model("/some/dir").zoo_options


def test_engines():
    assert parse_engine("mlxbun") == "mlxbun" and parse_engine("mlx_lm") == "mlx-lm"
    with pytest.raises(NamingError, match=r"--engine 'torch': unknown engine; accepted forms: mlxbun \| mlx-lm"):
        parse_engine("torch", what="--engine")


@pytest.mark.parametrize("text, spec, canonical", [
    ("ngram", DrafterSpec("ngram", n=3), "ngram:3"),
    ("ngram:5", DrafterSpec("ngram", n=5), "ngram:5"),
    ("lookup", DrafterSpec("ngram", n=3), "ngram:3"),
    ("self", DrafterSpec("self", n=1), "self:1"),
    ("self:2", DrafterSpec("self", n=2), "self:2"),
    ("layer_skip:2", DrafterSpec("self", n=2), "self:2"),
    ("model:zoo:llama@q8", DrafterSpec("model", ModelSpec("zoo", "llama", "q8")), "model:zoo:llama@q8"),
    ("zoo:llama,seed=1", DrafterSpec("model", ModelSpec("zoo", "llama", seed=1)), "model:zoo:llama,seed=1"),
])
def test_drafter_names(text, spec, canonical):
    assert parse_drafter(text) == spec and str(spec) == canonical and parse_drafter(canonical) == spec


@pytest.mark.parametrize("text, why", [("ngram:0", "N must be a positive whole number"),
                                       ("self:x", "L must be a positive whole number"),
                                       ("model:", "no model after 'model:'")])
def test_bad_drafter_names(text, why):
    with pytest.raises(NamingError) as e:
        parse_drafter(text)
    assert why in str(e.value) and DRAFTER_FORMS in str(e.value)


@pytest.mark.parametrize("text, settings, label", [
    ("plain", KVSettings(), "plain"),
    ("uniform:4", KVSettings("uniform", 4), "uniform 4-bit g64"),
    ("uniform:8,group=32,start=16", KVSettings("uniform", 8, 32, 16), "uniform 8-bit g32"),
    ("turboquant:3.5", KVSettings("turboquant", 3.5), "turboquant 3.5-bit"),
    ("turboquant:4,start=5", KVSettings("turboquant", 4, None, 5), "turboquant 4-bit"),
    # a chosen key/value split (lab/tq_bits): one side fixes the other, both may stand without BITS
    ("turboquant:3.5,keys=4", KVSettings("turboquant", 3.5, key_bits=4, value_bits=3), "turboquant K4/V3"),
    ("turboquant:3.5,values=3", KVSettings("turboquant", 3.5, key_bits=4), "turboquant K4/V3"),
    ("turboquant:keys=4,values=3", KVSettings("turboquant", key_bits=4, value_bits=3), "turboquant K4/V3"),
    ("turboquant:4,keys=5,values=3,start=2", KVSettings("turboquant", 4, None, 2, 5, 3), "turboquant K5/V3"),
    ("turboquant:3.5,keys=3", KVSettings("turboquant", 3.5, key_bits=3), "turboquant K3/V4"),  # mlx-vlm's, named
])
def test_kv_names(text, settings, label):
    assert parse_kv(text) == settings and settings.label == label
    assert parse_kv(str(settings)) == settings


def test_a_kv_split_is_held_whole_and_prints_both_sides():
    s = parse_kv("turboquant:3.5,keys=4")
    assert (s.bits, s.key_bits, s.value_bits) == (3.5, 4, 3) and s.split
    assert str(s) == "turboquant:3.5,keys=4,values=3"
    assert parse_kv("turboquant:keys=4,values=3") == s == parse_kv("turboquant:3.5,values=3")
    # mlx-vlm's split of 3.5 (K3/V4) stays the unsplit name; named explicitly it is a split
    assert not parse_kv("turboquant:3.5").split and parse_kv("turboquant:3.5").key_bits is None
    assert str(parse_kv("turboquant:3.5,keys=3")) == "turboquant:3.5,keys=3,values=4"


@pytest.mark.parametrize("text, error, why", [
    ("q4", NamingError, "unknown scheme"),
    ("uniform:four", NamingError, "bits must be a number"),
    ("turboquant:3.5,group=32", NamingError, "unknown or repeated option 'group=32'"),
    ("uniform:4,start=x", NamingError, "start must be a whole number"),
    ("uniform:3.5", NamingError, r"BITS 3.5 is not a uniform \(affine\) width.*fractional widths: turboquant:BITS"),
    ("uniform:9", NamingError, r"BITS 9 is not a uniform \(affine\) width; choose one of 2, 3, 4, 5, 6, 8;"),
    ("uniform:4,group=16", NamingError, "group=16 is not a KV group size; choose one of 32, 64, 128"),
    ("turboquant:9", NamingError, r"BITS 9 is not a TurboQuant width \(whole or half bits from 1 to 8"),
    ("turboquant:3.3", NamingError, "BITS 3.3 is not a TurboQuant width"),
    ("turboquant:3.5,keys=8", NamingError, r"keys=8 leaves values 2 x 3.5 - 8 = -1 bits"),
    ("turboquant:2,values=5", NamingError, "values=5 leaves keys 2 x 2 - 5 = -1 bits"),
    ("turboquant:3.5,keys=4,values=4", NamingError, "keys=4 and values=4 average 4 bits, not BITS 3.5"),
    ("turboquant:keys=4", NamingError, "keys alone does not fix the split"),
    ("turboquant:values=3,start=2", NamingError, "values alone does not fix the split"),
    ("turboquant:3.5,keys=9", NamingError, "keys must be a whole number of bits from 1 to 8, got 9"),
    ("turboquant:3.5,values=0", NamingError, "values must be a whole number of bits from 1 to 8, got 0"),
    ("turboquant:3.5,keys=3.5", NamingError, "keys must be a whole number, got '3.5'"),
    ("turboquant:3.5,keys=4,keys=4", NamingError, "unknown or repeated option 'keys=4'"),
    ("turboquant:3.5,key=4", NamingError, "unknown or repeated option 'key=4'"),
    ("turboquant:11,keys=4", NamingError, "BITS 11 is not supported by TurboQuant"),
    ("turboquant:start=3", NamingError, "no bits after 'turboquant:'"),
    ("uniform:4,keys=4", NamingError, "'keys=4': a key/value split is TurboQuant's"),
    ("uniform:4,values=2", NamingError, "'values=2': a key/value split is TurboQuant's"),
])
def test_bad_kv_names(text, error, why):
    with pytest.raises(error, match=why):
        parse_kv(text)
    if error is NamingError:
        with pytest.raises(NamingError) as e:
            parse_kv(text)
        assert KV_FORMS in str(e.value)


def test_kv_settings_from_mlx_lm_style_options():
    assert KVSettings.from_flags() == KVSettings(start=0)
    assert KVSettings.from_flags(kv_bits=4.0, kv_group_size=32) == KVSettings("uniform", 4, 32)
    assert KVSettings.from_flags(kv_bits=3.5, kv_scheme="turboquant", kv_group_size=64) == KVSettings("turboquant", 3.5)
    s = parse_kv("uniform:8,group=32,start=16")
    assert KVSettings.from_flags(**s.as_options()) == s
    assert parse_kv("plain").as_options()["kv_bits"] is None
    split = parse_kv("turboquant:3.5,keys=4,start=2")
    assert split.as_options() == dict(kv_bits=3.5, kv_group_size=64, quantized_kv_start=2, kv_scheme="turboquant",
                                      kv_key_bits=4, kv_value_bits=3)
    assert KVSettings.from_flags(**split.as_options()) == split
    assert KVSettings.from_flags(kv_scheme="turboquant", kv_key_bits=4, kv_value_bits=3.0) == parse_kv(
        "turboquant:keys=4,values=3")


@pytest.mark.parametrize("options, why", [
    (dict(kv_key_bits=4), "kv_key_bits=4: a key/value split is TurboQuant's"),
    (dict(kv_bits=4, kv_value_bits=4), "kv_value_bits=4: a key/value split is TurboQuant's"),
    (dict(kv_scheme="turboquant", kv_key_bits=4), "needs kv_bits"),
    (dict(kv_scheme="turboquant", kv_bits=3.5, kv_key_bits=2.5), "kv_key_bits must be a whole number of bits"),
    (dict(kv_scheme="turboquant", kv_bits=3.5, kv_value_bits=9), "kv_value_bits must be a whole number of bits"),
    (dict(kv_scheme="turboquant", kv_bits=3, kv_key_bits=8), "kv_key_bits=8 leaves kv_value_bits 2 x 3 - 8"),
    (dict(kv_scheme="turboquant", kv_bits=3, kv_key_bits=4, kv_value_bits=3), "average 3.5 bits, not kv_bits 3"),
    (dict(kv_scheme="turboquant", kv_bits=11, kv_key_bits=4), "kv_bits 11 is not supported by TurboQuant"),
])
def test_bad_kv_splits_name_the_option(options, why):
    with pytest.raises(GenerationError, match=why):
        KVSettings.from_flags(**options)


def test_locate_and_open_runtime(zoo, zoo_root, tmp_path):
    assert locate("zoo:llama", zoo_root=zoo_root) == zoo("llama")
    assert locate("zoo:llama@q4", zoo_root=zoo_root) == zoo("llama", quant=4)
    assert locate(str(zoo("llama"))) == zoo("llama")
    assert open_runtime(zoo("llama")).model_type == "llama"
    assert type(open_runtime(zoo("llama"), "mlx-lm")).__name__ == "MlxLmRuntimeModel"
    for name, why in (("random:llama-3-8b", "for `mlxbun bench` only"), (str(tmp_path / "x.gguf"), "no such GGUF file"),
                      (str(tmp_path / "none"), "no such checkpoint directory"), ("zoo:all", "give one zoo:ARCH"),
                      ("org/repo", "repo 'org/repo' not found"), ("real:nope", "no real model 'nope'; known: ")):
        with pytest.raises(MlxbunError, match=why):
            locate(name, cache_dir=tmp_path)


def test_generate_kv_name_is_the_four_flags(zoo_root, monkeypatch, capsys):
    monkeypatch.setenv("MLXBUN_ZOO_CACHE", str(zoo_root))
    base = ["generate", "--model", "zoo:llama,head_dim=32", "--prompt", "Once upon a time", "--max-tokens", "6",
            "--json"]

    def tokens(*flags):
        assert cli.main(base + list(flags)) == 0
        return json.loads(capsys.readouterr().out)["tokens"]

    named = tokens("--kv", "uniform:4,group=32,start=3")
    assert named == tokens("--kv-bits", "4", "--kv-group-size", "32", "--quantized-kv-start", "3")
    assert cli.main(base + ["--kv", "uniform:4", "--kv-bits", "8"]) == 1
    assert "--kv uniform:4 already sets the KV cache; drop --kv-bits" in capsys.readouterr().err
