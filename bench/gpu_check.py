"""GPU check: a 1B-class Llama on one GPU, no network and no Ray.

    python bench/gpu_check.py [--device cuda] [--dtype bfloat16] [--bandwidth 4.8e12]
    python bench/gpu_check.py --device cpu --tiny        # smoke test of the script itself

1. Writes a random-weight checkpoint of a Llama-3.2-1B-shaped config (hidden
   2048, 16 layers, 32 heads, 8 kv heads, intermediate 8192, vocab 128256,
   tied embeddings) and checks that the engine's greedy tokens equal Hugging
   Face ``generate`` on the same device in each of --check-dtypes (float32:
   exact; in bf16/fp16 the two may part where logits nearly tie, so the
   matching prefix of each prompt is printed, not asserted).
2. Decode step time at each --batches size (context --context tokens),
   eager and, on CUDA, replayed as CUDA graphs, against the HBM roofline:
   (bytes of weights + bytes of KV read per step) / --bandwidth. On a GPU,
   for both attention paths: the Triton kernel that reads the paged cache in
   place (``kernel``, EngineConfig.attention auto) and the PyTorch path it
   replaces (``gather``, attention sdpa: blocks gathered with index_select,
   then SDPA); and one row at batch 1 with --long-context tokens.
3. Prefill tokens per second over --prefill-lengths, for the same paths and
   for Hugging Face's forward in --dtype; and the same tails after a cached
   prefix of --prefill-cached tokens (they attend over the cached blocks).
4. KV transfer: --transfer-mib of blocks pushed between two pools on the
   device through the gRPC mover on loopback (device -> pinned host -> TCP ->
   pinned host -> device), against a plain device -> host -> device copy;
   and decode steps while another thread copies --transfer-mib of blocks to
   pinned host memory as a push does, against the steps alone (the overlap
   of the transfer's copies with compute).
5. Tensor parallelism: greedy tokens (float32) and output tokens per second
   at tensor_parallel_size 2 against 1, where two GPUs exist (NCCL), and on
   the host (gloo: the smoke test); reported as not run on one GPU.
The last line is one JSON object with the figures.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import tempfile
import time

import torch

from benchkit.device_transfer import transfer_check
from benchkit.engine_timing import (
    copy_overlap,
    decode_step_s,
    hf_prefill_tokens_per_s,
    prefill_tokens_per_s,
    profile_decode,
)
from engine import LLM, EngineConfig, LLMEngine
from engine.config import ModelSpec
from engine.default_model import make_random_checkpoint, tiny_config
from engine.device import resolve_device, synchronize
from protocol.sampling import SamplingParams

LLAMA_1B = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
)
PROMPT_LENGTHS = (7, 33, 120, 300)


def build_checkpoint(out: Path, tiny: bool) -> Path:
    config = tiny_config("llama") if tiny else tiny_config("llama", **LLAMA_1B)
    return make_random_checkpoint(out, config, seed=0)


def check_against_hf(ckpt: Path, device: torch.device, dtype: str, new_tokens: int) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch_dtype = getattr(torch, dtype)
    llm = LLM(str(ckpt), device=str(device), dtype=dtype, num_kv_blocks=256)
    vocab = llm.engine.spec.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    ours = [o.token_ids for o in llm.generate(prompts, params)]
    del llm
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch_dtype).to(device).eval()
    config = GenerationConfig(
        max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
    )
    matching = []
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt], device=device), generation_config=config)
        theirs = out[0, len(prompt) :].tolist()
        same = next(
            (i for i, (a, b) in enumerate(zip(tokens, theirs, strict=True)) if a != b), len(theirs)
        )
        matching.append(same)
    del model
    return {
        "dtype": dtype,
        "new_tokens": new_tokens,
        "matching_prefix": matching,
        "equal": all(m == new_tokens for m in matching),
    }


def roofline_s(spec: ModelSpec, itemsize: int, batch: int, context: int, bandwidth: float):
    """Seconds a decode step needs at least: every weight read once (the
    embedding only for the batch's rows), plus each sequence's KV."""
    h, d = spec.hidden_size, spec.head_dim
    qkv = h * (spec.num_heads + 2 * spec.num_kv_heads) * d
    layer = qkv + spec.num_heads * d * h + 3 * h * spec.intermediate_size + 2 * h
    weights = spec.num_layers * layer + spec.vocab_size * h + h + batch * h
    kv = batch * context * spec.num_layers * 2 * spec.num_kv_heads * d
    return (weights + kv) * itemsize / bandwidth, (weights + kv) * itemsize


# bench name of each attention path -> EngineConfig.attention
PATHS = {"kernel": "auto", "gather": "sdpa"}


def _engine(ckpt: Path, device, args, attention: str, batches: list[int]) -> LLMEngine:
    bs = 16
    per_seq = -(-(args.context + 2 * args.steps + 64) // bs)
    long_seq = -(-(args.long_context + 2 * args.steps + 64) // bs)
    return LLMEngine(
        EngineConfig(
            model=str(ckpt),
            device=str(device),
            dtype=args.dtype,
            attention=attention,
            # every batch's sequences, the long one, and blocks for copy_overlap to read
            num_kv_blocks=max(batches) * per_seq + long_seq + 4 * per_seq,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(8192, args.context),
            cuda_graphs=device.type == "cuda",
            block_size=bs,
        )
    )


def _decode_row(spec: ModelSpec, args, batch: int, context: int) -> dict:
    itemsize = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
    floor_s, nbytes = roofline_s(spec, itemsize, batch, context, args.bandwidth)
    return {
        "batch": batch,
        "context": context,
        "bytes_per_step": nbytes,
        "roofline_ms": round(floor_s * 1e3, 4),
    }


def _time_row(engine: LLMEngine, row: dict, path: str, graphs: bool, steps: int) -> None:
    step = decode_step_s(engine, row["batch"], row["context"], steps, graphs)
    key = f"{path}_{'graphs' if graphs else 'eager'}"
    row[f"{key}_ms"] = round(step * 1e3, 4)
    row[f"{key}_of_roofline"] = float(f"{row['roofline_ms'] / 1e3 / step:.4g}")


def engine_timings(ckpt: Path, device, args, spec: ModelSpec) -> dict:
    """Decode rows (one per batch size, and one long context at batch 1) and
    prefill rates (fresh prompts, and tails over a cached prefix) for each
    attention path; decode steps beside a push's copies (the engine's path)."""
    batches = [int(b) for b in args.batches.split(",")]
    lengths = [int(n) for n in args.prefill_lengths.split(",")]
    rows = [_decode_row(spec, args, b, args.context) for b in batches]
    long_row = _decode_row(spec, args, 1, args.long_context)
    prefill: dict = {"lengths": lengths, "cached_prefix": args.prefill_cached}
    out = {"decode": rows, "long_context_decode": long_row, "prefill": prefill}
    cuda = device.type == "cuda"
    for path in ("kernel", "gather") if cuda else ("host",):
        engine = _engine(ckpt, device, args, PATHS.get(path, "auto"), batches)
        for row in rows:
            for graphs in (False, True) if cuda else (False,):
                _time_row(engine, row, path, graphs, args.steps)
            print(f"decode ({path}): {row}", flush=True)
        _time_row(engine, long_row, path, cuda, args.steps)
        print(f"long-context decode ({path}): {long_row}", flush=True)
        if path != "gather":
            out["copy_overlap"] = copy_overlap(
                engine, min(32, max(batches)), args.context, args.steps, args.transfer_mib
            )
            print(f"KV copies during decode: {out['copy_overlap']}", flush=True)
            if args.profile:
                print(profile_decode(engine, 1, args.context, args.steps), flush=True)
        prefill[f"{path}_tokens_per_s"] = round(prefill_tokens_per_s(engine, lengths), 1)
        tails = [n for n in lengths if n + args.prefill_cached < engine.max_model_len]
        rate = prefill_tokens_per_s(engine, tails, cached=args.prefill_cached)
        prefill[f"{path}_cached_tokens_per_s"] = round(rate, 1)
        print(f"prefill ({path}): {prefill}", flush=True)
        del engine
        if cuda:
            torch.cuda.empty_cache()
    prefill["hf_tokens_per_s"] = round(hf_prefill_rate(ckpt, device, args.dtype, lengths), 1)
    return out


def tensor_parallel_check(ckpt: Path, device, dtype: str, new_tokens: int) -> dict:
    """Greedy tokens and output tokens per second at tensor_parallel_size 2
    against 1 (on GPUs: one a rank, NCCL; on the host: gloo, the smoke test)."""
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, min_tokens=new_tokens)
    result: dict = {"dtype": dtype}
    tokens = {}
    for tp in (1, 2):
        with LLM(
            str(ckpt), device=str(device), dtype=dtype, num_kv_blocks=256, tensor_parallel_size=tp
        ) as llm:
            vocab = llm.engine.spec.vocab_size
            prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in (64,) * 8]
            llm.generate(prompts[:1], params)  # warm up
            synchronize(device)
            start = time.perf_counter()
            tokens[tp] = [o.token_ids for o in llm.generate(prompts, params)]
            synchronize(device)
            rate = 8 * new_tokens / (time.perf_counter() - start)
            result[f"tp{tp}_tokens_per_s"] = round(rate, 1)
        gen.manual_seed(1)  # the same prompts at both sizes
    result["equal"] = tokens[1] == tokens[2]
    result["ratio"] = round(result["tp2_tokens_per_s"] / result["tp1_tokens_per_s"], 3)
    return result


def hf_prefill_rate(ckpt: Path, device, dtype: str, lengths: list[int]) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    rate = hf_prefill_tokens_per_s(model, lengths, model.config.vocab_size, device)
    del model
    return rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--check-dtypes", default="float32,bfloat16")
    p.add_argument("--bandwidth", type=float, default=4.8e12, help="HBM bytes/s (H200: 4.8e12)")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--long-context", type=int, default=7000, help="a batch-1 decode row")
    p.add_argument("--prefill-lengths", default="2048,2048,2048,2048,8000")
    p.add_argument("--prefill-cached", type=int, default=4096, help="prefix tokens cached")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--transfer-mib", type=int, default=256)
    p.add_argument("--profile", action="store_true", help="print where decode's host time goes")
    p.add_argument("--tiny", action="store_true", help="a tiny model and short runs (smoke test)")
    args = p.parse_args()
    device = resolve_device(args.device)
    if args.tiny:
        args.batches, args.context, args.steps, args.new_tokens = "1,4", 32, 4, 8
        args.prefill_lengths, args.prefill_cached, args.long_context = "64,32", 48, 200
        args.transfer_mib = min(args.transfer_mib, 4)
    result: dict = {"device": str(device), "tiny": args.tiny, "dtype": args.dtype}
    gpus = torch.cuda.device_count() if device.type == "cuda" else 0
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = build_checkpoint(Path(tmp) / "ckpt", args.tiny)
        result["hf_check"] = []
        for dtype in args.check_dtypes.split(","):
            check = check_against_hf(ckpt, device, dtype, args.new_tokens)
            print(f"greedy vs HF ({dtype}): {check}", flush=True)
            result["hf_check"].append(check)
        from engine.loader import load_hf_config

        spec = ModelSpec.from_hf_config(load_hf_config(ckpt))
        result.update(engine_timings(ckpt, device, args, spec))
        print(f"prefill: {result['prefill']}", flush=True)
        result["transfer"] = transfer_check(ckpt, device, args.dtype, args.transfer_mib, 3)
        print(f"KV transfer: {result['transfer']}", flush=True)
        if gpus >= 2 or device.type == "cpu":
            result["tensor_parallel"] = tensor_parallel_check(
                ckpt, device, "float32", args.new_tokens
            )
            print(f"tensor parallel: {result['tensor_parallel']}", flush=True)
        else:
            result["tensor_parallel"] = "not run: needs two GPUs"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
