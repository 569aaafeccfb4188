"""The backend that serves requests on Ray pools.

Disaggregated: the prefill worker computes the prompt, samples the first
token and pushes the KV blocks to the chosen decode worker; the router
then starts the decode there and reads its tokens from that worker's
output stream. Colocated: one worker does both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator

import grpc

from decode_pool.worker import DecodeRequest
from engine.hashing import root_hash
from engine.index import BlockIndex, InMemoryIndex, KVEvent
from engine.loader import resolve_model_dir
from engine.logfmt import log_event
from engine.sequence import RequestOutput, TokenLogprobs
from engine.transfer.grpc_server import message_limits
from prefill_pool.worker import PrefillRequest, PrefillResult
from protos.tandem.v1 import worker_pb2, worker_pb2_grpc
from router.backend import GenerateInput, GenerateResult, TokenDelta
from router.policies import make_policy
from router.pool_manager import WorkerHandle, WorkerPool
from router.prefix_routing import PrefixRouter, RoutePlan
from tandem_cli.config import ServeConfig

log = logging.getLogger(__name__)


class RayBackend:
    def __init__(self, config: ServeConfig) -> None:
        self.config = config
        self.router_id = f"router-{uuid.uuid4().hex[:8]}"
        self.colocated = config.mode == "colocated"
        self.prefill = WorkerPool("prefill", config)
        self.decode = WorkerPool("colocated" if self.colocated else "decode", config)
        self.policy = make_policy(config.routing_policy)
        self.tokenizer = None
        self.max_model_len = 0
        self.vocab_size = 0
        # request id -> (its deltas, the decode worker that streams them)
        self._queues: dict[str, tuple[asyncio.Queue[worker_pb2.RequestDelta], WorkerHandle]] = {}
        self._subscriptions: dict[str, asyncio.Task] = {}  # decode worker name -> reader
        self._scale_lock = asyncio.Lock()
        self._channels: dict[str, grpc.aio.Channel] = {}  # decode worker name -> channel
        self.index: BlockIndex | None = None
        self.routing: PrefixRouter | None = None
        self._watcher: asyncio.Task | None = None
        self._missing: dict[str, int] = {}  # role -> dead workers not replaced yet

    async def start(self) -> None:
        from transformers import AutoTokenizer

        model_dir = resolve_model_dir(self.config.model)  # builds the default model once
        with contextlib.suppress(OSError, ValueError):
            self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or model_dir)
        if not self.colocated:
            await self.prefill.scale_to(self.config.prefill)
        await self.decode.scale_to(self.config.decode)
        workers = self.prefill.workers + self.decode.workers
        self.max_model_len = min(w.info["max_model_len"] for w in workers)
        self.vocab_size = workers[0].info["vocab_size"]
        self.index = self._make_index(workers[0].info["model_fingerprint"])
        self.routing = PrefixRouter(
            self.index,
            self.config.block_size,
            root_hash(workers[0].info["model_fingerprint"], self.config.block_size),
            self.policy,
            enabled=self.config.prefix_routing and self.config.enable_prefix_caching,
            load_weight_blocks=self.config.load_weight_blocks,
            local_prefill_tokens=self.config.local_prefill_tokens,
            pull_min_blocks=self.config.pull_min_blocks,
        )
        for worker in self.decode.workers:
            await self._subscribe(worker)
        if self.config.worker_check_interval_s > 0:
            self._watcher = asyncio.create_task(
                self._watch_workers(self.config.worker_check_interval_s)
            )

    def _make_index(self, fingerprint: str) -> BlockIndex:
        if self.config.redis_url is None:
            return InMemoryIndex()
        from engine.index import RedisIndex, redis_prefix

        return RedisIndex(self.config.redis_url, redis_prefix(self.config.deployment, fingerprint))

    def _apply_events(self, events) -> None:
        for e in events:
            self.index.apply(KVEvent(e.worker, tuple(e.stored), tuple(e.removed)))

    async def shutdown(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        for task in self._subscriptions.values():
            task.cancel()
        if self.index is not None:
            self.index.close()
        for channel in self._channels.values():
            await channel.close()
        await asyncio.gather(self.prefill.stop(), self.decode.stop())

    async def scale(
        self, prefill: int | None, decode: int | None, drain_timeout_s: float = 30.0
    ) -> tuple[int, int]:
        """Resize the pools; removed workers drain before they stop, so no
        request in flight is dropped. Returns (prefill, decode) afterwards."""
        if self.colocated and prefill:
            raise ValueError("prefill must be 0 or unset in colocated mode")
        if decode is not None and decode < 1:
            raise ValueError("decode must be >= 1")
        if not self.colocated and prefill is not None and prefill < 1:
            raise ValueError("prefill must be >= 1 in disaggregated mode")
        async with self._scale_lock:
            gone = []
            for pool, n in ((self.prefill, prefill), (self.decode, decode)):
                if n is None or (self.colocated and pool is self.prefill):
                    continue
                self._missing.pop(pool.role, None)  # an explicit size replaces the old one
                if n > len(pool.workers):
                    for worker in await pool.scale_to(n):
                        if pool is self.decode:
                            await self._subscribe(worker)
                else:
                    gone += pool.take_out(len(pool.workers) - n)
            await WorkerPool.drain(gone, drain_timeout_s)
            await self._forget(gone)
            await WorkerPool.stop_workers(gone)
            return len(self.prefill.workers), len(self.decode.workers)

    async def replace_dead_workers(
        self, ping_timeout_s: float = 10.0, placement_timeout_s: float = 120.0
    ) -> list[str]:
        """Drop the workers whose actor died (a node went away) and start as
        many new ones, which Ray places on nodes that have the pool's
        resources; replacements that cannot be placed yet are tried again on
        the next call. Requests on a dead decode worker end as aborted.
        Returns the names dropped."""
        async with self._scale_lock:
            dropped: list[str] = []
            for pool in (self.prefill, self.decode):
                dead = await pool.find_dead(ping_timeout_s)
                if dead:
                    log.warning("%s workers died: %s", pool.role, [w.name for w in dead])
                    pool.remove(dead)
                    await self._forget(dead)
                    self._missing[pool.role] = self._missing.get(pool.role, 0) + len(dead)
                    dropped += [w.name for w in dead]
                missing = self._missing.get(pool.role, 0)
                if not missing:
                    continue
                try:
                    new = await pool.scale_to(len(pool.workers) + missing, placement_timeout_s)
                except Exception as exc:
                    log.warning("%d %s workers not placed yet: %r", missing, pool.role, exc)
                    continue
                self._missing[pool.role] = 0
                if pool is self.decode:
                    for worker in new:
                        await self._subscribe(worker)
            return dropped

    async def _watch_workers(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.replace_dead_workers()
            except Exception:
                log.exception("replacing dead workers failed; trying again in %.1f s", interval_s)

    async def _forget(self, workers: list[WorkerHandle]) -> None:
        """Drop the router's state of workers that leave the pools."""
        for worker in workers:
            self.index.drop_worker(worker.name)
            task = self._subscriptions.pop(worker.name, None)
            if task is not None:
                task.cancel()
            channel = self._channels.pop(worker.name, None)
            if channel is not None:
                await channel.close()

    async def worker_status(self) -> list[dict]:
        workers = self.prefill.workers + self.decode.workers
        stats = await asyncio.gather(*(w.actor.stats.remote() for w in workers))
        return [
            {
                "name": w.name,
                "role": w.role,
                "in_flight": w.in_flight,
                "free_blocks": s["free_blocks"],
                "total_blocks": s["total_blocks"],
            }
            for w, s in zip(workers, stats, strict=True)
        ]

    async def worker_stats(self) -> dict[str, dict]:
        workers = self.prefill.workers + self.decode.workers
        stats = await asyncio.gather(*(w.actor.stats.remote() for w in workers))
        return {w.name: {**s, "role": w.role} for w, s in zip(workers, stats, strict=True)}

    async def _subscribe(self, worker: WorkerHandle) -> None:
        transfer = self.config.transfer_config()
        security = transfer.security
        channel = security.channel(worker.info["outputs"], message_limits(transfer))
        self._channels[worker.name] = channel
        stream = worker_pb2_grpc.DecodeOutputsStub(channel).Subscribe(
            worker_pb2.SubscribeRequest(router_id=self.router_id), metadata=security.metadata()
        )
        await stream.read()  # the empty batch that opens the stream
        self._subscriptions[worker.name] = asyncio.create_task(self._read(worker, stream))

    async def _read(self, worker: WorkerHandle, stream) -> None:
        try:
            while (batch := await stream.read()) is not grpc.aio.EOF:
                self._apply_events(batch.cache_events)
                for delta in batch.deltas:
                    entry = self._queues.get(delta.request_id)
                    if entry is not None:
                        entry[0].put_nowait(delta)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                log.error("output stream of %s broke: %s", worker.name, exc)
        except Exception:
            log.exception("reading the output stream of %s failed", worker.name)
        finally:
            # Requests on that worker can no longer finish: end them as aborted.
            for rid, (queue, owner) in list(self._queues.items()):
                if owner is worker:
                    queue.put_nowait(
                        worker_pb2.RequestDelta(
                            request_id=rid, finished=True, finish_reason="abort"
                        )
                    )

    async def generate(self, inp: GenerateInput) -> AsyncIterator[TokenDelta | GenerateResult]:
        # Workers see a fresh id per attempt, so a client that reuses its request
        # id can never meet blocks or outputs of an earlier request on a worker.
        rid = f"{inp.request_id}#{uuid.uuid4().hex[:12]}"
        assert self.routing is not None, "backend not started"
        plan = self.routing.plan(
            inp.prompt_token_ids, self.prefill.workers, self.decode.workers, self.colocated
        )
        d, p = plan.decode, plan.prefill
        progress = _Progress(inp, p.name if p is not None else d.name, d.name)
        log_event(
            log,
            "request_routed",
            request_id=inp.request_id,
            attempt_id=rid,
            prefill_worker=p.name if p is not None else None,
            decode_worker=d.name,
            prompt_tokens=len(inp.prompt_token_ids),
            decode_cached_blocks=plan.decode_cached_blocks,
        )
        queue: asyncio.Queue[worker_pb2.RequestDelta] = asyncio.Queue()
        self._queues[rid] = (queue, d)
        d.in_flight += 1
        if p is not None:
            p.in_flight += 1
        try:
            if p is None:
                req = DecodeRequest(rid, self.router_id, inp.prompt_token_ids, [], inp.params)
                await d.actor.start_full.remote(req)
            else:
                prefilled = await self._prefill(rid, inp, plan)
                first = prefilled.first
                p.in_flight -= 1
                p = None
                if first.finished:
                    progress.transfer = None
                else:
                    progress.transfer = (prefilled.kv_bytes, prefilled.transfer_s)
                yield progress.first(first)
                if first.finished:
                    await asyncio.shield(self._abort(rid, None, d))  # drop the prefix pin
                    yield progress.result(first.finish_reason)
                    return
                await d.actor.start_decode.remote(
                    DecodeRequest(
                        rid, self.router_id, inp.prompt_token_ids, first.new_token_ids, inp.params
                    )
                )
            while True:
                delta = await queue.get()
                if delta.token_ids:
                    yield progress.delta(delta)
                progress.count(delta)
                if delta.finished:
                    yield progress.result(delta.finish_reason)
                    return
        finally:
            del self._queues[rid]
            d.in_flight -= 1
            if p is not None:
                p.in_flight -= 1
            if not progress.finished:
                await asyncio.shield(self._abort(rid, p, d))

    async def _prefill(self, rid: str, inp: GenerateInput, plan: RoutePlan) -> PrefillResult:
        """Prefill on the plan's prefill worker, which pushes the KV blocks the
        decode worker lacks; its result holds the first token's output."""
        d, p = plan.decode, plan.prefill
        assert p is not None
        skip = 0
        if plan.decode_cached_blocks:  # pin what the decode worker has: it is not pushed
            wanted = plan.hashes[: plan.decode_cached_blocks]
            skip = await d.actor.reserve_prefix.remote(rid, wanted)
        pull_from = plan.pull_from.info["kv"] if plan.pull_from is not None else None
        request = PrefillRequest(
            rid, inp.prompt_token_ids, inp.params, d.info["kv"], skip, pull_from, plan.pull_hashes
        )
        result = await p.actor.prefill.remote(request)
        self._apply_events(result.cache_events)
        return result

    async def _abort(self, rid: str, p: WorkerHandle | None, d: WorkerHandle) -> None:
        calls = [w.actor.abort.remote(rid) for w in (p, d) if w is not None]
        with contextlib.suppress(Exception):
            await asyncio.gather(*calls)


