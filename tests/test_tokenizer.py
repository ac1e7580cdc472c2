"""mlxbun.tokenizer: loading, BOS/EOS policy, streaming detokenizer, chat templates.

The chat-template oracle renders every fixture template in /work/shared/fixtures/chat_templates
with transformers' `apply_chat_template` and with mlxbun, for a grid of conversations, and asserts
identical text (or the same template error).
"""

from __future__ import annotations

import copy
import json
import shutil
from datetime import datetime
from pathlib import Path

import jinja2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers
from tokenizers.implementations import SentencePieceBPETokenizer

import mlxbun.chat_template as chat_template
from mlxbun.chat_template import ChatTemplateError
from mlxbun.detokenizer import StreamingDetokenizer
from mlxbun.errors import TokenizerError
from mlxbun.tokenizer import load_tokenizer

TEMPLATE_DIR = Path("/work/shared/fixtures/chat_templates")
TEMPLATES = {p.stem: p.read_text(encoding="utf-8") for p in sorted(TEMPLATE_DIR.glob("*.jinja"))}
LLAMA3_TEMPLATE = TEMPLATES["meta-llama-Llama-3.2-3B-Instruct"]

CORPUS = [
    "The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away into the forest.",
    "Language models read text as tokens. A tokenizer splits text into pieces and maps each piece "
    "to an id. Byte-level BPE never meets an unknown character, because every byte has a token.",
    "Hello, world! How are you today? I'm fine, thanks. Numbers: 0 1 2 3 42 1234 3.14159.",
    "def main():\n    print('hello')\n    return {\"key\": [1, 2, 3]}\n",
    "Café, naïve, résumé, Ångström, Straße, smörgåsbord — accents and dashes… «quotes».",
    "你好，世界！今天天气很好。日本語のテキストも少しあります。한국어 문장도 있습니다.",
    "Emoji time: 😀 🎉 👍🏽 🚀 ❤️ 🇫🇷 and symbols ∑ ∫ √ ≈ ≠ € £ ¥.",
]
SPM_CORPUS = CORPUS[:5]  # no CJK/emoji: the byte-fallback tokenizer must spell them as <0xHH>
STREAM_TEXTS = [
    "Hello world",
    "你好，世界！天气很好。",
    "Emoji 😀🎉👍🏽🚀 and flags 🇫🇷🇯🇵!",
    "Mixed: café 中文 😀 ∑≈ end.",
    "  leading spaces and\nnew lines\n\n  ",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𐍈 ꙮ 🧬",
]

LLAMA3_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|python_tag|>",
    "<bos>",
    "<eos>",
    "<pad>",
]


def _write(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, ensure_ascii=False, indent=1), encoding="utf-8")


