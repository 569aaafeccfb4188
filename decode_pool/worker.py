"""The decode worker (a plain class; the Ray actor wraps it).

It receives KV blocks over gRPC (the KV receiver), attaches them to a
request as soon as their push is done (the router starts the decode while
the prefill runs, and the push carries the prefill's token), and runs
continuous batching.
The engine thread writes every step's outputs to the routers' output
streams itself (output_channel.py). In colocated mode the same worker also
prefills.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from decode_pool.output_channel import OutputServer
from engine.block_pool import Held, Holder
from engine.config import EngineConfig
from engine.logfmt import log_event
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from engine.transfer import GrpcKVServer, TransferConfig
from engine.transfer.local_socket import host_identity
from engine.worker_base import EngineWorker, IndexSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeRequest:
    request_id: str
    router_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # tokens streamed before this try (after a failover);
    # start_decode appends the token the prefill sampled, which comes with the KV
    params: SamplingParams


@dataclass(frozen=True)
class WorkerAddresses:
    kv: str  # KVTransfer service
    outputs: str  # output streams (output_wire.py)
    outputs_local: str = ""  # the same on a Unix socket, for routers on this machine
    host_id: str = ""  # who can reach outputs_local (local_socket.host_identity)


class DecodeWorker(EngineWorker):
    def __init__(
        self,
        name: str,
        config: EngineConfig,
        transfer: TransferConfig | None = None,
        index: IndexSettings | None = None,
        host: str = "127.0.0.1",
    ) -> None:
        super().__init__(name, config, index)
        self.host = host
        self.transfer = transfer or TransferConfig()
        self.kv_server = GrpcKVServer(self.store, self.transfer, host=host, port=0)
        # request id -> (prefix blocks of this pool its pin holder (_pin_holder)
        # holds for it, lease timer)
        self._pinned: dict[str, tuple[list[int], asyncio.TimerHandle]] = {}
        self.outputs: OutputServer | None = None  # bound by start()
        self.addresses: WorkerAddresses | None = None
        self._background: set[asyncio.Future] = set()
        # request id -> when to forget it: aborted requests, so that a call for
        # one that arrives late (the router gave up on a hung try) is refused.
        self._aborted: dict[str, float] = {}

    async def start(self) -> WorkerAddresses:
        self.outputs = OutputServer(
            self.host,
            self.transfer.security,
            self._router_gone,
            self.transfer.max_message_bytes,
            local=self.transfer.local_streams,
        )
        self.start_loop()
        await self.kv_server.start()
        self.addresses = WorkerAddresses(
            self.kv_server.address,
            self.outputs.address,
            self.outputs.local_address,
            host_identity() if self.outputs.local_address else "",
        )
        return self.addresses

    async def stop(self) -> None:
        if self.outputs is not None:
            self.outputs.close()
        await self.kv_server.stop(1.0)
        for rid in list(self._pinned) + await self.loop.acall(lambda e: e.request_ids()):
            await self.abort(rid)
        self.stop_loop()

    async def reserve_prefix(self, request_id: str, block_hashes: list[bytes]) -> int:
        """Pin the longest prefix of ``block_hashes`` this pool holds for a request
        whose other blocks a prefill worker will push; returns how many. The pin
        lasts until start_decode, abort, or the transfer lease passes."""

        def pin(engine) -> list[int]:
            pool = engine.block_pool
            blocks = []
            for block_hash in block_hashes:  # hashes bind the tokens: no token check needed
                block = pool.block_for_hash(block_hash)
                if block is None:
                    break
                blocks.append(block)
            pool.acquire(_pin_holder(request_id), blocks)
            return blocks

        if self._was_aborted(request_id):
            return 0
        blocks = await self.loop.acall(pin)
        if self._was_aborted(request_id):  # aborted while pinning
            await self.loop.acall(lambda e: e.block_pool.release(_pin_holder(request_id), blocks))
            return 0
        if blocks:
            timer = asyncio.get_running_loop().call_later(
                self.transfer.lease_s, self._unpin_soon, request_id
            )
            self._pinned[request_id] = (blocks, timer)
        return len(blocks)

    async def start_decode(self, req: DecodeRequest) -> None:
        """Continue a request whose blocks a prefill worker pushes here (after
        the prefix blocks pinned for it by reserve_prefix, if any). The router
        calls this while the prefill runs (or after it, with
        early_decode_start off): the decode starts once the push is done,
        from the token it carries. An abort ends the wait
        (LookupError), as does a push that carries no token."""
        rid = req.request_id
        self._refuse_aborted(rid)
        self._own(req)  # first: a refusal here leaves the blocks to abort()
        try:
            next_tokens = await self.kv_server.committed(rid)
        except BaseException:
            self._disown(rid)
            raise
        prefix = Held(_pin_holder(rid), self._take_pins(rid))
        claimed = self.kv_server.claim(rid)
        if claimed is None or not next_tokens:
            self._disown(rid)
            held = [prefix] if claimed is None else [prefix, claimed]
            await self.loop.acall(lambda e: e.block_pool.release_held(held))
            why = "was aborted" if claimed is None else "came with no sampled token"
            raise LookupError(f"the KV push for request {rid!r} {why}")
        blocks = [prefix, claimed]
        log_event(
            log,
            "decode_start",
            request_id=req.request_id,
            worker=self.name,
            prompt_tokens=len(req.prompt_token_ids),
            reused_blocks=len(prefix.block_ids),
            received_blocks=len(claimed.block_ids),
        )
        added = self.loop.call(
            lambda e: e.add_prefilled_request(
                rid, req.prompt_token_ids, req.output_token_ids + next_tokens, req.params, blocks
            )
        )
        try:
            await asyncio.wrap_future(added)
        except BaseException:
            self._disown(req.request_id)
            if added.cancel():  # it had not run (we were cancelled): the blocks are ours
                self.loop.call(lambda e: e.block_pool.release_held(blocks))
            raise

    async def start_full(self, req: DecodeRequest) -> None:
        """Prefill and decode here (colocated mode, or a short uncached rest);
        every new token goes to the stream. ``output_token_ids``, when set, are
        tokens streamed before a failover: computed with the prompt, not sent."""
        self._refuse_aborted(req.request_id)
        self._own(req)
        log_event(
            log,
            "colocated_start",
            request_id=req.request_id,
            worker=self.name,
            prompt_tokens=len(req.prompt_token_ids),
        )
        try:
            await self.loop.acall(
                lambda e: e.add_request(
                    req.request_id, req.prompt_token_ids, req.params, False, req.output_token_ids
                )
            )
        except BaseException:
            self._disown(req.request_id)
            raise

    async def abort(self, request_id: str) -> bool:
        now = time.monotonic()
        if len(self._aborted) > 1024:
            self._aborted = {r: t for r, t in self._aborted.items() if t > now}
        self._aborted[request_id] = now + self.transfer.lease_s
        self._disown(request_id)
        pinned = self._take_pins(request_id)
        if pinned:
            await self.loop.acall(lambda e: e.block_pool.release(_pin_holder(request_id), pinned))
        self.kv_server.discard(request_id)
        return await super().abort(request_id)

    def _was_aborted(self, request_id: str) -> bool:
        return self._aborted.get(request_id, 0.0) > time.monotonic()

    def _refuse_aborted(self, request_id: str) -> None:
        if self._was_aborted(request_id):
            raise LookupError(f"request {request_id!r} was aborted")

    def _take_pins(self, request_id: str) -> list[int]:
        blocks, timer = self._pinned.pop(request_id, ([], None))
        if timer is not None:
            timer.cancel()
        return blocks

    def _unpin_soon(self, request_id: str) -> None:
        blocks = self._take_pins(request_id)
        if blocks:
            self.loop.call(lambda e: e.block_pool.release(_pin_holder(request_id), blocks))

    def _own(self, req: DecodeRequest) -> None:
        if self.outputs is None or not self.outputs.has_router(req.router_id):
            raise ConnectionError(f"router {req.router_id} has no open output stream here")
        self.outputs.own(req.request_id, req.router_id)

    def _disown(self, request_id: str) -> None:
        if self.outputs is not None:
            self.outputs.disown(request_id)

    def _on_outputs(self, outputs: list[RequestOutput]) -> None:
        """On the engine thread, after each step: straight to the routers."""
        if self.outputs is not None:
            try:
                self.outputs.publish(outputs, self.drain_events())
            except Exception:  # the engine thread must go on
                log.exception("publishing a step's outputs failed")
        for out in outputs:
            if out.finished:
                log_event(
                    log,
                    "decode_done",
                    request_id=out.request_id,
                    worker=self.name,
                    finish_reason=out.finish_reason,
                    output_tokens=out.num_output_tokens,
                    cached_tokens=out.num_cached_tokens,
                )

    def _router_gone(self, router_id: str, request_ids: list[str]) -> None:
        """A router's stream closed (in its connection's thread): abort what it owned."""
        if not request_ids or self._aio is None:
            return
        with contextlib.suppress(RuntimeError):  # the event loop is closed: nothing to abort
            self._aio.call_soon_threadsafe(self._abort_all, request_ids)

    def _abort_all(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = asyncio.ensure_future(self.abort(rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)


def _pin_holder(request_id: str) -> Holder:
    """Holds the prefix blocks reserve_prefix pins for a request."""
    return Holder("pin", request_id)
