"""A tiny random Llama with quantized weights: its logits stay close to the
float32 model's, through the CPU kernels and through torch's fallback; the
pools come back whole; ``none`` is the float model."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from engine.kernels import PackedWeight
from engine.quant import QuantFormat, QuantWeight
from engine.spec.runner import Chunk, last_token_logits
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.unit

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
KERNELS = ["auto", "off"] if HAVE_COMPILER else ["off"]
# Cosine of the logits to the float32 model's, at least, by quantization.
MIN_COSINE = {"int8": 0.999, "q4": 0.98}


def _logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Last-token logits of a prefill of ``prompt`` and of one decode step after it."""
    engine = llm.engine
    table = list(range(-(-(len(prompt) + 1) // engine.kv_cache.layout.block_size)))
    prefill = last_token_logits(engine.model, engine.kv_cache, [Chunk(table, 0, prompt)], "cpu")
    step = Chunk(table, len(prompt), [int(prefill.argmax())])
    decode = last_token_logits(engine.model, engine.kv_cache, [step], "cpu")
    return torch.cat((prefill, decode))


@pytest.mark.parametrize("cpu_kernels", KERNELS)
@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_logits_are_close_to_float32(llama_dir, quantization, cpu_kernels):
    prompt = torch.randint(10, 1000, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    options = {"num_kv_blocks": 16, "cpu_kernels": cpu_kernels}
    reference = _logits(LLM(str(llama_dir), **options), prompt)
    llm = LLM(str(llama_dir), quantization=quantization, **options)
    model = llm.engine.model
    fmt = QuantFormat.INT8 if quantization == "int8" else QuantFormat.Q4_1
    assert isinstance(model.layers[0].qkv, QuantWeight) and model.layers[0].qkv.format == fmt
    # q4 keeps the head at 8 bits (Q8_0 blocks)
    head = QuantFormat.INT8 if quantization == "int8" else QuantFormat.Q8_0
    assert isinstance(model.lm_head, QuantWeight) and model.lm_head.format == head
    assert model.screen_head is None  # the screen recomputes from float32 columns
    got = _logits(llm, prompt)
    cosine = F.cosine_similarity(got, reference, dim=-1)
    assert (cosine > MIN_COSINE[quantization]).all(), cosine


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_quantized_engine_generates_and_returns_its_blocks(llama_dir, quantization):
    llm = LLM(
        str(llama_dir), num_kv_blocks=32, max_num_batched_tokens=32, quantization=quantization
    )
    free = llm.engine.block_pool.num_free
    prompts = [[11, 12, 13], list(range(20, 60)), [5] * 9]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [6, 6, 6]
    assert llm.engine.block_pool.num_free == free


def test_none_and_as_stored_keep_float_weights(llama_dir):
    for setting in ("none", "as_stored"):  # as_stored on safetensors: the floats
        model = LLM(str(llama_dir), num_kv_blocks=8, quantization=setting).engine.model
        assert not isinstance(model.layers[0].qkv, QuantWeight)
        assert not isinstance(model.lm_head, QuantWeight)
    if HAVE_COMPILER:
        assert isinstance(model.lm_head, PackedWeight)


def test_quantized_workers_get_their_own_fingerprint(llama_dir):
    plain = LLM(str(llama_dir), num_kv_blocks=8).engine.kv_layout.model_fingerprint
    int8 = LLM(str(llama_dir), num_kv_blocks=8, quantization="int8").engine.kv_layout
    assert int8.model_fingerprint != plain


@pytest.mark.skipif(not HAVE_COMPILER, reason="no C++ compiler: no CPU kernels")
def test_a_long_prefill_on_the_matrix_units_keeps_the_logits(llama_dir):
    """matrix_units: a prefill of DENSE_ROWS tokens or more runs the quantized
    matmuls in bfloat16 (forced on here, so any CPU runs the path; only a CPU
    with AMX-BF16 turns it on by itself) and its logits stay those of the
    integer kernels to bfloat16's precision; off, or in deterministic mode, the
    model never takes it."""
    from engine.kernels import cpu_ops, matrix_units
    from engine.quant import DENSE_ROWS

    prompt = torch.randint(10, 1000, (DENSE_ROWS + 12,), generator=torch.Generator().manual_seed(7))
    options = {"num_kv_blocks": 32, "quantization": "q4", "cpu_kernels": "on"}
    integer = LLM(str(llama_dir), matrix_units=False, **options)
    assert integer.engine.model.dense is False
    llm = LLM(str(llama_dir), **options)
    assert llm.engine.model.dense is matrix_units(cpu_ops())
    llm.engine.model.dense = True
    want, got = _logits(integer, prompt.tolist()), _logits(llm, prompt.tolist())
    assert not torch.equal(got[0], want[0])  # the prefill took the other path
    assert (F.cosine_similarity(got, want, dim=-1) > 0.999).all()
    assert LLM(str(llama_dir), deterministic=True, **options).engine.model.dense is False