def _build_bytelevel(d: Path) -> None:
    """Llama-3 style: ByteLevel BPE, post-processor adds <|begin_of_text|>."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=460,
        special_tokens=LLAMA3_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 3, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A",
                pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
                special_tokens=[("<|begin_of_text|>", bos)],
            ),
        ]
    )
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIALS}
    _write(
        d / "tokenizer_config.json",
        {
            "bos_token": "<|begin_of_text|>",
            "eos_token": "<|eot_id|>",
            "pad_token": "<pad>",
            "clean_up_tokenization_spaces": True,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": LLAMA3_TEMPLATE,
            "added_tokens_decoder": {
                str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False, "normalized": False}
                for t, i in ids.items()
            },
        },
    )
    _write(
        d / "generation_config.json",
        {"eos_token_id": [ids["<|end_of_text|>"], ids["<|eom_id|>"], ids["<|eot_id|>"]]},
    )
    _write(
        d / "config.json",
        {"model_type": "llama", "eos_token_id": ids["<|end_of_text|>"], "bos_token_id": bos},
    )


def _build_metaspace(d: Path) -> None:
    """SentencePieceBPETokenizer (Metaspace pre-tokenizer/decoder), no post-processor, so
    tokenizer_config's add_bos_token decides."""
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(
        CORPUS * 3, vocab_size=420, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    d.mkdir(parents=True, exist_ok=True)
    sp.save(str(d / "tokenizer.json"))
    _write(
        d / "tokenizer_config.json",
        {"add_bos_token": True, "add_eos_token": False, "chat_template": "ignored: the .jinja file wins"},
    )
    _write(d / "special_tokens_map.json", {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    (d / "chat_template.jinja").write_text(TEMPLATES["google-gemma-2-2b-it"], encoding="utf-8")


def _build_bytefallback(d: Path) -> None:
    """Llama-2 style SentencePiece BPE: byte_fallback with <0xHH> tokens, decoder
    Replace/ByteFallback/Fuse/Strip, post-processor adds <s>."""
    tok = Backend(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=220, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
    )
    tok.train_from_iterator(SPM_CORPUS * 3, trainer)
    raw = json.loads(tok.to_str())
    vocab = raw["model"]["vocab"]
    base = len(vocab)
    for b in range(256):  # Llama-2 keeps the 256 byte tokens in the model vocabulary
        vocab[f"<0x{b:02X}>"] = base + b
    tok = Backend.from_str(json.dumps(raw))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    d.mkdir(parents=True, exist_ok=True)
    tok.save(str(d / "tokenizer.json"))
    _write(
        d / "tokenizer_config.json",
        {
            "bos_token": {"content": "<s>", "lstrip": False, "rstrip": False, "__type": "AddedToken"},
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "chat_template": [
                {"name": "default", "template": "DEFAULT{% for m in messages %}|{{ m.content }}{% endfor %}"},
                {
                    "name": "tool_use",
                    "template": "TOOLS{{ tools | length }}{% for m in messages %}|{{ m.content }}{% endfor %}",  # noqa: E501
                },
            ],
        },
    )


@pytest.fixture(scope="session")
def tok_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    _build_bytelevel(root / "bytelevel")
    _build_metaspace(root / "metaspace")
    _build_bytefallback(root / "bytefallback")
    return {name: root / name for name in ("bytelevel", "metaspace", "bytefallback")}


@pytest.fixture(scope="session")
def toks(tok_dirs):
    return {name: load_tokenizer(d) for name, d in tok_dirs.items()}


@pytest.fixture
def broken_dir(tok_dirs, tmp_path):
    """A fresh copy of the bytelevel checkpoint to break."""
    d = tmp_path / "ckpt"
    shutil.copytree(tok_dirs["bytelevel"], d)
    return d


# ----------------------------------------------------------------------------- loading


def test_bytelevel_special_tokens_and_eos_union(toks):
    tok = toks["bytelevel"]
    ids = {t: tok.token_to_id(t) for t in LLAMA3_SPECIALS}
    assert tok.bos_token == "<|begin_of_text|>" and tok.bos_token_id == ids["<|begin_of_text|>"]
    assert tok.eos_token_id == ids["<|eot_id|>"]
    # tokenizer_config first, then generation_config's list, then config.json; no duplicates
    assert tok.eos_token_ids == (ids["<|eot_id|>"], ids["<|end_of_text|>"], ids["<|eom_id|>"])
    assert tok.pad_token_id == ids["<pad>"]
    assert tok.special_tokens == {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
        "pad_token": "<pad>",
    }
    assert set(tok.all_special_ids) == set(ids.values())
    assert tok.vocab_size == 460
    for i in (0, 100, ids["<|eot_id|>"], tok.vocab_size - 1):
        assert tok.token_to_id(tok.id_to_token(i)) == i
    assert tok.token_to_id("definitely-not-a-token") is None


def test_special_tokens_map_fills_gaps_and_eos_from_it(toks):
    tok = toks["metaspace"]
    assert tok.bos_token == "<s>" and tok.eos_token_ids == (tok.token_to_id("</s>"),)
    assert tok.unk_token_id == tok.token_to_id("<unk>") and tok.pad_token_id is None


def test_added_token_dict_values_are_read(toks):
    tok = toks["bytefallback"]
    assert tok.bos_token == "<s>" and tok.bos_token_id == tok.backend.token_to_id("<s>")


def test_eos_accepts_token_strings_and_text_config(broken_dir):
    _write(broken_dir / "generation_config.json", {"eos_token_id": "<eos>"})
    _write(broken_dir / "config.json", {"text_config": {"eos_token_id": ["<|eom_id|>", 300]}})
    tok = load_tokenizer(broken_dir)
    assert tok.eos_token_ids == (
        tok.token_to_id("<|eot_id|>"),
        tok.token_to_id("<eos>"),
        tok.token_to_id("<|eom_id|>"),
        300,
    )


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: (d / "tokenizer.json").unlink(), r"tokenizer\.json: file not found"),
        (lambda d: (d / "tokenizer.json").write_text("{not json"), r"tokenizer\.json: malformed JSON"),
        (
            lambda d: (d / "tokenizer.json").write_text('{"model": 3}'),
            r"tokenizer\.json: not a valid tokenizers file",
        ),
        (
            lambda d: (d / "tokenizer_config.json").write_text("[1,"),
            r"tokenizer_config\.json: malformed JSON",
        ),
        (
            lambda d: (d / "tokenizer_config.json").write_text("[1]"),
            r"tokenizer_config\.json: expected a JSON object",
        ),
        (
            lambda d: _patch(d / "tokenizer_config.json", eos_token="<nope>"),
            r"tokenizer_config\.json: key 'eos_token' names '<nope>'",
        ),
        (
            lambda d: _patch(d / "tokenizer_config.json", pad_token=["x"]),
            r"tokenizer_config\.json: key 'pad_token': expected a token string",
        ),
        (
            lambda d: _patch(d / "tokenizer_config.json", image_token="<img>"),
            r"key 'image_token' names '<img>'",
        ),
        (
            lambda d: _patch(d / "tokenizer_config.json", additional_special_tokens=["<eos>", "<zz>"]),
            r"key 'additional_special_tokens'\[1\] names '<zz>'",
        ),
        (
            lambda d: _patch(d / "tokenizer_config.json", additional_special_tokens=3),
            r"key 'additional_special_tokens' must be a list",
        ),
        (
            lambda d: _patch(d / "tokenizer_config.json", added_tokens_decoder={"7": "<eos>"}),
            r"added_tokens_decoder'\['7'\]: expected",
        ),
        (
            lambda d: _patch(d / "tokenizer_config.json", added_tokens_decoder={"7": {"content": "<eos>"}}),
            r"added_tokens_decoder'\['7'\]: '<eos>' has id",
        ),
        (
            lambda d: _patch(d / "generation_config.json", eos_token_id=[1, "<nope>"]),
            r"generation_config\.json: key 'eos_token_id'\[1\] names '<nope>'",
        ),
        (
            lambda d: _patch(d / "config.json", eos_token_id=99999),
            r"config\.json: key 'eos_token_id': token id 99999 is outside",
        ),
        (
            lambda d: _patch(d / "config.json", eos_token_id=1.5),
            r"config\.json: key 'eos_token_id': expected a token string",
        ),
        (
            lambda d: (d / "generation_config.json").write_text("nope"),
            r"generation_config\.json: malformed JSON",
        ),
        (
            lambda d: _patch(d / "tokenizer_config.json", chat_template=[{"name": "x"}]),
            r"key 'chat_template'\): entry 0",
        ),
        (
            lambda d: (d / "chat_template.json").write_text('{"chat_template": 3}'),
            r"chat_template\.json: key 'chat_template' must be a string",
        ),
    ],
    ids=[
        "missing-tokenizer-json",
        "malformed-tokenizer-json",
        "invalid-tokenizer-json",
        "malformed-config",
        "config-not-object",
        "unknown-eos",
        "bad-pad-type",
        "unknown-model-specific",
        "unknown-additional",
        "additional-not-list",
        "added-token-not-dict",
        "added-token-id-mismatch",
        "unknown-generation-eos",
        "eos-id-out-of-range",
        "eos-id-float",
        "malformed-generation-config",
        "bad-template-list",
        "bad-chat-template-json",
    ],
)
def test_bad_files_raise_tokenizer_error_naming_file(broken_dir, mutate, match):
    mutate(broken_dir)
    with pytest.raises(TokenizerError, match=match):
        load_tokenizer(broken_dir)


