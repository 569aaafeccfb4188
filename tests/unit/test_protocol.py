"""protocol/: torch-free, and its worker types read what the workers send today."""

from __future__ import annotations

import asyncio
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from protocol import RequestOutput, SamplingParams, WorkerHealth, WorkerInfo, WorkerStats

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


def test_protocol_and_the_router_tokenizer_import_no_torch():
    code = (
        "import sys\n"
        "import protocol, protocol.sampling, protocol.outputs, protocol.workers\n"
        "import router.tokenizer\n"
        "protocol.SamplingParams(temperature=0.5, stop=['x'])\n"
        "loaded = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=120)


def test_the_engine_names_are_the_protocol_types():
    import engine
    from engine.sampling import SamplingParams as EngineSamplingParams
    from engine.sequence import RequestOutput as EngineRequestOutput
    from worker.base import WorkerHealth as BaseWorkerHealth

    assert engine.SamplingParams is EngineSamplingParams is SamplingParams
    assert engine.RequestOutput is EngineRequestOutput is RequestOutput
    assert BaseWorkerHealth is WorkerHealth


# -- worker messages ----------------------------------------------------------


def stats(**changes) -> WorkerStats:
    base = WorkerStats(
        free_blocks=127,
        total_blocks=128,
        initial_free_blocks=127,
        num_holders=1,
        initial_num_holders=1,
        num_requests=0,
        num_running=0,
        num_waiting=0,
        num_steps=10,
        num_preemptions=0,
    )
    return dataclasses.replace(base, **changes)


def test_a_worker_is_idle_only_with_no_request_no_extra_holder_and_its_blocks_free():
    assert stats().idle
    assert not stats(num_requests=1).idle
    assert not stats(num_holders=2).idle  # a lease or a pin left behind
    assert not stats(free_blocks=126).idle
    assert stats(free_blocks=90).used_blocks == 38


def test_speculative_acceptance_rate():
    assert stats().spec_acceptance_rate is None
    assert stats(spec_proposed_tokens=40, spec_accepted_tokens=30).spec_acceptance_rate == 0.75


def test_worker_messages_are_frozen():
    health = WorkerHealth("decode-0", "inc", True, 10, 12, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        health.started = False  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats().free_blocks = 3  # type: ignore[misc]


# -- against the workers themselves -------------------------------------------


def test_the_workers_describe_themselves_with_the_types(llama_dir):
    from decode_pool.worker import DecodeWorker
    from engine import EngineConfig
    from prefill_pool.worker import PrefillWorker

    config = EngineConfig(model=str(llama_dir), num_kv_blocks=16)

    async def run():
        prefill, decode = PrefillWorker("prefill-0", config), DecodeWorker("decode-0", config)
        await prefill.start()
        await decode.start()
        try:
            p_info, d_info = prefill.describe(), decode.describe()
            p_stats, d_stats = prefill.stats(), decode.stats()
            health = await prefill.health()
        finally:
            await prefill.stop()
            await decode.stop()
        return p_info, d_info, p_stats, d_stats, health

    p_info, d_info, p_stats, d_stats, health = asyncio.run(run())
    for info in (p_info, d_info):
        assert isinstance(info, WorkerInfo) and info.kv_address.startswith("127.0.0.1:")
        assert info.max_model_len > 0 and Path(info.model_dir) == llama_dir
        assert info.outputs is not None  # every worker streams (cache events at least)
    assert p_info.model_fingerprint == d_info.model_fingerprint
    for s in (p_stats, d_stats):
        assert isinstance(s, WorkerStats) and s.idle and s.total_blocks == 16
    assert isinstance(health, WorkerHealth) and health.name == "prefill-0" and health.started


def test_a_decode_start_round_trips_and_refuses_what_the_stream_cannot_carry():
    import json

    from protocol.decode_start import BadStart, DecodeStart, FirstToken
    from protocol.outputs import TokenLogprobs

    start = DecodeStart("router-a", 12, SamplingParams(max_tokens=4))
    assert DecodeStart.decode(start.encode()) == start
    first = FirstToken(" x", [TokenLogprobs(5, -0.5, [(5, -0.5)])], 3, 1)
    assert FirstToken.decode(first.encode()) == first
    good = json.loads(start.encode())
    for field, bad in [("num_prompt_tokens", 0), ("router_id", 3), ("params", {"max_tokens": -1})]:
        with pytest.raises(BadStart):
            DecodeStart.decode(json.dumps({**good, field: bad}).encode())
    good = json.loads(first.encode())
    for field, bad in [
        ("finish_reason", 7),
        ("finish_reason", "abort"),
        ("text", "\ud800"),
        ("num_output_tokens", 0),
        ("num_output_tokens", True),
        ("num_cached_tokens", -1),
    ]:
        with pytest.raises(BadStart):
            FirstToken.decode(json.dumps({**good, field: bad}).encode())
    for kind in (DecodeStart, FirstToken):
        with pytest.raises(BadStart):
            kind.decode(b"not json")
