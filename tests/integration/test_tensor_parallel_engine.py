"""Tensor parallelism within one engine (engine/parallel/), on CPU with gloo:
two ranks, the second a local process.

Greedy output at tensor_parallel_size 2 equals size 1 token for token on two
architectures, on the fused CPU path and the PyTorch one, with chunked
prefill and prefix-cache hits, and with weights quantized at load (int8,
q4); KV blocks exported from an engine of one size continue on an engine of
the other; a rank that dies makes the next step raise instead of hanging,
and the engine still closes.
"""

from __future__ import annotations

import importlib.util
import os
import signal

import pytest
import torch

from engine import LLM
from engine.parallel.group import GroupBroken
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT_LENGTHS = [5, 37, 100]
GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=0)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


NO_TRITON = pytest.mark.skipif(not importlib.util.find_spec("triton"), reason="no Triton")


@pytest.mark.parametrize(
    ("arch", "path"),
    [
        *((arch, path) for arch in ("llama", "qwen3") for path in ("kernels", "pytorch")),
        pytest.param("llama", "triton", marks=NO_TRITON),
    ],
)
def test_greedy_at_tp2_equals_tp1(checkpoint_factory, arch, path):
    """(``triton``: every rank attends with the GPU kernel, on CPU under
    Triton's interpreter, the step's metadata broadcast with its tables.)"""
    model_dir = str(checkpoint_factory(arch))
    # 32 tokens a step: the longer prompts are prefilled in chunks over cached context.
    options = {
        "num_kv_blocks": 64,
        "cpu_kernels": "auto" if path == "kernels" else "off",
        "max_num_batched_tokens": 32,
        "attention": "triton" if path == "triton" else "auto",
    }
    one = LLM(model_dir, **options)
    prompts = _prompts(one.engine.spec.vocab_size)
    expected = one.generate(prompts, GREEDY)
    with LLM(model_dir, tensor_parallel_size=2, **options) as two:
        assert two.engine.kv_cache.layers[0].shape[3] == one.engine.spec.num_kv_heads // 2
        free = two.engine.block_pool.num_free
        first = two.generate(prompts, GREEDY)
        again = two.generate(prompts, GREEDY)  # the prompts' full blocks hit the cache
        assert leftover_holders(two.engine.block_pool) == []
        assert two.engine.block_pool.num_free == free
    assert [o.num_cached_tokens for o in again] == [0, 32, 96]
    for ref, a, b in zip(expected, first, again, strict=True):
        assert a.token_ids == ref.token_ids
        assert b.token_ids == ref.token_ids
        ours = [lp.logprob for lp in a.logprobs]
        assert ours == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_weights_quantized_at_load_at_tp2_equal_tp1(checkpoint_factory, quantization):
    """Each rank's share holds the codes and scales of the whole matrix quantized
    at one rank (engine/parallel/sharding.py), so the tokens are the same."""
    model_dir = str(checkpoint_factory("llama"))
    options = {"num_kv_blocks": 64, "quantization": quantization}
    one = LLM(model_dir, **options)
    prompts = _prompts(one.engine.spec.vocab_size)
    expected = one.generate(prompts, GREEDY)
    with LLM(model_dir, tensor_parallel_size=2, **options) as two:
        outs = two.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


def _prefilled(llm: LLM, request_id: str, prompt: list[int]):
    """Prefill ``prompt`` alone on ``llm``'s engine; its KV export, with data."""
    engine = llm.engine
    engine.add_request(request_id, prompt, GREEDY, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    export = engine.export_kv(request_id)
    engine.release(request_id)
    return export


def _continue(llm: LLM, export) -> list[int]:
    """Decode ``export`` to the end on ``llm``'s engine: every token, the first included."""
    engine = llm.engine
    engine.import_kv(export, GREEDY)
    tokens = list(export.output_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_kv_moves_between_tp_sizes(checkpoint_factory):
    """A prefill at one size continues at the other: the export holds every
    kv head, gathered from both ranks; an import scatters them back."""
    model_dir = str(checkpoint_factory("llama"))
    options = {"num_kv_blocks": 64, "cpu_kernels": "off"}
    one = LLM(model_dir, **options)
    prompt = _prompts(one.engine.spec.vocab_size)[1]
    expected = one.generate([prompt], GREEDY)[0].token_ids
    with LLM(model_dir, tensor_parallel_size=2, **options) as two:
        from_two = _prefilled(two, "a", prompt)
        assert from_two.data.shape[4] == one.engine.spec.num_kv_heads  # every head
        assert _continue(one, from_two) == expected
        assert _continue(two, _prefilled(one, "b", prompt)) == expected
        assert leftover_holders(two.engine.block_pool) == []
    assert leftover_holders(one.engine.block_pool) == []


def test_a_dead_rank_fails_the_next_step_and_close_ends(checkpoint_factory):
    model_dir = str(checkpoint_factory("llama"))
    llm = LLM(model_dir, tensor_parallel_size=2, num_kv_blocks=64, cpu_kernels="off")
    prompt = _prompts(llm.engine.spec.vocab_size)[0]
    assert llm.generate([prompt], GREEDY)[0].finish_reason == "length"
    (pid,) = llm.engine.tp.launcher.pids().values()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(GroupBroken, match="tensor-parallel"):
        llm.generate([prompt], GREEDY)
    assert leftover_holders(llm.engine.block_pool) == []  # the request was aborted
    llm.close()  # returns: the dead rank is reaped, nothing waits on it
