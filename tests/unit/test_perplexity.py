"""engine/perplexity.py: teacher-forced log-probabilities equal Hugging Face's."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM
from engine.perplexity import perplexity, stdlib_docstrings, window_logprobs
from tests.pool_checks import leftover_holders

pytestmark = [pytest.mark.unit]


def test_text_is_fixed_and_long():
    text = stdlib_docstrings()
    assert text == stdlib_docstrings() and len(text) > 20_000
    assert "Text wrapping and filling." in text


def test_window_logprobs_equal_hf(llama_dir):
    llm = LLM(str(llama_dir), num_kv_blocks=64, cpu_kernels="off")
    engine = llm.engine
    free = engine.block_pool.num_free
    ids = llm.tokenizer.encode(stdlib_docstrings()[:2000])[:100]
    ours = window_logprobs(engine, ids)
    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    theirs = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)
    assert torch.allclose(ours, theirs, atol=1e-4)
    assert engine.block_pool.num_free == free and leftover_holders(engine.block_pool) == []
    result = perplexity(engine, stdlib_docstrings(), max_tokens=130, window=64)
    assert result.windows == 3 and result.tokens == 63 + 63 + 1
    assert math.isfinite(result.perplexity) and result.perplexity > 1
