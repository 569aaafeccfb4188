"""The embedded default tokenizer, the default model and random checkpoints."""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine import default_model as dm

pytestmark = pytest.mark.unit


@pytest.fixture(scope="session")
def session_cache(tmp_path_factory) -> Path:
    """A cache dir whose default tokenizer is trained once per session."""
    cache = tmp_path_factory.mktemp("tandem-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_CACHE_DIR", str(cache))
        dm.default_tokenizer_path()
    return cache


@pytest.fixture
def cache_env(monkeypatch, session_cache) -> Path:
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(session_cache))
    return session_cache


@pytest.fixture
def tokenizer(cache_env):
    return transformers.AutoTokenizer.from_pretrained(str(dm.default_tokenizer_path()))


def test_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "c"))
    assert dm.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TANDEM_CACHE_DIR")
    assert dm.cache_dir() == Path.home() / ".cache" / "tandem"


def test_tokenizer_cached_under_cache_dir(cache_env):
    path = dm.default_tokenizer_path()
    assert path.parent == cache_env
    assert (path / "tokenizer.json").is_file()
    # No leftover temporary dirs next to it.
    assert not [p for p in cache_env.iterdir() if ".tmp-" in p.name]


@pytest.mark.parametrize(
    "text",
    [
        "def main():\n    print('hello, world')\n",
        "héllo wörld — naïve café",
        "日本語のテキスト 🎉🚀 emoji\tand\ttabs",
        "  leading and trailing spaces  \n\n",
        "",
    ],
)
def test_tokenizer_round_trip(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens_and_chat_template(tokenizer):
    assert len(tokenizer) == dm.DEFAULT_VOCAB_SIZE
    assert tokenizer.bos_token == dm.BOS_TOKEN
    assert tokenizer.eos_token == dm.EOS_TOKEN
    assert tokenizer.pad_token == dm.PAD_TOKEN
    assert len({tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id}) == 3
    for tok in (dm.IM_START_TOKEN, dm.IM_END_TOKEN):
        assert len(tokenizer.encode(tok)) == 1
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_tokenizer_training_is_deterministic(tmp_path, cache_env):
    dm.build_tokenizer(tmp_path / "again")
    a = (dm.default_tokenizer_path() / "tokenizer.json").read_bytes()
    b = (tmp_path / "again" / "tokenizer.json").read_bytes()
    assert a == b


@pytest.mark.parametrize("arch", dm.TINY_ARCHS)
def test_tiny_checkpoint_loads_with_saved_weights(arch, tmp_path, cache_env, tokenizer):
    config = dm.tiny_config(arch)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    out = dm.make_random_checkpoint(tmp_path / arch, config, seed=1)
    assert out == tmp_path / arch
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert (out / name).is_file(), name

    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    saved = load_file(str(out / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in saved.items():
        assert tensor.dtype == torch.float32
        assert torch.equal(state[name], tensor), name
    expected_missing = {"lm_head.weight"} if arch == "llama-tied" else set()
    assert set(state) - set(saved) == expected_missing
    if arch == "llama-tied":
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    cfg = json.loads((out / "config.json").read_text())
    if arch == "llama3":
        assert cfg["rope_parameters"]["rope_type"] == "llama3"
        assert cfg["rope_parameters"]["original_max_position_embeddings"] == 256
    if arch == "qwen2":
        assert saved["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0
    if arch == "qwen3":
        assert cfg["head_dim"] != cfg["hidden_size"] // cfg["num_attention_heads"]
        assert "model.layers.0.self_attn.q_norm.weight" in saved
    if arch == "mistral":
        assert cfg["sliding_window"] is None

    # Peaked next-token distributions, and the tokenizer came along.
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = tok("import os\n", return_tensors="pt")
    with torch.no_grad():
        logits = model(**ids).logits[0, -1]
    assert 2.0 < float(logits.std()) < 8.0


def test_tiny_config_overrides(cache_env):
    cfg = dm.tiny_config("llama", num_hidden_layers=3, hidden_size=64)
    assert cfg.num_hidden_layers == 3
    assert cfg.hidden_size == 64
    with pytest.raises(ValueError):
        dm.tiny_config("gpt2")


def test_random_checkpoint_is_deterministic(tmp_path, cache_env):
    config = dm.tiny_config("qwen3")
    a = dm.make_random_checkpoint(tmp_path / "a", config, seed=3)
    b = dm.make_random_checkpoint(tmp_path / "b", config, seed=3)
    c = dm.make_random_checkpoint(tmp_path / "c", config, seed=4)
    bytes_a = (a / "model.safetensors").read_bytes()
    assert bytes_a == (b / "model.safetensors").read_bytes()
    assert bytes_a != (c / "model.safetensors").read_bytes()
    assert (a / "config.json").read_bytes() == (b / "config.json").read_bytes()


def test_random_checkpoint_rejects_small_vocab(tmp_path, cache_env):
    config = dm.tiny_config("llama", vocab_size=1000)
    with pytest.raises(ValueError, match="vocab"):
        dm.make_random_checkpoint(tmp_path / "x", config)


def _build_default_model(barrier, queue) -> None:
    barrier.wait()
    path = dm.default_model_path()
    queue.put((str(path), os.stat(path / "model.safetensors").st_ino))


@pytest.mark.slow
def test_default_model_concurrent_build(tmp_path, monkeypatch, session_cache):
    cache = tmp_path / "cache"
    cache.mkdir()
    # Reuse the session's tokenizer so only the model build is contended.
    for entry in session_cache.iterdir():
        if entry.name.startswith("tokenizer-") and entry.is_dir():
            shutil.copytree(entry, cache / entry.name)
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(cache))

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(2)
    queue = ctx.Queue()
    procs = [ctx.Process(target=_build_default_model, args=(barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    results = [queue.get(timeout=180) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0

    (path_a, ino_a), (path_b, ino_b) = results
    assert path_a == path_b
    assert ino_a == ino_b  # built once, by one process
    path = Path(path_a)
    assert path.parent.parent == cache
    assert (path / ".tandem-complete").is_file()
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]

    # A third call reuses it.
    assert dm.default_model_path() == path
    assert os.stat(path / "model.safetensors").st_ino == ino_a

    cfg = json.loads((path / "config.json").read_text())
    assert cfg["hidden_size"] == 256
    assert cfg["num_hidden_layers"] == 4
    assert cfg["num_key_value_heads"] == 4
    assert cfg["tie_word_embeddings"] is False
    gen = json.loads((path / "generation_config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    assert cfg["vocab_size"] == len(tok)
    assert gen["eos_token_id"] == tok.eos_token_id == cfg["eos_token_id"]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path))
    saved = load_file(str(path / "model.safetensors"))
    state = model.state_dict()
    assert set(saved) == set(state)
    assert all(torch.equal(state[k], v) for k, v in saved.items())
