"""The backend that serves requests on Ray pools.

Disaggregated: one call per try, to the prefill worker, which computes the
prompt, samples the first token and pushes the KV blocks the decode worker
lacks, with the request, to the decode worker the router chose. The decode
worker starts the request when the push commits; every token, the first
included, reaches the router on that worker's output stream. Colocated (or
a short tail after a prefix the decode worker holds): one call to the
decode worker, which prefills too.

A request that meets a dead worker or a failed transfer is tried again
(router/failover.py): a try that had streamed tokens already resumes after
them on a healthy pair. Dead workers leave routing until their health
check passes again (router/worker_recovery.py). A request a worker failed
for a fault tied to it (``RequestFault``) is tried again too, but fails
with INTERNAL once it has failed so ``MAX_REQUEST_FAULTS`` times. A worker
that failed or dropped a request is asked for its health then, and leaves
routing if its steps keep failing. A try whose push found no KV room on its
decode worker within the push's wait (``PushNoRoom``) is not a failed try:
the request waits for room again (router/admission.py), within its deadline.

A client that reads too slowly is cut (router/backpressure.py): its try's
queue passes ``limits.max_unread_output_kb``, the try is aborted on its
decode worker at once, and the request ends with RESOURCE_EXHAUSTED; it is
not tried again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import uuid
from collections.abc import AsyncIterator

import grpc

from block_index import BlockIndex, InMemoryIndex, KVEvent
from engine.hashing import root_hash
from net.grants import PULL, PUSH, GrantMinter, pull_digest, push_digest
from protocol.requests import DecodeRequest, PrefillRequest, PrefillResult
from router import health
from router.admission import Admitter
from router.backend import (
    GenerateInput,
    GenerateResult,
    TokenDelta,
    WorkerReport,
)
from router.config import ServeConfig
from router.deployment import (
    DeploymentClient,
    DeploymentMismatch,
    DeploymentNotFound,
    open_deployment,
)
from router.failover import (
    MAX_REQUEST_FAULTS,
    FailoverStats,
    NoWorkerAvailable,
    RequestFault,
    RetryPolicy,
    WorkerLost,
    is_no_room,
    is_retryable,
    request_fault,
)
from router.index_reconcile import IndexReconciler
from router.member_sync import MEMBERSHIP_POLL_S, MemberSync
from router.messages import RequestError
from router.policies import make_policy
from router.pool_manager import WorkerHandle, WorkerPool
from router.prefix_routing import PrefixRouter, RoutePlan
from router.progress import Progress
from router.route_admission import RouteAdmission
from router.tokenizer import RouterTokenizer
from router.watchdog import Watchdog
from router.worker_changes import WorkerChanges
from router.worker_recovery import WorkerRecovery
from router.worker_streams import CUT, LOST, DeltaQueue, Item, WorkerStreams, merge_queued
from worker.cpu_binding import CoreLayout
from worker.logfmt import log_event

log = logging.getLogger(__name__)

ABORT_TIMEOUT_S = 10.0


class RayBackend:
    def __init__(self, config: ServeConfig, cores: CoreLayout | None = None) -> None:
        """``cores``: the local machine's core layout (worker/cpu_binding.py) that
        the workers bind to; None binds nothing."""
        self.config = config
        self.cores = cores
        # 128 random bits: a router's id is its output streams' login name.
        self.router_id = f"router-{secrets.token_hex(16)}"
        self.prefill = WorkerPool("prefill")
        self.decode = WorkerPool("decode")
        self._take_config(config)
        self.policy = make_policy(config.routing.policy)
        self.tokenizer = None
        self.max_model_len = 0  # these two once the workers are up
        self.vocab_size = 0
        self.eos_token_ids: frozenset[int] = frozenset()
        self.retry = RetryPolicy(config.tuning.max_attempts)
        self.failover = FailoverStats()
        self.admission = Admitter(config.limits.max_waiting_requests)
        self.routes = RouteAdmission(self)
        self.changes = WorkerChanges(self)
        self._make_streams()
        self.recovery = WorkerRecovery(
            [self.prefill, self.decode],
            self.changes.worker_down,
            self.changes.worker_back,
            self.failover,
            recovery_timeout_s=config.pools.worker_recovery_timeout_s,
            health_timeout_s=config.tuning.health_timeout_s,
            on_lost=self.changes.worker_lost,
            enter=lambda worker: self.members.enter(worker),
        )
        self.watchdog = Watchdog(
            self.recovery,
            stall_check_s=config.tuning.stall_check_s,
            health_timeout_s=config.tuning.health_timeout_s,
        )
        self.index: BlockIndex | None = None
        self.routing: PrefixRouter | None = None
        self.deployment: DeploymentClient | None = None  # the owner of the workers
        self.members = MemberSync(self)
        self.reconciler = IndexReconciler(
            lambda: self.index, lambda: [*self.prefill.workers, *self.decode.workers]
        )
        self._tasks: list[asyncio.Task] = []
        self._cut_aborts: set[asyncio.Task] = set()  # aborts of tries their clients fell behind

    def _make_streams(self) -> None:
        transfer = self.config.transfer_config()
        self.streams = WorkerStreams(
            self.router_id, self._apply_events, self._suspect, transfer, self.routes.on_room
        )
        self.grants = GrantMinter(transfer.security)  # the workers' KV pushes and pulls

    def _take_config(self, config: ServeConfig) -> None:
        """What the router derives from its config: again once it joined its
        deployment, whose pools mode, model and block size it serves."""
        self.config = config
        self.colocated = config.pools.mode == "colocated"
        self.decode.role = "colocated" if self.colocated else "decode"
        self.model_name = config.served_name()
        self.block_size = config.engine.block_size

    def pool_of(self, role: str) -> WorkerPool:
        return self.prefill if role == "prefill" else self.decode

    async def start(self) -> None:
        """Open the deployment (router/deployment.py): a new one starts its
        pools; a named one that runs already is attached to, its config and
        secret taken, and its running workers used as they are."""
        classes = {p.role: p.actor_cls for p in (self.prefill, self.decode) if p.actor_cls}
        self.deployment = await asyncio.to_thread(open_deployment, self.config, self.cores, classes)
        joined = await self.deployment.call("join", self.config)
        if joined.refused:
            raise DeploymentMismatch(joined.refused)
        joined.config.security.adopt_secret(joined.secret)
        self._take_config(joined.config)
        # A named deployment's workers are shared: its owner judges a lost one.
        self.recovery.kill_lost = self.config.deployment.name is None
        self._make_streams()  # signed with the deployment's secret
        members = await self.deployment.call("members")
        if not members.workers:
            if self.config.deployment.attach:
                raise DeploymentNotFound(
                    f"deployment {self.config.deployment.name!r} has no worker running "
                    f"(deployment.attach is set)"
                )
            pools = self.config.pools
            # Prefill first, as Ray places them in this order: decode workers then
            # land on the emptier nodes where both pools may run.
            sizes = {} if self.colocated else {"prefill": pools.prefill}
            sizes[self.decode.role] = pools.decode
            members = await self.deployment.call("ensure", sizes, None)
        refs = await self.members.connect(members)
        workers = refs
        info = workers[0].info
        self.tokenizer = await asyncio.to_thread(self._load_tokenizer, info.model_dir)
        self.max_model_len = min(w.info.max_model_len for w in workers)
        self.vocab_size = info.vocab_size
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.index = self._make_index(info.model_fingerprint)
        self.routing = PrefixRouter(
            self.index,
            self.config.engine.block_size,
            root_hash(info.model_fingerprint, self.config.engine.block_size),
            self.policy,
            enabled=self.config.routing.prefix_routing and self.config.engine.enable_prefix_caching,
            load_weight_blocks=self.config.tuning.load_weight_blocks,
            local_prefill_tokens=self.config.routing.local_prefill_tokens,
            pull_min_blocks=self.config.tuning.pull_min_blocks,
            host_block_weight=self.config.tuning.host_block_weight,
        )
        await self.members.join_all()  # prefill workers' streams bring their cache events
        self._tasks.append(asyncio.create_task(self.members.poll(MEMBERSHIP_POLL_S)))
        if self.config.pools.worker_check_interval_s > 0:
            self._tasks.append(
                asyncio.create_task(self.changes.watch(self.config.pools.worker_check_interval_s))
            )
        if (every := self.config.routing.index_reconcile_interval_s) > 0:
            self._tasks.append(asyncio.create_task(self.reconciler.every(every)))

    def _load_tokenizer(self, worker_model_dir: str) -> RouterTokenizer | None:
        """The configured tokenizer, else the one in the checkpoint the workers
        loaded (on this machine), else the model's hub id; None: token-id
        prompts only. The workers resolve the model (and build the embedded
        default one): this process never loads the model code."""
        sources = [self.config.engine.tokenizer] if self.config.engine.tokenizer else []
        sources += [worker_model_dir, self.config.engine.model]
        for source in sources:
            if source:
                with contextlib.suppress(OSError, ValueError):
                    return RouterTokenizer.from_pretrained(source)
        log.warning("no tokenizer found (tried %s): token-id prompts only", sources)
        return None

    def _make_index(self, fingerprint: str) -> BlockIndex:
        routing = self.config.routing
        if routing.redis_url is None:
            return InMemoryIndex()
        from block_index import RedisIndex, redis_prefix

        return RedisIndex(
            routing.redis_url,
            redis_prefix(self.config.deployment.redis_name(), fingerprint),
            password=routing.redis_password_value(),
        )

    def _apply_events(self, events) -> None:
        for e in events:
            self.index.apply(
                KVEvent(e.worker, tuple(e.stored), tuple(e.removed), host=tuple(e.host))
            )

    async def shutdown(self) -> None:
        """Stop this router's part: its tasks, streams and index. The workers of
        an ephemeral deployment stop too; a named one's keep serving its other
        routers (router.deployment.down removes them)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.recovery.close()
        await self.streams.close()
        if self.index is not None:
            self.index.close()
        if self.deployment is not None and not self.deployment.remote:
            await self.deployment.call("down", 0.0)
        self.prefill.workers, self.decode.workers = [], []

    async def scale(
        self, prefill: int | None, decode: int | None, drain_timeout_s: float = 30.0
    ) -> tuple[int, int]:
        """Resize the pools through the deployment (router/worker_changes.py);
        workers removed drain this router's requests before they stop.
        Returns (prefill, decode) afterwards."""
        return await self.changes.scale(prefill, decode, drain_timeout_s)

    async def replace_dead_workers(
        self, ping_timeout_s: float = 10.0, placement_timeout_s: float | None = None
    ) -> list[str]:
        """Drop the workers whose actor died for good (a node went away and Ray
        could not restart it, or it was killed) and report them, with those
        recovery gave up, to the deployment, which starts as many new ones once
        per lost worker (however many routers report it) where Ray finds the
        pool's resources; replacements not placed within ``placement_timeout_s``
        (None: ``pools.placement_timeout_s``) are tried again on the next call.
        Returns the names dropped here."""
        return await self.changes.replace_dead_workers(ping_timeout_s, placement_timeout_s)

    async def worker_reports(self) -> list[WorkerReport]:
        """The workers in routing and their stats (a worker that fails to
        answer is taken out of routing and left out)."""
        workers = self.prefill.workers + self.decode.workers
        stats = await asyncio.gather(
            *(w.actor.stats.remote() for w in workers), return_exceptions=True
        )
        reports = []
        for w, s in zip(workers, stats, strict=True):
            if isinstance(s, BaseException):
                self.recovery.suspect(w, f"stats failed: {type(s).__name__}")
            else:
                reports.append(WorkerReport(w.name, w.role, w.in_flight, s))
        return reports

    # ---- failures -------------------------------------------------------

    def _suspect(self, worker: WorkerHandle, why: str) -> None:
        """A worker's output stream broke (the streams exist before recovery)."""
        self.recovery.suspect(worker, why)

    # ---- requests -------------------------------------------------------

    async def generate(self, inp: GenerateInput) -> AsyncIterator[TokenDelta | GenerateResult]:
        progress = Progress(inp)
        failures = faults = 0
        avoid: set[WorkerHandle] = set()
        while True:
            attempt = self._attempt(inp, progress, avoid)
            try:
                async with contextlib.aclosing(attempt):
                    async for item in attempt:
                        yield item
                return
            except NoWorkerAvailable as exc:
                if not self.recovery.down:  # none will come back
                    raise RequestError(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
                # Not a failed try: wait for a worker to pass its health check
                # (the request's deadline bounds the wait).
                await asyncio.sleep(max(self.retry.max_backoff_s, 0.05))
            except Exception as exc:
                if is_no_room(exc):
                    # Not a failed try either: its decode worker had no room
                    # within the push's wait (several routers share it, or
                    # this one's view was stale). Its promise is settled; it
                    # queues for room again, bounded by its deadline.
                    self.failover.no_room += 1
                    log.info("request %s: no KV room on its decode worker: %s", inp.request_id, exc)
                    await asyncio.sleep(self.retry.backoff_s)
                    continue
                if not is_retryable(exc):
                    raise
                faults += isinstance(exc, RequestFault)
                if faults >= MAX_REQUEST_FAULTS:
                    self.failover.faulted += 1
                    log.warning("request %s faulted in %d tries: %s", inp.request_id, faults, exc)
                    raise RequestError(
                        grpc.StatusCode.INTERNAL,
                        f"request failed in {faults} tries, each for a fault of its own: {exc}",
                    ) from exc
                failures += 1
                if failures >= self.retry.max_attempts:
                    self.failover.failed += 1
                    raise RequestError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"request failed after {failures} tries; last error: {exc}",
                    ) from exc
                log.warning("request %s: try %d failed: %s", inp.request_id, failures, exc)
                self.failover.retries += 1
                self.failover.resumed += bool(progress.token_ids)
                await asyncio.sleep(self.retry.delay(failures))

    async def _attempt(
        self, inp: GenerateInput, progress: Progress, avoid: set[WorkerHandle]
    ) -> AsyncIterator[TokenDelta | GenerateResult]:
        """One try: route, then one call: the prefill worker's (which pushes
        the KV and the request to the decode worker), or the decode worker's
        alone (colocated, or a short tail after a prefix it holds). Every
        token comes from the decode worker's output stream. Resumes after
        the tokens already streamed; adds the workers it used to ``avoid``
        when it fails."""
        # Workers see a fresh id per try, so no try can meet blocks or outputs
        # of another one (or of an earlier request with the same client id).
        rid = f"{inp.request_id}#{uuid.uuid4().hex[:12]}"
        assert self.routing is not None, "backend not started"
        streamed = list(progress.token_ids)
        admitted = await self.routes.admit(inp, inp.prompt_token_ids + streamed, avoid)
        plan = admitted.route
        d, p = plan.decode, plan.prefill
        progress.attempt(
            p.name if p is not None else d.name,
            d.name,
            plan.predicted_tokens,
            plan.available_tokens,
        )
        log_event(
            log,
            "request_routed",
            request_id=inp.request_id,
            attempt_id=rid,
            prefill_worker=p.name if p is not None else None,
            decode_worker=d.name,
            prompt_tokens=len(inp.prompt_token_ids),
            resumed_tokens=len(streamed),
            decode_cached_blocks=plan.decode_cached_blocks,
            predicted_cached_tokens=plan.predicted_tokens,
        )
        queue = self.streams.register(rid, d, inp.unread, lambda: self._cut(inp, rid, d))
        d.in_flight += 1
        ok = False
        prefill: asyncio.Future[PrefillResult] | None = None
        streaming = False  # the decode worker's first frame has come
        try:
            if p is None:
                req = DecodeRequest(
                    rid, self.router_id, inp.prompt_token_ids, streamed, inp.params, inp.cache_salt
                )
                await self.watchdog.call(d, d.actor.start_full.remote(req))
            else:
                prefill = asyncio.ensure_future(self._prefill(rid, inp, plan, streamed))
            while True:
                queue.written()  # the client accepted what the last turn yielded
                # Once the decode worker streams, the request is its own: a
                # prefill call failing after its push (a lost reply) costs
                # only the transfer figures, not the try.
                waiting = prefill if not streaming else None
                delta = await self._next_delta(queue, d, plan.prefill, waiting)
                if not streaming:  # its request runs there: the worker's reports count it
                    self.admission.settle(admitted)
                streaming = True
                if delta is CUT:
                    raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(inp.unread.cut))
                if delta is not LOST:
                    delta = merge_queued(delta, queue)
                if delta is LOST:
                    raise WorkerLost(d.name, "its output stream broke")
                if delta.finished and delta.finish_reason == "abort":
                    await self._check_after_fault(d)  # its steps may keep failing
                    raise WorkerLost(d.name, "it dropped the request")
                if delta.finished and delta.finish_reason == "error":
                    await self._check_after_fault(d)
                    raise RequestFault(d.name, delta.error or "no reason given")
                if delta.token_ids:
                    yield progress.delta(delta)
                progress.count(delta)
                if delta.finished:
                    ok = True
                    if prefill is not None:
                        progress.transfer = await _transfer_figures(prefill)
                    yield progress.result(delta.finish_reason)
                    return
        except Exception:
            avoid.update(w for w in (p, d) if w is not None)
            raise
        finally:
            prefilling = prefill is not None and not prefill.done()
            if prefill is not None:
                _drop(prefill)
            self.streams.unregister(rid)
            d.in_flight -= 1
            if not streaming:
                self.admission.settle(admitted)
            if not ok:
                await asyncio.shield(self._abort(rid, p if prefilling else None, d))

    async def _next_delta(
        self,
        queue: DeltaQueue,
        d: WorkerHandle,
        p: WorkerHandle | None,
        prefill: asyncio.Future[PrefillResult] | None,
    ) -> Item:
        """The request's next delta from the decode worker's stream (or LOST, CUT);
        while the prefill call runs, raises as soon as it fails."""
        if prefill is None or prefill.done():
            if prefill is not None:
                _check_prefill(prefill, p)
            return await self.watchdog.next_delta(queue, d)
        waiter = asyncio.ensure_future(self.watchdog.next_delta(queue, d))
        try:
            await asyncio.wait([waiter, prefill], return_when=asyncio.FIRST_COMPLETED)
            if prefill.done():
                _check_prefill(prefill, p)
            return await waiter
        finally:
            if not waiter.done():
                _drop(waiter)

    async def _prefill(
        self, rid: str, inp: GenerateInput, plan: RoutePlan, streamed: list[int]
    ) -> PrefillResult:
        """The prefill call: the prefill worker computes the prompt and pushes
        the KV the decode worker lacks, with the request, to it. Its result
        holds the cost, not tokens. Returns once the worker's output stream
        has brought the cache events it had published by then (the prompt's
        blocks among them) into the index: the request ends after that, so a
        request sent after its answer is routed with its prefix known."""
        d, p = plan.decode, plan.prefill
        assert p is not None
        pull_from = plan.pull_from.info.kv_address if plan.pull_from is not None else None
        push_grant = self.grants.mint(PUSH, d.info.kv_address, rid, push_digest(inp.cache_salt))
        pull_grant = b""
        if pull_from is not None:
            pull_grant = self.grants.mint(PULL, pull_from, rid, pull_digest(plan.pull_hashes))
        request = PrefillRequest(
            rid, self.router_id, inp.prompt_token_ids, inp.params, d.info.kv_address, pull_from,
            plan.pull_hashes, streamed, inp.cache_salt, push_grant, pull_grant,
        )  # fmt: skip
        p.in_flight += 1
        try:
            result = await self.watchdog.call(p, p.actor.prefill.remote(request))
        except Exception as exc:
            fault = request_fault(p.name, exc)
            if fault is None:
                raise
            await self._check_after_fault(p)
            raise fault from exc
        finally:
            p.in_flight -= 1
        if result.aborted:  # it dropped the request: its steps may keep failing
            await self._check_after_fault(p)
        await self.streams.caught_up(p, result.events_seq)
        return result

    def _cut(self, inp: GenerateInput, rid: str, d: WorkerHandle) -> None:
        """A try's client fell behind past the bound (router/backpressure.py): abort
        it on its decode worker now, not when the handler next gets to run
        (which waits for the client)."""
        log_event(
            log,
            "request_cut",
            request_id=inp.request_id,
            attempt_id=rid,
            decode_worker=d.name,
            unread_bytes=inp.unread.bytes,
            unread_tokens=inp.unread.tokens,
        )
        task = asyncio.ensure_future(self._abort(rid, None, d))
        self._cut_aborts.add(task)
        task.add_done_callback(self._cut_aborts.discard)

    async def _check_after_fault(self, worker: WorkerHandle) -> None:
        """A worker failed or dropped a request: one health check, and out of
        routing unless it passes (its steps keep failing, or it does not answer)."""
        state = await health.check(worker, self.config.tuning.health_timeout_s)
        if state is not health.Health.HEALTHY:
            self.recovery.suspect(worker, f"its health is {state.value} after a request failed")

    async def _abort(self, rid: str, p: WorkerHandle | None, d: WorkerHandle) -> None:
        """Free the request's blocks on both workers. A worker out of routing
        gets the abort without waiting: a restarted one has nothing to free,
        a hung one frees the blocks when it runs again."""
        workers = [w for w in (p, d) if w is not None]
        calls = [w.actor.abort.remote(rid) for w in workers]
        live = [c for w, c in zip(workers, calls, strict=True) if not self.recovery.is_down(w)]
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*live), ABORT_TIMEOUT_S)


def _check_prefill(prefill: asyncio.Future[PrefillResult], p: WorkerHandle | None) -> None:
    """Raise what the finished prefill call raised, or WorkerLost if the
    prefill worker dropped the request."""
    if prefill.result().aborted:
        raise WorkerLost(p.name if p is not None else "prefill", "it dropped the request")


async def _transfer_figures(prefill: asyncio.Future[PrefillResult]) -> tuple[int, float] | None:
    """(bytes, seconds) of the KV push, once the prefill call returns; None
    if it failed after the decode worker had finished the request."""
    try:
        result = await prefill
    except Exception:
        return None
    return (result.kv_bytes, result.transfer_s) if result.kv_bytes else None


def _drop(task: asyncio.Future) -> None:
    """Cancel a task whose outcome is no longer wanted (or already read), and
    read its exception when it ends so that asyncio does not log it."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
