"""TTFT with the KV streamed during the prefill, against the whole-prompt push.

    python bench/layerwise.py [--model tiny|smollm2|llama1b] [--prompts 2048,8192] [--reps 3]
    python bench/layerwise.py --device cuda --dtype bfloat16 --model llama1b   # on a GPU

A prefill worker and a decode worker (prefill_pool/, decode_pool/, no Ray,
no router), each in a process of its own with one torch thread, on
127.0.0.1, the KV on the data channel. Each request is a fresh prompt (no
prefix hit on either side), 2 output tokens. Its TTFT runs from the
prefill call to the decode worker writing the first token to its router's
stream (CLOCK_MONOTONIC in both processes); its tail from the prefill's
first token to that write, which is what a push after the prefill adds.
Rotates three modes, the same workers, in the same run: ``transfer.stream``
on (each block's KV leaves once a layer has computed it), chunk-wise (the
same push, the engine's reports after each prefill step only: a baseline
this script builds by turning the per-layer reports off) and off (the
baseline: push after the prefill). ``--model``: the default model's shape
(hidden 256, 4 layers, 4 KiB of KV a token), SmolLM2-135M's (30 layers,
45 KiB a token) or Llama-3.2-1B's (16 layers, 32 KiB a token in bf16),
random weights, 16,384 positions; ``--device`` and ``--dtype`` place both
workers (a GPU: both on it, the KV through pinned host memory and TCP).
The last line is a JSON object (medians).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gpu_check import LLAMA_1B
from bench.kv_transfer import SMOLLM2_135M

TINY = dict(
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    vocab_size=32000,
    architectures=["LlamaForCausalLM"],
)
ROUTER = "bench-router"
# layer: transfer.stream (the engine reports after every layer); chunk: the
# same push with reports after each step only (each prefill chunk), a
# baseline only this script builds; whole: transfer.stream off.
MODES = ["layer", "chunk", "whole"]
SECRET = b"bench-layerwise-secret"


class _Outputs:
    """The decode worker's output streams: when each request's first frame went out."""

    def __init__(self) -> None:
        self.first: dict[str, float] = {}

    def has_router(self, router_id: str) -> bool:
        return True

    def own(self, request_id: str, router_id: str) -> bool:
        return True

    def disown(self, request_id: str) -> None:
        pass

    def publish(self, outputs, events, room=None) -> None:
        now = time.monotonic()
        for out in outputs:
            self.first.setdefault(out.request_id, now)

    def close(self) -> None:
        pass


def _worker(conn, role: str, model_dir: str, kv_mb: int, device: str, dtype: str) -> None:
    asyncio.run(_serve(conn, role, model_dir, kv_mb, device, dtype))


async def _serve(conn, role: str, model_dir: str, kv_mb: int, device: str, dtype: str) -> None:
    from decode_pool.worker import DecodeWorker
    from engine import EngineConfig
    from kv_transfer import TransferConfig
    from net.security import ClusterSecurity
    from prefill_pool.worker import PrefillWorker

    config = EngineConfig(
        model=model_dir,
        load_format="dummy",
        num_threads=1,
        kv_cache_memory_bytes=kv_mb << 20,
        device=device,
        dtype=dtype,
        **({} if device == "cpu" else {"max_num_batched_tokens": 8192}),
    )
    transfer = TransferConfig(security=ClusterSecurity(SECRET))
    loop = asyncio.get_running_loop()
    if role == "decode":
        worker = DecodeWorker("d", config, transfer)
        worker.start_loop()
        await worker.kv_server.start()
        worker.outputs = outputs = _Outputs()
        conn.send(worker.kv_server.address)
    else:
        worker = PrefillWorker("p", config, transfer)
        await worker.start()
        conn.send(worker.kv_server.address)
    while True:
        cmd, arg = await loop.run_in_executor(None, conn.recv)
        if cmd == "exit":
            break
        if cmd == "first":  # decode: when the request's first frame went out
            while arg not in outputs.first:
                await asyncio.sleep(0.002)
            conn.send(outputs.first.pop(arg))
        elif cmd == "prefill":  # prefill: (mode, request) -> (start, result)
            mode, req = arg
            worker.transfer_config = dataclasses.replace(transfer, stream_push=mode != "whole")
            worker.engine.__dict__.pop("_layer_reports", None)
            if mode == "chunk":  # this bench's baseline only: reports after each step alone
                worker.engine._layer_reports = lambda batch: contextlib.nullcontext()
            start = time.monotonic()
            result = await worker.prefill(req)
            conn.send((start, result))
    if role == "prefill":
        await worker.stop()
    conn.send("bye")


class Proc:
    def __init__(self, role: str, model_dir: str, kv_mb: int, device: str, dtype: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, role, model_dir, kv_mb, device, dtype)
        self.process = ctx.Process(target=_worker, args=args)
        self.process.start()
        self.address = self.conn.recv()

    def call(self, cmd: str, arg=None, timeout_s: float = 1800):
        self.conn.send((cmd, arg))
        if not self.conn.poll(timeout_s):
            raise TimeoutError(cmd)
        return self.conn.recv()

    def close(self) -> None:
        self.conn.send(("exit", None))
        self.process.join(30)
        if self.process.is_alive():
            self.process.kill()


def _request(rid: str, prompt: list[int], decode: Proc):
    from benchkit.kv_peer import push_grant
    from kv_transfer import TransferConfig
    from net.security import ClusterSecurity
    from protocol.requests import PrefillRequest
    from protocol.sampling import SamplingParams

    transfer = TransferConfig(security=ClusterSecurity(SECRET))
    grant = push_grant(transfer, decode.address, rid)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    return PrefillRequest(rid, ROUTER, prompt, params, decode.address, push_grant=grant)


def one(prefill: Proc, decode: Proc, rid: str, prompt: list[int], mode: str) -> dict:
    start, result = prefill.call("prefill", (mode, _request(rid, prompt, decode)))
    first = decode.call("first", rid)
    tail = first - (start + result.prefill_s)
    return {"ttft_s": first - start, "prefill_s": result.prefill_s, "tail_s": tail}


SHAPES = {"tiny": TINY, "smollm2": SMOLLM2_135M, "llama1b": LLAMA_1B}
KV_MB = {"tiny": 256, "smollm2": 1536, "llama1b": 4096}


def run(model: str, lengths: list[int], reps: int, device: str, dtype: str) -> dict:
    from transformers import LlamaConfig

    shape = dict(SHAPES[model], max_position_embeddings=16384)
    shape.setdefault("architectures", ["LlamaForCausalLM"])
    out: dict = {"model": model, "reps": reps, "device": device, "dtype": dtype}
    with tempfile.TemporaryDirectory() as tmp:
        LlamaConfig(**shape).save_pretrained(tmp)
        prefill = Proc("prefill", tmp, KV_MB[model], device, dtype)
        decode = Proc("decode", tmp, KV_MB[model], device, dtype)
        try:
            n = 0
            for length in lengths:
                rows: dict[str, list[dict]] = {mode: [] for mode in MODES}
                for rep in range(reps + 1):  # the first round warms up
                    for mode in MODES[rep % 3 :] + MODES[: rep % 3]:
                        n += 1
                        vocab = shape["vocab_size"] - 10
                        prompt = [(n * 7919 + i * 104729) % vocab + 10 for i in range(length)]
                        row = one(prefill, decode, f"r{n}", prompt, mode)
                        if rep:
                            rows[mode].append(row)
                        print(length, mode, {k: round(v, 4) for k, v in row.items()}, flush=True)
                out[str(length)] = _summary(rows)
        finally:
            prefill.close()
            decode.close()
    return out


def _summary(rows: dict[str, list[dict]]) -> dict:
    def med(mode: str, key: str) -> float:
        return round(statistics.median(r[key] for r in rows[mode]), 4)

    s = {
        f"{key}_{mode}": med(mode, key)
        for key in ("ttft_s", "prefill_s", "tail_s")
        for mode in MODES
    }
    for mode in ("layer", "chunk"):
        s[f"ttft_{mode}_over_whole"] = round(s[f"ttft_s_{mode}"] / s["ttft_s_whole"], 4)
        s[f"tail_{mode}_over_whole"] = round(s[f"tail_s_{mode}"] / s["tail_s_whole"], 4)
    return s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(SHAPES), default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", default="2048,8192")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    lengths = [int(x) for x in args.prompts.split(",")]
    print(json.dumps(run(args.model, lengths, args.reps, args.device, args.dtype)))


if __name__ == "__main__":
    main()