def _patch(path: Path, **changes) -> None:
    data = json.loads(path.read_text()) if path.exists() else {}
    data.update(changes)
    _write(path, data)


def test_not_a_directory(tmp_path):
    with pytest.raises(TokenizerError, match="not a directory"):
        load_tokenizer(tmp_path / "missing")


def test_added_tokens_decoder_entry_missing_from_tokenizer_json_is_added(broken_dir):
    n = load_tokenizer(broken_dir).vocab_size
    _patch(
        broken_dir / "tokenizer_config.json",
        added_tokens_decoder={str(n): {"content": "<|new|>", "special": True}},
    )
    tok = load_tokenizer(broken_dir)
    assert tok.token_to_id("<|new|>") == n and n in tok.all_special_ids
    assert tok.encode("a<|new|>b", add_special_tokens=False)[1] == n


# ----------------------------------------------------------------------------- BOS policy


def test_encode_follows_post_processor(toks):
    tok = toks["bytelevel"]
    bos = tok.bos_token_id
    assert tok.add_bos_token
    with_bos = tok.encode("Hello world")
    assert with_bos[0] == bos and with_bos[1:] == tok.encode("Hello world", add_special_tokens=False)
    assert bos not in with_bos[1:]
    assert tok.decode(with_bos) == "<|begin_of_text|>Hello world"
    assert tok.decode(with_bos, skip_special_tokens=True) == "Hello world"


