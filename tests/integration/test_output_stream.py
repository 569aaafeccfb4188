"""A worker's output streams (worker/output_channel.py) and the router's
reader (router/worker_streams.py), both in this process on 127.0.0.1:
framing, the handshake, cache events and waiting for them, a broken stream, a router
that goes away or reads slowly, TLS, the Unix socket of a router on the
same machine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import socket
import threading
import time

import pytest

from block_index import KVEvent
from kv_transfer import TransferConfig
from net import handshake
from net.local_socket import host_identity, local_path
from net.security import ClusterSecurity
from protocol.outputs import RequestOutput
from protocol.workers import WorkerInfo
from protos.tandem.v1 import worker_pb2
from router.pool_manager import WorkerHandle
from router.worker_streams import LOST, WorkerStreams
from tests.tls_certs import tls_files
from worker import output_channel
from worker import output_wire as wire
from worker.output_channel import OutputServer

pytestmark = pytest.mark.integration

SECRET = b"output stream secret"


def _out(rid: str, token: int, finished: bool = False) -> RequestOutput:
    reason = "length" if finished else None
    return RequestOutput(rid, [token], f"<{token}>", finished, reason, None, 8, 0, token)


class Pair:
    """An output server and a router's reader of it."""

    def __init__(self, security: ClusterSecurity, reader_security: ClusterSecurity | None = None):
        self.gone: list[tuple[str, list[str]]] = []
        self.gone_event = threading.Event()
        self.server = OutputServer("127.0.0.1", security, self._router_gone, 1 << 20)
        self.events: list[worker_pb2.CacheEvent] = []
        self.broken: list[tuple[str, str]] = []
        self.reader_config = TransferConfig(
            security=reader_security or security, max_message_bytes=16 << 20
        )
        info = WorkerInfo("decode-0", 64, 100, "fp", "1", "/model", outputs=self.server.address)
        self.worker = WorkerHandle("decode-0", "decode", None, info)
        self.streams: WorkerStreams | None = None

    def _router_gone(self, router_id: str, request_ids: list[str]) -> None:
        self.gone.append((router_id, request_ids))
        self.gone_event.set()

    async def subscribe(self, router_id: str = "router-a") -> WorkerStreams:
        self.streams = WorkerStreams(
            router_id,
            self.events.extend,
            lambda w, why: self.broken.append((w.name, why)),
            self.reader_config,
        )
        await self.streams.subscribe(self.worker)
        return self.streams

    async def paused_reader(self):
        """Subscribed, request r1 registered, and the reader not reading."""
        streams = await self.subscribe()
        stream = streams._streams["decode-0"]
        assert stream.transport is not None
        stream.transport.pause_reading()
        self.server.own("r1", "router-a")
        return streams, stream, streams.register("r1", self.worker)

    async def publish(self, outputs, events=()) -> None:
        """From another thread, as the engine thread does."""
        await asyncio.to_thread(self.server.publish, list(outputs), list(events))

    def close(self) -> None:
        self.server.close()


def run_with_pair(body, security=None, reader_security=None) -> None:
    """Run ``await body(pair)`` with a fresh Pair, closed afterwards."""

    async def run():
        pair = Pair(security or ClusterSecurity(SECRET), reader_security)
        try:
            await body(pair)
        finally:
            pair.close()

    asyncio.run(run())


async def _drain(queue, until_finished: bool = True) -> list:
    got = []
    while True:
        delta = await asyncio.wait_for(queue.get(), 10)
        got.append(delta)
        if delta is LOST or (until_finished and delta.finished):
            return got


def test_steps_reach_the_owning_router_in_order_with_cache_events():
    async def body(pair: Pair):
        streams = await pair.subscribe()
        assert pair.server.has_router("router-a")
        assert pair.server.own("r1", "router-a")
        # A router with no stream here owns nothing: r2's steps go nowhere.
        assert not pair.server.own("r2", "router-b")
        q1 = streams.register("r1", pair.worker)
        event = KVEvent("decode-0", (b"h" * 16,), (b"x" * 16,))
        for step in range(1, 4):
            outs = [_out("r1", step, finished=step == 3), _out("r2", step)]
            await pair.publish(outs, [event] if step == 2 else [])
        got = await _drain(q1)
        assert [list(d.token_ids) for d in got] == [[1], [2], [3]]
        assert [d.text for d in got] == ["<1>", "<2>", "<3>"]
        assert got[-1].finished and got[-1].finish_reason == "length"
        assert [(e.worker, list(e.stored), list(e.removed)) for e in pair.events] == [
            ("decode-0", [b"h" * 16], [b"x" * 16])
        ]
        await streams.close()

    run_with_pair(body)


