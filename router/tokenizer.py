"""The router's tokenizer: Hugging Face's ``tokenizers`` library, without transformers.

``transformers.AutoTokenizer`` imports torch, and the router process must not
(protocol/__init__.py). ``RouterTokenizer.from_pretrained(dir)`` reads the
files ``save_pretrained`` writes (``tokenizer.json``, ``tokenizer_config.json``,
the legacy ``special_tokens_map.json`` and ``added_tokens.json``, and
``chat_template.jinja`` / ``additional_chat_templates/*.jinja``) and sets the
Rust tokenizer up as transformers' ``TokenizersBackend`` (the class behind
``AutoTokenizer`` for a ``tokenizer.json``) does, for what the router uses:

* ``encode(text, add_special_tokens=True)``: prompt text to ids; the
  post-processor of ``tokenizer.json`` adds BOS (or not) as Hugging Face's does;
* ``decode(ids, skip_special_tokens=False)``: logprob tokens' text;
* ``chat_template`` and ``special_tokens_map`` (``bos_token``, ``eos_token``,
  ...): what router/http/chat.py renders a chat with.

Like vLLM's and TGI's Rust front ends, it takes ``tokenizer.json`` as the
truth: a model-specific transformers class that rebuilds its pipeline from
vocab and merges (rather than loading ``tokenizer.json`` as is) is not
imitated, nor transformers' opt-in ``fix_mistral_regex`` patch. A directory
without ``tokenizer.json`` (a SentencePiece-only or tiktoken checkpoint)
raises ``TokenizerNotFound``; the router then serves token-id prompts only.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, processors

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
ADDED_TOKENS_FILE = "added_tokens.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CHAT_TEMPLATE_DIR = "additional_chat_templates"

NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
"""transformers' ``SPECIAL_TOKENS_ATTRIBUTES``, in its order."""

_HUB_PATTERNS = [
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    ADDED_TOKENS_FILE,
    "*.jinja",
]
_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")

Token = str | AddedToken


class TokenizerNotFound(FileNotFoundError):
    """No ``tokenizer.json`` where the tokenizer was looked for."""


