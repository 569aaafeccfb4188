"""What a decode worker adds to each step: TPOT seen by a router's reader vs
the bare engine's decode step, without Ray or the public API.

A DecodeWorker runs in a process of its own and the router's WorkerStreams
reads its output stream in another, as in a deployment; requests start with
``start_full`` (the worker prefills them itself; 64-token prompts, 64 greedy
tokens). Each measurement first times the bare engine's median decode step
in the worker's process (same model, same number of streams), then runs the
same requests through the worker and takes the router-side mean time per
output token after the first. The difference is the worker's per-step
overhead.

With ``--compare OTHER_CHECKOUT`` a second worker and reader run from that
checkout (it must have the same DecodeWorker and WorkerStreams, or DecodeStreams, API), and the
two alternate measurement by measurement, so both see the same machine load.
Medians over ``--rounds``; the last line is one JSON object.

  python bench/decode_overhead.py [--streams 1,64] [--rounds 5] [--compare PATH]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The repository root, not bench/ (which has an engine.py); a reader (--side)
# and its worker put their checkout first.
sys.path[0] = str(ROOT)

# Figures in docs/benchmarks.md are of the random tiny model: keep it the default here
# (and in the `tandem serve` this starts); TANDEM_DEFAULT_MODEL=... measures another.
os.environ.setdefault("TANDEM_DEFAULT_MODEL", "tandem-tiny-llama")

import argparse
import asyncio
import dataclasses
import itertools
import json
import multiprocessing as mp
import statistics
import subprocess
import time

OUT_TOKENS = 64
PROMPT_TOKENS = 64
ROUTER_ID = "router-bench"


def _prompts(n: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, 30000, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(n)]


# ---- the worker's process ----


def _bare(engine, streams: int, seed: int) -> dict:
    """The median decode step, and CPU time per step of the whole run."""
    from protocol.sampling import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    for i, p in enumerate(_prompts(streams, seed)):
        engine.add_request(f"bare-{seed}-{i}", p, params)
    steps = []
    cpu = time.process_time()
    while engine.has_unfinished():
        t = time.perf_counter()
        outs = engine.step()
        steps.append((time.perf_counter() - t, outs))
    cpu = time.process_time() - cpu
    full = [dt for dt, outs in steps if len(outs) == streams]
    decode = [dt for dt, outs in steps if len(outs) == streams and outs[0].num_output_tokens > 1]
    decode = decode or full
    return {"bare_ms": statistics.median(decode) * 1e3, "bare_cpu_ms": cpu / len(steps) * 1e3}


def _worker_main(conn, tree: str) -> None:
    sys.path.insert(0, tree)
    asyncio.run(_serve_worker(conn, conn.recv()))


async def _serve_worker(conn, secret: bytes) -> None:
    """``secret``: the cluster secret the reader's process made (sent on the pipe)."""
    from decode_pool.worker import DecodeWorker
    from engine import EngineConfig, LLMEngine
    from kv_transfer import TransferConfig
    from net.security import ClusterSecurity
    from protocol.requests import DecodeRequest
    from protocol.sampling import SamplingParams

    config = EngineConfig(num_threads=1, kv_cache_memory_bytes=256 << 20)
    transfer = TransferConfig(security=ClusterSecurity(secret))
    worker = DecodeWorker("decode-bench", config, transfer, host="127.0.0.1")
    bare = LLMEngine(config)
    addresses = await worker.start()  # older checkouts: their addresses
    # What the actor tells the router: WorkerInfo, or a dict in older checkouts.
    conn.send(worker.describe() if addresses is None else dataclasses.asdict(addresses))
    loop = asyncio.get_running_loop()
    params = SamplingParams(temperature=0, max_tokens=OUT_TOKENS, ignore_eos=True)
    started = (0.0, 0)
    while (cmd := await loop.run_in_executor(None, conn.recv)) is not None:
        kind, streams, seed = cmd
        if kind == "bare":
            conn.send(_bare(bare, streams, seed))
            continue
        if kind == "cpu":  # the run is over: CPU time of this process per engine step
            cpu, steps = time.process_time() - started[0], worker.loop.num_steps - started[1]
            conn.send(cpu / steps * 1e3)
            continue
        started = (time.process_time(), worker.loop.num_steps)
        requests = [
            DecodeRequest(f"{seed}-{i}", ROUTER_ID, p, [], params)
            for i, p in enumerate(_prompts(streams, seed))
        ]
        await asyncio.gather(*(worker.start_full(r) for r in requests))
        conn.send("started")
    await worker.stop()


# ---- the reader's process (one per checkout) ----


