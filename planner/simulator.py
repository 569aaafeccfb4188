"""Discrete-event model of a disaggregated deployment, on a trace.

The path of each request, as the real one (docs/design.md):

1. Admission (router/admission.py): the request needs the blocks of its
   longest length (prompt + max_tokens) on one decode worker; it waits,
   first come first served, until a decode worker's room (its blocks less
   what the requests admitted there need) holds them.
2. Routing (router/prefix_routing.py): each worker's count of the prompt's
   leading blocks in its prefix cache; a worker's score is that count less
   ``load_weight_blocks`` per request in flight, ties to the least loaded.
   When the chosen decode worker holds a prefix and at most
   ``local_prefill_tokens`` are left, it prefills the tail itself; else a
   prefill worker does, after pulling the prefix from the worker holding
   most of it when that is ``pull_min_blocks`` more than its own.
3. Prefill (planner/workers.py): the engine's step loop with a token
   budget, chunked, batched, skipping cached leading blocks.
4. KV push: the decode worker takes the leading blocks its cache holds; the
   rest cost ``kv_latency_s + bytes / kv_bandwidth_Bps``.
5. Decode: the first token goes out when the push commits, or at the end of
   the decode worker's step under way; the request joins the next step. A
   step serves every running sequence; its time comes from the profile for
   the batch and mean context.

TTFT is arrival to the first token at the client (``rpc_latency_s`` for the
call to the worker, ``stream_latency_s`` from the decode worker's stream);
TPOT is (last token - first token) / (tokens - 1). The reserve rule means
admission never preempts a running sequence, so the model has no preemption:
a full pool shows as admission wait. Deterministic for a trace.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from planner.cluster import ClusterModel
from planner.trace import Trace, TraceRequest, independent
from planner.workers import DecodeCost, PrefillCost, Seq, StepCost, StepFn

__all__ = [
    "DecodeCost", "PrefillCost", "SimResult", "SystemConfig", "Workload",
    "make_trace", "simulate",
]  # fmt: skip

UNLIMITED_BLOCKS = 1 << 40


@dataclass(frozen=True)
class Workload:
    """A load described by distributions; ``make_trace`` draws its trace."""

    rate: float  # requests per second
    input_len: tuple[int, int] = (256, 256)  # uniform [lo, hi]; lo == hi: fixed
    output_len: tuple[int, int] = (64, 64)
    arrival: str = "poisson"  # "poisson" or "gamma"
    cv: float = 1.0  # gamma arrivals: coefficient of variation of the gaps
    num_requests: int = 500

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError("rate must be > 0")
        for name in ("input_len", "output_len"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {lo}:{hi}")
        if self.arrival not in ("poisson", "gamma"):
            raise ValueError(f"arrival must be poisson or gamma, got {self.arrival!r}")
        if self.cv <= 0 or self.num_requests < 1:
            raise ValueError("cv must be > 0 and num_requests >= 1")


@dataclass(frozen=True)
class SystemConfig:
    num_prefill: int
    num_decode: int
    prefill_token_budget: int = 512  # engine.max_num_batched_tokens; 0: a whole prompt a step
    decode_token_budget: int = 512
    max_decode_seqs: int = 256
    max_prefill_seqs: int = 256
    block_size: int = 16
    prefill_kv_blocks: int = UNLIMITED_BLOCKS  # a prefill worker's pool
    decode_kv_blocks: int = UNLIMITED_BLOCKS  # a decode worker's pool (admission room)
    kv_bytes_per_token: int = 0  # bytes a transfer moves per token
    kv_bandwidth_Bps: float = 10e9
    kv_latency_s: float = 0.0005  # a push's or pull's fixed cost (handshake, commit)
    rpc_latency_s: float = 0.0  # router to worker: the Ray call
    local_latency_s: float | None = None  # the same, prefilled on the decode worker (None: rpc's)
    stream_latency_s: float = 0.0  # decode worker's stream to the client
    step_overhead_s: float = 0.0  # an engine step's time beyond the profile's (the loop, outputs)
    prefix_routing: bool = True
    local_prefill_tokens: int = 256
    load_weight_blocks: float = 4.0
    pull_min_blocks: int = 2


@dataclass
class SimResult:
    requests: list[Seq]
    ttft_slo_s: float
    tpot_slo_s: float
    makespan_s: float
    ttft: np.ndarray = field(init=False)
    tpot: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        done = [r for r in self.requests if not r.failed]
        self.ttft = np.array([r.ttft for r in done])
        self.tpot = np.array([r.tpot for r in done])

    @property
    def failed(self) -> int:
        return sum(r.failed for r in self.requests)

    @property
    def attainment(self) -> float:
        ok = (self.ttft <= self.ttft_slo_s) & (self.tpot <= self.tpot_slo_s)
        return float(ok.sum()) / len(self.requests)

    @property
    def goodput(self) -> float:
        """Requests per second that met both SLOs."""
        good = self.attainment * len(self.requests)
        return good / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def mean_queue_wait(self) -> float:
        return float(np.mean([r.queue_wait for r in self.requests if not r.failed]))

    @property
    def prefix_hit_share(self) -> float:
        """Prompt tokens served from a cache, of all prompt tokens."""
        total = sum(r.prompt_len for r in self.requests)
        return sum(r.cached_tokens for r in self.requests) / total if total else 0.0

    def summary(self) -> dict[str, float]:
        def pct(a: np.ndarray, q: float) -> float:
            return float(np.percentile(a, q) * 1e3) if len(a) else float("nan")

        return {
            "attainment": self.attainment,
            "goodput_rps": self.goodput,
            "ttft_p50_ms": pct(self.ttft, 50),
            "ttft_p90_ms": pct(self.ttft, 90),
            "tpot_p50_ms": pct(self.tpot, 50),
            "tpot_p90_ms": pct(self.tpot, 90),
        }


def make_trace(workload: Workload, seed: int, vocab: int = 1000) -> Trace:
    return independent(
        "workload", rate=workload.rate, num_requests=workload.num_requests,
        input_len=workload.input_len, output_len=workload.output_len, vocab=vocab,
        seed=seed, cv=workload.cv if workload.arrival == "gamma" else 1.0,
    )  # fmt: skip


def _unique_prompts(workload: Workload, seed: int) -> list[TraceRequest]:
    """The workload's arrivals and lengths, with prompts no cache can share
    (cheap to draw for long closed-form runs)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(workload.num_requests):
        if workload.arrival == "poisson":
            t += rng.expovariate(workload.rate)
        else:  # gamma gaps with mean 1/rate and the given CV
            shape = 1.0 / workload.cv**2
            t += rng.gammavariate(shape, 1.0 / (shape * workload.rate))
        n, out_len = rng.randint(*workload.input_len), rng.randint(*workload.output_len)
        out.append(TraceRequest(t, (i + 1,) * n, out_len))
    return out


