"""Chat messages -> prompt text, through a Jinja chat template.

The template is ``--chat-template FILE`` when given, else the tokenizer's
``chat_template``, else ``FALLBACK_TEMPLATE``:

    system: You are terse.
    user: Hi!
    assistant:

Templates render in a sandbox like Hugging Face's (``bos_token``,
``eos_token`` and ``raise_exception`` are available); the generation
prompt is always added.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


class ChatTemplate:
    def __init__(self, tokenizer: Any, template_file: str | Path | None = None) -> None:
        self.tokenizer = tokenizer
        if template_file is not None:
            self.source, self.origin = Path(template_file).read_text(), "file"
        elif isinstance(getattr(tokenizer, "chat_template", None), str):
            self.source, self.origin = tokenizer.chat_template, "tokenizer"
        else:
            self.source, self.origin = FALLBACK_TEMPLATE, "fallback"
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise
        self._template = env.from_string(self.source)

    def render(self, messages: list[ChatMessage]) -> str:
        """The prompt text; RequestError(INVALID_ARGUMENT) for messages it cannot take."""
        plain = [{"role": m.role, "content": _text_of(m, i)} for i, m in enumerate(messages)]
        try:
            return self._template.render(
                messages=plain,
                add_generation_prompt=True,
                bos_token=getattr(self.tokenizer, "bos_token", None) or "",
                eos_token=getattr(self.tokenizer, "eos_token", None) or "",
            )
        except TemplateError as e:
            raise invalid_argument(f"messages: the chat template refused them: {e}") from None


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