async def _side(tree: str) -> None:
    from kv_transfer import TransferConfig
    from net.security import ClusterSecurity
    from router.pool_manager import WorkerHandle

    try:
        from router.worker_streams import LOST, WorkerStreams
    except ImportError:  # a checkout from before the rename (--compare)
        from router.decode_streams import LOST
        from router.decode_streams import DecodeStreams as WorkerStreams

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_worker_main, args=(child, tree), daemon=True)
    proc.start()
    transfer = TransferConfig(security=ClusterSecurity.generate())
    parent.send(transfer.security.secret)  # on the pipe, never a command line
    loop = asyncio.get_running_loop()
    info = await loop.run_in_executor(None, parent.recv)
    streams = WorkerStreams(ROUTER_ID, lambda events: None, lambda w, why: None, transfer)
    handle = WorkerHandle("decode-bench", "decode", None, info)
    await streams.subscribe(handle)
    outputs = info["outputs"] if isinstance(info, dict) else info.outputs
    print(json.dumps({"ready": outputs}), flush=True)

    async def ask(cmd):
        parent.send(cmd)
        return await loop.run_in_executor(None, parent.recv)

    async def collect(queue) -> list[float]:
        stamps = []
        while True:
            delta = await queue.get()
            assert delta is not LOST, "the output stream broke"
            if delta.token_ids:
                stamps.append(time.perf_counter())
            if delta.finished:
                return stamps

    while line := await loop.run_in_executor(None, sys.stdin.readline):
        cmd = json.loads(line)
        n, seed = cmd["streams"], cmd["seed"]
        bare = await ask(("bare", n, seed))
        cpu = time.process_time()
        queues = [streams.register(f"{seed}-{i}", handle) for i in range(n)]
        readers = [asyncio.create_task(collect(q)) for q in queues]
        await ask(("run", n, seed))
        stamps = await asyncio.gather(*readers)
        reader_cpu = time.process_time() - cpu
        worker_cpu = await ask(("cpu", n, seed))
        for i in range(n):
            streams.unregister(f"{seed}-{i}")
        tpot = statistics.mean((s[-1] - s[0]) / (len(s) - 1) for s in stamps) * 1e3
        gaps = [b - a for s in stamps for a, b in itertools.pairwise(s)]
        result = {
            **bare,
            "tpot_ms": tpot,
            "itl_ms": statistics.median(gaps) * 1e3,
            "worker_cpu_ms": worker_cpu,  # per engine step, whole worker process
            "reader_cpu_ms": reader_cpu / OUT_TOKENS * 1e3,  # per step of the run
        }
        print(json.dumps(result), flush=True)
    parent.send(None)
    await streams.close()
    proc.join(30)


# ---- the driver ----


def _start_side(tree: Path) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--side", str(tree)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while line := proc.stdout.readline():
        if line.startswith('{"ready"'):
            return proc
    raise RuntimeError(f"the side for {tree} did not start")


def _measure(proc: subprocess.Popen, streams: int, seed: int) -> dict:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(json.dumps({"streams": streams, "seed": seed}) + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", default="1,64")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", type=Path, help="another checkout, measured alternately")
    parser.add_argument("--side", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.side:
        sys.path.insert(0, args.side)
        asyncio.run(_side(args.side))
        return
    trees = {"this": ROOT}
    if args.compare is not None:
        trees["compare"] = args.compare.resolve()
    sides = {name: _start_side(tree) for name, tree in trees.items()}
    counts = [int(s) for s in args.streams.split(",")]
    runs: dict[tuple[str, int], list[dict]] = {(name, n): [] for name in sides for n in counts}
    try:
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for n in counts:
                for name in order:
                    m = _measure(sides[name], n, seed=1000 * r + n)
                    runs[name, n].append(m)
                    print(name, n, {k: round(v, 3) for k, v in m.items()}, flush=True)
    finally:
        for proc in sides.values():
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(60)
    summary = {}
    for (name, n), ms in runs.items():

        def med(f, ms=ms) -> float:
            return round(statistics.median(f(m) for m in ms), 3)

        summary[f"{name}_{n}"] = {
            "bare_ms": med(lambda m: m["bare_ms"]),
            "tpot_ms": med(lambda m: m["tpot_ms"]),
            "overhead_ms": med(lambda m: m["tpot_ms"] - m["bare_ms"]),
            "ratio": med(lambda m: m["tpot_ms"] / m["bare_ms"]),
            "itl_ratio": med(lambda m: m["itl_ms"] / m["bare_ms"]),
            "cpu_overhead_ms": med(lambda m: m["worker_cpu_ms"] - m["bare_cpu_ms"]),
            "reader_cpu_ms": med(lambda m: m["reader_cpu_ms"]),
        }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
