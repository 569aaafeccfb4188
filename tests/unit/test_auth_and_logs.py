"""API keys (router/auth.py), structured logs (worker/logfmt.py) and chat
templates (router/http/chat.py)."""

from __future__ import annotations

import json
import logging
import re

import pytest

from router.auth import (
    ApiKeys,
    bearer_token,
    client_headers,
    client_metadata,
    keys_from_env,
    read_keys_file,
)
from router.http.chat import FALLBACK_TEMPLATE, ChatTemplate
from router.http.schemas import ChatMessage
from router.messages import RequestError
from worker.logfmt import JsonFormatter, format_fields, log_event

pytestmark = pytest.mark.unit


def test_keys_come_from_config_file_and_env_together(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team a\nkey-file-1\n\n  key-file-2  \n")
    path.chmod(0o600)
    assert read_keys_file(path) == ["key-file-1", "key-file-2"]
    env = {"TANDEM_API_KEYS": " env-1, ,env-2"}
    assert keys_from_env(env) == ["env-1", "env-2"]
    keys = ApiKeys.load(["cfg"], path, env)
    assert len(keys) == 5 and keys.enabled
    for key in ("cfg", "key-file-1", "key-file-2", "env-1", "env-2"):
        assert keys.check(key)
        assert keys.check_header(f"Bearer {key}")
        assert keys.check_header(f"bearer   {key} ")
    for bad in (None, "", "cfg2", "Cfg", "key-file"):
        assert not keys.check(bad)
    assert not keys.check_header("cfg")  # no scheme
    assert not keys.check_header("Basic cfg")
    assert "cfg" not in repr(keys)


def test_no_keys_means_authentication_is_off():
    keys = ApiKeys.load([], None, {})
    assert not keys.enabled
    assert keys.check(None) and keys.check_header(None)


def test_bearer_token_parsing():
    assert bearer_token("Bearer abc") == "abc"
    assert bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    assert bearer_token("Token abc") is None


def test_clients_send_the_env_key(monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    assert client_metadata() == ()
    monkeypatch.setenv("TANDEM_API_KEY", "k1")
    assert client_metadata() == (("authorization", "Bearer k1"),)
    assert client_headers("k2") == {"authorization": "Bearer k2"}


def test_log_event_key_value_and_json(caplog):
    log = logging.getLogger("tandem.test")
    with caplog.at_level(logging.INFO, logger="tandem.test"):
        log_event(log, "prefill_done", request_id="r1#ab", note="two words", skipped=None, n=3)
    record = caplog.records[-1]
    assert record.getMessage() == 'event=prefill_done request_id=r1#ab note="two words" n=3'
    doc = json.loads(JsonFormatter().format(record))
    assert doc["event"] == "prefill_done" and doc["request_id"] == "r1#ab" and doc["n"] == 3
    assert "skipped" not in doc and doc["level"] == "INFO"
    assert format_fields({"a": "x=y", "b": ""}) == 'a="x=y" b=""'


class _Tok:
    bos_token = "<s>"
    eos_token = "</s>"
    chat_template = None


def test_chat_templates_file_tokenizer_fallback(tmp_path):
    messages = [
        ChatMessage(role="system", content="be brief"),
        ChatMessage(role="user", content="hi"),
    ]
    fallback = ChatTemplate(_Tok())
    assert fallback.origin == "fallback" and fallback.source == FALLBACK_TEMPLATE
    assert fallback.render(messages) == "system: be brief\nuser: hi\nassistant:"
    tok = _Tok()
    tok.chat_template = "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    assert ChatTemplate(tok).render(messages) == "<s>[be brief][hi]"
    path = tmp_path / "t.jinja"
    path.write_text("{{ raise_exception('no system messages') }}")
    with pytest.raises(RequestError) as info:
        ChatTemplate(tok, path).render(messages)
    assert "no system messages" in info.value.message


def test_the_default_model_ships_a_chat_template():
    from engine.default_model import default_tokenizer_path
    from router.tokenizer import RouterTokenizer

    tok = RouterTokenizer.from_pretrained(default_tokenizer_path())
    template = ChatTemplate(tok)
    assert template.origin == "tokenizer"
    text = template.render([ChatMessage(role="user", content="hi")])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620, 0o660], ids=oct)
def test_a_keys_file_group_or_others_can_reach_is_refused_naming_the_setting(tmp_path, mode):
    path = tmp_path / "keys"
    path.write_text("key-1\n")
    path.chmod(mode)
    wanted = re.escape(f"security.admin_keys_file {path} ") + f".*mode {mode:04o}"
    with pytest.raises(ValueError, match=wanted):
        ApiKeys.load([], path, {}, file_setting="security.admin_keys_file")
    with pytest.raises(ValueError, match=re.escape("security.api_keys_file")):
        read_keys_file(path)


@pytest.mark.parametrize("mode", [0o600, 0o400], ids=oct)
def test_a_keys_file_only_its_owner_can_read_is_accepted(tmp_path, mode):
    path = tmp_path / "keys"
    path.write_text("key-1\n")
    path.chmod(mode)
    assert read_keys_file(path) == ["key-1"]
