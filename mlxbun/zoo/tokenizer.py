"""The zoo tokenizer: one real byte-level BPE `tokenizer.json` shared by every arch.

Trained with `tokenizers` on the packaged corpus (deterministic: same corpus and
library version -> same merges), plus the HF side files (`tokenizer_config.json`,
`special_tokens_map.json`) that `transformers.AutoTokenizer` reads offline.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from pathlib import Path

VOCAB_SIZE = 512

# id order is fixed: special tokens take ids 0..4, then the 256 byte symbols, then merges.
PAD, BOS, EOS, IM_START, IM_END = (
    "<pad>",
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|im_start|>",
    "<|im_end|>",
)
SPECIAL_TOKENS = (PAD, BOS, EOS, IM_START, IM_END)
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
# generation stops on end-of-text or end-of-turn (as Llama-3-style instruct models do)
GENERATION_EOS_IDS = [EOS_ID, IM_END_ID]
MODEL_MAX_LENGTH = 512


def _package_text(name: str) -> str:
    return resources.files(__package__).joinpath(name).read_text(encoding="utf-8")


def chat_template() -> str:
    return _package_text("chat_template.jinja")


@functools.lru_cache(maxsize=1)
def tokenizer_json() -> str:
    """The serialized tokenizer (trained once per process)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _package_text("corpus.txt").splitlines(keepends=True)
    tok.train_from_iterator(lines, trainer=trainer, length=len(lines))
    # ByteLevel offsets trimming, then BOS on every encode (like Llama 3's tokenizer.json)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS}:0 $A:0",
                pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1",
                special_tokens=[(BOS, BOS_ID)],
            ),
        ]
    )
    if tok.get_vocab_size() != VOCAB_SIZE:  # the corpus must be rich enough to fill it
        raise RuntimeError(f"zoo tokenizer trained to {tok.get_vocab_size()} tokens, not {VOCAB_SIZE}")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return tok.to_str(pretty=True)


def _added_token(content: str) -> dict:
    return {
        "content": content,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }


def tokenizer_config() -> dict:
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(i): _added_token(t) for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": BOS,
        "chat_template": chat_template(),
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "extra_special_tokens": {},
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": MODEL_MAX_LENGTH,
        "pad_token": PAD,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def special_tokens_map() -> dict:
    return {
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
    }


def generation_config() -> dict:
    return {
        "bos_token_id": BOS_ID,
        "do_sample": False,
        "eos_token_id": list(GENERATION_EOS_IDS),
        "pad_token_id": PAD_ID,
    }


def _dump(obj: dict) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def write_tokenizer_files(out: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json."""
    (out / "tokenizer.json").write_text(tokenizer_json(), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(_dump(tokenizer_config()), encoding="utf-8")
    (out / "special_tokens_map.json").write_text(_dump(special_tokens_map()), encoding="utf-8")
    (out / "generation_config.json").write_text(_dump(generation_config()), encoding="utf-8")
