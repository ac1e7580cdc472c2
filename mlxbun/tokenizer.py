"""Tokenizer: a checkpoint's `tokenizer.json` through the `tokenizers` library.

One job per piece:
- `load_tokenizer(path)` reads tokenizer.json, tokenizer_config.json, special_tokens_map.json,
  chat templates and the EOS ids of generation_config.json / config.json, and refuses bad files
  with a `TokenizerError` that names the file and key.
- `Tokenizer` encodes/decodes, knows BOS/EOS/special tokens, picks a chat template and renders
  it through `mlxbun.chat_template` (transformers' `apply_chat_template` semantics), and hands out
  `mlxbun.detokenizer.StreamingDetokenizer`s, whose streamed pieces always concatenate to
  `Tokenizer.decode(all_ids)`.

BOS policy (matches transformers 5 `AutoTokenizer` for tokenizer.json checkpoints): the
post-processor of tokenizer.json decides what `encode(add_special_tokens=True)` adds. Only when
tokenizer.json has no post-processor do `add_bos_token` / `add_eos_token` of tokenizer_config.json
decide (transformers 5 ignores them when tokenizer.json exists). `decode` never applies
`clean_up_tokenization_spaces`: generated text is the tokens' text, as mlx-lm streams it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, processors
from tokenizers import Tokenizer as _Backend

from mlxbun.chat_template import render_chat_template
from mlxbun.detokenizer import StreamingDetokenizer
from mlxbun.errors import TokenizerError

_EXTRA_SPECIAL_KEYS = ("additional_special_tokens", "extra_special_tokens")
# tokenizers' ByteFallback decoder reads any 6-char "<0xHH>" token as one raw byte.
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


# ----------------------------------------------------------------------------- file reading


def _read_json(path: Path, *, required: bool = False, want_object: bool = True) -> Any:
    if not path.is_file():
        if required:
            raise TokenizerError(f"{path}: file not found")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path}: malformed JSON ({e})") from e
    if want_object and not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(value: Any, where: str) -> str | None:
    """A special-token value as configs write it: a string, null, or an AddedToken dict."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: expected a token string or {{'content': ...}}, got {value!r}")


def _flatten_decoders(decoder: Any) -> list[str]:
    """The decoder types of a tokenizer.json `decoder` entry, Sequence flattened."""
    if not isinstance(decoder, dict):
        return []
    if decoder.get("type") == "Sequence":
        return [t for d in decoder.get("decoders") or [] for t in _flatten_decoders(d)]
    return [str(decoder.get("type"))]


def _read_chat_templates(root: Path, config: dict, config_path: Path) -> dict[str, tuple[str, str]]:
    """Named templates -> (text, source label). Files beat tokenizer_config.json, as in HF."""
    templates: dict[str, tuple[str, str]] = {}
    jinja_file = root / "chat_template.jinja"
    json_file = root / "chat_template.json"
    if jinja_file.is_file():
        templates["default"] = (_read_text(jinja_file), str(jinja_file))
    elif json_file.is_file():
        data = _read_json(json_file)
        text = data.get("chat_template")
        if not isinstance(text, str):
            raise TokenizerError(f"{json_file}: key 'chat_template' must be a string")
        templates["default"] = (text, f"{json_file} (key 'chat_template')")
    extra_dir = root / "additional_chat_templates"
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = (_read_text(f), str(f))
    if templates:
        return templates

    value = config.get("chat_template")
    where = f"{config_path} (key 'chat_template')"
    if value is None:
        return {}
    if isinstance(value, str):
        return {"default": (value, where)}
    if isinstance(value, list):
        for i, entry in enumerate(value):
            if not (
                isinstance(entry, dict)
                and isinstance(entry.get("name"), str)
                and isinstance(entry.get("template"), str)
            ):
                raise TokenizerError(f"{where}: entry {i} must be {{'name': str, 'template': str}}")
            templates[entry["name"]] = (entry["template"], f"{where}[{entry['name']!r}]")
        return templates
    raise TokenizerError(f"{where}: expected a string or a list of named templates")


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TokenizerError(f"{path}: unreadable ({e})") from e


