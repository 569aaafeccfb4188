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

PREFILL_INFO = {
    "name": "prefill-0",
    "max_model_len": 4096,
    "vocab_size": 32000,
    "model_fingerprint": "ad78cfd3ba8b6620ffbc781465ea151b",
    "incarnation": "400dca4a7d6143e6b994f42e53ee414d",
    "kv": "10.0.0.5:41001",
}
DECODE_INFO = {
    **PREFILL_INFO,
    "name": "decode-0",
    "kv": "10.0.0.6:41002",
    "outputs": "10.0.0.6:41003",
    "outputs_local": "/tmp/tandem-out-41003.sock",
    "host_id": "boot-id-1234",
}
BASE_STATS = {
    "free_blocks": 90,
    "total_blocks": 128,
    "initial_free_blocks": 127,
    "num_requests": 3,
    "num_running": 2,
    "num_waiting": 1,
    "num_steps": 1000,
    "num_preemptions": 4,
    "spec_proposed_tokens": 40,
    "spec_accepted_tokens": 30,
    "spec_emitted_tokens": 40,
}
PREFILL_STATS = {
    **BASE_STATS,
    "kv_bytes_pushed": 1 << 20,
    "kv_bytes_pulled": 4096,
}


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


# -- WorkerInfo ---------------------------------------------------------------


def test_worker_info_of_a_prefill_worker():
    info = WorkerInfo.from_dict(PREFILL_INFO)
    assert info.name == "prefill-0" and info.max_model_len == 4096
    assert info.kv_address == "10.0.0.5:41001"
    assert info.outputs is None and info.outputs_local is None and info.host_id is None
    assert not info.serves_outputs
    assert info.to_dict() == PREFILL_INFO


def test_worker_info_of_a_decode_worker():
    info = WorkerInfo.from_dict({**DECODE_INFO, "some_future_key": 1})
    assert info.serves_outputs and info.outputs == "10.0.0.6:41003"
    assert info.outputs_local == "/tmp/tandem-out-41003.sock" and info.host_id == "boot-id-1234"
    assert info.to_dict() == DECODE_INFO


def test_worker_info_empty_addresses_are_none():
    wire = {**DECODE_INFO, "outputs_local": "", "host_id": ""}
    info = WorkerInfo.from_dict(wire)
    assert info.outputs_local is None and info.host_id is None
    assert info.to_dict() == wire  # WorkerAddresses' '' again
    assert WorkerInfo.from_dict({**PREFILL_INFO, "kv": ""}).kv_address is None


def test_worker_info_needs_the_identity_fields_and_is_frozen():
    with pytest.raises(ValueError, match="lacks model_fingerprint, incarnation"):
        WorkerInfo.from_dict({"name": "x", "max_model_len": 1, "vocab_size": 1})
    info = WorkerInfo.from_dict(PREFILL_INFO)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.name = "other"  # type: ignore[misc]
    assert info == WorkerInfo.from_dict(dict(PREFILL_INFO)) and hash(info)


# -- WorkerStats --------------------------------------------------------------


def test_worker_stats_of_a_prefill_worker():
    stats = WorkerStats.from_dict({**PREFILL_STATS, "role": "prefill"})  # the router adds role
    assert stats.kv_bytes_pushed == 1 << 20 and stats.kv_bytes_pulled == 4096
    assert stats.used_blocks == 38 and not stats.idle
    assert stats.spec_acceptance_rate == 0.75
    assert stats.to_dict() == PREFILL_STATS


def test_worker_stats_of_a_decode_worker_default_the_prefill_counters():
    stats = WorkerStats.from_dict(BASE_STATS)
    assert (stats.kv_bytes_pushed, stats.kv_bytes_pulled) == (0, 0)
    idle = dataclasses.replace(stats, num_requests=0, free_blocks=127)
    assert idle.idle
    no_spec = {k: v for k, v in BASE_STATS.items() if not k.startswith("spec_")}
    assert WorkerStats.from_dict(no_spec).spec_acceptance_rate is None


def test_worker_stats_refuse_missing_and_non_integer_counters():
    with pytest.raises(ValueError, match="lack num_steps"):
        WorkerStats.from_dict({k: v for k, v in BASE_STATS.items() if k != "num_steps"})
    for bad in (1.5, "3", True, None):
        with pytest.raises(ValueError, match="free_blocks must be an int"):
            WorkerStats.from_dict({**BASE_STATS, "free_blocks": bad})


def test_worker_health_is_frozen():
    health = WorkerHealth("decode-0", "inc", True, 10, 12, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        health.started = False  # type: ignore[misc]


# -- against the workers themselves -------------------------------------------


def test_the_types_cover_what_the_workers_send(llama_dir):
    from decode_pool.worker import DecodeWorker, WorkerAddresses
    from engine import EngineConfig
    from engine.spec.decoder import spec_stats
    from prefill_pool.worker import PrefillWorker

    config = EngineConfig(model=str(llama_dir), num_kv_blocks=16)
    fields = {f.name for f in dataclasses.fields(WorkerStats)}
    assert set(spec_stats(None)) <= fields

    prefill = PrefillWorker("prefill-0", config)
    assert set(prefill.stats()) == fields
    assert WorkerStats.from_dict(prefill.stats()).to_dict() == prefill.stats()
    wire = {**prefill.describe(), "kv": "127.0.0.1:5000"}  # the address exists once started
    assert WorkerInfo.from_dict(wire).to_dict() == wire
    health = asyncio.run(prefill.health())
    assert isinstance(health, WorkerHealth) and health.name == "prefill-0"

    decode = DecodeWorker("decode-0", config)
    stats = WorkerStats.from_dict(decode.stats())
    assert stats.to_dict() == {**decode.stats(), **dict.fromkeys(fields - set(decode.stats()), 0)}
    addresses = WorkerAddresses("127.0.0.1:5001", "127.0.0.1:5002", "/tmp/s.sock", "host")
    wire = {**decode.describe(), **dataclasses.asdict(addresses)}  # DecodeActor.start
    info = WorkerInfo.from_dict(wire)
    assert info.kv_address == addresses.kv and info.serves_outputs
    assert info.to_dict() == wire
