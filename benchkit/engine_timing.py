"""Timing an LLMEngine's steps on any device: decode step time at a batch
size and context, prefill tokens per second, and the PyTorch attention path
as a baseline for the GPU kernel (bench/gpu_check.py)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import torch

from engine import LLMEngine
from engine.block_pool import Holder
from engine.device import synchronize
from engine.gpu import paged_attention as gpu
from kv_transfer import PoolBlockStore
from protocol.sampling import SamplingParams


@contextlib.contextmanager
def attention_path(name: str) -> Iterator[None]:
    """``kernel``: the engine's own choice (the Triton kernel on a GPU);
    ``gather``: the PyTorch path (blocks gathered with index_select, then
    SDPA), the baseline the kernel replaces. Engines built inside keep it."""
    if name == "kernel":
        yield
        return
    available = gpu.available
    gpu.available = lambda device: False
    try:
        yield
    finally:
        gpu.available = available


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + j * 104729) % (vocab - 10) + 10 for j in range(n)]


def _drain_first_tokens(engine: LLMEngine, ids: set[str]) -> None:
    seen: set[str] = set()
    while seen < ids:
        seen.update(o.request_id for o in engine.step() if o.new_token_ids)


def decode_step_s(
    engine: LLMEngine, batch: int, context: int, steps: int, graphs: bool, tag: str
) -> float:
    """Mean seconds of a decode-only step of ``batch`` sequences of ``context``
    tokens (CUDA graphs on or off where the engine has a runner); the
    requests are aborted after, so the engine can be reused."""
    runner = engine.decode_graphs
    engine.decode_graphs = runner if graphs else None
    vocab = engine.spec.vocab_size
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = {f"{tag}-{batch}-{i}" for i in range(batch)}
    for i in range(batch):
        engine.add_request(f"{tag}-{batch}-{i}", _tokens(batch * 1000 + i, context, vocab), params)
    try:
        _drain_first_tokens(engine, ids)
        for _ in range(3):  # warm up (and capture the graphs)
            engine.step()
        synchronize(engine.device)
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        synchronize(engine.device)
        return (time.perf_counter() - start) / steps
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.decode_graphs = runner


def profile_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> str:
    """cProfile's top functions (cumulative time) over ``steps`` decode steps:
    where a step's host time goes."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    timed = engine.step

    def step(*args, **kwargs):
        with contextlib.ExitStack() as stack:
            if profiling:
                profiler.enable()
                stack.callback(profiler.disable)
            return timed(*args, **kwargs)

    profiling = False
    engine.step = step
    try:
        profiling = True  # decode_step_s's prefill and warm-up steps are profiled too
        decode_step_s(engine, batch, context, steps, graphs=True, tag="profile")
    finally:
        del engine.step
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def prefill_tokens_per_s(engine: LLMEngine, lengths: list[int], tag: str) -> float:
    """Prompt tokens per second until every prompt of ``lengths`` has its
    first token (no prefix hits: the prompts differ from the first token)."""
    vocab = engine.spec.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    ids = {f"{tag}-p{i}" for i in range(len(lengths))}
    for i, n in enumerate(lengths):
        engine.add_request(f"{tag}-p{i}", _tokens(500_000 + i, n, vocab), params)
    synchronize(engine.device)
    start = time.perf_counter()
    _drain_first_tokens(engine, ids)
    synchronize(engine.device)
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    return sum(lengths) / elapsed


@torch.inference_mode()
def hf_prefill_tokens_per_s(model, lengths: list[int], vocab: int, device) -> float:
    """The same measure for a Hugging Face model: one forward per prompt."""
    prompts = [
        torch.tensor([_tokens(i + 1, n, vocab)], device=device) for i, n in enumerate(lengths)
    ]
    model(prompts[0][:, :16])  # warm up
    synchronize(device)
    start = time.perf_counter()
    for ids in prompts:
        model(ids, use_cache=False, logits_to_keep=1)
    synchronize(device)
    return sum(lengths) / (time.perf_counter() - start)


def copy_overlap(engine: LLMEngine, batch: int, context: int, steps: int, mib: int) -> dict:
    """Decode steps alone and while another thread reads ``mib`` MiB of KV
    blocks into page-locked host memory over and over, as a push does
    (kv_transfer's PoolBlockStore, its copies on a stream of their own): how
    much the copies slow the steps, and their rate with and without them."""
    store = PoolBlockStore(engine.block_pool, engine.kv_cache)
    layout = store.layout
    decode_needs = batch * -(-(context + steps + 16) // layout.block_size)
    n = min((mib << 20) // layout.block_bytes, store.num_free - decode_needs)
    holder = Holder("lease", "copy-overlap")
    blocks = store.reserve(holder, n)
    if n < 1 or blocks is None:
        raise RuntimeError(f"no room for {mib} MiB of blocks to copy beside the decode")
    staging = store.staging_buffer(n * layout.block_bytes)
    nbytes = n * layout.block_bytes

    def copy_rate(stop: threading.Event, rates: list[float]) -> None:
        start, copies = time.perf_counter(), 0
        while not stop.is_set() or copies == 0:
            store.read_into(blocks, 0, layout.num_layers, staging)
            copies += 1
        rates.append(copies * nbytes / (time.perf_counter() - start))

    try:
        alone_rate: list[float] = []
        stop = threading.Event()
        stop.set()  # one copy, timed
        copy_rate(stop, alone_rate)
        alone = decode_step_s(engine, batch, context, steps, graphs=True, tag="overlap-a")
        stop, busy_rate = threading.Event(), []
        thread = threading.Thread(target=copy_rate, args=(stop, busy_rate))
        thread.start()
        together = decode_step_s(engine, batch, context, steps, graphs=True, tag="overlap-b")
        stop.set()
        thread.join()
    finally:
        store.release(holder)
    return {
        "batch": batch,
        "copy_mib": nbytes >> 20,
        "step_alone_ms": round(alone * 1e3, 4),
        "step_with_copies_ms": round(together * 1e3, 4),
        "copy_gb_s_alone": round(alone_rate[0] / 1e9, 3),
        "copy_gb_s_during_decode": round(busy_rate[0] / 1e9, 3),
    }
