"""A deployment of 16 simulated workers (8 prefill, 8 decode) on local Ray:
the real router, pools, KV transfer and output streams around the simulated
model (engine/simulated.py). Its outputs equal the offline simulated engine
token for token, a disaggregated request equals a colocated one, prefix hits
change nothing, and every worker's pool returns to where it started."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engine import LLM
from protocol.sampling import SamplingParams
from router.client import TandemClient
from router.config import ServeConfig
from tests.deployment_helpers import deployed

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

PROFILE = "llama-3.1-8b-h200"
MAX_TOKENS = 16
KV_MB = 2048  # 1024 blocks of the profiled model's 128 KiB a token
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS, "ignore_eos": True}
CHEAP = {"num_cpus": 0.25}  # a simulated worker sleeps through its steps


def _prompt(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128256, (n,), generator=gen).tolist()


SHARED = _prompt(96, 999)  # a prefix several prompts share
PROMPTS = [_prompt(n, i) for i, n in enumerate([3, 17, 64, 250, 700, 33, 129, 16])]
PROMPTS += [SHARED + _prompt(n, 100 + n) for n in (5, 40, 77)]


def _config(**pools) -> ServeConfig:
    return ServeConfig(
        engine={"simulate": PROFILE, "kv_cache_memory_mb": KV_MB},
        pools={"prefill_resources": CHEAP, "decode_resources": CHEAP, **pools},
        limits={"max_queued_requests": 256},
        transfer={"lease_s": 120},
    )


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The offline simulated engine's outputs."""
    llm = LLM(simulate=PROFILE, kv_cache_memory_bytes=KV_MB << 20)
    params = SamplingParams(**GREEDY)
    return [o.token_ids for o in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def sixteen(ray_cluster):
    with deployed(_config(prefill=8, decode=8)) as d:
        yield d


@pytest.fixture(scope="module")
def colocated(ray_cluster):
    with deployed(_config(mode="colocated", decode=1)) as d:
        yield d


async def _complete_all(address: str, prompts, **sampling):
    async with TandemClient(address) as client:
        return await asyncio.gather(*(client.complete(p, **sampling) for p in prompts))


def test_sixteen_workers_serve_the_offline_engines_tokens(sixteen, reference):
    assert len(sixteen.worker_stats()) == 16
    prompts = PROMPTS * 4
    outs = asyncio.run(_complete_all(sixteen.address, prompts, **GREEDY))
    expected = reference * 4
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    used = {(o.timings.prefill_worker, o.timings.decode_worker) for o in outs}
    assert len({p for p, _ in used}) >= 4 and len({d for _, d in used}) >= 4
    assert sixteen.wait_no_leaks() == {}


def test_prefix_hits_give_the_same_tokens(sixteen, reference):
    shared = PROMPTS[-3:]
    first = asyncio.run(_complete_all(sixteen.address, shared, **GREEDY))
    again = asyncio.run(_complete_all(sixteen.address, shared, **GREEDY))
    assert [o.token_ids for o in first] == [o.token_ids for o in again] == reference[-3:]
    assert sum(o.usage.cached_tokens for o in again) >= 3 * 96
    assert sixteen.wait_no_leaks() == {}


def test_a_disaggregated_request_equals_a_colocated_one(sixteen, colocated, reference):
    disagg = asyncio.run(_complete_all(sixteen.address, PROMPTS, **GREEDY))
    local = asyncio.run(_complete_all(colocated.address, PROMPTS, **GREEDY))
    assert [o.token_ids for o in disagg] == [o.token_ids for o in local] == reference
    assert colocated.wait_no_leaks() == {}


def test_a_resumed_request_goes_on_with_the_same_tokens(sixteen, reference):
    """A client's resume after a lost router (resume_token_ids): the rest of
    the output is the uninterrupted one's."""
    resumed = [ref[:5] for ref in reference[:4]]
    outs = asyncio.run(_complete_resumed(sixteen.address, PROMPTS[:4], resumed))
    assert [o.token_ids for o in outs] == [ref[5:] for ref in reference[:4]]
    assert sixteen.wait_no_leaks() == {}


async def _complete_resumed(address: str, prompts, resumed):
    async with TandemClient(address) as client:
        return await asyncio.gather(
            *(
                client.complete(p, resume_token_ids=r, **GREEDY)
                for p, r in zip(prompts, resumed, strict=True)
            )
        )
