"""Discrete-event simulation of the disaggregated system.

Requests arrive (Poisson, or gamma with a coefficient of variation), go to the
least loaded of P prefill workers (FIFO; a free worker takes the waiting
prompts in order while they fit a token budget), get their first token when
that batch ends (TTFT), wait a KV transfer (bytes / bandwidth + latency), then
join the least loaded of D decode workers at its next step boundary. A decode
step serves every running sequence; its time comes from the profile, given
the batch and the mean context.
"""

from __future__ import annotations

import heapq
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

PrefillCost = Callable[[Sequence[int]], float]
DecodeCost = Callable[[int, float], float]


@dataclass(frozen=True)
class Workload:
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
    prefill_token_budget: int = 512  # as tandem serve; 0: no batching (one prompt per batch)
    max_decode_seqs: int = 256
    kv_bytes_per_token: int = 0
    kv_bandwidth_Bps: float = 10e9
    kv_latency_s: float = 0.0005


@dataclass
class Request:
    id: int
    arrival: float
    prompt_len: int
    output_len: int
    prefill_start: float = 0.0
    first_token: float = 0.0
    finish: float = 0.0
    generated: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def queue_wait(self) -> float:
        return self.prefill_start - self.arrival

    @property
    def tpot(self) -> float:
        if self.output_len <= 1:
            return 0.0
        return (self.finish - self.first_token) / (self.output_len - 1)


@dataclass
class SimResult:
    requests: list[Request]
    ttft_slo_s: float
    tpot_slo_s: float
    makespan_s: float
    ttft: np.ndarray = field(init=False)
    tpot: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.ttft = np.array([r.ttft for r in self.requests])
        self.tpot = np.array([r.tpot for r in self.requests])

    @property
    def attainment(self) -> float:
        ok = (self.ttft <= self.ttft_slo_s) & (self.tpot <= self.tpot_slo_s)
        return float(ok.mean())

    @property
    def goodput(self) -> float:
        """Requests per second that met both SLOs."""
        good = self.attainment * len(self.requests)
        return good / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def mean_queue_wait(self) -> float:
        return float(np.mean([r.queue_wait for r in self.requests]))

    def summary(self) -> dict[str, float]:
        return {
            "attainment": self.attainment,
            "goodput_rps": self.goodput,
            "ttft_p50_ms": float(np.percentile(self.ttft, 50) * 1e3),
            "ttft_p90_ms": float(np.percentile(self.ttft, 90) * 1e3),
            "tpot_p50_ms": float(np.percentile(self.tpot, 50) * 1e3),
            "tpot_p90_ms": float(np.percentile(self.tpot, 90) * 1e3),
        }


def make_requests(workload: Workload, seed: int) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    out = []
    for i in range(workload.num_requests):
        if workload.arrival == "poisson":
            gap = rng.expovariate(workload.rate)
        else:  # gamma gaps with mean 1/rate and the given CV
            shape = 1.0 / workload.cv**2
            gap = rng.gammavariate(shape, 1.0 / (shape * workload.rate))
        t += gap
        out.append(
            Request(i, t, rng.randint(*workload.input_len), rng.randint(*workload.output_len))
        )
    return out


# Event kinds, in the order simultaneous events are handled.
_FINISH_PREFILL, _FINISH_STEP, _ARRIVE, _JOIN_DECODE = range(4)


class _PrefillWorker:
    def __init__(self) -> None:
        self.queue: deque[Request] = deque()
        self.busy = False
        self.load = 0  # prompt tokens queued or in service


class _DecodeWorker:
    def __init__(self) -> None:
        self.running: list[Request] = []
        self.joining: list[Request] = []
        self.busy = False
        self.context = 0  # sum of contexts of the running sequences

    @property
    def load(self) -> int:
        return len(self.running) + len(self.joining)


def simulate(
    workload: Workload,
    system: SystemConfig,
    prefill_cost: PrefillCost,
    decode_cost: DecodeCost,
    *,
    ttft_slo_s: float = float("inf"),
    tpot_slo_s: float = float("inf"),
    seed: int = 0,
    requests: list[Request] | None = None,
) -> SimResult:
    """Run the simulation to the last request's end; deterministic for a seed."""
    if system.num_prefill < 1 or system.num_decode < 1:
        raise ValueError("need at least one prefill and one decode worker")
    reqs = requests if requests is not None else make_requests(workload, seed)
    prefill = [_PrefillWorker() for _ in range(system.num_prefill)]
    decode = [_DecodeWorker() for _ in range(system.num_decode)]
    decode_backlog: deque[Request] = deque()  # every decode worker full
    events: list[tuple[float, int, int, object]] = []
    counter = 0

    def push(t: float, kind: int, payload: object) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, kind, counter, payload))

    def start_prefill(w: _PrefillWorker, now: float) -> None:
        batch = [w.queue.popleft()]
        tokens = batch[0].prompt_len
        budget = system.prefill_token_budget
        while budget and w.queue and tokens + w.queue[0].prompt_len <= budget:
            tokens += w.queue[0].prompt_len
            batch.append(w.queue.popleft())
        for r in batch:
            r.prefill_start = now
        w.busy = True
        push(now + prefill_cost([r.prompt_len for r in batch]), _FINISH_PREFILL, (w, batch))

    def start_step(w: _DecodeWorker, now: float) -> None:
        for r in w.joining:
            w.running.append(r)
            w.context += r.prompt_len + r.generated
        w.joining.clear()
        if not w.running:
            w.busy = False
            return
        w.busy = True
        batch = len(w.running)
        push(now + decode_cost(batch, w.context / batch), _FINISH_STEP, w)

    def place(r: Request, now: float) -> None:
        open_workers = [w for w in decode if w.load < system.max_decode_seqs]
        if not open_workers:
            decode_backlog.append(r)
            return
        w = min(open_workers, key=lambda w: (w.load, w.context))
        w.joining.append(r)
        if not w.busy:
            start_step(w, now)

    for r in reqs:
        push(r.arrival, _ARRIVE, r)
    now = 0.0
    while events:
        now, kind, _, payload = heapq.heappop(events)
        if kind == _ARRIVE:
            r = payload  # type: ignore[assignment]
            w = min(prefill, key=lambda w: w.load)
            w.queue.append(r)
            w.load += r.prompt_len
            if not w.busy:
                start_prefill(w, now)
        elif kind == _FINISH_PREFILL:
            w, batch = payload  # type: ignore[misc]
            for r in batch:
                w.load -= r.prompt_len
                r.first_token = now
                r.generated = 1
                if r.output_len <= 1:
                    r.finish = now
                    continue
                delay = system.kv_latency_s
                if system.kv_bytes_per_token:
                    delay += r.prompt_len * system.kv_bytes_per_token / system.kv_bandwidth_Bps
                push(now + delay, _JOIN_DECODE, r)
            w.busy = False
            if w.queue:
                start_prefill(w, now)
        elif kind == _JOIN_DECODE:
            place(payload, now)  # type: ignore[arg-type]
        else:  # _FINISH_STEP
            w = payload  # type: ignore[assignment]
            still = []
            for r in w.running:
                r.generated += 1
                w.context += 1
                if r.generated >= r.output_len:
                    r.finish = now
                    w.context -= r.prompt_len + r.generated
                else:
                    still.append(r)
            w.running = still
            while decode_backlog and w.load < system.max_decode_seqs:
                w.joining.append(decode_backlog.popleft())
            start_step(w, now)
    return SimResult(reqs, ttft_slo_s, tpot_slo_s, makespan_s=now)
