"""A KV transfer endpoint in its own process, driven over a pipe.

The child runs a GrpcKVServer and a GrpcKVClient over either a pool of
random blocks or a whole LLMEngine, on one asyncio loop (so no pool lock is
needed). bench/kv_transfer.py and the integration tests
(tests/integration/test_kv_transfer.py) use it to put sender and receiver in
separate processes on 127.0.0.1. ``push`` can stall or corrupt its messages
(through GrpcKVClient's message filter) for the tests of broken transfers.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time
import zlib
from dataclasses import dataclass, field
from typing import Any

import grpc
import torch

from engine.block_pool import BlockPool, Holder
from engine.hashing import hash_blocks, root_hash
from engine.kv_cache import KVCache, KVLayout
from kv_transfer import (
    GrpcKVClient,
    GrpcKVServer,
    KVBlocks,
    PoolBlockStore,
    TransferConfig,
    TransferError,
)
from net.grants import PULL, PUSH, GrantMinter, pull_digest, push_digest


@dataclass(frozen=True)
class PeerSpec:
    num_blocks: int
    layout: KVLayout | None = None  # a pool of random blocks of this layout...
    model: str | None = None  # ...or an LLMEngine over this checkpoint
    load_format: str = "auto"
    config: TransferConfig = field(default_factory=TransferConfig)
    seed: int = 0
    num_threads: int = 1


class Peer:
    """Parent-side handle of a peer process."""

    def __init__(self, spec: PeerSpec) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_main, args=(child, spec), daemon=True)
        self.process.start()
        child.close()
        self._address: str | None = None

    @property
    def address(self) -> str:
        """The peer's gRPC address; waits for the peer to be up."""
        if self._address is None:
            self._address = self.call("address", timeout_s=180)
        return self._address

    def submit(self, cmd: str, *args: Any) -> None:
        self._conn.send((cmd, args))

    def result(self, timeout_s: float = 120) -> Any:
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"peer gave no answer in {timeout_s} s")
        try:
            status, value = self._conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"peer process died (exit code {self.process.exitcode})") from e
        if status == "error":
            code, message = value
            raise TransferError(grpc.StatusCode[code], message)
        return value

    def call(self, cmd: str, *args: Any, timeout_s: float = 120) -> Any:
        self.submit(cmd, *args)
        return self.result(timeout_s)

    def kill(self) -> None:
        self.process.kill()
        self.process.join()

    def close(self) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit", ()))
                self.process.join(10)
            except (BrokenPipeError, OSError):
                pass
        if self.process.is_alive():
            self.kill()


# Holds the blocks the driving process allocates, claims and releases by id.
DRIVER = Holder("lease", "peer-driver")


def _main(conn, spec: PeerSpec) -> None:
    torch.set_num_threads(spec.num_threads)
    asyncio.run(_Handler(spec).serve(conn))


