"""The prefill worker (a plain class; the Ray actor wraps it).

A request's prompt joins the engine's batch (chunked under the token
budget), its first token is sampled, then its KV blocks are pushed to the
decode worker the router named and released here. Full blocks stay in this
worker's prefix cache.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.index import KVEvent
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput
from engine.transfer import GrpcKVClient, KVBlocks, TransferConfig
from engine.worker_base import EngineWorker, IndexSettings


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    decode_kv_address: str  # where to push the blocks
    skip_blocks: int = 0  # leading blocks the decode worker holds already (not pushed)


@dataclass(frozen=True)
class PrefillResult:
    request_id: str
    first: RequestOutput  # the first token (finished if it already ends the request)
    kv_bytes: int
    prefill_s: float  # queue + compute, seconds
    transfer_s: float
    cache_events: list[KVEvent] = field(default_factory=list)  # for the router's index


class PrefillWorker(EngineWorker):
    def __init__(
        self,
        name: str,
        config: EngineConfig,
        transfer: TransferConfig | None = None,
        index: IndexSettings | None = None,
    ) -> None:
        super().__init__(name, config, index)
        self.transfer_config = transfer or TransferConfig()
        self._client: GrpcKVClient | None = None
        self.kv_bytes_pushed = 0

    async def start(self) -> None:
        self.start_loop()
        self._client = GrpcKVClient(self.transfer_config)

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.close()
        self.stop_loop()

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "kv_bytes_pushed": self.kv_bytes_pushed}

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        rid = req.request_id
        first: asyncio.Future[RequestOutput] = asyncio.get_running_loop().create_future()
        self.listen(rid, lambda out: first.done() or first.set_result(out))
        start = time.perf_counter()
        try:
            await self.loop.acall(
                lambda e: e.add_request(rid, req.prompt_token_ids, req.params, prefill_only=True)
            )
            out = await first
        except BaseException:
            await asyncio.shield(self.abort(rid))
            raise
        finally:
            self.unlisten(rid)
        prefilled = time.perf_counter()
        if out.finished:
            return PrefillResult(rid, out, 0, prefilled - start, 0.0, self.drain_events())
        try:
            export = await self.loop.acall(lambda e: e.export_kv(rid, with_data=False))
            n_hashed = len(export.block_hashes)
            hashes = export.block_hashes + [None] * (len(export.block_ids) - n_hashed)
            skip = min(req.skip_blocks, len(export.block_ids) - 1)
            tokens = export.prompt_token_ids[skip * self.engine.config.block_size :]
            blocks = KVBlocks(rid, export.block_ids[skip:], hashes[skip:], tokens)
            assert self._client is not None, "worker not started"
            pushed = await self._client.push(req.decode_kv_address, self.store, blocks)
            self.kv_bytes_pushed += pushed.bytes_sent
        finally:
            await asyncio.shield(self.loop.acall(lambda e: e.abort(rid)))
        done = time.perf_counter()
        return PrefillResult(
            rid, out, pushed.bytes_sent, prefilled - start, done - prefilled, self.drain_events()
        )