def test_encode_matches_transformers_autotokenizer(tok_dirs, toks):
    """mlx-lm loads with AutoTokenizer; ids (BOS included) must agree where tokenizer.json has a
    post-processor (transformers 5 ignores add_bos_token then)."""
    from transformers import AutoTokenizer

    for name in ("bytelevel", "bytefallback"):
        hf = AutoTokenizer.from_pretrained(str(tok_dirs[name]))
        for text in STREAM_TEXTS + ["<|eot_id|> special in text", ""]:
            for add in (True, False):
                assert toks[name].encode(text, add_special_tokens=add) == hf.encode(
                    text, add_special_tokens=add
                ), (name, text, add)


def test_add_bos_token_config_when_no_post_processor(toks, tok_dirs, tmp_path):
    tok = toks["metaspace"]
    bos = tok.bos_token_id
    assert tok.add_bos_token
    assert tok.encode("the fox") == [bos] + tok.encode("the fox", add_special_tokens=False)
    d = tmp_path / "no_bos"
    shutil.copytree(tok_dirs["metaspace"], d)
    _patch(d / "tokenizer_config.json", add_bos_token=False, add_eos_token=True)
    tok2 = load_tokenizer(d)
    assert not tok2.add_bos_token
    assert tok2.encode("the fox") == tok.encode("the fox", add_special_tokens=False) + [
        tok.token_to_id("</s>")
    ]
    _patch(d / "tokenizer_config.json", add_bos_token="yes")
    with pytest.raises(TokenizerError, match="key 'add_bos_token' must be true or false"):
        load_tokenizer(d)


def test_no_double_bos_with_chat_template(toks, hf_tokenizer):
    """Llama-3's template renders <|begin_of_text|>; encoding that text with special tokens would
    add a second one (the mlx-lm / HF pitfall). encode_prompt and tokenize=True must not."""
    tok = toks["bytelevel"]
    bos = tok.bos_token_id
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, date_string="01 Jan 2025")
    assert text.startswith("<|begin_of_text|>")
    naive = tok.encode(text)
    assert naive[:2] == [bos, bos]  # the hazard is real for this tokenizer
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, date_string="01 Jan 2025")
    assert ids[0] == bos and ids[1] != bos and ids.count(bos) == 1
    assert ids == tok.encode(text, add_special_tokens=False) == tok.encode_prompt(text)
    hf_ids = hf_tokenizer.apply_chat_template(
        msgs,
        chat_template=LLAMA3_TEMPLATE,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        date_string="01 Jan 2025",
    )
    assert ids == list(hf_ids)
    assert tok.decode(ids) == text
    # a prompt without the BOS string still gets exactly one
    plain = tok.encode_prompt("Hello")
    assert plain[0] == bos and plain.count(bos) == 1


