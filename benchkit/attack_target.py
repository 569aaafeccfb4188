"""What the attack suite (benchkit/attacks.py) reads from a running
Deployment: the attacker's ``Target``, the honest users' reference (the
engine alone) and the memory of the worker processes."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import ray

from benchkit.attacks import (
    FORGED_PROMPT,
    HONEST_PROMPTS,
    HONEST_SAMPLING,
    SYSTEM_PROMPT,
    Target,
    WorkerEndpoints,
)
from benchkit.deployment import Deployment
from engine.kv_layout import KVLayout


@dataclass(frozen=True)
class Reference:
    """The engine alone, greedy: each prompt's token ids and output tokens."""

    layout: KVLayout
    prompt_tokens: dict[str, list[int]]
    outputs: dict[str, list[int]]


def engine_alone(prompts: list[str] | None = None) -> Reference:
    """Run ``prompts`` (HONEST_PROMPTS and FORGED_PROMPT) through a bare engine."""
    from engine.llm import LLM
    from protocol.sampling import SamplingParams

    prompts = prompts or [*HONEST_PROMPTS, FORGED_PROMPT]
    llm = LLM(None, kv_cache_memory_bytes=32 << 20)
    outs = llm.generate(prompts, SamplingParams(**HONEST_SAMPLING))
    return Reference(
        llm.engine.kv_layout,
        {p: o.prompt_token_ids for p, o in zip(prompts, outs, strict=True)},
        {p: o.token_ids for p, o in zip(prompts, outs, strict=True)},
    )


def target_of(dep: Deployment, user_key: str, ref: Reference) -> Target:
    backend = dep.backend
    handles = backend.prefill.workers + backend.decode.workers
    workers = tuple(
        WorkerEndpoints(h.name, h.role, h.info.kv_address, h.info.outputs, h.info.outputs_local)
        for h in handles
        if h.info is not None
    )
    assert dep.http_url is not None, "the suite needs the HTTP front (server.http_port)"
    return Target(
        address=dep.address,
        http_url=dep.http_url,
        router_id=backend.router_id,
        layout=ref.layout,
        workers=workers,
        pools=(len(backend.prefill.workers), len(backend.decode.workers)),
        user_key=user_key,
        system_tokens=tuple(
            ref.prompt_tokens[next(p for p in HONEST_PROMPTS if SYSTEM_PROMPT in p)]
        ),
        forged_tokens=tuple(ref.prompt_tokens[FORGED_PROMPT]),
    )


def worker_pids(dep: Deployment) -> dict[str, int]:
    """Each worker's process id, by worker name."""
    handles = dep.backend.prefill.workers + dep.backend.decode.workers
    pids = ray.get([h.actor.__ray_call__.remote(lambda _self: os.getpid()) for h in handles])
    return {h.name: pid for h, pid in zip(handles, pids, strict=True)}


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` (Linux /proc), in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for process {pid}")


def cluster_secret(dep: Deployment) -> bytes:
    """The secret the deployment generated at start (what an insider holds)."""
    return dep.backend.streams.transfer.security.secret