def test_a_stream_counts_event_batches_from_where_it_opened():
    """Every batch with events counts, for every router; a stream that opens
    later starts at the count so far (it never carries the earlier ones)."""

    async def body(pair: Pair):
        event = KVEvent("decode-0", (b"h" * 16,), ())
        await pair.publish([], [event])  # no router yet: nobody gets it
        await pair.publish([_out("r9", 1)], [])  # no events: not counted
        assert pair.server.events_seq == 1
        streams = await pair.subscribe()
        stream = streams._streams["decode-0"]
        assert stream.events_seq == 1 and pair.events == []
        await pair.publish([], [event])
        await pair.publish([], [event])
        await asyncio.wait_for(streams.caught_up(pair.worker, 3), 10)
        assert stream.events_seq == pair.server.events_seq == 3
        assert len(pair.events) == 2
        await streams.close()

    run_with_pair(body)


def test_a_router_that_logs_in_gets_the_cache_snapshot_first():
    """With a snapshot (an in-process index), every router that logs in, late
    or not, first learns what the worker's cache holds; then the events."""

    async def body(pair: Pair):
        held = [b"a" * 16, b"b" * 16]
        pair.server._snapshot = lambda: [KVEvent("decode-0", tuple(held), ())]
        streams = await pair.subscribe("router-late")
        await pair.publish([], [KVEvent("decode-0", (b"c" * 16,), ())])
        await asyncio.wait_for(streams.caught_up(pair.worker, pair.server.events_seq), 10)
        got = [(e.worker, list(e.stored)) for e in pair.events]
        assert got == [("decode-0", held), ("decode-0", [b"c" * 16])]
        await streams.close()

    run_with_pair(body)


def test_caught_up_returns_once_the_events_are_applied():
    async def body(pair: Pair):
        streams, stream, _ = await pair.paused_reader()
        await pair.publish([], [KVEvent("prefill-0", (b"p" * 16,), ())])
        seq = pair.server.events_seq
        waiting = asyncio.ensure_future(streams.caught_up(pair.worker, seq))
        for _ in range(10):  # nothing can arrive while the reader is paused
            await asyncio.sleep(0)
        assert not waiting.done() and pair.events == []
        stream.transport.resume_reading()
        await asyncio.wait_for(waiting, 10)
        assert [list(e.stored) for e in pair.events] == [[b"p" * 16]]
        await streams.caught_up(pair.worker, seq)  # already there: at once
        await streams.close()

    run_with_pair(body)


def test_caught_up_gives_up_when_the_stream_ends():
    async def body(pair: Pair):
        streams, stream, _ = await pair.paused_reader()
        waiting = asyncio.ensure_future(streams.caught_up(pair.worker, 5))  # never published
        await asyncio.sleep(0)
        assert not waiting.done()
        await asyncio.to_thread(pair.server.close)  # the worker goes away
        stream.transport.resume_reading()
        await asyncio.wait_for(waiting, 10)
        assert stream.ended
        await streams.caught_up(pair.worker, 5)  # no stream: at once

    run_with_pair(body)


def test_the_stream_is_registered_before_the_router_hears_it_open(monkeypatch):
    """A router routes requests to a worker as soon as its stream opens, and
    the worker refuses one whose router it does not know (has_router): the
    OPEN frame must not reach the router before the registration."""
    send = output_channel.RouterConnection.send

    def slow_after_open(self, data):
        send(self, data)
        if data == wire.open_frame(0):
            time.sleep(0.3)  # a thread switch right after the frame went out

    monkeypatch.setattr(output_channel.RouterConnection, "send", slow_after_open)

    async def body(pair: Pair):
        await pair.subscribe()
        assert pair.server.has_router("router-a")

    run_with_pair(body)