# ----------------------------------------------------------------------------- streaming


def _stream(tok, ids, **kw):
    det = StreamingDetokenizer(tok, **kw)
    pieces = [det.add_token(i) for i in ids]
    pieces.append(det.finalize())
    return det, pieces


@pytest.mark.parametrize("name", ["bytelevel", "metaspace", "bytefallback"])
@pytest.mark.parametrize("text", STREAM_TEXTS, ids=range(len(STREAM_TEXTS)))
def test_stream_text_never_emits_partial_characters(toks, name, text):
    tok = toks[name]
    ids = tok.encode(text)
    det, pieces = _stream(tok, ids)
    full = tok.decode(ids)
    assert "".join(pieces) == full == det.text
    assert det.tokens == ids
    if "\ufffd" not in full:
        assert all("\ufffd" not in p for p in pieces)
    if name == "bytelevel":
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_stream_splits_multibyte_characters(toks):
    """The characters really are split across tokens, and are held back until complete."""
    for name in ("bytelevel", "bytefallback"):
        tok = toks[name]
        ids = tok.encode("😀🚀", add_special_tokens=False)
        assert len(ids) >= 4, name  # 8 bytes, no merge covers a whole emoji
        det = tok.detokenizer()
        pieces = [det.add_token(i) for i in ids] + [det.finalize()]
        assert "".join(pieces) == "😀🚀"
        assert [p for p in pieces if p] == ["😀", "🚀"] or [p for p in pieces if p] == ["😀🚀"], pieces
        assert pieces[0] == ""  # first byte alone is never released


def test_stream_byte_fallback_run_turning_invalid(toks):
    """A complete '€' made of byte tokens followed by a stray continuation byte: decode turns the
    whole run into U+FFFD, so the stream must not have released '€' early."""
    tok = toks["bytefallback"]
    b = {x: tok.token_to_id(f"<0x{x:02X}>") for x in (0xE2, 0x82, 0xAC, 0x80)}
    word = tok.encode("the fox", add_special_tokens=False)[-1]
    assert word not in tok.byte_token_ids
    ids = [b[0xE2], b[0x82], b[0xAC], b[0x80], word]
    det, pieces = _stream(tok, ids)
    assert tok.decode(ids).startswith("\ufffd" * 4)
    assert "".join(pieces) == tok.decode(ids)
    assert "€" not in "".join(pieces)


def test_last_segment_and_reset(toks):
    tok = toks["bytelevel"]
    det = tok.detokenizer()
    for i in tok.encode("Hello world", add_special_tokens=False)[:2]:
        det.add_token(i)
    first = det.last_segment
    assert first and det.last_segment == ""
    det.reset()
    assert det.text == "" and det.tokens == []


def _fragment_ids(tok):
    """Ids whose text alone is an unfinished character (or a raw byte): the hard cases."""
    ids = [i for i in range(tok.vocab_size) if "\ufffd" in tok.decode([i])]
    return ids + sorted(tok.byte_token_ids)


def _check_stream(tok, ids, skip):
    det = StreamingDetokenizer(tok, skip_special_tokens=skip)
    pieces = []
    for k, i in enumerate(ids, 1):
        pieces.append(det.add_token(i))
        # released text is final: a prefix of the decode of every longer sequence
        assert tok.decode(ids[:k], skip_special_tokens=skip).startswith(det.text)
    pieces.append(det.finalize())
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip) == det.text


@pytest.mark.parametrize("name", ["bytelevel", "metaspace", "bytefallback"])
def test_stream_random_ids_equal_decode(toks, name):
    tok = toks[name]
    fragments = _fragment_ids(tok)
    assert len(fragments) >= (0 if name == "metaspace" else 128)
    specials = list(tok.all_special_ids)
    any_id = st.integers(0, tok.vocab_size - 1)
    pick = (
        st.one_of(any_id, st.sampled_from(fragments), st.sampled_from(specials))
        if fragments
        else st.one_of(any_id, st.sampled_from(specials))
    )

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    @given(ids=st.lists(pick, max_size=30), skip=st.booleans())
    def run(ids, skip):
        _check_stream(tok, ids, skip)

    run()


