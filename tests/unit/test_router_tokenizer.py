"""router/tokenizer.py against transformers' AutoTokenizer, on the same files.

For every tokenizer: encode (with and without special tokens), decode of the
whole and of each id, and the chat prompt router/http/chat.py renders, all
equal to what ``AutoTokenizer.from_pretrained`` gives. Besides the embedded
default tokenizer and the test checkpoints', variants written here cover the
loading rules: a post-processor that adds BOS/EOS, none at all, the legacy
special_tokens_map.json, special tokens missing from the vocabulary,
model-specific tokens, split_special_tokens, overridden added-token flags,
WordPiece with clean_up_tokenization_spaces, and a Metaspace BPE.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)
from transformers import AutoTokenizer

from engine.default_model import default_model_path, default_tokenizer_path
from router.http.chat import ChatTemplate, encode_rendered
from router.http.schemas import ChatMessage
from router.messages import RequestError
from router.tokenizer import RouterTokenizer, TokenizerNotFound

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]

TEXTS = [
    "",
    " ",
    "   ",
    "\n",
    "\t",
    "\r\n",
    "hello",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "multiple   spaces\tand\ttabs",
    "line1\nline2\n\nline4\n",
    "naïve café résumé",
    "Ünïcödé ß ø å Ω",
    "日本語のテキストです。",
    "中文测试，标点！",
    "한국어 문장",
    "Привет, мир",
    "مرحبا بالعالم",
    "שלום עולם",
    "emoji 🤖🚀✨",
    "family 👩‍👩‍👧‍👦 flag 🇫🇷",
    "combining e\u0301 a\u0308 n\u0303",
    "zero\u200bwidth\u200djoiner",
    "nbsp\u00a0here and\u3000ideographic",
    "math ∑ ∫ √ ≤ ≥ ≠ ∞",
    "def add(a, b):\n    return a + b\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }",
    '{"key": [1, 2.5, null, true], "s": "x\\"y"}',
    '<html><body class="x">&amp;</body></html>',
    "SELECT * FROM t WHERE id = 42;",
    "0123456789 3.14159 -1e-10 1,000,000",
    "don't won't it's we're I'm they've",
    "Hello , world . How are you ? Fine ! ' quoted '",
    "\x00\x01 control \x7f chars",
    "<|begin_of_text|>",
    "<|im_start|>user\nhi<|im_end|>\n",
    "text<|end_of_text|>more",
    " <|im_end|> spaced ",
    "<|unknown_special|>",
    "<unk> <s> </s> [CLS] [SEP] [MASK] <image> <|tool|>",
    "a" * 500,
    "ab " * 200,
]

MESSAGES = [
    [ChatMessage(role="user", content="hi")],
    [
        ChatMessage(role="system", content="You are terse."),
        ChatMessage(role="user", content="Write add(a, b) in Python."),
        ChatMessage(role="assistant", content="def add(a, b):\n    return a + b"),
        ChatMessage(role="user", content='Now in 日本語 🤖, with <b>tags</b> & "quotes".'),
    ],
    [ChatMessage(role="user", content="", name="alice"), ChatMessage(role="tool", content=" x ")],
]

# Templates that use what transformers' environment offers.
TEMPLATES = {
    "llama3_like": (
        "{{ bos_token }}{% for message in messages %}"
        "{% if loop.first and message['role'] != 'system' %}"
        "<|start_header_id|>system<|end_header_id|>\n\nDefault.<|eot_id|>{% endif %}"
        "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
        "{{ message['content'] | trim }}<|eot_id|>"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
    ),
    "tojson_namespace": (
        "{% set ns = namespace(n=0, sys=none) %}"
        "{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{% if m.role == 'system' %}{% set ns.sys = m.content %}{% continue %}{% endif %}"
        "{{ m | tojson }}\n"
        "{% if ns.n > 10 %}{% break %}{% endif %}"
        "{% endfor %}"
        "{{ dict(count=ns.n, sys=ns.sys) | tojson(sort_keys=true) }}\n"
        "{% if tools is none and documents is none %}no tools{% endif %}"
        "{% if add_generation_prompt %}\n>{% endif %}"
    ),
    "generation_tag": (
        "{% for m in messages %}"
        "{% if m.role == 'assistant' %}{% generation %}[A]{{ m.content }}{{ eos_token }}"
        "{% endgeneration %}{% else %}[{{ m.role | upper }}{{ ' ' + m.name if m.name }}]"
        "{{ m.content }}\n{% endif %}"
        "{% endfor %}"
        "{% if add_generation_prompt %}[A]{% endif %}"
        "{{ pad_token if pad_token is defined else 'nopad' }}"
        "{{ unk_token if unk_token is defined else 'nounk' }}"
    ),
    "whitespace_control": (
        "{%- for message in messages -%}\n"
        "    {{- '<|' + message.role + '|>\n' }}\n"
        "    {%- if message.content is string %}{{ message.content }}{% endif %}\n"
        "    {{- '<|end|>\n' -}}\n"
        "{%- endfor %}\n"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
        "{{ strftime_now('%Y') | length }}"
    ),
}


# -- helpers ------------------------------------------------------------------


def _pair(path: Path) -> tuple[RouterTokenizer, object]:
    return RouterTokenizer.from_pretrained(path), AutoTokenizer.from_pretrained(str(path))


def _assert_same(ours: RouterTokenizer, hf, texts=TEXTS) -> None:
    assert len(ours) == len(hf)
    assert ours.special_tokens_map == hf.special_tokens_map
    assert ours.bos_token == hf.bos_token and ours.eos_token == hf.eos_token
    assert ours.bos_token_id == hf.bos_token_id and ours.eos_token_id == hf.eos_token_id
    assert ours.pad_token_id == hf.pad_token_id
    assert sorted(ours.all_special_tokens) == sorted(hf.all_special_tokens)
    for text in texts:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == hf.encode(text, add_special_tokens=special), (text, special)
        ids = hf.encode(text)
        assert ours.decode(ids) == hf.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(
            ids, skip_special_tokens=True
        ), text
        for i in ids:
            assert ours.decode([i]) == hf.decode([i]), (text, i)


def _hf_chat(hf, messages: list[ChatMessage], template: str | None = None):
    plain = [m.model_dump(exclude_none=True) for m in messages]
    text = hf.apply_chat_template(
        plain, chat_template=template, tokenize=False, add_generation_prompt=True
    )
    ids = hf.apply_chat_template(
        plain, chat_template=template, tokenize=True, add_generation_prompt=True
    )["input_ids"]
    return text, ids


def _assert_same_chat(ours: RouterTokenizer, hf, template_file: Path | None = None) -> None:
    template = ChatTemplate(ours, template_file)
    source = template_file.read_text() if template_file is not None else None
    for messages in MESSAGES:
        text, ids = _hf_chat(hf, messages, source)
        assert template.render(messages) == text
        assert encode_rendered(ours, text) == ids


def _copy_default(tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(default_tokenizer_path(), out, ignore=shutil.ignore_patterns(".tandem-*"))
    return out


def _edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data, ensure_ascii=False, indent=2))


def _write_config(out: Path, config: dict) -> None:
    (out / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TokenizersBackend", **config}, indent=2)
    )


def _corpus() -> list[str]:
    return [*TEXTS, *(m.content for ms in MESSAGES for m in ms)] * 3


# -- the embedded default model and the test checkpoints ----------------------


def test_the_default_tokenizer_matches_hugging_face():
    ours, hf = _pair(default_tokenizer_path())
    _assert_same(ours, hf)
    assert ours.chat_template == hf.chat_template
    _assert_same_chat(ours, hf)


def test_the_default_models_tokenizer_matches_hugging_face():
    ours, hf = _pair(default_model_path())
    _assert_same(ours, hf)
    _assert_same_chat(ours, hf)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_test_checkpoints_tokenizers_match_hugging_face(checkpoint_factory, arch):
    ours, hf = _pair(checkpoint_factory(arch))
    _assert_same(ours, hf)
    _assert_same_chat(ours, hf)


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chat_templates_render_as_in_transformers(tmp_path, name):
    ours, hf = _pair(default_tokenizer_path())
    path = tmp_path / f"{name}.jinja"
    path.write_text(TEMPLATES[name])
    _assert_same_chat(ours, hf, path)


def test_template_errors_and_sandbox_refusals_are_request_errors(tmp_path):
    ours = RouterTokenizer.from_pretrained(default_tokenizer_path())
    for source in (
        "{{ raise_exception('only user messages') }}",
        "{% set ns = namespace() %}{% set ns._secret = 1 %}",
        "{{ messages.__class__ }}{{ ''.__class__.__mro__ }}",
    ):
        path = tmp_path / "t.jinja"
        path.write_text(source)
        with pytest.raises(RequestError):
            ChatTemplate(ours, path).render(MESSAGES[0])


# -- loading rules, on variants of the default tokenizer --------------------


def test_a_post_processor_that_adds_bos_and_eos(tmp_path):
    out = _copy_default(tmp_path, "bos")

    def bos_eos(data):
        data["post_processor"] = json.loads(
            processors.TemplateProcessing(
                single="<|begin_of_text|> $A <|end_of_text|>",
                pair="<|begin_of_text|> $A $B:1 <|end_of_text|>",
                special_tokens=[("<|begin_of_text|>", 0), ("<|end_of_text|>", 1)],
            ).__getstate__()
        )

    _edit_json(out / "tokenizer.json", bos_eos)
    ours, hf = _pair(out)
    assert ours.encode("hi")[0] == 0 and ours.encode("hi")[-1] == 1
    assert ours.encode("hi", add_special_tokens=False)[0] != 0
    _assert_same(ours, hf)
    _assert_same_chat(ours, hf)


def test_no_post_processor(tmp_path):
    out = _copy_default(tmp_path, "nopost")
    _edit_json(out / "tokenizer.json", lambda d: d.update(post_processor=None))
    ours, hf = _pair(out)
    _assert_same(ours, hf)


def test_add_bos_token_is_ignored_next_to_a_tokenizer_json(tmp_path):
    out = _copy_default(tmp_path, "addbos")
    _edit_json(out / "tokenizer_config.json", lambda d: d.update(add_bos_token=True))
    ours, hf = _pair(out)
    _assert_same(ours, hf)


def test_legacy_special_tokens_map_and_tokens_missing_from_the_vocabulary(tmp_path):
    out = _copy_default(tmp_path, "legacy")
    _write_config(out, {"clean_up_tokenization_spaces": False, "additional_special_tokens": []})
    (out / "special_tokens_map.json").write_text(
        json.dumps(
            {
                "bos_token": {"content": "<|begin_of_text|>", "lstrip": False, "rstrip": False},
                "eos_token": "<|end_of_text|>",
                "unk_token": {"content": "<unk>", "normalized": False},
                "pad_token": "<|pad|>",
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<|tool|>"],
            }
        )
    )
    (out / "added_tokens.json").write_text(json.dumps({"<|im_end|>": 4}))
    ours, hf = _pair(out)
    assert len(ours) > 32000  # <unk> and <|tool|> were added
    _assert_same(ours, hf)
    _assert_same_chat(ours, hf, _template_file(tmp_path, "generation_tag"))


def _template_file(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.jinja"
    path.write_text(TEMPLATES[name])
    return path


def test_model_specific_and_extra_special_tokens(tmp_path):
    out = _copy_default(tmp_path, "specific")

    def edit(d):
        d["image_token"] = "<image>"
        d["extra_special_tokens"] = ["<|im_start|>", "<|im_end|>", "<|tool|>"]
        d["unk_token"] = {"__type": "AddedToken", "content": "<unk>", "special": True}

    _edit_json(out / "tokenizer_config.json", edit)
    ours, hf = _pair(out)
    assert "image_token" in ours.special_tokens_map
    _assert_same(ours, hf)
    _assert_same_chat(ours, hf, _template_file(tmp_path, "generation_tag"))


def test_added_token_flags_in_the_config_win(tmp_path):
    out = _copy_default(tmp_path, "flags")

    def edit(d):
        d["added_tokens_decoder"] = {
            "3": {"content": "<|im_start|>", "lstrip": True, "rstrip": False, "special": True},
            "4": {"content": "<|im_end|>", "lstrip": True, "rstrip": True, "special": False},
            "32000": {"content": "<|new|>", "normalized": False, "special": False},
        }

    _edit_json(out / "tokenizer_config.json", edit)
    ours, hf = _pair(out)
    _assert_same(ours, hf, [*TEXTS, "a <|new|> b  <|im_end|>  c", "x<|new|>"])


def test_split_special_tokens(tmp_path):
    out = _copy_default(tmp_path, "split")
    _edit_json(out / "tokenizer_config.json", lambda d: d.update(split_special_tokens=True))
    ours, hf = _pair(out)
    assert ours.encode("<|im_end|>") != [4]
    _assert_same(ours, hf)


def test_named_chat_templates(tmp_path):
    out = _copy_default(tmp_path, "named")
    (out / "chat_template.jinja").unlink()
    _edit_json(
        out / "tokenizer_config.json",
        lambda d: d.update(
            chat_template=[
                {"name": "default", "template": TEMPLATES["llama3_like"]},
                {"name": "tool_use", "template": TEMPLATES["tojson_namespace"]},
            ]
        ),
    )
    ours, hf = _pair(out)
    assert ours.chat_template == TEMPLATES["llama3_like"]
    assert set(ours.chat_templates) == {"default", "tool_use"}
    _assert_same_chat(ours, hf)
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "rag.jinja").write_text(TEMPLATES["generation_tag"])
    (out / "chat_template.jinja").write_text(TEMPLATES["whitespace_control"])
    ours, hf = _pair(out)
    assert ours.chat_templates == {
        "default": TEMPLATES["whitespace_control"],
        "rag": TEMPLATES["generation_tag"],
    }
    _assert_same_chat(ours, hf)


# -- other models ----------------------------------------------------------


def test_wordpiece_with_clean_up_tokenization_spaces(tmp_path):
    specials = ["[UNK]", "[CLS]", "[SEP]", "[PAD]", "[MASK]"]
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(
        _corpus(), trainers.WordPieceTrainer(vocab_size=400, special_tokens=specials)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", tok.token_to_id("[CLS]")), ("[SEP]", tok.token_to_id("[SEP]"))],
    )
    out = tmp_path / "wordpiece"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    _write_config(
        out,
        {
            "unk_token": "[UNK]",
            "cls_token": "[CLS]",
            "sep_token": "[SEP]",
            "pad_token": "[PAD]",
            "mask_token": "[MASK]",
            "clean_up_tokenization_spaces": True,
        },
    )
    ours, hf = _pair(out)
    assert ours.decode(ours.encode("Hello , world .", add_special_tokens=False)) == "hello, world."
    _assert_same(ours, hf)


def test_metaspace_bpe(tmp_path):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(
        _corpus(), trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"])
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B:1", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    out = tmp_path / "metaspace"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    _write_config(
        out,
        {
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "clean_up_tokenization_spaces": True,  # ignored: a BPE model
            "chat_template": TEMPLATES["llama3_like"],
        },
    )
    ours, hf = _pair(out)
    assert ours.encode("hi")[0] == ours.bos_token_id
    _assert_same(ours, hf)
    _assert_same_chat(ours, hf)


# -- errors and imports -------------------------------------------------------


def test_a_directory_without_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(TokenizerNotFound, match=r"no tokenizer\.json in"):
        RouterTokenizer.from_pretrained(tmp_path)
    with pytest.raises(OSError, match="not a directory"):  # what RayBackend.start catches
        RouterTokenizer.from_pretrained(tmp_path / "missing")
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid tokenizers file"):
        RouterTokenizer.from_pretrained(tmp_path)
    shutil.copy(default_tokenizer_path() / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": [{"template": "x"}]}')
    with pytest.raises(ValueError, match="malformed tokenizer settings"):
        RouterTokenizer.from_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        RouterTokenizer.from_pretrained(tmp_path)


def test_loading_and_encoding_do_not_import_torch_or_transformers():
    code = (
        "import sys\n"
        "from router.tokenizer import RouterTokenizer\n"
        "from router.http.chat import ChatTemplate\n"
        "from router.http.schemas import ChatMessage\n"
        f"tok = RouterTokenizer.from_pretrained({str(default_tokenizer_path())!r})\n"
        "assert tok.decode(tok.encode('hello world')) == 'hello world'\n"
        "ChatTemplate(tok).render([ChatMessage(role='user', content='hi')])\n"
        "loaded = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)