class RouterTokenizer:
    """A ``tokenizers.Tokenizer`` plus the settings of ``tokenizer_config.json``.

    Build it with ``from_pretrained``; the constructor takes the parts, for
    tests and for tokenizers built in memory.
    """

    def __init__(
        self,
        backend: Tokenizer,
        *,
        special_tokens: Mapping[str, Token] | None = None,
        extra_special_tokens: Iterable[Token] = (),
        added_tokens: Iterable[AddedToken] = (),
        chat_template: str | Mapping[str, str] | None = None,
        clean_up_tokenization_spaces: bool = False,
        clean_up_for_bpe: bool = False,
        split_special_tokens: bool = False,
        name_or_path: str = "",
    ) -> None:
        """``special_tokens``: named ones (``bos_token`` ...) and model-specific
        ones (any ``*_token`` name), in the order templates see them;
        ``added_tokens``: ``tokenizer_config.json``'s ``added_tokens_decoder``,
        by id. Every special token missing from ``backend`` is added to it,
        as transformers does on loading."""
        self.name_or_path = name_or_path
        self._tokenizer = backend
        self._special = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self._extra = list(extra_special_tokens)
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self._clean_up_for_bpe = clean_up_for_bpe
        self.split_special_tokens = split_special_tokens
        if isinstance(chat_template, Mapping):
            self.chat_templates = dict(chat_template)
        else:
            self.chat_templates = {} if chat_template is None else {"default": chat_template}

        backend.no_truncation()  # what encode(..., truncation=False, padding=False) does
        backend.no_padding()
        backend.encode_special_tokens = split_special_tokens
        self._add_missing_tokens(list(added_tokens))
        if backend.post_processor is None:
            # TokenizersBackend.update_post_processor with add_bos/add_eos off
            backend.post_processor = processors.TemplateProcessing(
                single="$A:0", pair="$A:0 $B:1", special_tokens=[]
            )

    def _add_missing_tokens(self, added: list[AddedToken]) -> None:
        """TokenizersBackend.__init__: the config's added tokens, then every
        named and extra special token the vocabulary lacks, in one call."""
        present = self._tokenizer.get_added_tokens_decoder().values()
        encoder = {t.content for t in present} | {str(t) for t in added}
        to_add: list[Token] = list(added)
        for token in [*self._special.values(), *self._extra]:
            if str(token) not in encoder and token not in to_add:
                to_add.append(token)
        named = {str(t) for t in self._special.values()}
        tokens = []
        for token in to_add:
            if isinstance(token, str):
                token = AddedToken(token, special=True)
            elif not token.special and str(token) in named:
                token.special = True
            tokens.append(token)
        if tokens:
            self._tokenizer.add_tokens(tokens)

    # -- loading --------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike) -> RouterTokenizer:
        """The tokenizer saved in a directory (or a hub id's, downloaded with
        huggingface_hub). Raises TokenizerNotFound (an OSError) without a
        ``tokenizer.json``, ValueError for a malformed file."""
        path = _tokenizer_dir(name_or_path)
        file = path / TOKENIZER_FILE
        if not file.is_file():
            raise TokenizerNotFound(
                f"no {TOKENIZER_FILE} in {str(path)!r}: the router reads tokenizers in the "
                "Hugging Face tokenizers format only (save the tokenizer with transformers' "
                "save_pretrained to write one)"
            )
        try:
            backend = Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"{file}: not a valid tokenizers file: {e}") from None
        try:
            return cls._configured(backend, path, str(name_or_path))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}: malformed tokenizer settings: {e!r}") from None

    @classmethod
    def _configured(cls, backend: Tokenizer, path: Path, name_or_path: str) -> RouterTokenizer:
        """``backend`` with the settings of the other files in ``path``, read as
        transformers' ``_from_pretrained`` and ``TokenizersBackend`` read them."""
        init = _read_json(path / TOKENIZER_CONFIG_FILE)
        init.pop("tokenizer_class", None)
        init.pop("init_inputs", None)
        init.pop("add_bos_token", None)  # ignored next to a tokenizer.json
        init.pop("add_eos_token", None)
        templates = _chat_templates(path, init.pop("chat_template", None))

        if "additional_special_tokens" in init and not init.get("extra_special_tokens"):
            init["extra_special_tokens"] = init.pop("additional_special_tokens")
        model_specific = {
            k: init.pop(k)
            for k in list(init)
            if k not in NAMED_SPECIAL_TOKENS and k.endswith("_token") and isinstance(init[k], str)
        }
        if isinstance(init.get("extra_special_tokens"), dict):
            model_specific.update(init.pop("extra_special_tokens"))

        added: dict[int, AddedToken] = {}
        if "added_tokens_decoder" in init:
            for idx, token in init["added_tokens_decoder"].items():
                added[int(idx)] = _added_token(token)
        else:  # legacy files
            for key, value in _read_json(path / SPECIAL_TOKENS_MAP_FILE).items():
                if isinstance(value, dict) and key != "extra_special_tokens":
                    value = _added_token({**value, "special": True})
                elif key == "extra_special_tokens" and isinstance(value, list):
                    merged = list(init.get("extra_special_tokens") or [])
                    for t in value:
                        t = _added_token({**t, "special": True}) if isinstance(t, dict) else t
                        if t not in merged:
                            merged.append(t)
                    value = merged
                init[key] = value
            if isinstance(init.get("extra_special_tokens"), dict):
                model_specific.update(init.pop("extra_special_tokens"))
            legacy_added = _read_json(path / ADDED_TOKENS_FILE)
            if legacy_added:
                specials = {str(init[k]) for k in NAMED_SPECIAL_TOKENS if init.get(k)}
                specials.update(str(t) for t in init.get("extra_special_tokens") or [])
                for text, idx in legacy_added.items():
                    special = text in specials
                    added[idx] = AddedToken(text, normalized=not special, special=special)
            added.update(backend.get_added_tokens_decoder())
        init = {k: _typed_token(v) for k, v in init.items()}
        by_text = {str(t): t for t in added.values()}
        specials: dict[str, Token] = {}
        for key in NAMED_SPECIAL_TOKENS:
            value = init.get(key)
            if value is not None:
                specials[key] = by_text.get(str(value), value) if by_text else value
        auto_specific = {
            k: v
            for k, v in init.items()
            if k not in NAMED_SPECIAL_TOKENS
            and k.endswith("_token")
            and isinstance(v, str | AddedToken)
        }
        for key, value in {**auto_specific, **model_specific}.items():
            specials[key] = _typed_token(value)
        extra = init.get("extra_special_tokens") or []
        return cls(
            backend,
            special_tokens=specials,
            extra_special_tokens=[_typed_token(t) for t in extra],
            added_tokens=[added[i] for i in sorted(added)],
            chat_template=templates,
            clean_up_tokenization_spaces=bool(init.get("clean_up_tokenization_spaces", False)),
            clean_up_for_bpe=bool(
                init.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output")
            ),
            split_special_tokens=bool(init.get("split_special_tokens", False)),
            name_or_path=name_or_path,
        )

    # -- encoding -------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor
        (BOS for most Llama-family checkpoints), as Hugging Face's encode does."""
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of ``token_ids`` (Hugging Face's decode, same defaults)."""
        ids = [int(t) for t in token_ids]
        text = self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        if self.clean_up_tokenization_spaces and (
            type(self._tokenizer.model).__name__ != "BPE" or self._clean_up_for_bpe
        ):
            text = clean_up_tokenization(text)
        return text

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    # -- vocabulary and special tokens ------------------------------------

    @property
    def backend_tokenizer(self) -> Tokenizer:
        return self._tokenizer

    def __len__(self) -> int:
        """The vocabulary with added tokens (Hugging Face's ``len(tokenizer)``)."""
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens."""
        return self._tokenizer.get_vocab_size(with_added_tokens=False)

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 length of the longest vocabulary entry, added tokens included (at least 1)."""
        vocab = self._tokenizer.get_vocab(with_added_tokens=True)
        return max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1) or 1

    def convert_tokens_to_ids(self, token: str) -> int | None:
        """The id of ``token``, else the unknown token's id, else None."""
        idx = self._tokenizer.token_to_id(token)
        if idx is None and self.unk_token is not None:
            idx = self._tokenizer.token_to_id(self.unk_token)
        return idx

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """Named (and model-specific) special tokens by attribute name; what a
        chat template sees besides ``messages``."""
        return {k: str(v) for k, v in self._special.items()}

    @property
    def extra_special_tokens(self) -> list[str]:
        return [str(t) for t in self._extra]

    @property
    def all_special_tokens(self) -> list[str]:
        seen: dict[str, None] = {}
        for t in [*self._special.values(), *self._extra]:
            seen.setdefault(str(t), None)
        return list(seen)

    @property
    def all_special_ids(self) -> list[int]:
        return [
            i for i in map(self.convert_tokens_to_ids, self.all_special_tokens) if i is not None
        ]

    def _named(self, key: str) -> str | None:
        value = self._special.get(key)
        return None if value is None else str(value)

    def _named_id(self, key: str) -> int | None:
        value = self._named(key)
        return None if value is None else self.convert_tokens_to_ids(value)

    @property
    def bos_token(self) -> str | None:
        return self._named("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._named("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._named("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._named("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._named_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._named_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._named_id("pad_token")

    # -- chat template ------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The template ``apply_chat_template`` uses without tools: the only one,
        or the one named ``default``; None without one (where transformers
        would raise, the router falls back to its plain template)."""
        return self.chat_templates.get("default")

    def __repr__(self) -> str:
        return (
            f"RouterTokenizer(name_or_path={self.name_or_path!r}, len={len(self)}, "
            f"special_tokens={self.special_tokens_map})"
        )


def clean_up_tokenization(text: str) -> str:
    """transformers' ``clean_up_tokenization`` (spaces before punctuation and
    English contractions), for tokenizers that ask for it."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


def _tokenizer_dir(name_or_path: str | os.PathLike) -> Path:
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    text = str(name_or_path)
    if path.exists() or text.startswith((".", "/", "~")):
        raise TokenizerNotFound(f"tokenizer {text!r} is not a directory")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(text, allow_patterns=_HUB_PATTERNS))
    except Exception as e:
        raise TokenizerNotFound(
            f"tokenizer {text!r} is neither a local directory nor reachable on the hub: {e}"
        ) from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _chat_templates(path: Path, from_config: Any) -> str | dict[str, str] | None:
    """Template files win over the config's entry, as in transformers."""
    templates: dict[str, str] = {}
    file = path / CHAT_TEMPLATE_FILE
    if file.is_file():
        templates["default"] = file.read_text(encoding="utf-8")
    extra_dir = path / CHAT_TEMPLATE_DIR
    if extra_dir.is_dir():
        for f in sorted(extra_dir.glob("*.jinja")):
            templates[f.name.removesuffix(".jinja")] = f.read_text(encoding="utf-8")
    if len(templates) == 1 and "default" in templates:
        return templates["default"]
    if templates:
        return templates
    if isinstance(from_config, list):  # [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in from_config}
    if isinstance(from_config, str | dict):
        return from_config
    return None


def _added_token(fields: Mapping[str, Any]) -> AddedToken:
    kwargs = {k: fields[k] for k in _ADDED_TOKEN_FIELDS if k in fields}
    return AddedToken(kwargs.pop("content"), **kwargs)


def _typed_token(value: Any) -> Any:
    """A serialized AddedToken (``{"__type": "AddedToken", ...}``) as one."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return _added_token(value)
    if isinstance(value, list):
        return [_typed_token(v) for v in value]
    return value