class _Handler:
    def __init__(self, spec: PeerSpec) -> None:
        self.spec = spec
        self.engine = None
        if spec.model is not None:
            from engine import EngineConfig, LLMEngine

            self.engine = LLMEngine(
                EngineConfig(
                    model=spec.model,
                    load_format=spec.load_format,  # type: ignore[arg-type]
                    num_kv_blocks=spec.num_blocks,
                    num_threads=spec.num_threads,
                )
            )
            pool, cache = self.engine.block_pool, self.engine.kv_cache
        else:
            assert spec.layout is not None
            pool = BlockPool(spec.num_blocks, spec.layout.block_size)
            cache = KVCache(spec.layout, spec.num_blocks, torch.device("cpu"))
            gen = torch.Generator().manual_seed(spec.seed)
            for t in cache.layers:
                t.copy_(torch.rand(t.shape, generator=gen))
        self.store = PoolBlockStore(pool, cache)
        self.server = GrpcKVServer(self.store, spec.config)
        self.client = GrpcKVClient(spec.config)

    async def serve(self, conn) -> None:
        await self.server.start()
        loop = asyncio.get_running_loop()
        while True:
            cmd, args = await loop.run_in_executor(None, conn.recv)
            if cmd == "exit":
                break
            try:
                conn.send(("ok", await getattr(self, f"do_{cmd}")(*args)))
            except TransferError as e:
                conn.send(("error", (e.code.name, e.message)))
            except Exception as e:
                conn.send(("error", ("UNKNOWN", f"{type(e).__name__}: {e}")))
        await self.client.close()
        await self.server.stop(0)

    # ---- pool ----

    async def do_address(self) -> str:
        return self.server.address

    async def do_num_free(self) -> int:
        return self.store.num_free

    async def do_holders(self) -> list[str]:
        return [str(holder) for holder in self.store.holders()]

    async def do_allocate(self, n: int) -> list[int] | None:
        return self.store.reserve(DRIVER, n)

    async def do_release(self, block_ids: list[int]) -> None:
        self.store.release(DRIVER, block_ids)

    async def do_claim(self, request_id: str) -> list[int] | None:
        """The claimed blocks, handed over to the driver's holder."""
        held = self.server.claim(request_id)
        if held is None:
            return None
        with self.store.lock:
            return self.store.pool.transfer(held.holder, DRIVER, held.block_ids)

    async def do_digest(self, block_ids: list[int]) -> int:
        data = self.store.cache.read_blocks(block_ids).cpu()
        return zlib.crc32(data.view(-1).view(torch.uint8).numpy())

    async def do_make_cached(self, n: int, seed: int) -> tuple[list[bytes], list[int], int]:
        """Index ``n`` blocks under a hash chain of random tokens, leave them
        cached (ref 0): (hashes, token ids, crc of their data)."""
        layout, bs = self.store.layout, self.store.layout.block_size
        tokens = torch.randint(0, 30000, (n * bs,), generator=torch.Generator().manual_seed(seed))
        tokens_list = tokens.tolist()
        hashes = hash_blocks(tokens_list, bs, root_hash(layout.model_fingerprint, bs))
        blocks = self.store.reserve(DRIVER, n)
        assert blocks is not None
        self.store.commit(blocks, hashes, tokens_list)
        digest = await self.do_digest(blocks)
        self.store.release(DRIVER, blocks)
        return list(hashes), tokens_list, digest

    # ---- transfers ----

    async def do_push(
        self,
        address: str,
        request_id: str,
        block_ids: list[int],
        block_hashes: list[bytes | None] | None = None,
        token_ids: list[int] | None = None,
        stall_after: int | None = None,
        corrupt_message: int | None = None,
        grant: bytes | None = None,
    ) -> tuple[list[int], int, float]:
        """Push blocks; ``stall_after`` hangs the whole process after that many
        messages and ``corrupt_message`` flips a payload byte of that message.
        ``token_ids`` None: tokens of the request's own (from its id) fill the
        blocks. ``grant`` None: this peer mints one, as a router would."""
        count = 0

        def tamper(msg: bytes) -> bytes:
            nonlocal count
            count += 1
            if stall_after is not None and count > stall_after:
                time.sleep(3600)
            if count == corrupt_message:
                broken = bytearray(msg)
                broken[-1] ^= 0xFF
                return bytes(broken)
            return msg

        if token_ids is None:
            bs = self.store.layout.block_size
            gen = torch.Generator().manual_seed(zlib.crc32(request_id.encode()))
            token_ids = torch.randint(0, 30000, (len(block_ids) * bs,), generator=gen).tolist()
        if grant is None:
            grant = push_grant(self.spec.config, address, request_id)
        blocks = KVBlocks(
            request_id,
            block_ids,
            block_hashes or [None] * len(block_ids),
            token_ids,
            grant=grant,
        )
        if stall_after is None and corrupt_message is None:
            client = self.client  # kept, like a prefill worker's: its channels stay up
        else:
            client = GrpcKVClient(self.spec.config, message_filter=tamper)
        try:
            start = time.perf_counter()
            result = await client.push(address, self.store, blocks)
            return result.remote_block_ids, result.bytes_sent, time.perf_counter() - start
        finally:
            if client is not self.client:
                await client.close()

    async def do_pull(
        self, address: str, block_hashes: list[bytes], grant: bytes | None = None
    ) -> tuple[list[int], int]:
        """Pull into this pool: the blocks, held by the driver's holder, and the
        bytes. ``grant`` None: this peer mints one, as a router would."""
        request_id = f"pull-{time.monotonic_ns()}"
        if grant is None:
            grant = pull_grant(self.spec.config, address, request_id, block_hashes)
        result = await self.client.pull(
            address, self.store, block_hashes, request_id=request_id, grant=grant
        )
        with self.store.lock:
            self.store.pool.transfer(result.holder, DRIVER, result.block_ids)
        return result.block_ids, result.bytes_received

    # ---- engine ----

    async def do_generate(self, request_id: str, prompt: list[int], params: dict) -> list[int]:
        self.engine.add_request(request_id, prompt, self._params(params))
        return self._run()[request_id]

    async def do_prefill_and_push(
        self, address: str, request_id: str, prompt: list[int], params: dict
    ) -> tuple[list[int], float, float]:
        """Prefill only, push the blocks, release them: (output ids, prefill
        seconds, push seconds)."""
        start = time.perf_counter()
        self.engine.add_request(request_id, prompt, self._params(params), prefill_only=True)
        self._run()
        prefill_s = time.perf_counter() - start
        export = self.engine.export_kv(request_id, with_data=False)
        hashes = list(export.block_hashes)
        hashes += [None] * (len(export.block_ids) - len(hashes))
        try:
            _, _, push_s = await self.do_push(address, request_id, export.block_ids, hashes, prompt)
        finally:
            self.engine.release(request_id)
        return export.output_token_ids, prefill_s, push_s

    async def do_decode_pushed(
        self, request_id: str, prompt: list[int], output_ids: list[int], params: dict
    ) -> list[int]:
        held = self.server.claim(request_id)
        if held is None:
            raise TransferError(grpc.StatusCode.NOT_FOUND, f"no push for {request_id}")
        self.engine.add_prefilled_request(
            request_id, prompt, output_ids, self._params(params), [held]
        )
        return output_ids + self._run().get(request_id, [])

    def _params(self, params: dict):
        from protocol.sampling import SamplingParams

        return SamplingParams(**params)

    def _run(self) -> dict[str, list[int]]:
        tokens: dict[str, list[int]] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens


def push_grant(config: TransferConfig, address: str, request_id: str) -> bytes:
    """The grant a router would mint for this push (net/grants.py)."""
    return GrantMinter(config.security).mint(PUSH, address, request_id, push_digest(b""))


def pull_grant(config: TransferConfig, address: str, request_id: str, hashes) -> bytes:
    """The grant a router would mint for this pull."""
    return GrantMinter(config.security).mint(PULL, address, request_id, pull_digest(hashes))