def test_a_handshake_without_the_secret_is_refused():
    async def body(pair: Pair):
        with pytest.raises(ConnectionError):
            await pair.subscribe("intruder")
        assert not pair.server.has_router("intruder")
        assert pair.broken == []

    run_with_pair(body, reader_security=ClusterSecurity(b"wrong"))


@pytest.mark.parametrize(
    "sends", ["garbage", "a forged answer", "a KV data answer", "an answer for another server"]
)
def test_a_raw_client_without_a_valid_answer_is_dropped(sends):
    pair = Pair(ClusterSecurity(SECRET))
    try:
        host, port = pair.server.address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            nonce = handshake.parse_hello(sock.recv(handshake.HELLO_BYTES, socket.MSG_WAITALL))
            here, security = pair.server.address.encode(), ClusterSecurity(SECRET)
            tag = wire.HANDSHAKE_TAG
            if sends == "garbage":
                sock.sendall(handshake.MAGIC + b"\0" * 64)
            elif sends == "a forged answer":
                guess = ClusterSecurity(b"guess")
                sock.sendall(handshake.answer(guess, tag, nonce, b"router-a", here))
            elif sends == "a KV data answer":  # the right secret, for another purpose
                sock.sendall(
                    handshake.answer(security, b"tandem-kv-data", nonce, b"router-a", here)
                )
            else:  # relayed: the client dialled another worker's stream
                elsewhere = f"{host}:{int(port) + 1}".encode()
                sock.sendall(handshake.answer(security, tag, nonce, b"router-a", elsewhere))
            # Closed without a frame (reset when our bytes went unread).
            with contextlib.suppress(ConnectionResetError):
                assert sock.recv(1) == b""
        assert not pair.server.has_router("router-a")
    finally:
        pair.close()


def test_a_broken_stream_makes_its_requests_lost_and_the_worker_suspect():
    async def body(pair: Pair):
        streams = await pair.subscribe()
        pair.server.own("r1", "router-a")
        queue = streams.register("r1", pair.worker)
        await pair.publish([_out("r1", 1)])
        await asyncio.to_thread(pair.server.close)  # the worker goes away
        got = await _drain(queue)
        assert [list(d.token_ids) for d in got[:-1]] == [[1]] and got[-1] is LOST
        assert [name for name, _ in pair.broken] == ["decode-0"]

    run_with_pair(body)


def test_unsubscribing_makes_requests_lost_without_suspecting_the_worker():
    async def body(pair: Pair):
        streams = await pair.subscribe()
        queue = streams.register("r1", pair.worker)
        await streams.unsubscribe(pair.worker)
        assert await _drain(queue) == [LOST]
        assert pair.broken == []

    run_with_pair(body)


def test_a_router_that_goes_away_has_its_requests_aborted():
    async def body(pair: Pair):
        streams = await pair.subscribe()
        pair.server.own("r1", "router-a")
        pair.server.own("r2", "router-a")
        pair.server.own("r3", "router-b")
        await streams.close()
        assert await asyncio.to_thread(pair.gone_event.wait, 10)
        assert pair.gone == [("router-a", ["r1", "r2"])]
        assert not pair.server.has_router("router-a")

    run_with_pair(body)


def test_a_router_that_subscribes_again_replaces_its_old_stream():
    async def body(pair: Pair):
        streams = await pair.subscribe()
        old = streams.register("old", pair.worker)
        await streams.subscribe(pair.worker)  # e.g. the worker came back
        assert await _drain(old) == [LOST]
        pair.server.own("r1", "router-a")
        queue = streams.register("r1", pair.worker)
        await pair.publish([_out("r1", 1, finished=True)])
        assert [list(d.token_ids) for d in await _drain(queue)] == [[1]]
        assert all(not owned for _, owned in pair.gone)  # the old stream had nothing
        assert pair.broken == []
        await streams.close()

    run_with_pair(body)


def test_a_login_under_a_live_router_id_is_refused_and_the_stream_goes_on(monkeypatch):
    """Knowing a router's id (and the secret) does not take over its stream."""
    monkeypatch.setattr(output_channel, "RELOGIN_WAIT_S", 0.2)

    async def body(pair: Pair):
        streams = await pair.subscribe()
        pair.server.own("r1", "router-a")
        queue = streams.register("r1", pair.worker)
        intruder = WorkerStreams("router-a", list.append, lambda w, why: None, pair.reader_config)
        with pytest.raises(ConnectionError):
            await intruder.subscribe(pair.worker)
        await pair.publish([_out("r1", 1), _out("r1", 2, finished=True)])
        assert [list(d.token_ids) for d in await _drain(queue)] == [[1], [2]]
        assert pair.gone == [] and pair.broken == []
        await streams.close()

    run_with_pair(body)


