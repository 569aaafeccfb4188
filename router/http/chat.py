"""Chat messages -> prompt text, through a Jinja chat template.

The template is ``--chat-template FILE`` when given, else the tokenizer's
``chat_template``, else ``FALLBACK_TEMPLATE``:

    system: You are terse.
    user: Hi!
    assistant:

Templates render as transformers' ``apply_chat_template(messages,
add_generation_prompt=True, tokenize=False)`` renders them: the same
sandboxed Jinja environment (``trim_blocks``, ``lstrip_blocks``, loop
controls, the ``{% generation %}`` tag, a ``tojson`` that keeps non-ASCII
characters, ``raise_exception``, ``strftime_now``, and ``dict`` and
``namespace`` that refuse underscore names), the tokenizer's special tokens
(``bos_token``, ``eos_token``, ...) as variables, ``tools`` and
``documents`` set to None. The generation prompt is always added.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from router.messages import invalid_argument

from .schemas import ChatMessage

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters; transformers' does not.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body (transformers
    uses the tag to mark the assistant's tokens for training masks)."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller) -> str:
        return caller()


class _TemplateDict:
    """``dict(...)`` without attribute access to the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace``, refusing underscore-prefixed attributes."""

    def __init__(*args, **kwargs):  # Jinja's signature trick: namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot set underscore-prefixed attributes, got {name!r}"
            )


def template_environment() -> ImmutableSandboxedEnvironment:
    """The Jinja environment transformers renders chat templates in."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


def special_tokens_of(tokenizer: Any) -> dict[str, str]:
    """The variables a tokenizer's special tokens give a template (transformers:
    ``special_tokens_map``, the tokens that are set)."""
    tokens = getattr(tokenizer, "special_tokens_map", None)
    if isinstance(tokens, dict):
        return {k: str(v) for k, v in tokens.items() if v is not None}
    names = ("bos_token", "eos_token")
    return {k: str(v) for k in names if (v := getattr(tokenizer, k, None)) is not None}


class ChatTemplate:
    def __init__(self, tokenizer: Any, template_file: str | Path | None = None) -> None:
        self.tokenizer = tokenizer
        if template_file is not None:
            self.source, self.origin = Path(template_file).read_text(), "file"
        elif isinstance(getattr(tokenizer, "chat_template", None), str):
            self.source, self.origin = tokenizer.chat_template, "tokenizer"
        else:
            self.source, self.origin = FALLBACK_TEMPLATE, "fallback"
        self._template = template_environment().from_string(self.source)
        self._special_tokens = special_tokens_of(tokenizer)

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt text; RequestError(INVALID_ARGUMENT) for messages it cannot take."""
        plain = [_plain(m, i) for i, m in enumerate(messages)]
        try:
            return self._template.render(
                **self._special_tokens,
                messages=plain,
                tools=None,
                documents=None,
                add_generation_prompt=True,
            )
        except TemplateError as e:
            raise invalid_argument(f"messages: the chat template refused them: {e}") from None


def _plain(message: ChatMessage, index: int) -> dict[str, str]:
    """A message as the template sees it: role, content text, and name when set
    (transformers drops keys whose value is None)."""
    plain = {"role": message.role, "content": _text_of(message, index)}
    if message.name is not None:
        plain["name"] = message.name
    return plain


def message_text(message: ChatMessage) -> str:
    """The text a message carries: its content, or its text parts joined."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text or "" for part in content)


def _text_of(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise invalid_argument(
                f"messages[{index}].content: only text parts are supported, got {part.type!r}"
            )
        texts.append(part.text)
    return "".join(texts)


def encode_rendered(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a rendered template: its special tokens are in the text already."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=False))
    except TypeError:  # a tokenizer without that keyword
        return list(tokenizer.encode(text))
