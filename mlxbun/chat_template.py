"""Chat templates rendered exactly as transformers' `apply_chat_template(tokenize=False)`.

Mirrors transformers/utils/chat_template_utils.py (`_compile_jinja_template`,
`render_jinja_template`): the same jinja2 sandbox, filters, globals and input preparation,
so mlxbun renders what Hugging Face renders. Templates are untrusted code: any failure is
a `ChatTemplateError` naming the template's source.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlxbun.errors import TokenizerError


class ChatTemplateError(TokenizerError):
    """A chat template failed to compile or render; `template_message` is the template's own text
    (for `raise_exception(...)`) or the underlying error's message."""

    def __init__(self, source: str, template_message: str):
        super().__init__(f"chat template ({source}): {template_message}")
        self.source = source
        self.template_message = template_message


class _TemplateRaised(jinja2.exceptions.TemplateError):
    """`raise_exception(msg)` called by a template."""


def _raise_exception(message):
    raise _TemplateRaised(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # HF's tojson: no HTML escaping (jinja's default), and json.dumps' options exposed.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict` in templates: callable and `fromkeys`, nothing else reachable."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace` that refuses underscore names (no reaching CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, "
                f"but got {name!r}. Please rename the attribute."
            )


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for HF's training masks; for
    rendering it is transparent."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=64)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _to_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models like the OpenAI SDK's) to plain dicts."""
    if isinstance(value, Mapping):
        return {k: _to_dicts(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_dicts(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_to_dicts(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _to_dicts(value.model_dump())
    return value


def _plain(value: Any) -> Any:
    """Rebuild template inputs from JSON types; anything else becomes an inert "<TypeName>"."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar exists only if numpy was imported
    if numpy is not None and isinstance(value, numpy.generic):
        return _plain(value.item())  # np.bool_(False) must not become a truthy placeholder
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    # Templates read `reasoning_content` (most) or `thinking` (gpt-oss); accept any of the names.
    out = []
    for message in chat:
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(
    template: str,
    messages,
    *,
    tools=None,
    documents=None,
    add_generation_prompt: bool = False,
    continue_final_message: bool | str = False,
    source: str = "chat template",
    variables: Mapping[str, Any] | None = None,
) -> str:
    """Render one conversation exactly as transformers' `apply_chat_template(tokenize=False)`.

    `variables` are the template's extra names (special tokens, `enable_thinking`, ...). Any
    failure of the template is a `ChatTemplateError` naming `source`.
    """
    chat = _prepare_messages(messages, source)
    if continue_final_message and add_generation_prompt:
        raise TokenizerError("continue_final_message and add_generation_prompt cannot both be set")
    if tools is not None:
        if not isinstance(tools, (list, tuple)) or not all(isinstance(t, Mapping) for t in tools):
            raise TokenizerError("tools must be a list of JSON-schema dicts")
        tools = _plain(list(tools))
    if documents is not None:
        if not all(isinstance(d, Mapping) for d in documents):
            raise TokenizerError("documents must be a list of dicts")
        documents = _plain(documents)
    variables = _plain(dict(variables or {}))

    final_message = None
    if continue_final_message:
        final_message = _tag_final_message(chat, continue_final_message, template)

    try:
        compiled = _compile(template)
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(source, f"does not compile: {e}") from e
    try:
        rendered = compiled.render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except _TemplateRaised as e:
        raise ChatTemplateError(source, str(e.message)) from e
    except Exception as e:  # untrusted template code: any failure is the template's/inputs' fault
        raise ChatTemplateError(source, str(e)) from e

    if continue_final_message:
        rendered = _cut_at_final_message(rendered, final_message)
    return rendered


def _prepare_messages(messages, source: str) -> list[dict]:
    messages = _to_dicts(getattr(messages, "messages", messages))
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TokenizerError(f"chat template ({source}): messages must be a non-empty list of dicts")
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise TokenizerError(f"chat template ({source}): a message must be a dict, got {message!r}")
        # APIs send `content=None` / `tool_calls=None`; templates handle a missing key, not None.
        out.append({k: v for k, v in message.items() if v is not None})
    return _alias_reasoning(_plain(out))


def _tag_final_message(chat: list[dict], field: bool | str, template: str) -> str:
    """Append HF's continue tag to the final message's text (prefill); return the original text."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field)
    if final is None:
        raise TokenizerError(f'continue_final_message: the final message has no "{field}" to continue')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise TokenizerError(f'continue_final_message: "{field}" is not a field the chat template reads')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return final
        raise TokenizerError("continue_final_message: no text to continue in the final message")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _cut_at_final_message(rendered: str, final_message: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_message.strip() not in rendered or tag not in rendered:
        raise TokenizerError(
            "continue_final_message: the chat template dropped part of the final message, so it "
            "cannot be continued"
        )
    loc = rendered.rindex(tag)
    if rendered[loc : loc + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:loc]
    return rendered[:loc].rstrip()
