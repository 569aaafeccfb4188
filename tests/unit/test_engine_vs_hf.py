"""The engine's greedy output equals Hugging Face transformers token for token."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine import LLM
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = [pytest.mark.unit, pytest.mark.slow]

NEW_TOKENS = 64
# Different lengths, several spanning many 16-token blocks; one shorter than a block.
PROMPT_LENGTHS = [5, 16, 37, 100, 211]


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model_dir, prompts):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    results = []
    for prompt in prompts:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), generation_config=config)
        tokens = out.sequences[0, len(prompt) :].tolist()
        logprobs = [
            torch.log_softmax(step[0].float(), -1)[t].item()
            for step, t in zip(out.logits, tokens, strict=True)
        ]
        results.append((tokens, logprobs))
    return results


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("max_batched_tokens", [2048, 48], ids=["whole", "chunked"])
@pytest.mark.parametrize("cpu_kernels", ["auto", "off"], ids=["kernels", "pytorch"])
def test_greedy_equals_hf(checkpoint_factory, arch, max_batched_tokens, cpu_kernels):
    model_dir = checkpoint_factory(arch)
    llm = LLM(
        str(model_dir),
        max_num_batched_tokens=max_batched_tokens,
        num_kv_blocks=256,
        cpu_kernels=cpu_kernels,
    )
    prompts = _prompts(llm.engine.spec.vocab_size)
    # min_tokens masks EOS exactly as HF's min_new_tokens does.
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, logprobs=0)
    free_before = llm.engine.block_pool.num_free
    outputs = llm.generate(prompts, params)
    assert leftover_holders(llm.engine.block_pool) == []
    assert llm.engine.block_pool.num_free == free_before
    for out, (hf_tokens, hf_logprobs) in zip(outputs, _hf_greedy(model_dir, prompts), strict=True):
        assert out.token_ids == hf_tokens
        ours = [lp.logprob for lp in out.logprobs]
        assert ours == pytest.approx(hf_logprobs, abs=2e-4)
        assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "mistral", "llama-tied"])
def test_other_architectures_equal_hf(checkpoint_factory, arch):
    model_dir = checkpoint_factory(arch)
    llm = LLM(str(model_dir), num_kv_blocks=128)
    prompts = _prompts(llm.engine.spec.vocab_size, seed=1)[1:4]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    outputs = llm.generate(prompts, params)
    for out, (hf_tokens, _) in zip(outputs, _hf_greedy(model_dir, prompts), strict=True):
        assert out.token_ids == hf_tokens
