"""Speculative decoding and quantized KV transfer, against plain decoding and
unquantized transfer measured in the same run.

    python bench/speculative.py [--reps 3] [--tokens 128] [--prompts 24] [--transfer-reps 9]
                                [--model PATH] [--quantization none] [--threads 1]
                                [--parts decode,transfer,quality]

With ``--model`` (e.g. ``smollm2-135m-instruct``, a trained instruct model) the
"edit this file" prompts are a user turn of the model's chat template and the
draft-model run is left out.

1. Decode tokens/s of the default model (random weights) with and without
   prompt-lookup speculation, greedy, 1 and 4 streams, on
   - a repetitive workload, "edit this file": the prompt holds a Python
     source file from the standard library. A trained model would copy much
     of it; a random one does not, but greedy decoding of a random model
     falls into loops that prompt lookup finds in its own output. The
     acceptance rate is measured and reported, not assumed;
   - a non-repetitive one: random-token prompts, sampled at temperature 1.
   Plus the draft-model path with the target as its own draft (every
   proposal accepted: the mechanism's upper bound, at twice the model cost).
   Output must equal plain decoding for greedy runs (checked). Runs are
   interleaved (off, ngram, draft, off, ...) and speedups are medians of
   per-rep ratios; ``steps_vs_off`` (target passes) does not depend on load.
2. KV transfer of a 2,048-token prompt's blocks over gRPC + the data
   channel on loopback (client and server in this process), float32 vs
   int8 and fp8 on the wire: bytes and time.
3. Effect on output over a test set (--prompts prompts from stdlib sources):
   prefill, move the KV through the int8 / fp8 codec, decode 32 greedy
   tokens; against the unquantized import: share of prompts with identical
   output, share of equal tokens, and |logprob difference| of the chosen
   tokens before the first divergence.

The last line is a JSON object with the figures (medians over --reps).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Figures in docs/benchmarks.md are of the random tiny model: keep it the default here
# (and in the `tandem serve` this starts); TANDEM_DEFAULT_MODEL=... measures another.
os.environ.setdefault("TANDEM_DEFAULT_MODEL", "tandem-tiny-llama")

import torch

from benchkit.kv_peer import push_grant
from engine import EngineConfig, LLMEngine
from engine.block_pool import BlockPool, Holder
from engine.config import SpeculativeConfig
from engine.kv_cache import KVCache
from kv_transfer import GrpcKVClient, GrpcKVServer, KVBlocks, PoolBlockStore
from kv_transfer.quantized import QuantizedBlockStore, dequantize, quantize
from protocol.sampling import SamplingParams

K = 4


def code_prompts(tokenizer, n: int, max_tokens: int, chat: bool = False) -> list[list[int]]:
    """``n`` "edit this file" prompts over standard library sources (the file cut
    to ``max_tokens`` tokens); ``chat``: as a user turn of the model's chat template
    (an instruct model), else as a plain completion (a random model)."""
    src = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in src.glob("*.py") if 4000 < p.stat().st_size < 40000)
    out = []
    for path in files[:: max(1, len(files) // n)][:n]:
        text = path.read_text(errors="ignore")
        if chat:
            code = tokenizer.decode(tokenizer.encode(text)[:max_tokens])
            ask = "Rename every variable `x` to `y` in this Python file; reply with the whole file."
            message = {"role": "user", "content": f"{ask}\n\n```python\n{code}\n```"}
            ids = tokenizer.apply_chat_template([message], add_generation_prompt=True)
            out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
            continue
        ids = tokenizer.encode(f"# Rename every variable `x` to `y`.\n{text}")[:max_tokens]
        out.append(ids + tokenizer.encode("\n# Edited file:\n"))
    return out


def random_prompts(n: int, length: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(10, 30000, (length,), generator=gen).tolist() for _ in range(n)]


@dataclasses.dataclass
class DecodeRun:
    tok_s: float  # decode tokens/s, after every request has its first token
    steps: int  # engine steps (target passes) after that point
    outputs: dict[str, list[int]]


def decode_run(engine: LLMEngine, prompts, params) -> DecodeRun:
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    out: dict[str, list[int]] = {}
    started = None
    steps = 0
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        if started is None and len(out) == len(prompts):
            started, first = time.perf_counter(), sum(len(v) for v in out.values())
        elif started is not None:
            steps += 1
    elapsed = time.perf_counter() - started
    return DecodeRun((sum(len(v) for v in out.values()) - first) / elapsed, steps, out)


def engine_config(args, **kw) -> EngineConfig:
    """The engine of every run: ``--model`` (None: the random tiny default) with
    ``--quantization``."""
    return EngineConfig(model=args.model, quantization=args.quantization, **kw)


def decode_bench(args) -> dict:
    base = engine_config(args, num_kv_blocks=2048, max_num_seqs=16)
    plain = LLMEngine(base)
    engines = {
        "off": plain,
        "ngram": LLMEngine(dataclasses.replace(base, speculative=SpeculativeConfig("ngram", K))),
    }
    if args.model is None:  # a real model as its own draft costs two targets' memory and time
        draft = SpeculativeConfig("draft", K, draft_model=str(plain.model_dir))
        engines["draft=target"] = LLMEngine(dataclasses.replace(base, speculative=draft))
    code = code_prompts(plain.tokenizer, 4, 384, chat=args.model is not None)
    randoms = random_prompts(4, 384)
    greedy = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, max_tokens=args.tokens, ignore_eos=True, seed=1)
    workloads = {"code_edit": (code, greedy), "random_sampled": (randoms, sampled)}
    result = {}
    for wname, (prompts, params) in workloads.items():
        names = list(engines) if wname == "code_edit" else ["off", "ngram"]
        for streams in (1, 4):
            batch = prompts[:streams]
            runs: dict[str, list[DecodeRun]] = {n: [] for n in names}
            before = {n: _counters(engines[n]) for n in names}
            for _ in range(args.reps):  # interleaved: load drift hits every engine alike
                for n in names:
                    runs[n].append(decode_run(engines[n], batch, params))
            for n in names:
                key = f"{wname}_{streams}streams_{n}"
                entry = {
                    "decode_tok_s": round(statistics.median(r.tok_s for r in runs[n]), 1),
                    "decode_steps": runs[n][0].steps,
                }
                if n != "off":
                    ratios = [r.tok_s / o.tok_s for r, o in zip(runs[n], runs["off"], strict=True)]
                    entry["speedup_vs_off"] = round(statistics.median(ratios), 2)
                    entry["steps_vs_off"] = round(runs[n][0].steps / runs["off"][0].steps, 3)
                    proposed, accepted, emitted = (
                        a - b for a, b in zip(_counters(engines[n]), before[n], strict=True)
                    )
                    entry["acceptance"] = round(accepted / max(1, proposed), 3)
                    entry["tokens_per_spec_step"] = round(emitted / max(1, emitted - accepted), 2)
                    if params.greedy:
                        entry["equal_to_plain"] = runs[n][0].outputs == runs["off"][0].outputs
                result[key] = entry
                print(key, entry, flush=True)
    return result


def _counters(engine: LLMEngine) -> tuple[int, int, int]:
    s = engine.speculator
    return (0, 0, 0) if s is None else (s.num_proposed, s.num_accepted, s.num_emitted)


async def _push_once(layout, wire: str | None, num_blocks: int) -> tuple[int, float]:
    def store(seed: int):
        cache = KVCache(layout, num_blocks, torch.device("cpu"))
        gen = torch.Generator().manual_seed(seed)
        for t in cache.layers:
            t.copy_(torch.randn(t.shape, generator=gen))
        s = PoolBlockStore(BlockPool(num_blocks, layout.block_size), cache)
        return QuantizedBlockStore(s, wire) if wire else s

    src, dst = store(1), store(2)
    server, client = GrpcKVServer(dst), GrpcKVClient()
    await server.start()
    try:
        bench = Holder("lease", "bench")
        ids = src.reserve(bench, num_blocks)
        t0 = time.perf_counter()
        tokens = list(range(num_blocks * layout.block_size))
        grant = push_grant(server.service.config, server.address, "r")
        blocks = KVBlocks("r", ids, [None] * num_blocks, tokens, grant=grant)
        result = await client.push(server.address, src, blocks)
        elapsed = time.perf_counter() - t0
        dst.release(server.claim("r").holder)
        src.release(bench)
    finally:
        await client.close()
        await server.stop()
    return result.bytes_sent, elapsed


def transfer_bench(args, layout) -> dict:
    blocks = 2048 // layout.block_size
    wires = {"float32": None, "int8": "int8", "fp8": "fp8"}
    runs: dict[str, list[tuple[int, float]]] = {name: [] for name in wires}
    for wire in wires.values():
        asyncio.run(_push_once(layout, wire, blocks))  # warm-up
    for _ in range(args.transfer_reps):  # interleaved, like the decode runs
        for name, wire in wires.items():
            runs[name].append(asyncio.run(_push_once(layout, wire, blocks)))
    out = {}
    for name in wires:
        out[name] = {
            "bytes": runs[name][0][0],
            "ms": round(1000 * statistics.median(t for _, t in runs[name]), 1),
        }
        if name != "float32":
            out[name]["bytes_ratio"] = round(out[name]["bytes"] / out["float32"]["bytes"], 3)
            ratios = [t / f for (_, t), (_, f) in zip(runs[name], runs["float32"], strict=True)]
            out[name]["time_ratio"] = round(statistics.median(ratios), 2)
        print("transfer", name, out[name], flush=True)
    return out


def _exported(prefill, rid, prompt, params):
    """The prompt's KV and first token, prefilled once (every wire format decodes
    from the same export)."""
    prefill.add_request(rid, prompt, params, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    export = prefill.export_kv(rid)
    prefill.release(rid)
    return export


def _decode_after_import(decoder, rid, export, wire, params):
    """Greedy tokens and logprobs after importing ``export`` through ``wire``
    (None: float32, as exported)."""
    if wire is not None:
        data = export.data.clone()
        for layer in range(data.shape[0]):
            codes, scales = quantize(data[layer], wire)
            data[layer] = dequantize(codes, scales, data.dtype)
        export = dataclasses.replace(export, data=data)
    decoder.import_kv(dataclasses.replace(export, request_id=rid), params)
    ids, logprobs = list(export.output_token_ids), []
    while decoder.has_unfinished():
        for o in decoder.step():
            ids += o.new_token_ids
            logprobs += [x.logprob for x in o.logprobs or []]
    return ids, logprobs


def _compare(runs, ref) -> dict:
    same_prompts, same_tokens, total, diffs = 0, 0, 0, []
    for (ids, lps), (ref_ids, ref_lps) in zip(runs, ref, strict=True):
        same_prompts += ids == ref_ids
        # the first token is the shared prefill's: equal by construction, not counted
        same_tokens += sum(a == b for a, b in zip(ids[1:], ref_ids[1:], strict=True))
        total += len(ids) - 1
        diverge = next(
            (j for j, (a, b) in enumerate(zip(ids, ref_ids, strict=True)) if a != b), len(ids)
        )
        # logprobs cover the decoded tokens (after the prefill's first one)
        diffs += [
            abs(a - b) for a, b in zip(lps[: diverge - 1], ref_lps[: diverge - 1], strict=True)
        ]
    return {
        "prompts_identical": round(same_prompts / len(runs), 3),
        "tokens_equal": round(same_tokens / total, 3),
        "mean_abs_logprob_diff": round(statistics.fmean(diffs), 5) if diffs else None,
        "max_abs_logprob_diff": round(max(diffs), 5) if diffs else None,
    }


def quality_bench(args, prefill: LLMEngine, decoder: LLMEngine) -> dict:
    prompts = code_prompts(prefill.tokenizer, args.prompts, 480, chat=args.model is not None)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    wires = {"float32": None, "int8": "int8", "fp8": "fp8"}
    runs: dict[str, list] = {name: [] for name in wires}
    for i, p in enumerate(prompts):
        export = _exported(prefill, f"q{i}", p, params)
        for name, wire in wires.items():
            runs[name].append(_decode_after_import(decoder, f"{name}{i}", export, wire, params))
    out = {}
    for name in ("int8", "fp8"):
        out[name] = _compare(runs[name], runs["float32"])
        print("quality", name, out[name], flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--transfer-reps", type=int, default=9)
    parser.add_argument(
        "--model", default=None, help="a checkpoint or .gguf file, or smollm2-135m-instruct"
    )
    parser.add_argument("--quantization", default="none", help="engine.quantization")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--parts", default="decode,transfer,quality")
    args = parser.parse_args()
    parts = args.parts.split(",")
    torch.set_num_threads(args.threads)
    result: dict = {"model": args.model or "tandem-tiny-llama", "quantization": args.quantization}
    if "decode" in parts:
        result["decode"] = decode_bench(args)
    if "transfer" in parts or "quality" in parts:
        prefill = LLMEngine(engine_config(args, num_kv_blocks=1024))
        decoder = LLMEngine(engine_config(args, num_kv_blocks=1024))
        if "transfer" in parts:
            result["transfer_2048_tokens"] = transfer_bench(args, prefill.kv_layout)
        if "quality" in parts:
            result["quantized_output"] = quality_bench(args, prefill, decoder)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
