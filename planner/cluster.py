"""The event loop of the model (planner/simulator.py): the router's
admission and routing, and the workers' steps, pushes and commits, in
time order. Stages and their rules are in planner/simulator.py."""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from typing import TYPE_CHECKING

from planner.blocks import blocks_for
from planner.workers import Seq, StepCost, WorkerModel

if TYPE_CHECKING:
    from planner.simulator import SystemConfig

# Event kinds, in the order simultaneous events are handled.
# An idle worker starts its step after every call of the same instant, as the
# engine thread runs the calls waiting before it steps (_KICK last).
_STEP_END, _PUSH_DONE, _AT_PREFILL, _AT_DECODE, _ARRIVE, _KICK = range(6)


class ClusterModel:
    def __init__(self, system: SystemConfig, cost: StepCost) -> None:
        s = system
        self.s = s
        self.cost = cost
        self.prefill = [
            WorkerModel(f"p{i}", s.prefill_kv_blocks, s.prefill_token_budget, s.max_prefill_seqs)
            for i in range(s.num_prefill)
        ]
        self.decode = [
            WorkerModel(f"d{i}", s.decode_kv_blocks, s.decode_token_budget, s.max_decode_seqs)
            for i in range(s.num_decode)
        ]
        self.queue: deque[Seq] = deque()  # admission
        self.events: list[tuple[float, int, int, object]] = []
        self.counter = itertools.count()
        self.rr = itertools.count()  # the fallback policy's tie breaker
        self.steps: dict[WorkerModel, tuple[list[tuple[Seq, int]], list[Seq]]] = {}
        self.dest: dict[Seq, WorkerModel] = {}  # where a prefill's KV goes

    def at(self, t: float, kind: int, payload: object) -> None:
        heapq.heappush(self.events, (t, kind, next(self.counter), payload))

    def run(self, seqs: list[Seq], resident: list[Seq] | None = None) -> float:
        """``resident``: sequences decoding at t=0 (already admitted, their
        first token out), spread over the decode workers."""
        for s in resident or ():
            self.place_resident(s)
        for s in seqs:
            self.at(s.arrival, _ARRIVE, s)
        now = 0.0
        while self.events:
            now, kind, _, payload = heapq.heappop(self.events)
            if kind == _ARRIVE:
                self.queue.append(payload)  # type: ignore[arg-type]
                self.admit(now)
            elif kind == _AT_PREFILL:
                s, p, pulled = payload  # type: ignore[misc]
                p.cache.touch(s.keys[:pulled])
                p.cache.hold(blocks_for(s.prompt_len, s.block_size))
                p.waiting.append(s)
                self.kick(p, now)
            elif kind == _AT_DECODE:
                s, d = payload  # type: ignore[misc]
                d.waiting.append(s)
                self.kick(d, now)
            elif kind == _PUSH_DONE:
                self.commit(*payload, now)  # type: ignore[misc]
            elif kind == _KICK:
                w = payload  # type: ignore[assignment]
                w.kick_pending = False
                if not w.busy:
                    self.start_step(w, now)
            else:
                self.end_step(payload, now)  # type: ignore[arg-type]
        return now

    def place_resident(self, s: Seq) -> None:
        d = min(self.decode, key=lambda w: w.in_flight)
        s.admitted = s.first_token = s.arrival
        s.computed, s.generated = s.prompt_len, 1
        d.reserved += s.final_blocks
        d.cache.hold(s.final_blocks)
        d.in_flight += 1
        d.running.append(s)
        self.kick(d, s.arrival)

    # ---- router ----------------------------------------------------------

    def admit(self, now: float) -> None:
        while self.queue:
            s = self.queue[0]
            if s.final_blocks > self.s.decode_kv_blocks:
                s.failed = True  # INVALID_ARGUMENT: fits no decode worker's pool
                self.queue.popleft()
                continue
            fits = [d for d in self.decode if d.room() >= s.final_blocks]
            if not fits:
                return
            self.queue.popleft()
            self.route(s, fits, now)

    def best(self, workers: list[WorkerModel], cached: dict[WorkerModel, int]) -> WorkerModel:
        if cached:
            w = self.s.load_weight_blocks
            scores = {x: cached.get(x, 0) - w * x.in_flight for x in workers}
            top = max(scores.values())
            workers = [x for x in workers if scores[x] == top]
        least = min(x.in_flight for x in workers)
        tied = [x for x in workers if x.in_flight == least]
        return tied[next(self.rr) % len(tied)]

    def route(self, s: Seq, fits: list[WorkerModel], now: float) -> None:
        cached: dict[WorkerModel, int] = {}
        if self.s.prefix_routing:
            for w in (*self.prefill, *self.decode):
                n = w.cache.leading(s.keys)
                if n:
                    cached[w] = n
        d = self.best(fits, cached)
        s.admitted = now
        d.reserved += s.final_blocks
        d.cache.hold(s.final_blocks)
        d.in_flight += 1
        d_blocks = cached.get(d, 0)
        tail = s.prompt_len - d_blocks * s.block_size
        if d_blocks and self.s.local_prefill_tokens and tail <= self.s.local_prefill_tokens:
            s.local = True
            lat = self.s.rpc_latency_s if self.s.local_latency_s is None else self.s.local_latency_s
            self.at(now + lat, _AT_DECODE, (s, d))
            return
        p = self.best(self.prefill, cached)
        p.in_flight += 1
        have = cached.get(p, 0)
        holders = [w for w in (*self.prefill, *self.decode) if w is not p]
        most = max((cached.get(w, 0) for w in holders), default=0)
        delay = self.s.rpc_latency_s
        pulled = 0
        if self.s.pull_min_blocks and most - have >= self.s.pull_min_blocks:
            delay += self.transfer_s(most - have)
            pulled = most
        self.dest[s] = d
        self.at(now + delay, _AT_PREFILL, (s, p, pulled))

    def transfer_s(self, blocks: int) -> float:
        s = self.s
        return s.kv_latency_s + blocks * s.block_size * s.kv_bytes_per_token / s.kv_bandwidth_Bps

    # ---- workers ---------------------------------------------------------

    def kick(self, w: WorkerModel, now: float) -> None:
        if not w.busy and not w.kick_pending:
            w.kick_pending = True
            self.at(now, _KICK, w)

    def start_step(self, w: WorkerModel, now: float) -> None:
        chunks, decodes = w.plan_step(now)
        if not chunks and not decodes:
            w.busy = False
            return
        ctx = sum(x.prompt_len + x.generated for x in decodes) / len(decodes) if decodes else 0.0
        w.busy = True
        lengths, contexts = [n for _, n in chunks], [x.computed for x, _ in chunks]
        w.step_end = (
            now + self.s.step_overhead_s + self.cost.step_s(lengths, contexts, len(decodes), ctx)
        )
        self.steps[w] = (chunks, decodes)
        self.at(w.step_end, _STEP_END, w)

    def end_step(self, w: WorkerModel, now: float) -> None:
        chunks, decodes = self.steps.pop(w)
        for s in decodes:
            s.generated += 1
            if s.generated >= s.output_len:
                self.finish(s, w, now)
        for s, n in chunks:
            s.computed += n
            if s.computed < s.prompt_len:
                continue
            s.prefill_end = now
            if s.local:
                self.first_token(s, w, now, running=True)
            else:
                self.push(s, w, now)
        for s in w.joining:
            self.first_token(s, w, now)
        w.joining.clear()
        self.start_step(w, now)

    def push(self, s: Seq, p: WorkerModel, now: float) -> None:
        p.running.remove(s)
        p.cache.touch(s.keys)
        d = self.dest.pop(s)
        held = d.cache.leading(s.keys)
        s.pushed_blocks = blocks_for(s.prompt_len, s.block_size) - held
        d.cache.touch(s.keys[:held])
        self.at(now + self.transfer_s(s.pushed_blocks), _PUSH_DONE, (s, p, d))

    def commit(self, s: Seq, p: WorkerModel, d: WorkerModel, now: float) -> None:
        p.in_flight -= 1
        p.cache.release(blocks_for(s.prompt_len, s.block_size))
        d.cache.touch(s.keys)
        if d.busy:
            d.joining.append(s)  # first token when the step under way ends
        else:
            self.first_token(s, d, now)
            self.kick(d, now)

    def first_token(self, s: Seq, d: WorkerModel, now: float, running: bool = False) -> None:
        s.first_token = now + self.s.stream_latency_s
        s.generated = 1
        s.computed = s.prompt_len
        if not running:
            d.running.append(s)
        if s.output_len <= 1:
            self.finish(s, d, now)

    def finish(self, s: Seq, d: WorkerModel, now: float) -> None:
        s.finish = now + self.s.stream_latency_s
        if s in d.running:
            d.running.remove(s)
        d.reserved -= s.final_blocks
        d.in_flight -= 1
        d.cache.release(s.final_blocks)
        d.cache.touch(s.keys)
        d.cache.store_unmatched((s.prompt_len + s.generated) // s.block_size - len(s.keys))
        self.admit(now)