def simulate(
    workload: Workload | Trace | None,
    system: SystemConfig,
    prefill_cost: PrefillCost,
    decode_cost: DecodeCost,
    *,
    ttft_slo_s: float = float("inf"),
    tpot_slo_s: float = float("inf"),
    seed: int = 0,
    step_cost: StepFn | None = None,
    resident: Sequence[TraceRequest] = (),
) -> SimResult:
    """Run the model to the last request's end. A ``Workload`` is drawn with
    ``seed`` (prompts share nothing); a ``Trace`` runs as it is.
    ``step_cost(lengths, contexts, decode batch, decode context)``: one
    engine step's seconds (``Profile.step_s``), else the two costs added.
    ``resident``: requests decoding when the trace starts (the autoscaler's
    view of its decode pool now; ``output_len``: the tokens each has left),
    which load the decode steps and are not in the result."""
    if system.num_prefill < 1 or system.num_decode < 1:
        raise ValueError("need at least one prefill and one decode worker")
    if isinstance(workload, Trace):
        reqs: Sequence[TraceRequest] = workload.requests
    elif isinstance(workload, Workload):
        reqs = _unique_prompts(workload, seed)
    else:
        raise TypeError("simulate needs a Workload or a Trace")
    seqs = [
        Seq(i, r.arrival_s, r.prompt, r.output_len, system.block_size) for i, r in enumerate(reqs)
    ]
    model = ClusterModel(system, StepCost(prefill_cost, decode_cost, step_cost))
    running = [
        Seq(-1 - i, 0.0, r.prompt, r.output_len + 1, system.block_size)
        for i, r in enumerate(resident)
    ]
    end = model.run(seqs, running)
    return SimResult(seqs, ttft_slo_s, tpot_slo_s, makespan_s=end)