# ----------------------------------------------------------------------------- chat templates


def test_template_selection_named_templates(toks):
    tok = toks["bytefallback"]
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert isinstance(tok.chat_template, dict) and set(tok.chat_template) == {"default", "tool_use"}
    assert tok.apply_chat_template(msgs) == "DEFAULT|a|b"
    assert tok.apply_chat_template(msgs, tools=[{"type": "function"}]) == "TOOLS1|a|b"
    assert tok.apply_chat_template(msgs, chat_template="tool_use", tools=[]) == "TOOLS0|a|b"
    assert tok.apply_chat_template(msgs, chat_template="RAW{{ messages | length }}") == "RAW2"


def test_chat_template_jinja_file_wins(toks):
    tok = toks["metaspace"]
    assert tok.chat_template == TEMPLATES["google-gemma-2-2b-it"]
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert out == "<s><start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


def test_no_template_raises(broken_dir):
    cfg = json.loads((broken_dir / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    _write(broken_dir / "tokenizer_config.json", cfg)
    tok = load_tokenizer(broken_dir)
    assert tok.chat_template is None and not tok.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_template_errors(toks):
    tok = toks["metaspace"]
    with pytest.raises(ChatTemplateError, match="System role not supported") as info:
        tok.apply_chat_template([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}])
    assert info.value.template_message == "System role not supported"
    assert "chat_template.jinja" in str(info.value)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="underscore-prefixed"):
        tok.apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template="{% set ns = namespace(_x=1) %}"
        )
    with pytest.raises(ChatTemplateError, match="unsafe|not safely callable|access to attribute"):
        tok.apply_chat_template(
            [{"role": "user", "content": "x"}], chat_template="{{ messages.__class__.__mro__ }}"
        )
    with pytest.raises(TokenizerError, match="non-empty list"):
        tok.apply_chat_template([])


def test_template_environment_features(toks):
    tok = toks["bytelevel"]
    msgs = [{"role": "user", "content": "<b>é</b>"}, {"role": "assistant", "content": "x"}]
    render = lambda t, **kw: tok.apply_chat_template(msgs, chat_template=t, **kw)  # noqa: E731
    data = {"b": ["é", "<&>"], "a": 1}
    assert render("{{ d | tojson }}", d=data) == json.dumps(data, ensure_ascii=False)
    assert render("{{ d | tojson(indent=2, sort_keys=True) }}", d=data) == json.dumps(
        data, ensure_ascii=False, indent=2, sort_keys=True
    )
    assert render("{{ d | tojson(separators=(',', ':')) }}", d=data) == '{"b":["é","<&>"],"a":1}'
    assert (
        render("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}")
        == "user"
    )
    assert (
        render("{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}")
        == "[<b>é</b>][x]"
    )
    assert render("{{ dict(a=1) | tojson }} {{ dict.fromkeys(['k']) | tojson }}") == '{"a": 1} {"k": null}'
    assert (
        render(
            "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
            "{{ ns.n }}"
        )
        == "2"
    )
    assert (
        render("{{ bos_token }}|{{ eos_token }}|{{ pad_token }}|{{ unk_token is defined }}")
        == "<|begin_of_text|>|<|eot_id|>|<pad>|False"
    )
    assert render("{{ bos_token }}", bos_token="OVERRIDE") == "OVERRIDE"
    assert render("{{ enable_thinking }}", enable_thinking=False) == "False"
    assert render("{{ strftime_now('%Y') }}") == str(datetime.now().year)
    with pytest.raises(ChatTemplateError) as info:
        render("{{ raise_exception('custom ' + messages[0].role) }}")
    assert info.value.template_message == "custom user"


