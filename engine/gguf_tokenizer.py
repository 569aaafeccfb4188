"""A GGUF file's tokenizer as Hugging Face tokenizer files (``tokenizer.json`` ...).

A GGUF has no ``tokenizer.json``: it stores the vocabulary, the merges, each
token's type and the special ids under llama.cpp's keys. For a byte-level BPE
vocabulary (``tokenizer.ggml.model`` ``gpt2``, what SmolLM2, Llama 3, Qwen and
most recent models use) this module builds the ``tokenizers`` pipeline itself,
as transformers' GGUF integration does (integrations/gguf/gguf_tokenizer_mapping.py):
the BPE model from vocabulary and merges, control tokens (type 3) as special
added tokens, user-defined ones (type 4) as plain added tokens, a ByteLevel
pre-tokenizer and decoder, BOS added when ``tokenizer.ggml.add_bos_token`` says
so. Other vocabularies (SentencePiece ``llama``, ``t5`` ...) and pre-tokenizer
splits this module does not know are converted by transformers itself
(``AutoTokenizer.from_pretrained(dir, gguf_file=name)``), which is slower.

The files are written once per model file (engine/gguf_model.py caches them)
and read by the engine (transformers) and the router (router/tokenizer.py).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONTROL, USER_DEFINED = 3, 4  # llama.cpp's token types

# Pre-tokenizer names (tokenizer.ggml.pre) whose split is GPT-2's regex, the
# ByteLevel pre-tokenizer's own. smollm's vocabulary has no merge across digits,
# so llama.cpp's extra split of single digits changes nothing.
_GPT2_SPLIT = {None, "default", "gpt2", "smollm"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_REGEX_SPLITS = {name: _LLAMA3_SPLIT for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")}


def _named_token(md: dict[str, Any], tokens: list[str], key: str) -> str | None:
    idx = md.get(f"tokenizer.ggml.{key}")
    return None if idx is None else tokens[int(idx)]


def build_byte_level(md: dict[str, Any]) -> Any:
    """The ``tokenizers.Tokenizer`` of a ``gpt2`` (byte-level BPE) vocabulary."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
    )
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:  # a token outside the byte alphabet, in its bytes' spelling
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges") or []]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    split = _REGEX_SPLITS.get(md.get("tokenizer.ggml.pre"))
    if split is None:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tok.decoder = decoders.ByteLevel()
    types = list(md.get("tokenizer.ggml.token_type") or [])
    control = [
        AddedToken(t, normalized=False, special=True)
        for t, kind in zip(tokens, types, strict=False)
        if kind == CONTROL and set(t) <= alphabet  # others: llama.cpp mislabels
    ]
    if control:
        tok.add_special_tokens(control)
    user = [
        AddedToken(t, normalized=False, special=False)
        for t, kind in zip(tokens, types, strict=False)
        if kind == USER_DEFINED and t in vocab
    ]
    if user:
        tok.add_tokens(user)
    bos = _named_token(md, tokens, "bos_token_id")
    if md.get("tokenizer.ggml.add_bos_token") and bos is not None:
        bos_id = int(md["tokenizer.ggml.bos_token_id"])
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A:0", pair=f"{bos} $A:0 {bos} $B:1", special_tokens=[(bos, bos_id)]
        )
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="$A:0", pair="$A:0 $B:1", special_tokens=[]
        )
    return tok


def can_build(md: dict[str, Any]) -> bool:
    """Whether ``build_byte_level`` handles this vocabulary (else transformers converts it)."""
    pre = md.get("tokenizer.ggml.pre")
    return md.get("tokenizer.ggml.model") == "gpt2" and (pre in _GPT2_SPLIT or pre in _REGEX_SPLITS)


def write_tokenizer(md: dict[str, Any], gguf_path: Path, out_dir: Path) -> None:
    """Write the file's tokenizer (and its chat template) into ``out_dir`` in the
    Hugging Face format; nothing when the file has no vocabulary."""
    import transformers

    if "tokenizer.ggml.tokens" not in md:
        log.warning("%s has no tokenizer: token-id prompts only", gguf_path)
        return
    if not can_build(md):
        log.info("converting the %s tokenizer with transformers", md.get("tokenizer.ggml.model"))
        fast = transformers.AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name
        )
        fast.save_pretrained(out_dir)
        return
    tokens = md["tokenizer.ggml.tokens"]
    names = {
        "bos_token": "bos_token_id",
        "eos_token": "eos_token_id",
        "unk_token": "unknown_token_id",
        "pad_token": "padding_token_id",
    }
    specials = {k: _named_token(md, tokens, v) for k, v in names.items()}
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_byte_level(md),
        clean_up_tokenization_spaces=False,
        **{k: v for k, v in specials.items() if v is not None},
    )
    template = md.get("tokenizer.chat_template")
    if template:
        fast.chat_template = template
    fast.save_pretrained(out_dir)
