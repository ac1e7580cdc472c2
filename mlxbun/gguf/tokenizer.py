"""A GGUF file's tokenizer rebuilt as Hugging Face files: `tokenizer.json` (the `tokenizers`
library's format) and `tokenizer_config.json` (special tokens, BOS/EOS policy, chat template).

A GGUF stores no tokenizer.json, only llama.cpp's metadata: the vocabulary
(`tokenizer.ggml.tokens`), its kind (`tokenizer.ggml.model`: "gpt2" byte-level BPE with
`merges`, or "llama" SentencePiece with `scores`), the pre-tokenizer (`tokenizer.ggml.pre`),
token types (3 = control, 4 = user-defined), the special ids and the add-BOS/EOS flags.

Each kind is rebuilt the way transformers 5 builds it from the same file
(`AutoTokenizer.from_pretrained(dir, gguf_file=...)`, the reference the tests hold this to),
except where transformers and llama.cpp disagree, where llama.cpp (what the model was run
with) wins: the pre-tokenizers llama.cpp knows and transformers does not ("smollm" and its
family split digits one by one), and the BOS/EOS flags, which become a post-processor of
tokenizer.json so every loader (mlxbun's, mlx-lm's, transformers') adds the same tokens.
A kind or pre-tokenizer not listed here is refused by name, never approximated.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from mlxbun.gguf.reader import GGUFError

__all__ = ["PRE_TOKENIZER_SPLITS", "tokenizer_files"]

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# The GPT-2 split (what ByteLevel(use_regex=True) applies) and the splits of other vocabularies,
# as llama.cpp's llama-vocab.cpp and transformers' gguf_tokenizer_mapping.py spell them.
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"

# tokenizer.ggml.pre -> the regex splits applied in order before byte-level encoding. "smollm"
# and the vocabularies llama.cpp groups with it isolate every digit, then split as GPT-2 does
# (transformers' converter does not know them and would merge digit runs).
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("default", "gpt-2", "gpt2"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"),
                    (r"\p{N}", _GPT2)),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), (_LLAMA3,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), (_QWEN2,)),
}

# SentencePiece vocabularies whose shape depends on the architecture (transformers' builders)
_GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (every byte-level BPE vocabulary is spelled in it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _require(metadata: Mapping[str, Any], key: str) -> Any:
    if key not in metadata:
        raise GGUFError(f"GGUF metadata lacks {key!r} (needed to rebuild the tokenizer)")
    return metadata[key]


# ----------------------------------------------------------------------------- the two kinds


def _byte_level(metadata: Mapping[str, Any]) -> Tokenizer:
    """GPT-2-style byte-level BPE: the file's tokens and merges (as transformers' GPT2Tokenizer)."""
    pre = metadata.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZER_SPLITS:
        raise GGUFError(f"GGUF tokenizer.ggml.pre {pre!r}: a pre-tokenizer mlxbun does not know; "
                        f"known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(_require(metadata, "tokenizer.ggml.tokens"))}
    merges = [tuple(m.split(" ")) for m in _require(metadata, "tokenizer.ggml.merges")]
    backend = Tokenizer(BPE(vocab=vocab, merges=merges, dropout=None, continuing_subword_prefix="",
                            end_of_word_suffix="", fuse_unk=False))
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in PRE_TOKENIZER_SPLITS[pre]]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend


def _generated_merges(tokens: list[str], scores: Mapping[str, float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies, best first (transformers' `generate_merges`):
    every split of every token into two vocabulary tokens, ordered by the token's score."""
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece(metadata: Mapping[str, Any], arch: str) -> Tokenizer:
    """SentencePiece BPE with byte fallback (transformers' LlamaTokenizer / GemmaTokenizer shapes)."""
    tokens = list(_require(metadata, "tokenizer.ggml.tokens"))
    unk = tokens[metadata["tokenizer.ggml.unknown_token_id"]] if "tokenizer.ggml.unknown_token_id" in metadata \
        else "<unk>"
    if arch in _GEMMA_ARCHS:
        # Gemma files spell whitespace-only tokens with real spaces and list no merges; the merge
        # order is the file's token order, not the scores.
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        merges = _generated_merges(tokens, {t: -i for i, t in enumerate(tokens)})
        backend = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True,
                                unk_token=unk, dropout=None, byte_fallback=True))
        backend.normalizer = normalizers.Replace(" ", "\u2581")
        backend.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="merged_with_previous", invert=False)
        backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                             decoders.Fuse()])
        return backend
    if "tokenizer.ggml.merges" in metadata:
        merges = [tuple(m.split(" ")) for m in metadata["tokenizer.ggml.merges"]]
    else:
        merges = _generated_merges(tokens, dict(zip(tokens, _require(metadata, "tokenizer.ggml.scores"))))
    backend = Tokenizer(BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True,
                            unk_token=unk, dropout=None, byte_fallback=True))
    prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if arch == "phi3":  # the prefix space comes from a normalizer, not from Metaspace
        backend.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                                   normalizers.Replace(" ", "\u2581")])
    else:
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", split=False,
                                                         prepend_scheme="first" if prefix else "never")
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


