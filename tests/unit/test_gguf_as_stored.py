"""``quantization: as_stored`` on a tiny GGUF file (tests/gguf_files.py) with Q8_0,
Q4_0 and Q4_1 matrices and one in a type the kernels lack (Q5_0): the first
three are QuantWeight over the file's bytes, q/k rows in the Hugging Face order,
and the logits are the dequantized load's; int8 / q4 quantize the dequantized
floats."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from engine import LLM
from engine.gguf_model import gguf_table, prepare
from engine.quant import QuantFormat, QuantWeight
from engine.spec.runner import Chunk, last_token_logits
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

gguf = pytest.importorskip("gguf", reason="GGUF loading needs the gguf package (pip install gguf)")

from tests.gguf_files import write_gguf  # noqa: E402

pytestmark = [pytest.mark.unit]

HAVE_COMPILER = shutil.which("c++") is not None or shutil.which("g++") is not None
KERNELS = ["auto", "off"] if HAVE_COMPILER else ["off"]
# by part of the name, first match wins; the embedding stays F32
MIXED = {"down_proj": "Q5_0", "mlp": "Q4_0", "self_attn": "Q8_0", "lm_head": "Q4_1"}


@pytest.fixture(scope="module")
def files(checkpoint_factory, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-as-stored")
    tied = checkpoint_factory("llama-tied")
    return {
        "mixed": write_gguf(checkpoint_factory("llama"), out / "mixed.gguf", quantize=MIXED),
        "tied": write_gguf(tied, out / "tied.gguf", quantize={"embed": "Q8_0", "": "Q4_1"}),
    }


def _round_trip(w: torch.Tensor, ggml_type: str) -> torch.Tensor:
    qtype = gguf.GGMLQuantizationType[ggml_type]
    blocks = gguf.quants.quantize(w.float().numpy(), qtype)
    return torch.from_numpy(gguf.quants.dequantize(blocks, qtype))


def _logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Last-token logits of a prefill of ``prompt`` and of one decode step after it."""
    engine = llm.engine
    table = list(range(-(-(len(prompt) + 1) // engine.kv_cache.layout.block_size)))
    prefill = last_token_logits(engine.model, engine.kv_cache, [Chunk(table, 0, prompt)], "cpu")
    step = Chunk(table, len(prompt), [int(prefill.argmax())])
    decode = last_token_logits(engine.model, engine.kv_cache, [step], "cpu")
    return torch.cat((prefill, decode))


def test_stored_types_stay_quantized_and_q_k_rows_keep_their_blocks(checkpoint_factory, files):
    model = LLM(
        str(files["mixed"]), num_kv_blocks=8, quantization="as_stored", cpu_kernels="off"
    ).engine.model
    layer = model.layers[0]
    assert isinstance(layer.qkv, QuantWeight) and layer.qkv.format == QuantFormat.Q8_0
    assert isinstance(layer.o, QuantWeight) and layer.o.format == QuantFormat.Q8_0
    assert isinstance(layer.gate_up, QuantWeight) and layer.gate_up.format == QuantFormat.Q4_0
    assert isinstance(model.lm_head, QuantWeight) and model.lm_head.format == QuantFormat.Q4_1
    assert isinstance(layer.down, torch.Tensor)  # Q5_0: no kernel, dequantized
    assert isinstance(model.embed, torch.Tensor)  # F32 in the file
    # the file's bytes, no more: q, k and v of layer 0 as stored
    table = {t["name"]: t for t in gguf_table(prepare(files["mixed"]))["tensors"]}
    attn = "model.layers.0.self_attn."
    assert layer.qkv.nbytes == sum(table[attn + f"{x}_proj.weight"]["nbytes"] for x in "qkv")
    # the file's q/k rows were permuted (llama.cpp's layout) before quantizing; each
    # block is one row's, so the stored blocks, rows put back, are the original rows'
    ref = load_file(str(checkpoint_factory("llama") / "model.safetensors"))
    want = torch.cat([_round_trip(ref[attn + f"{x}_proj.weight"], "Q8_0") for x in "qkv"])
    assert torch.equal(layer.qkv.dequantize(), want)
    mlp = "model.layers.0.mlp."
    want = torch.cat([_round_trip(ref[mlp + f"{x}_proj.weight"], "Q4_0") for x in ("gate", "up")])
    assert torch.equal(layer.gate_up.dequantize(), want)
    assert torch.equal(model.lm_head.dequantize(), _round_trip(ref["lm_head.weight"], "Q4_1"))


@pytest.mark.parametrize("cpu_kernels", KERNELS)
def test_as_stored_logits_equal_the_dequantized_load(files, cpu_kernels):
    prompt = torch.randint(10, 1000, (37,), generator=torch.Generator().manual_seed(7)).tolist()
    options = {"num_kv_blocks": 16, "cpu_kernels": cpu_kernels, "greedy_screen": False}
    reference = _logits(LLM(str(files["mixed"]), **options), prompt)
    got = _logits(LLM(str(files["mixed"]), quantization="as_stored", **options), prompt)
    if cpu_kernels == "off":  # the same float weights, multiplied by torch
        torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)
    else:  # the kernel quantizes a few rows' activations to int8 (blocks of 32)
        cosine = F.cosine_similarity(got, reference, dim=-1)
        assert (cosine > 0.999).all(), cosine


def test_tied_head_shares_the_stored_embedding_and_generates(files):
    options = {"num_kv_blocks": 32, "cpu_kernels": "off"}
    llm = LLM(str(files["tied"]), quantization="as_stored", **options)
    model = llm.engine.model
    assert isinstance(model.embed, QuantWeight) and model.embed.format == QuantFormat.Q8_0
    assert model.lm_head.data.data_ptr() == model.embed.data.data_ptr()  # one copy
    assert model.layers[1].down.format == QuantFormat.Q4_1
    reference = LLM(str(files["tied"]), **options)
    ids = torch.tensor([3, 500, 77, 3])
    assert torch.equal(model._embed(ids), reference.engine.model.embed[ids])
    free = llm.engine.block_pool.num_free
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 300, 41], list(range(100, 140))]
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert ours == [o.token_ids for o in reference.generate(prompts, params)]
    assert all(len(t) == 12 for t in ours)
    assert llm.engine.block_pool.num_free == free
    assert leftover_holders(llm.engine.block_pool) == []


@pytest.mark.parametrize(("setting", "fmt"), [("int8", QuantFormat.INT8), ("q4", QuantFormat.Q4_1)])
def test_int8_and_q4_quantize_the_dequantized_floats(files, setting, fmt):
    options = {"num_kv_blocks": 8, "cpu_kernels": "off"}
    floats = LLM(str(files["mixed"]), **options).engine.model.layers[0].qkv  # [in, out]
    qkv = LLM(str(files["mixed"]), quantization=setting, **options).engine.model.layers[0].qkv
    assert isinstance(qkv, QuantWeight) and qkv.format == fmt
    assert torch.equal(qkv.dequantize(), QuantWeight.quantize(floats.t(), fmt).dequantize())