def test_a_slow_reader_never_blocks_the_publisher_and_gets_every_frame():
    async def body(pair: Pair):
        streams, stream, queue = await pair.paused_reader()
        big = "x" * (256 << 10)
        steps = 64  # 16 MiB: far more than the socket buffers hold

        def publish_all():
            for i in range(1, steps + 1):
                out = _out("r1", i, finished=i == steps)
                out.text_delta = big
                pair.server.publish([out], [])

        # publish returns while nothing is read (the thread would hang otherwise)
        writer = threading.Thread(target=publish_all, daemon=True)
        writer.start()
        await asyncio.to_thread(writer.join, 60)
        assert not writer.is_alive()
        stream.transport.resume_reading()
        got = await _drain(queue)
        assert [d.num_output_tokens for d in got] == list(range(1, steps + 1))
        await streams.close()

    run_with_pair(body)


def test_a_reader_too_far_behind_is_dropped(monkeypatch):
    monkeypatch.setattr(output_channel, "MAX_BACKLOG_BYTES", 1 << 20)

    async def body(pair: Pair):
        _, stream, queue = await pair.paused_reader()
        out = _out("r1", 1)
        out.text_delta = "x" * (256 << 10)
        for _ in range(64):
            await pair.publish([out])
        assert await asyncio.to_thread(pair.gone_event.wait, 10)
        assert pair.gone == [("router-a", ["r1"])]
        stream.transport.resume_reading()
        got = await _drain(queue, until_finished=False)
        assert got[-1] is LOST

    run_with_pair(body)


def test_a_step_bigger_than_the_frame_limit_is_split():
    batch = worker_pb2.StepBatch(
        deltas=[worker_pb2.RequestDelta(request_id=f"r{i}", text="y" * 1000) for i in range(10)],
        cache_events=[worker_pb2.CacheEvent(worker="w", stored=[b"s" * 16])],
        events_seq=7,
    )
    frames = list(wire.frames(batch, 2500))
    assert len(frames) > 1
    reader = wire.FrameReader(2500)
    payloads = []
    for frame in frames:  # byte by byte across frame boundaries
        for i in range(len(frame)):
            payloads += reader.feed(frame[i : i + 1])
    parts = [worker_pb2.StepBatch.FromString(p) for p in payloads]
    assert [d.request_id for p in parts for d in p.deltas] == [f"r{i}" for i in range(10)]
    assert sum(len(p.cache_events) for p in parts) == 1
    assert [p.events_seq for p in parts] == [0] * (len(parts) - 1) + [7]  # once all is read
    with pytest.raises(wire.ProtocolError):
        wire.FrameReader(100).feed(wire.LENGTH.pack(101))


@pytest.mark.parametrize("reader", ["cluster", "plaintext", "stranger"])
def test_tls_streams_refuse_plaintext_and_strangers(cluster_certs, reader, monkeypatch):
    monkeypatch.setattr(output_channel, "HANDSHAKE_TIMEOUT_S", 1.0)  # the plaintext reader's
    security = ClusterSecurity(SECRET, tls_files(cluster_certs[0]))
    readers = {
        "cluster": security,
        "plaintext": ClusterSecurity(SECRET),
        "stranger": ClusterSecurity(SECRET, tls_files(cluster_certs[1])),
    }

    async def body(pair: Pair):
        if reader != "cluster":
            with pytest.raises(ConnectionError):
                await pair.subscribe()
            assert not pair.server.has_router("router-a")
            return
        streams = await pair.subscribe()
        pair.server.own("r1", "router-a")
        queue = streams.register("r1", pair.worker)
        await pair.publish([_out("r1", 1), _out("r2", 1)])
        await pair.publish([_out("r1", 2, finished=True)])
        assert [list(d.token_ids) for d in await _drain(queue)] == [[1], [2]]
        await streams.close()

    run_with_pair(body, security, readers[reader])


