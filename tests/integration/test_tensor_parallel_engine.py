"""Tensor parallelism within one engine (engine/parallel/), on CPU with gloo:
two ranks, the second a local process.

Greedy output at tensor_parallel_size 2 equals size 1 token for token on two
architectures, on the fused CPU path and the PyTorch one, with chunked
prefill and prefix-cache hits, and with weights quantized at load (int8,
q4); KV blocks exported from an engine of one size continue on an engine of
the other; a rank that dies makes the next step raise instead of hanging,
and the engine still closes; one that hangs fails a KV read instead of
holding it, and a worker stopped while its engine thread is stuck in a pass
ends the ranks without a second thread on that pass's group. The ranks get
the engine's secret in their spec, never through the rendezvous store, and a
rank that does not prove it is refused before the engine starts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import importlib.util
import os
import signal
import threading

import pytest
import torch

from engine import LLM
from engine.config import EngineConfig
from engine.engine_loop import EngineLoop
from engine.llm_engine import LLMEngine
from engine.parallel import auth, group
from engine.parallel.group import GroupBroken, Rendezvous
from engine.parallel.local import LocalRanks
from protocol.sampling import SamplingParams
from tests.pool_checks import leftover_holders
from worker.base import EngineWorker

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

PROMPT_LENGTHS = [5, 37, 100]
GREEDY = SamplingParams(temperature=0, max_tokens=24, min_tokens=24, logprobs=0)


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


NO_TRITON = pytest.mark.skipif(not importlib.util.find_spec("triton"), reason="no Triton")


@pytest.mark.parametrize(
    ("arch", "path"),
    [
        *((arch, path) for arch in ("llama", "qwen3") for path in ("kernels", "pytorch")),
        pytest.param("llama", "triton", marks=NO_TRITON),
    ],
)
def test_greedy_at_tp2_equals_tp1(checkpoint_factory, arch, path):
    """(``triton``: every rank attends with the GPU kernel, on CPU under
    Triton's interpreter, the step's metadata broadcast with its tables.)"""
    model_dir = str(checkpoint_factory(arch))
    # 32 tokens a step: the longer prompts are prefilled in chunks over cached context.
    options = {
        "num_kv_blocks": 64,
        "cpu_kernels": "auto" if path == "kernels" else "off",
        "max_num_batched_tokens": 32,
        "attention": "triton" if path == "triton" else "auto",
    }
    one = LLM(model_dir, **options)
    prompts = _prompts(one.engine.spec.vocab_size)
    expected = one.generate(prompts, GREEDY)
    with LLM(model_dir, tensor_parallel_size=2, **options) as two:
        assert two.engine.kv_cache.layers[0].shape[3] == one.engine.spec.num_kv_heads // 2
        free = two.engine.block_pool.num_free
        first = two.generate(prompts, GREEDY)
        again = two.generate(prompts, GREEDY)  # the prompts' full blocks hit the cache
        assert leftover_holders(two.engine.block_pool) == []
        assert two.engine.block_pool.num_free == free
    assert [o.num_cached_tokens for o in again] == [0, 32, 96]
    for ref, a, b in zip(expected, first, again, strict=True):
        assert a.token_ids == ref.token_ids
        assert b.token_ids == ref.token_ids
        ours = [lp.logprob for lp in a.logprobs]
        assert ours == pytest.approx([lp.logprob for lp in ref.logprobs], abs=1e-4)


@pytest.mark.parametrize("quantization", ["int8", "q4"])
def test_weights_quantized_at_load_at_tp2_equal_tp1(checkpoint_factory, quantization):
    """Each rank's share holds the codes and scales of the whole matrix quantized
    at one rank (engine/parallel/sharding.py), so the tokens are the same (on the
    integer kernels: on the matrix units the ranks split bfloat16 sums otherwise)."""
    model_dir = str(checkpoint_factory("llama"))
    options = {"num_kv_blocks": 64, "quantization": quantization, "matrix_units": False}
    one = LLM(model_dir, **options)
    prompts = _prompts(one.engine.spec.vocab_size)
    expected = one.generate(prompts, GREEDY)
    with LLM(model_dir, tensor_parallel_size=2, **options) as two:
        outs = two.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


def _prefilled(llm: LLM, request_id: str, prompt: list[int]):
    """Prefill ``prompt`` alone on ``llm``'s engine; its KV export, with data."""
    engine = llm.engine
    engine.add_request(request_id, prompt, GREEDY, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    export = engine.export_kv(request_id)
    engine.release(request_id)
    return export


def _continue(llm: LLM, export) -> list[int]:
    """Decode ``export`` to the end on ``llm``'s engine: every token, the first included."""
    engine = llm.engine
    engine.import_kv(export, GREEDY)
    tokens = list(export.output_token_ids)
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_kv_moves_between_tp_sizes(checkpoint_factory):
    """A prefill at one size continues at the other: the export holds every
    kv head, gathered from both ranks; an import scatters them back."""
    model_dir = str(checkpoint_factory("llama"))
    options = {"num_kv_blocks": 64, "cpu_kernels": "off"}
    one = LLM(model_dir, **options)
    prompt = _prompts(one.engine.spec.vocab_size)[1]
    expected = one.generate([prompt], GREEDY)[0].token_ids
    with LLM(model_dir, tensor_parallel_size=2, **options) as two:
        from_two = _prefilled(two, "a", prompt)
        assert from_two.data.shape[4] == one.engine.spec.num_kv_heads  # every head
        assert _continue(one, from_two) == expected
        assert _continue(two, _prefilled(one, "b", prompt)) == expected
        assert leftover_holders(two.engine.block_pool) == []
    assert leftover_holders(one.engine.block_pool) == []


def test_a_dead_rank_fails_the_next_step_and_close_ends(checkpoint_factory):
    model_dir = str(checkpoint_factory("llama"))
    llm = LLM(model_dir, tensor_parallel_size=2, num_kv_blocks=64, cpu_kernels="off")
    prompt = _prompts(llm.engine.spec.vocab_size)[0]
    assert llm.generate([prompt], GREEDY)[0].finish_reason == "length"
    (pid,) = llm.engine.tp.launcher.pids().values()
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(GroupBroken, match="tensor-parallel"):
        llm.generate([prompt], GREEDY)
    assert leftover_holders(llm.engine.block_pool) == []  # the request was aborted
    llm.close()  # returns: the dead rank is reaped, nothing waits on it


def test_a_hung_rank_fails_a_kv_read_and_close_ends(checkpoint_factory, monkeypatch):
    """A rank that stops answering (SIGSTOP: alive, its connections open) makes
    rank 0's KV read fail instead of waiting for it forever; the group is then
    broken as for a dead rank, and close ends the rank without waiting on it."""
    monkeypatch.setattr(group, "KV_TIMEOUT", datetime.timedelta(seconds=1))
    llm = LLM(str(checkpoint_factory("llama")), tensor_parallel_size=2, num_kv_blocks=64,
              cpu_kernels="off")  # fmt: skip
    engine = llm.engine
    engine.add_request("a", _prompts(engine.spec.vocab_size)[1], GREEDY, prefill_only=True)
    while engine.has_unfinished():
        engine.step()
    (pid,) = llm.engine.tp.launcher.pids().values()
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(GroupBroken, match=r"collective failed: .*imed out"):
            engine.export_kv("a")
        engine.release("a")
        assert leftover_holders(engine.block_pool) == []
        with pytest.raises(GroupBroken, match="is broken"):
            llm.generate([[5, 6, 7]], GREEDY)
    finally:
        llm.close()  # kills the stopped rank: it was never told to stop
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_worker_stopped_mid_pass_ends_its_ranks_without_a_stop_broadcast(
    checkpoint_factory, monkeypatch
):
    """The engine thread is in a pass that waits on a stopped rank when the
    worker stops: the loop's join gives up, and closing must not broadcast
    Stop on the group that pass is using (two threads on one gloo group); it
    breaks the group and ends the rank, which ends the pass."""
    monkeypatch.setattr(EngineLoop, "JOIN_TIMEOUT_S", 0.5)
    worker = EngineWorker("w", _config(checkpoint_factory("llama")))
    tp = worker.engine.tp
    in_pass, sent = threading.Event(), []
    run, broadcast = tp.model._run, tp.group.broadcast

    def entering(msg, local):
        in_pass.set()
        return run(msg, local)

    def recording(pg, message=None):
        sent.append((threading.current_thread().name, type(message).__name__))
        return broadcast(pg, message)

    tp.model._run, tp.group.broadcast = entering, recording
    (pid,) = tp.launcher.pids().values()
    prompt = _prompts(worker.engine.spec.vocab_size)[0]

    async def main() -> None:
        worker.start_loop()
        os.kill(pid, signal.SIGSTOP)  # the pass's all-reduce waits for it
        worker.loop.call(lambda e: e.add_request("a", prompt, GREEDY))
        assert await asyncio.to_thread(in_pass.wait, 60)
        worker.stop_loop()
        await asyncio.to_thread(worker.loop._thread.join, 60)  # the pass raised: rank gone

    asyncio.run(main())
    stopper = threading.current_thread().name
    assert [m for name, m in sent if name == stopper] == []  # no Stop, no StopKV
    assert [m for _, m in sent] == ["Forward"]  # the engine thread's pass, alone
    assert "still in a pass" in (tp.group.broken or "")
    assert not worker.loop._thread.is_alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert leftover_holders(worker.engine.block_pool) == []  # the request was aborted


class _SeenRanks(LocalRanks):
    """Local ranks whose specs the test sees; with ``secret``, a rank that was
    handed another one (as a stranger in its place would hold)."""

    def __init__(self, secret: bytes | None = None) -> None:
        super().__init__()
        self.secret = secret
        self.specs = []
        self.started: dict[int, int] = {}

    def launch(self, specs) -> None:
        if self.secret is not None:
            specs = [dataclasses.replace(s, secret=self.secret) for s in specs]
        self.specs = specs
        super().launch(specs)
        self.started = self.pids()


def _config(model_dir) -> EngineConfig:
    return EngineConfig(
        model=str(model_dir), tensor_parallel_size=2, num_kv_blocks=64, cpu_kernels="off"
    )


def test_the_secret_goes_in_the_ranks_spec_and_never_in_the_store(checkpoint_factory, monkeypatch):
    stored: list[bytes] = []
    remove = Rendezvous.remove

    def snapshot(self: Rendezvous) -> None:  # what the store held, at the end of the start
        stored.append(b"".join(_read(p) for p in _files(self.directory)))
        remove(self)

    monkeypatch.setattr(Rendezvous, "remove", snapshot)
    ranks = _SeenRanks()
    engine = LLMEngine(_config(checkpoint_factory("llama")), ranks)
    try:
        (spec,) = ranks.specs
        secret = spec.secret
        assert len(secret) == auth.SECRET_BYTES
        assert str(secret) not in repr(spec) and secret.hex() not in repr(spec)
        assert stored and stored[0]  # the ranks met there
        assert secret not in stored[0] and secret.hex().encode() not in stored[0]
        prompt = _prompts(engine.spec.vocab_size)[0]
        engine.add_request("a", prompt, GREEDY)
        while engine.has_unfinished():
            engine.step()  # the proven groups carry the passes
    finally:
        engine.close()


def test_a_rank_that_cannot_prove_the_secret_is_refused_at_start(checkpoint_factory):
    ranks = _SeenRanks(secret=auth.new_secret())
    with pytest.raises(auth.PeerRefused, match="group 'steps': rank 1 gave a wrong answer"):
        LLMEngine(_config(checkpoint_factory("llama")), ranks)
    (pid,) = ranks.started.values()
    with pytest.raises(ProcessLookupError):  # ended and reaped by the failed start
        os.kill(pid, 0)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _files(directory: str) -> list[str]:
    return [os.path.join(root, f) for root, _, files in os.walk(directory) for f in files]