def test_message_preparation_like_transformers(toks):
    tok = toks["bytelevel"]
    t = "{% for m in messages %}{{ m | tojson }};{% endfor %}"
    msgs = [
        {"role": "assistant", "content": None, "reasoning": "hmm"},
        {"role": "assistant", "content": "x", "thinking": "own", "reasoning_content": "rc"},
    ]
    out = tok.apply_chat_template(msgs, chat_template=t)
    first, second = (json.loads(p) for p in out.split(";")[:2])
    assert first == {"thinking": "hmm", "role": "assistant", "reasoning": "hmm", "reasoning_content": "hmm"}
    assert second == {"thinking": "own", "role": "assistant", "content": "x", "reasoning_content": "rc"}
    assert msgs[0]["content"] is None and "thinking" not in msgs[0]  # caller's messages untouched


def test_continue_final_message(toks):
    tok = toks["bytelevel"]
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure, "}]
    out = tok.apply_chat_template(msgs, continue_final_message=True, date_string="x")
    assert out.endswith("<|start_header_id|>assistant<|end_header_id|>\n\nSure,")
    with pytest.raises(TokenizerError, match="cannot both be set"):
        tok.apply_chat_template(msgs, continue_final_message=True, add_generation_prompt=True)


# ----------------------------------------------------------------------------- oracle: transformers

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city (°C/°F) <b>& more</b>.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "City name, e.g. Paris"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city"],
            },
        },
    }
]
TOOL_CALL = {
    "id": "call12345",  # Mistral requires 9 alphanumerics
    "type": "function",
    "function": {"name": "get_weather", "arguments": {"city": "São Paulo", "unit": "celsius"}},
}
SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly."}
USER = {"role": "user", "content": "What is the capital of France?"}


def _tool_conversation(content, json_arguments=False):
    call = copy.deepcopy(TOOL_CALL)
    if json_arguments:  # the OpenAI wire format: arguments as a JSON string
        call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    return [
        SYSTEM,
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {
            "role": "tool",
            "tool_call_id": "call12345",
            "name": "get_weather",
            "content": '{"temperature": 21, "unit": "celsius"}',
        },
    ]


CONVERSATIONS = {
    "system_user": ([SYSTEM, USER], {}),
    "user_only": ([USER], {}),
    "multi_turn": (
        [
            SYSTEM,
            USER,
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Japan? 日本 🗾"},
            {"role": "assistant", "content": "Tokyo."},
            {"role": "user", "content": "Thanks!"},
        ],
        {},
    ),
    "tool_call": (_tool_conversation(""), {"tools": TOOLS}),
    "tool_call_null_content": (_tool_conversation(None), {"tools": TOOLS}),
    "tool_call_json_args": (_tool_conversation("", json_arguments=True), {"tools": TOOLS}),
    "tools_no_call": ([SYSTEM, USER], {"tools": TOOLS}),
    "reasoning": (
        [
            USER,
            {
                "role": "assistant",
                "content": "Paris.",
                "reasoning_content": "The user asks about France; its capital is Paris.",
            },
            {"role": "user", "content": "Sure?"},
        ],
        {},
    ),
    "reasoning_alias": (
        [
            USER,
            {"role": "assistant", "content": "Paris.", "reasoning": "Older field name for the reasoning."},
        ],
        {},
    ),
    "documents": ([USER], {"documents": [{"title": "France", "text": "Paris is the capital of France."}]}),
    "prefill": ([USER, {"role": "assistant", "content": "The capital is"}], {"continue_final_message": True}),
}
THINKING = {
    "think_default": {},
    "think_on": {"enable_thinking": True, "thinking": True},
    "think_off": {"enable_thinking": False, "thinking": False},
}
# Exercises the environment itself: trim/lstrip of indented blocks, tojson options, namespace,
# loop controls, the generation tag, dict(), None-dropping and reasoning aliases.
PROBE_TEMPLATE = """{{ bos_token }}
{% set ns = namespace(count=0) %}
    {% for m in messages %}
        {% if loop.index0 > 6 %}{% break %}{% endif %}
        {% set ns.count = ns.count + 1 %}
  <{{ m.role }}> {{ m | tojson }} {{ m | tojson(indent=2, sort_keys=True) }}
        {% if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}{% endif %}
    {% endfor %}
{{ tools | tojson(separators=(',', ':')) }} {{ dict(n=ns.count) | tojson }} {{ documents | tojson }}
{% if add_generation_prompt %}GEN {{ enable_thinking | default('unset') }}{% endif %}{{ eos_token }}
"""
ORACLE_TEMPLATES = {**TEMPLATES, "probe": PROBE_TEMPLATE}
ORACLE_CASES = [
    pytest.param(t, c, th, agp, id=f"{t}-{c}-{th}-{'gen' if agp else 'nogen'}")
    for t in ORACLE_TEMPLATES
    for c in CONVERSATIONS
    for th in THINKING
    for agp in (False, True)
    if not (c == "prefill" and agp)  # HF refuses continue_final_message with a generation prompt
]
FROZEN_NOW = datetime(2024, 7, 26, 13, 45, 0)