# ----------------------------------------------------------------------------- the files


def _special_tokens(backend: Tokenizer, metadata: Mapping[str, Any], byte_level: bool) -> None:
    """Control tokens whole and special, user-defined ones whole (as llama.cpp matches them)."""
    tokens = metadata["tokenizer.ggml.tokens"]
    types = metadata.get("tokenizer.ggml.token_type") or ()
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    # a "control" token outside the byte alphabet of a byte-level vocabulary is a llama.cpp
    # mislabel: adding it would grow the vocabulary past the model's (transformers skips it too)
    control = [AddedToken(t, normalized=False, special=True) for t, k in zip(tokens, types)
               if k == CONTROL and (alphabet is None or set(t) <= alphabet)]
    backend.add_special_tokens(control)
    vocab = backend.get_vocab()
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t, k in zip(tokens, types)
                        if k == USER_DEFINED and t in vocab])


def _token(metadata: Mapping[str, Any], key: str) -> str | None:
    i = metadata.get(f"tokenizer.ggml.{key}_token_id")
    tokens = metadata["tokenizer.ggml.tokens"]
    if i is None:
        return None
    if not 0 <= int(i) < len(tokens):
        raise GGUFError(f"GGUF tokenizer.ggml.{key}_token_id {i} is outside the vocabulary of {len(tokens)}")
    return tokens[int(i)]


def _post_processor(backend: Tokenizer, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """BOS/EOS as llama.cpp adds them, written into tokenizer.json (one policy for every loader)."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    if not (add_bos or add_eos):
        return
    single = " ".join([*([f"{bos}:0"] if add_bos else []), "$A:0", *([f"{eos}:0"] if add_eos else [])])
    pair = " ".join([single, *([f"{bos}:1"] if add_bos else []), "$B:1", *([f"{eos}:1"] if add_eos else [])])
    used = [(t, backend.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair,
                                                           special_tokens=list(dict.fromkeys(used)))


def tokenizer_files(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """{"tokenizer.json": ..., "tokenizer_config.json": ...} (JSON objects) for a GGUF's metadata."""
    kind = _require(metadata, "tokenizer.ggml.model")
    arch = metadata.get("general.architecture", "")
    if kind == "gpt2":
        backend = _byte_level(metadata)
    elif kind == "llama":
        backend = _sentencepiece(metadata, arch)
    else:
        raise GGUFError(f"GGUF tokenizer.ggml.model {kind!r}: mlxbun rebuilds 'gpt2' (byte-level BPE) "
                        f"and 'llama' (SentencePiece) tokenizers only")
    _special_tokens(backend, metadata, byte_level=kind == "gpt2")
    specials = {f"{k}_token": _token(metadata, k) for k in ("bos", "eos", "unknown", "padding")}
    specials = {"bos_token": specials["bos_token"], "eos_token": specials["eos_token"],
                "unk_token": specials["unknown_token"], "pad_token": specials["padding_token"]}
    # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
    _post_processor(backend, specials["bos_token"], specials["eos_token"], add_bos, add_eos)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: v for k, v in specials.items() if v is not None},
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(metadata.get(f"{arch}.context_length", 0)) or 1_000_000_000,
    }
    if metadata.get("tokenizer.chat_template"):
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return {"tokenizer.json": json.loads(backend.to_str()), "tokenizer_config.json": config}