class _Progress:
    """What the router measures and counts for one request."""

    def __init__(self, inp: GenerateInput, prefill_worker: str, decode_worker: str) -> None:
        self.inp = inp
        self.workers = (prefill_worker, decode_worker)
        self.start = time.perf_counter()
        self.first_time = self.last_time = 0.0
        self.num_output = self.cached = 0
        self.finished = False
        self.transfer: tuple[int, float] | None = None  # (bytes, seconds) of the KV push

    def first(self, out: RequestOutput) -> TokenDelta:
        self.first_time = self.last_time = time.perf_counter()
        self.num_output, self.cached = out.num_output_tokens, out.num_cached_tokens
        return TokenDelta(out.new_token_ids, out.text_delta, out.logprobs)

    def delta(self, delta: worker_pb2.RequestDelta) -> TokenDelta:
        now = time.perf_counter()
        self.first_time = self.first_time or now
        self.last_time = now
        return TokenDelta(list(delta.token_ids), delta.text, _logprobs(delta))

    def count(self, delta: worker_pb2.RequestDelta) -> None:
        if delta.num_output_tokens:
            self.num_output = delta.num_output_tokens
            self.cached = self.cached or delta.num_cached_tokens

    def result(self, reason: str | None) -> GenerateResult:
        self.finished = True
        n = self.num_output
        tpot = (self.last_time - self.first_time) / (n - 1) if n > 1 else 0.0
        return GenerateResult(
            finish_reason=reason or "abort",
            prompt_tokens=len(self.inp.prompt_token_ids),
            cached_tokens=self.cached,
            completion_tokens=n,
            ttft_s=self.first_time - self.start if self.first_time else 0.0,
            mean_tpot_s=tpot,
            prefill_worker=self.workers[0],
            decode_worker=self.workers[1],
            kv_transfer_bytes=self.transfer[0] if self.transfer else 0,
            kv_transfer_s=self.transfer[1] if self.transfer else None,
        )


def _logprobs(delta: worker_pb2.RequestDelta) -> list[TokenLogprobs] | None:
    if not delta.logprobs:
        return None
    return [
        TokenLogprobs(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
        for lp in delta.logprobs
    ]