class _FrozenDatetime(datetime):
    @classmethod
    def now(cls, tz=None):
        return FROZEN_NOW


@pytest.fixture
def frozen_clock(monkeypatch):
    import transformers.utils.chat_template_utils as hf_ctu

    monkeypatch.setattr(hf_ctu, "datetime", _FrozenDatetime)
    monkeypatch.setattr(chat_template, "datetime", _FrozenDatetime)


@pytest.fixture(scope="session")
def hf_tokenizer(tok_dirs):
    from transformers import PreTrainedTokenizerFast

    backend = Backend.from_file(str(tok_dirs["bytelevel"] / "tokenizer.json"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<pad>"
    )


def _render_both(hf, tok, template, conv, think, agp):
    msgs, extra = CONVERSATIONS[conv]
    kwargs = {**extra, **THINKING[think]}
    results = []
    for render in (
        lambda: hf.apply_chat_template(
            copy.deepcopy(msgs),
            chat_template=ORACLE_TEMPLATES[template],
            add_generation_prompt=agp,
            tokenize=False,
            **copy.deepcopy(kwargs),
        ),
        lambda: tok.apply_chat_template(
            copy.deepcopy(msgs),
            chat_template=ORACLE_TEMPLATES[template],
            add_generation_prompt=agp,
            **copy.deepcopy(kwargs),
        ),
    ):
        try:
            results.append((render(), None))
        except Exception as e:  # noqa: BLE001 - the oracle may fail in any way; compare below
            results.append((None, e))
    return results


@pytest.mark.parametrize("template, conv, think, agp", ORACLE_CASES)
def test_chat_template_matches_transformers(hf_tokenizer, toks, frozen_clock, template, conv, think, agp):
    (hf_text, hf_err), (text, err) = _render_both(hf_tokenizer, toks["bytelevel"], template, conv, think, agp)
    if hf_err is None:
        assert err is None, f"transformers rendered, mlxbun raised {err!r}"
        assert text == hf_text
        if template == "meta-llama-Llama-3.2-3B-Instruct":
            assert "Today Date: 26 Jul 2024" in text  # the clock is frozen on both sides
    else:
        assert isinstance(err, TokenizerError), f"transformers raised {hf_err!r}, mlxbun gave {err or text!r}"
        if isinstance(err, ChatTemplateError):
            assert err.template_message == str(hf_err)
        else:  # HF's own continue_final_message checks (ValueError) – same condition, own wording
            assert isinstance(hf_err, ValueError) and "continue_final_message" in str(hf_err)


def test_oracle_grid_is_not_vacuous(hf_tokenizer, toks, frozen_clock):
    """Every template renders most conversations, and the known refusals do happen."""
    rendered = {t: 0 for t in ORACLE_TEMPLATES}
    raised = set()
    for case in ORACLE_CASES:
        template, conv, think, agp = case.values
        (hf_text, hf_err), _ = _render_both(hf_tokenizer, toks["bytelevel"], template, conv, think, agp)
        if hf_err is None:
            rendered[template] += 1
        elif isinstance(hf_err, jinja2.TemplateError):
            raised.add((template, conv))
    assert all(n >= 15 for n in rendered.values()), rendered
    assert ("google-gemma-2-2b-it", "system_user") in raised