# ----------------------------------------------------------------------------- loading


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer of checkpoint directory `path` (see module docstring)."""
    root = Path(path)
    if not root.is_dir():
        raise TokenizerError(f"{root}: not a directory")
    tok_path = root / "tokenizer.json"
    raw = _read_json(tok_path, required=True)  # parsed here too: decoder/post-processor types
    try:
        backend = _Backend.from_file(str(tok_path))
    except Exception as e:  # tokenizers raises a bare Exception for schema errors
        raise TokenizerError(f"{tok_path}: not a valid tokenizers file ({e})") from e

    cfg_path = root / "tokenizer_config.json"
    config = _read_json(cfg_path) or {}
    stm_path = root / "special_tokens_map.json"
    stm = _read_json(stm_path) or {}

    _sync_added_tokens(backend, config, cfg_path, tok_path)

    # Named and model-specific (`image_token`, ...) special tokens: tokenizer_config.json first,
    # special_tokens_map.json fills gaps. Every one must exist in the vocabulary.
    specials: dict[str, str] = {}
    for source, path_ in ((config, cfg_path), (stm, stm_path)):
        for key, value in source.items():
            if key in specials or not key.endswith("_token") or key.startswith("add_"):
                continue
            if isinstance(value, (bool, int)):
                continue
            where = f"{path_}: key {key!r}"
            text = _token_text(value, where)
            if text is None:
                continue
            if backend.token_to_id(text) is None:
                raise TokenizerError(f"{where} names {text!r}, which is not a token of {tok_path}")
            specials[key] = text

    extra: list[str] = []
    for source, path_ in ((config, cfg_path), (stm, stm_path)):
        for key in _EXTRA_SPECIAL_KEYS:
            values = source.get(key)
            if values is None:
                continue
            if not isinstance(values, (list, dict)):
                raise TokenizerError(f"{path_}: key {key!r} must be a list of tokens")
            for i, value in values.items() if isinstance(values, dict) else enumerate(values):
                where = f"{path_}: key {key!r}[{i!r}]"
                text = _token_text(value, where)
                if text is not None and backend.token_to_id(text) is None:
                    raise TokenizerError(f"{where} names {text!r}, which is not a token of {tok_path}")
                if text is not None and text not in extra:
                    extra.append(text)

    if raw.get("post_processor") is None:
        _install_bos_eos_processor(backend, config, cfg_path, specials)

    eos_ids = _collect_eos_ids(root, backend, specials, config, cfg_path, stm_path)
    decoder_types = _flatten_decoders(raw.get("decoder"))
    return Tokenizer(
        backend,
        special_tokens=specials,
        extra_special_tokens=tuple(extra),
        eos_token_ids=eos_ids,
        chat_templates=_read_chat_templates(root, config, cfg_path),
        byte_fallback="ByteFallback" in decoder_types,
        path=root,
    )


def _sync_added_tokens(backend: _Backend, config: dict, cfg_path: Path, tok_path: Path) -> None:
    """Add tokenizer_config.json's `added_tokens_decoder` entries that tokenizer.json lacks (as HF
    does) and refuse ones whose id disagrees with tokenizer.json."""
    entries = config.get("added_tokens_decoder")
    if entries is None:
        return
    if not isinstance(entries, dict):
        raise TokenizerError(f"{cfg_path}: key 'added_tokens_decoder' must be an object")
    for key, entry in sorted(entries.items(), key=lambda kv: _int_key(kv[0], cfg_path)):
        where = f"{cfg_path}: key 'added_tokens_decoder'[{key!r}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise TokenizerError(f"{where}: expected {{'content': str, ...}}, got {entry!r}")
        content = entry["content"]
        want = int(key)
        have = backend.token_to_id(content)
        if have is None:
            flags = {k: entry[k] for k in ("single_word", "lstrip", "rstrip", "normalized") if k in entry}
            backend.add_tokens([AddedToken(content, special=bool(entry.get("special")), **flags)])
            have = backend.token_to_id(content)
        if have != want:
            raise TokenizerError(f"{where}: {content!r} has id {have} in {tok_path}, not {want}")


def _int_key(key: str, cfg_path: Path) -> int:
    try:
        return int(key)
    except ValueError:
        raise TokenizerError(f"{cfg_path}: key 'added_tokens_decoder' has non-integer id {key!r}") from None


def _install_bos_eos_processor(backend: _Backend, config: dict, cfg_path: Path, specials: dict) -> None:
    """tokenizer.json has no post-processor: honour add_bos_token/add_eos_token the way HF's
    `update_post_processor` builds its template."""
    flags = {}
    for name in ("bos", "eos"):
        key = f"add_{name}_token"
        value = config.get(key, False)
        if not isinstance(value, bool):
            raise TokenizerError(f"{cfg_path}: key {key!r} must be true or false, got {value!r}")
        if value and f"{name}_token" not in specials:
            raise TokenizerError(f"{cfg_path}: key {key!r} is true but no {name}_token is set")
        flags[name] = value
    if not (flags["bos"] or flags["eos"]):
        return
    bos, eos = specials.get("bos_token"), specials.get("eos_token")
    single = f"{bos + ':0 ' if flags['bos'] else ''}$A:0{' ' + eos + ':0' if flags['eos'] else ''}"
    pair = (
        f"{single}{' ' + bos + ':1' if flags['bos'] else ''} $B:1{' ' + eos + ':1' if flags['eos'] else ''}"
    )
    tokens = [(t, backend.token_to_id(t)) for t, on in ((bos, flags["bos"]), (eos, flags["eos"])) if on]
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=tokens)


def _collect_eos_ids(root: Path, backend, specials, config, cfg_path, stm_path) -> tuple[int, ...]:
    """Union, in first-seen order, of the EOS of tokenizer_config.json, generation_config.json and
    config.json (also its `text_config`); each may be an id, a token string, or a list of them."""
    n_vocab = backend.get_vocab_size(with_added_tokens=True)
    ids: list[int] = []

    def add(value: Any, where: str) -> None:
        if value is None:
            return
        if isinstance(value, list):
            for i, v in enumerate(value):
                add(v, f"{where}[{i}]")
            return
        if isinstance(value, bool):
            raise TokenizerError(f"{where}: expected a token id or token string, got {value!r}")
        if isinstance(value, int):
            if not 0 <= value < n_vocab:
                raise TokenizerError(f"{where}: token id {value} is outside the vocabulary (size {n_vocab})")
            token_id = value
        else:
            text = _token_text(value, where)
            token_id = backend.token_to_id(text)
            if token_id is None:
                raise TokenizerError(
                    f"{where} names {text!r}, which is not a token of {root / 'tokenizer.json'}"
                )
        if token_id not in ids:
            ids.append(token_id)

    if "eos_token" in specials:
        src = cfg_path if "eos_token" in config else stm_path
        add(specials["eos_token"], f"{src}: key 'eos_token'")
    gen_path = root / "generation_config.json"
    gen = _read_json(gen_path) or {}
    add(gen.get("eos_token_id"), f"{gen_path}: key 'eos_token_id'")
    model_path = root / "config.json"
    model_cfg = _read_json(model_path) or {}
    add(model_cfg.get("eos_token_id"), f"{model_path}: key 'eos_token_id'")
    text_cfg = model_cfg.get("text_config")
    if isinstance(text_cfg, dict):
        add(text_cfg.get("eos_token_id"), f"{model_path}: key 'text_config.eos_token_id'")
    return tuple(ids)


# ----------------------------------------------------------------------------- the tokenizer


class Tokenizer:
    """Encode/decode, special tokens, chat templates. Build it with `load_tokenizer`."""

    def __init__(
        self,
        backend: _Backend,
        *,
        special_tokens: dict[str, str],
        extra_special_tokens: tuple[str, ...] = (),
        eos_token_ids: tuple[int, ...] = (),
        chat_templates: dict[str, tuple[str, str]] | None = None,
        byte_fallback: bool = False,
        path: Path | None = None,
    ):
        self.backend = backend
        self.path = path
        self.special_tokens: dict[str, str] = dict(special_tokens)
        self.extra_special_tokens = tuple(extra_special_tokens)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_token_ids)
        self._chat_templates = dict(chat_templates or {})
        self._byte_fallback = byte_fallback
        self._byte_token_ids: frozenset[int] | None = None
        # What `decode(..., skip_special_tokens=True)` drops: tokenizer.json's special added tokens.
        self.skippable_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, "
            f"eos_token_ids={self.eos_token_ids})"
        )

    # -- vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (HF's `len(tokenizer)`)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config's `eos_token`; generation stops on any of `eos_token_ids`."""
        return self._special_id("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def unk_token_id(self) -> int | None:
        return self._special_id("unk_token")

    @property
    def all_special_tokens(self) -> tuple[str, ...]:
        """Named and extra special tokens of the config plus tokenizer.json's special added tokens."""
        seen = dict.fromkeys([*self.special_tokens.values(), *self.extra_special_tokens])
        for added in self.backend.get_added_tokens_decoder().values():
            if added.special:
                seen.setdefault(added.content)
        return tuple(seen)

    @property
    def all_special_ids(self) -> tuple[int, ...]:
        return tuple(sorted({self.backend.token_to_id(t) for t in self.all_special_tokens}))

    @property
    def add_bos_token(self) -> bool:
        """Whether `encode(..., add_special_tokens=True)` prepends the BOS token."""
        bos = self.bos_token_id
        return bos is not None and self.backend.encode("", add_special_tokens=True).ids[:1] == [bos]

    # -- encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode expects a str, got {type(text).__name__}")
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Encode a ready prompt. Special tokens are added unless the text already starts with the
        BOS string (a rendered chat template usually does), so BOS is never doubled — mlx-lm's
        rule in `generate`."""
        bos = self.bos_token
        return self.encode(text, add_special_tokens=bos is None or not text.startswith(bos))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self.backend.decode(_as_id_list(ids), skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> StreamingDetokenizer:
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens)

    @property
    def byte_token_ids(self) -> frozenset[int]:
        """Ids the ByteFallback decoder reads as raw bytes (`<0xE2>`); empty without ByteFallback."""
        if self._byte_token_ids is None:
            ids: set[int] = set()
            if self._byte_fallback:
                vocab = self.backend.get_vocab(with_added_tokens=True)
                ids = {i for t, i in vocab.items() if len(t) == 6 and _BYTE_TOKEN.fullmatch(t)}
            self._byte_token_ids = frozenset(ids)
        return self._byte_token_ids

    # -- chat templates

    @property
    def chat_template(self) -> str | dict[str, str] | None:
        """As HF exposes it: one string, a dict of named templates, or None."""
        if not self._chat_templates:
            return None
        if list(self._chat_templates) == ["default"]:
            return self._chat_templates["default"][0]
        return {name: text for name, (text, _) in self._chat_templates.items()}

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_templates)

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> tuple[str, str]:
        """(template text, source label), chosen as HF's `get_chat_template`: an explicit template
        (or template name) wins; with several named templates, "tool_use" when tools are given,
        else "default"."""
        named = self._chat_templates
        if chat_template is not None:
            if chat_template in named:
                return named[chat_template]
            return chat_template, "chat_template argument"
        if len(named) > 1 or (named and "default" not in named):
            if tools is not None and "tool_use" in named:
                return named["tool_use"]
            if "default" in named:
                return named["default"]
            raise TokenizerError(
                f"{self.path}: several chat templates and none named 'default'; pass chat_template= "
                f"one of {sorted(named)}"
            )
        if "default" in named:
            return named["default"]
        raise TokenizerError(
            f"{self.path}: no chat template (looked for chat_template.jinja, chat_template.json and "
            "key 'chat_template' in tokenizer_config.json)"
        )

    def template_variables(self) -> dict[str, str]:
        """Special tokens a template sees (`bos_token`, `eos_token`, ..., model-specific ones)."""
        return dict(self.special_tokens)

    def apply_chat_template(
        self,
        messages,
        tools=None,
        add_generation_prompt: bool = False,
        tokenize: bool = False,
        chat_template: str | None = None,
        documents=None,
        continue_final_message: bool | str = False,
        **kwargs,
    ) -> str | list[int]:
        """Render `messages` with HF semantics; with `tokenize=True` return the ids of the rendered
        text encoded without added special tokens (as HF does), so BOS comes only from the
        template."""
        template, source = self.get_chat_template(chat_template, tools)
        text = render_chat_template(
            template,
            messages,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            source=source,
            variables={**self.template_variables(), **kwargs},
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text


def _as_id_list(ids) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]