def _family(streams: WorkerStreams) -> socket.AddressFamily:
    transport = streams._streams["decode-0"].transport
    assert transport is not None
    return transport.get_extra_info("socket").family


async def _one_request_streams(pair: Pair, streams: WorkerStreams) -> None:
    pair.server.own("r1", "router-a")
    queue = streams.register("r1", pair.worker)
    await pair.publish([_out("r1", 1)])
    await pair.publish([_out("r1", 2, finished=True)])
    assert [list(d.token_ids) for d in await _drain(queue)] == [[1], [2]]


def _offer(worker: WorkerHandle, address: str, host_id: str | None = None) -> None:
    """The worker's handle names its Unix socket (host_id: this machine's)."""
    host = host_identity() if host_id is None else host_id
    worker.info = dataclasses.replace(worker.info, outputs_local=address, host_id=host)


needs_local = pytest.mark.skipif(not host_identity(), reason="no abstract Unix sockets here")


@needs_local
def test_a_router_on_the_same_machine_reads_over_the_unix_socket():
    async def body(pair: Pair):
        _offer(pair.worker, pair.server.local_address)
        streams = await pair.subscribe()
        assert _family(streams) == socket.AF_UNIX
        await _one_request_streams(pair, streams)

    run_with_pair(body, ClusterSecurity(SECRET))


def test_under_cluster_mutual_tls_a_worker_offers_no_unix_socket(cluster_certs):
    """Mutual TLS promises every peer shows a certificate; the Unix socket
    could not ask for one, so it is off and a local router reads over TLS."""
    security = ClusterSecurity(SECRET, tls_files(cluster_certs[0]))

    async def body(pair: Pair):
        assert pair.server.local_address == ""
        streams = await pair.subscribe()
        assert _family(streams) == socket.AF_INET
        await _one_request_streams(pair, streams)

    run_with_pair(body, security)


def _hello_bytes(path: str, user: int | None) -> int:
    """Bytes a process (forked, as ``user`` if given) reads from the Unix
    socket at ``path`` before the server closes it or sends its HELLO."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: socket calls only, then _exit
        got = 0
        try:
            if user is not None:
                os.setuid(user)
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(10)
                s.connect(path)
                got = len(s.recv(64))
        except OSError:
            pass
        os.write(write_end, str(got).encode())
        os._exit(0)
    os.close(write_end)
    try:
        return int(os.read(read_end, 16) or b"-1")
    finally:
        os.close(read_end)
        os.waitpid(pid, 0)


@needs_local
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_the_unix_socket_refuses_another_users_process_before_the_handshake():
    """Another user's process gets not even the server's HELLO; one of the
    worker's own user does (then it must still prove the secret)."""
    server = OutputServer("127.0.0.1", ClusterSecurity(SECRET), lambda r, ids: None)
    path = local_path(server.local_address)
    try:
        assert _hello_bytes(path, 65534) == 0
        assert _hello_bytes(path, None) == handshake.HELLO_BYTES
    finally:
        server.close()


@needs_local
def test_the_unix_socket_refuses_a_handshake_without_the_secret():
    async def body(pair: Pair):
        _offer(pair.worker, pair.server.local_address)
        with pytest.raises(ConnectionError):
            await pair.subscribe("intruder")
        assert not pair.server.has_router("intruder")

    run_with_pair(body, reader_security=ClusterSecurity(b"wrong"))


@needs_local
@pytest.mark.parametrize("case", ["other machine", "name gone", "router opted out"])
def test_a_router_uses_tcp_when_the_unix_socket_is_not_for_it(case):
    async def body(pair: Pair):
        address, host_id = pair.server.local_address, None
        if case == "other machine":
            host_id = "another-boot-id/1"
        elif case == "name gone":
            address = "unix-abstract:tandem-out-nobody-listens-here"
        else:
            pair.reader_config = dataclasses.replace(pair.reader_config, local_streams=False)
        _offer(pair.worker, address, host_id)
        streams = await pair.subscribe()
        assert _family(streams) == socket.AF_INET
        await _one_request_streams(pair, streams)

    run_with_pair(body)


def test_a_worker_that_opts_out_offers_no_unix_socket():
    server = OutputServer("127.0.0.1", ClusterSecurity(SECRET), lambda r, ids: None, local=False)
    try:
        assert server.local_address == ""
    finally:
        server.close()
