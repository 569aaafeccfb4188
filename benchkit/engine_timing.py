"""Timing an LLMEngine's steps on any device (bench/gpu_check.py): decode
step time at a batch size and context, prefill tokens per second with and
without a cached prefix, decode steps beside a push's KV copies, and where
a step's host time goes."""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable

import torch

from engine import LLMEngine
from engine.block_pool import Holder
from engine.device import synchronize
from kv_transfer import PoolBlockStore
from protocol.sampling import SamplingParams

_seeds = itertools.count(1)  # every prompt of a run its own: no prefix hits between runs
WARM_UP_STEPS = 3


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return [(seed * 7919 + j * 104729) % (vocab - 10) + 10 for j in range(n)]


def _drain_first_tokens(engine: LLMEngine, ids: set[str]) -> None:
    seen: set[str] = set()
    while seen < ids:
        seen.update(o.request_id for o in engine.step() if o.new_token_ids)


def decode_step_s(
    engine: LLMEngine,
    batch: int,
    context: int,
    steps: int,
    graphs: bool,
    during: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> float:
    """Mean seconds of a decode-only step of ``batch`` sequences of ``context``
    tokens (CUDA graphs on or off where the engine has a runner), every
    sequence running in every timed step; ``during()`` is entered around the
    timed steps only. The requests are aborted after, so the engine can be
    reused."""
    runner = engine.decode_graphs
    engine.decode_graphs = runner if graphs else None
    vocab = engine.spec.vocab_size
    # Enough tokens that none finishes while the last ones are still prefilling.
    budget = engine.config.max_num_batched_tokens
    max_tokens = steps + WARM_UP_STEPS + 2 * -(-batch * context // budget) + 8
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids = set()
    for i in range(batch):
        ids.add(rid := f"decode-{batch}-{i}-{next(_seeds)}")
        engine.add_request(rid, _tokens(next(_seeds), context, vocab), params)
    try:
        _drain_first_tokens(engine, ids)
        for _ in range(WARM_UP_STEPS):  # (and the graphs' capture)
            engine.step()
        synchronize(engine.device)
        with during():
            start = time.perf_counter()
            for _ in range(steps):
                if len(engine.step()) != batch:
                    raise RuntimeError(f"a decode step ran fewer than {batch} sequences")
            synchronize(engine.device)
            elapsed = time.perf_counter() - start
        return elapsed / steps
    finally:
        for rid in ids:
            engine.abort(rid)
        engine.decode_graphs = runner


def profile_decode(engine: LLMEngine, batch: int, context: int, steps: int) -> str:
    """cProfile's top functions (cumulative time) over ``steps`` timed decode
    steps with CUDA graphs: where a step's host time goes."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()

    @contextlib.contextmanager
    def profiling():
        profiler.enable()
        try:
            yield
        finally:
            profiler.disable()

    decode_step_s(engine, batch, context, steps, graphs=True, during=profiling)
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
    return out.getvalue()


def prefill_tokens_per_s(engine: LLMEngine, lengths: list[int], cached: int = 0) -> float:
    """Prompt tokens computed per second until every prompt of ``lengths`` has
    its first token. ``cached``: each prompt starts with that many tokens of
    a prefix prefilled just before (a prefix-cache hit), so only its tail is
    computed, attending over the cached blocks."""
    vocab = engine.spec.vocab_size
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    prefix = _tokens(next(_seeds), cached, vocab)
    if cached:
        engine.add_request(f"prefix-{next(_seeds)}", prefix, params)
        while engine.has_unfinished():
            engine.step()
    ids = set()
    for n in lengths:
        ids.add(rid := f"prefill-{next(_seeds)}")
        engine.add_request(rid, prefix + _tokens(next(_seeds), n, vocab), params)
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
    prompts = [torch.tensor([_tokens(next(_seeds), n, vocab)], device=device) for n in lengths]
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
    decode_needs = batch * -(-(context + 2 * steps + 64) // layout.block_size)
    n = min((mib << 20) // layout.block_bytes, store.num_free - decode_needs)
    holder = Holder("lease", "copy-overlap")
    blocks = store.reserve(holder, n) if n > 0 else None
    if blocks is None:
        raise RuntimeError(f"no room for {mib} MiB of blocks to copy beside the decode")
    staging = store.staging_buffer(n * layout.block_bytes)
    nbytes = n * layout.block_bytes
    rates: list[float] = []

    def copy() -> None:
        store.read_into(blocks, 0, layout.num_layers, staging)

    def timed_copies(stop: threading.Event) -> None:
        start, copies = time.perf_counter(), 0
        while not stop.is_set() or copies < 3:
            copy()
            copies += 1
        rates.append(copies * nbytes / (time.perf_counter() - start))

    @contextlib.contextmanager
    def copying():
        stop = threading.Event()
        thread = threading.Thread(target=timed_copies, args=(stop,))
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()

    try:
        copy()  # warm up
        done = threading.Event()
        done.set()
        timed_copies(done)  # three copies, alone
        alone = decode_step_s(engine, batch, context, steps, graphs=True)
        together = decode_step_s(engine, batch, context, steps, graphs=True, during=copying)
    finally:
        store.release(holder)
    return {
        "batch": batch,
        "copy_mib": nbytes >> 20,
        "step_alone_ms": round(alone * 1e3, 4),
        "step_with_copies_ms": round(together * 1e3, 4),
        "copy_gb_s_alone": round(rates[0] / 1e9, 3),
        "copy_gb_s_during_decode": round(rates[1] / 1e9, 3),
    }
