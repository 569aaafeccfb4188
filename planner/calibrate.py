"""The serving path's own costs, measured on an idle deployment.

A profile times the forward pass. A request also pays costs outside it:
the router's work and its call to the worker, the KV push's handshake and
commit, the engine thread's wake-up, the output stream to the client (once
per request), and each engine step's work around the forward pass (the
scheduler, sampling, writing the step's outputs). The probe measures them:
a few requests, each alone on the deployment (nothing queues, no batch),
prompts of several lengths. Then

- ``step_s``: the mean of measured TPOT less the model's (without overheads);
- ``fixed_s``: the mean of measured TTFT less the model's, with ``step_s``
  already counted in the prefill steps, over the requests a prefill worker
  prefills (call, push);
- ``local_s``: the same over requests whose decode worker prefills a short
  tail after a prefix it holds (no prefill worker, no push): the probe
  sends each prompt twice, the second time with a short tail.

The model charges ``fixed_s`` (or ``local_s``) once per request on the way
to the prefill (``rpc_latency_s``, ``local_latency_s``) and ``step_s`` on
every engine step (``step_overhead_s``). They are measured on the probe only, never on the
traces whose predictions they then serve.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace

import numpy as np

from planner.simulator import SystemConfig, simulate
from planner.trace import Trace, TraceRequest
from planner.verify import Measured

PROBE_LENGTHS = (64, 256, 1024, 2048, 64, 256, 1024, 2048)
PROBE_TAIL = 48  # tokens after a repeated prompt: prefilled on the decode worker


@dataclass(frozen=True)
class Calibration:
    fixed_s: float  # per request, outside every engine step
    step_s: float  # per engine step, beyond the profile's time
    local_s: float | None = None  # per request prefilled on its decode worker

    def apply(self, system: SystemConfig) -> SystemConfig:
        return replace(
            system,
            rpc_latency_s=max(0.0, self.fixed_s),
            local_latency_s=None if self.local_s is None else max(0.0, self.local_s),
            kv_latency_s=0.0,
            stream_latency_s=0.0,
            step_overhead_s=max(0.0, self.step_s),
        )


def probe_trace(vocab: int, seed: int = 0, gap_s: float = 1.0, output_len: int = 24) -> Trace:
    """Requests far enough apart that each runs alone: each prompt, then the
    same prompt with a short tail."""
    rng = random.Random(seed)
    reqs = []
    for n in PROBE_LENGTHS:
        prompt = tuple(rng.choices(range(1, vocab), k=n))
        tail = tuple(rng.choices(range(1, vocab), k=PROBE_TAIL))
        for p in (prompt, prompt + tail):
            reqs.append(TraceRequest(gap_s * (len(reqs) + 1), p, output_len))
    return Trace("probe", tuple(reqs))


def fit(system: SystemConfig, profile, trace: Trace, measured: Measured) -> Calibration:
    """The overheads that make the model meet the probe's measurements on
    average (``profile``: planner.profile.Profile)."""
    if not measured.index:
        raise ValueError("calibration probe: no request was measured")
    bare = replace(
        system, rpc_latency_s=0.0, kv_latency_s=0.0, stream_latency_s=0.0, step_overhead_s=0.0
    )

    def model(sys_: SystemConfig):
        res = simulate(
            trace, sys_, profile.prefill_s, profile.decode_step_s,
            step_cost=getattr(profile, "step_s", None),
        )  # fmt: skip
        return res.requests

    idx = measured.index
    reqs = model(bare)
    step = float(np.mean([m - reqs[i].tpot for i, m in zip(idx, measured.tpot_s, strict=True)]))
    stepped = model(replace(bare, step_overhead_s=max(0.0, step)))
    gaps = {True: [], False: []}
    for i, m in zip(idx, measured.ttft_s, strict=True):
        gaps[stepped[i].local].append(m - stepped[i].ttft)
    if not gaps[False]:
        raise ValueError("calibration probe: no request went through a prefill worker")
    local = float(np.mean(gaps[True])) if gaps[True] else None
    return Calibration(fixed_s=float(np.mean(gaps[False])), step_s=step, local_s=local)
