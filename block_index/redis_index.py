"""The Redis block index: several routers share the events of all workers.

Keys, all under ``prefix`` = ``tandem:{deployment}:{model_fingerprint}`` (see
:func:`redis_prefix`), so deployments and models can share one Redis:

``{prefix}:events``          a stream of KV events, trimmed with ``MAXLEN ~``;
                             fields ``worker``, ``stored``, ``removed`` (hashes
                             packed as concatenated 16-byte strings), ``reset``
                             (``b"1"``/``b"0"``)
``{prefix}:blocks:{worker}`` a set: the hashes the worker holds (the snapshot)
``{prefix}:worker:{worker}`` the worker's heartbeat, expiring after ``ttl_s``
``{prefix}:epoch``           a random token a router sets once; its absence or
                             change tells routers that Redis lost its data

Writers (:class:`RedisEventPublisher`) apply each event to their set and
append it to the stream in one ``MULTI`` transaction, from a background
thread fed by a bounded queue: the engine never waits on Redis. Whenever the
publisher may have lost track (Redis unreachable, queue overflow, its
heartbeat key gone because Redis restarted or the key expired) it sends a
full snapshot (``reset=True`` + every hash it holds) once Redis answers again.

Readers (:class:`RedisIndex`) keep a local :class:`InMemoryIndex` fed by a
background thread: rebuild from the sets of live workers, then follow the
stream. Lookups are local: no network hop per request.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from block_index.base import HASH_SIZE, KVEvent
from block_index.memory import InMemoryIndex

logger = logging.getLogger(__name__)

_INITIAL_BACKOFF_S = 0.05


def redis_prefix(deployment: str, model_fingerprint: str) -> str:
    """The key prefix of one deployment serving one model."""
    return f"tandem:{deployment}:{model_fingerprint}"


class _Keys:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.events = f"{prefix}:events"
        self.epoch = f"{prefix}:epoch"
        self.heartbeat_prefix = f"{prefix}:worker:"

    def blocks(self, worker: str) -> str:
        return f"{self.prefix}:blocks:{worker}"

    def heartbeat(self, worker: str) -> str:
        return f"{self.heartbeat_prefix}{worker}"

    def heartbeat_pattern(self) -> str:
        return _glob_escape(self.heartbeat_prefix) + "*"


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


def _client(url: str, socket_timeout_s: float, password: str | None = None) -> redis.Redis:
    """A client whose errors surface at once: we retry and resync ourselves.

    redis-py's own retries would reconnect silently and hide that Redis may
    have restarted empty. The hiredis parser is used when installed.
    ``password``: AUTH with it unless the URL carries one (a ``rediss://`` URL
    speaks TLS).
    """
    return redis.Redis.from_url(
        url,
        password=password,
        socket_timeout=socket_timeout_s,
        socket_connect_timeout=min(socket_timeout_s, 2.0),
        retry=Retry(NoBackoff(), 0),
        retry_on_timeout=False,
        health_check_interval=0,
        decode_responses=False,
    )


def pack_hashes(hashes: Iterable[bytes]) -> bytes:
    return b"".join(hashes)


def unpack_hashes(packed: bytes) -> tuple[bytes, ...]:
    if len(packed) % HASH_SIZE:
        raise ValueError(f"packed hashes of {len(packed)} bytes, not a multiple of {HASH_SIZE}")
    return tuple(packed[i : i + HASH_SIZE] for i in range(0, len(packed), HASH_SIZE))


def _entry_fields(
    worker: str, stored: Sequence[bytes], removed: Sequence[bytes], reset: bool
) -> dict[str, bytes]:
    return {
        "worker": worker.encode(),
        "stored": pack_hashes(stored),
        "removed": pack_hashes(removed),
        "reset": b"1" if reset else b"0",
    }


def _event_from_fields(fields: dict[bytes, bytes]) -> KVEvent:
    return KVEvent(
        worker=fields[b"worker"].decode(),
        stored=unpack_hashes(fields.get(b"stored", b"")),
        removed=unpack_hashes(fields.get(b"removed", b"")),
        reset=fields.get(b"reset", b"0") == b"1",
    )


def _chunks(items: Sequence[bytes], size: int) -> list[Sequence[bytes]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


class RedisEventPublisher:
    """A worker's side: events to the stream and its set, plus a heartbeat.

    ``publish`` only appends to a bounded in-memory queue; a background
    thread drains it, many events per ``MULTI``. Every event becomes one or
    more stream entries (at most ``max_hashes_per_entry`` hashes each, so no
    entry is huge) and the matching ``SADD``/``SREM`` on
    ``{prefix}:blocks:{worker}``, in the same transaction.

    Resync: at start, after any Redis error, after a queue overflow and when
    the heartbeat key is found missing (Redis restarted empty, or it expired
    while this worker was stalled and routers dropped it), the publisher
    discards its queue and sends a full snapshot: ``reset=True`` plus every
    hash the worker holds. The hashes come from ``snapshot()`` when given
    (called from the publisher's thread: it must be safe to call
    concurrently with the engine) or else from a set the publisher mirrors
    from the events it was given. Events published after the snapshot was
    taken are sent after it, so the order of effects is kept (set operations
    replayed over a newer state are harmless).

    While Redis is unreachable events are dropped (the next snapshot covers
    them) and the thread retries with exponential backoff up to
    ``backoff_max_s``. ``close()`` is a clean leave: the worker's heartbeat
    and set are deleted and a ``reset`` entry tells routers at once.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        worker: str,
        heartbeat_s: float = 2.0,
        ttl_s: float = 10.0,
        snapshot: Callable[[], Iterable[bytes]] | None = None,
        *,
        max_queue: int = 10_000,
        stream_maxlen: int = 100_000,
        max_hashes_per_entry: int = 4096,
        max_events_per_batch: int = 256,
        socket_timeout_s: float = 2.0,
        backoff_max_s: float = 2.0,
        password: str | None = None,
    ) -> None:
        if heartbeat_s <= 0 or ttl_s <= heartbeat_s:
            raise ValueError(f"need 0 < heartbeat_s < ttl_s, got {heartbeat_s=} {ttl_s=}")
        self.worker = worker
        self._keys = _Keys(prefix)
        self._blocks_key = self._keys.blocks(worker)
        self._hb_key = self._keys.heartbeat(worker)
        self._heartbeat_s = heartbeat_s
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._snapshot = snapshot
        self._mirror: set[bytes] | None = set() if snapshot is None else None
        self._max_queue = max_queue
        self._stream_maxlen = stream_maxlen
        self._max_hashes = max_hashes_per_entry
        self._max_batch = max_events_per_batch
        self._socket_timeout_s = socket_timeout_s
        self._backoff_max_s = backoff_max_s
        self._client = _client(url, socket_timeout_s, password)

        self._cond = threading.Condition()
        self._queue: deque[KVEvent] = deque()
        self._need_resync = True  # the first thing sent: a reset (+ what we hold)
        self._closed = False
        self._stop = threading.Event()
        self._sending = False  # the drain thread is between dequeue and reply
        self._connected = True  # for logging transitions only
        self.stats = {"published": 0, "sent": 0, "dropped": 0, "resyncs": 0, "errors": 0}

        self._drainer = threading.Thread(
            target=self._drain_loop, name=f"kv-publisher-{worker}", daemon=True
        )
        self._heartbeater = threading.Thread(
            target=self._heartbeat_loop, name=f"kv-heartbeat-{worker}", daemon=True
        )
        self._drainer.start()
        self._heartbeater.start()

    # -- the engine's side -------------------------------------------------

    def publish(self, event: KVEvent) -> None:
        try:
            if event.worker != self.worker:
                logger.error("publisher %r got an event of %r: dropped", self.worker, event.worker)
                return
            if any(len(h) != HASH_SIZE for h in event.stored) or any(
                len(h) != HASH_SIZE for h in event.removed
            ):
                logger.error("KV event with a hash that is not %d bytes: dropped", HASH_SIZE)
                return
            with self._cond:
                if self._closed:
                    return
                self.stats["published"] += 1
                mirror = self._mirror
                if mirror is not None:
                    if event.reset:
                        mirror.clear()
                    mirror.difference_update(event.removed)
                    mirror.update(event.stored)
                if self._need_resync:  # the coming snapshot covers this event
                    self.stats["dropped"] += 1
                    return
                if len(self._queue) >= self._max_queue:
                    logger.warning("KV event queue of %r full: resyncing", self.worker)
                    self.stats["dropped"] += len(self._queue) + 1
                    self._queue.clear()
                    self._need_resync = True
                else:
                    self._queue.append(event)
                self._cond.notify()
        except Exception:
            logger.exception("publish failed")

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything published so far was sent (tests, benches)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._need_resync or self._sending:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._closed:
                    return False
                self._cond.wait(min(remaining, 0.05))
            return True

    # -- the background threads --------------------------------------------

    def _drain_loop(self) -> None:
        backoff = _INITIAL_BACKOFF_S
        while True:
            blocks: list[bytes] | None = None
            batch: list[KVEvent] = []
            with self._cond:
                while not (self._closed or self._need_resync or self._queue):
                    self._cond.wait(1.0)
                if self._closed:
                    return
                resync = self._need_resync
                if resync:
                    self._need_resync = False
                    self._queue.clear()
                    if self._mirror is not None:
                        blocks = list(self._mirror)
                else:
                    while self._queue and len(batch) < self._max_batch:
                        batch.append(self._queue.popleft())
                self._sending = True
            try:
                if resync:
                    self._client.ping()  # don't take a snapshot for nothing
                    if blocks is None:
                        assert self._snapshot is not None
                        blocks = list(self._snapshot())
                    self._send_snapshot(blocks)
                    self.stats["resyncs"] += 1
                else:
                    self._send_batch(batch)
                    self.stats["sent"] += len(batch)
                backoff = _INITIAL_BACKOFF_S
                if not self._connected:
                    self._connected = True
                    logger.info("KV publisher %r: Redis reachable again, resynced", self.worker)
            except Exception as exc:
                self.stats["errors"] += 1
                with self._cond:
                    self.stats["dropped"] += len(batch) + len(self._queue)
                    self._queue.clear()
                    self._need_resync = True
                if self._connected:
                    self._connected = False
                    logger.warning("KV publisher %r: Redis down (%s), retrying", self.worker, exc)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._backoff_max_s)
            finally:
                with self._cond:
                    self._sending = False
                    self._cond.notify_all()

    def _xadd(self, pipe, stored: Sequence[bytes], removed: Sequence[bytes], reset: bool) -> None:
        pipe.xadd(
            self._keys.events,
            _entry_fields(self.worker, stored, removed, reset),
            maxlen=self._stream_maxlen,
            approximate=True,
        )

    def _send_snapshot(self, blocks: list[bytes]) -> None:
        pipe = self._client.pipeline(transaction=True)
        pipe.delete(self._blocks_key)
        chunks = _chunks(blocks, self._max_hashes) or [()]
        for i, chunk in enumerate(chunks):
            if chunk:
                pipe.sadd(self._blocks_key, *chunk)
            self._xadd(pipe, chunk, (), reset=i == 0)
        pipe.set(self._hb_key, b"1", px=self._ttl_ms)
        pipe.execute()

    def _send_batch(self, batch: list[KVEvent]) -> None:
        pipe = self._client.pipeline(transaction=True)
        for ev in batch:
            if ev.reset:
                pipe.delete(self._blocks_key)
            removed = _chunks(ev.removed, self._max_hashes)
            stored = _chunks(ev.stored, self._max_hashes)
            if not removed and not stored:
                self._xadd(pipe, (), (), ev.reset)
                continue
            reset = ev.reset
            for chunk in removed:
                pipe.srem(self._blocks_key, *chunk)
                self._xadd(pipe, (), chunk, reset)
                reset = False
            for chunk in stored:
                pipe.sadd(self._blocks_key, *chunk)
                self._xadd(pipe, chunk, (), reset)
                reset = False
        pipe.execute()

    def _heartbeat_loop(self) -> None:
        while not self._stop.wait(self._heartbeat_s):
            try:
                # XX: only refresh; a missing key means routers dropped us or
                # Redis lost its data, and only a snapshot may bring us back.
                if not self._client.set(self._hb_key, b"1", px=self._ttl_ms, xx=True):
                    with self._cond:
                        if not self._need_resync and not self._sending:
                            logger.info("KV publisher %r: heartbeat gone, resync", self.worker)
                            self._queue.clear()
                            self._need_resync = True
                            self._cond.notify_all()
            except Exception:
                pass  # the drain thread reports and recovers

    # -- leaving -----------------------------------------------------------

    def close(self) -> None:
        """Clean leave: stop the threads, delete the heartbeat and the set."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._stop.set()
        self._drainer.join(self._socket_timeout_s + 1.0)
        self._heartbeater.join(self._socket_timeout_s + 1.0)
        try:
            pipe = self._client.pipeline(transaction=True)
            pipe.delete(self._hb_key, self._blocks_key)
            self._xadd(pipe, (), (), reset=True)
            pipe.execute()
        except Exception as exc:
            logger.info("KV publisher %r: clean leave failed (%s); TTL will do", self.worker, exc)
        finally:
            self._client.close()

    def abandon(self) -> None:
        """Stop without a clean leave, as if the worker died (tests)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._stop.set()
        self._drainer.join(self._socket_timeout_s + 1.0)
        self._heartbeater.join(self._socket_timeout_s + 1.0)
        self._client.close()

    def __enter__(self) -> RedisEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RedisIndex:
    """A router's view: a local :class:`InMemoryIndex` that follows Redis.

    A background thread, on start and after any error or data loss:

    1. notes the stream position and its ``entries-added`` count
       (``XINFO STREAM``), and sets ``{prefix}:epoch`` if absent;
    2. reads the live workers (heartbeat keys present, ``SCAN``) and their
       ``blocks:`` sets into a fresh local index;
    3. follows the stream from the noted position (``XREAD BLOCK``),
       applying events in order. Replaying events the sets already reflect
       is harmless: every operation sets one (worker, hash) pair.

    Every ``refresh_s`` it drops workers whose heartbeat expired and
    checks the epoch token (changed or gone: Redis restarted or was
    flushed) and whether the stream was trimmed past our position
    (``entries-added - length`` > entries we consumed): either means events
    were lost, so it rebuilds.

    ``healthy`` is False until the first rebuild and while Redis is
    unreachable; ``lookup`` then returns ``{}`` (a miss, never an error).

    ``apply`` applies an event to the local view only (events piggybacked
    in-process); the stream brings the same event again, harmlessly. A worker
    known only through ``apply`` and without a heartbeat in Redis is dropped
    at the next refresh. ``drop_worker`` is local too: the worker comes back
    if it publishes again.
    """

    def __init__(
        self,
        url: str,
        prefix: str,
        refresh_s: float = 1.0,
        *,
        socket_timeout_s: float = 2.0,
        backoff_max_s: float = 2.0,
        read_count: int = 512,
        password: str | None = None,
    ) -> None:
        if refresh_s <= 0:
            raise ValueError(f"refresh_s must be > 0, got {refresh_s}")
        self._keys = _Keys(prefix)
        self._refresh_s = refresh_s
        self._block_s = min(refresh_s, 1.0)
        self._backoff_max_s = backoff_max_s
        self._read_count = read_count
        self._socket_timeout_s = socket_timeout_s
        self._client = _client(url, socket_timeout_s + self._block_s, password)
        self._view = InMemoryIndex()
        self._healthy = False
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._epoch = b""
        self._pos = b"0-0"
        self._consumed = 0  # stream entries up to _pos, as counted by entries-added
        self.stats = {"rebuilds": 0, "events": 0, "errors": 0, "expired": 0}
        self._thread = threading.Thread(target=self._run, name="kv-index-follower", daemon=True)
        self._thread.start()

    # -- BlockIndex ----------------------------------------------------------

    def apply(self, event: KVEvent) -> None:
        self._view.apply(event)

    def lookup(self, hashes: Sequence[bytes]) -> dict[str, int]:
        if not self._healthy:
            return {}
        return self._view.lookup(hashes)

    def drop_worker(self, worker: str) -> None:
        self._view.drop_worker(worker)

    def workers(self) -> set[str]:
        return self._view.workers()

    @property
    def healthy(self) -> bool:
        return self._healthy

    def num_blocks(self, worker: str | None = None) -> int:
        return self._view.num_blocks(worker)

    def blocks(self, worker: str) -> set[bytes]:
        """A copy of the hashes the local view has for ``worker``."""
        return self._view.blocks(worker)

    def retract(self, worker: str, hashes: Iterable[bytes], max_hashes: int = 4096) -> None:
        """Forget that ``worker`` holds ``hashes`` (stale entries, block_index/reconcile.py):
        in the local view at once, and in Redis (its ``blocks:`` set, and a removal
        event on the stream, so every router's view drops them). Raises the
        client's error when Redis is unreachable (the local view is retracted)."""
        hashes = list(hashes)
        self._view.retract(worker, hashes)
        if not hashes:
            return
        pipe = self._client.pipeline(transaction=True)
        for chunk in _chunks(hashes, max_hashes):
            pipe.srem(self._keys.blocks(worker), *chunk)
            pipe.xadd(self._keys.events, _entry_fields(worker, (), chunk, False))
        pipe.execute()

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until the first rebuild is done (True) or the timeout (False)."""
        return self._ready.wait(timeout_s)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(self._socket_timeout_s + self._block_s + 1.0)
        self._client.close()

    def __enter__(self) -> RedisIndex:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- the follower thread ---------------------------------------------------

    def _run(self) -> None:
        backoff = _INITIAL_BACKOFF_S
        while not self._stop.is_set():
            try:
                self._rebuild()
                if not self._healthy:
                    logger.info("block index %s: synced from Redis", self._keys.prefix)
                self._healthy = True
                self._ready.set()
                backoff = _INITIAL_BACKOFF_S
                self._follow()  # returns when a rebuild is needed or on stop
            except Exception as exc:
                self.stats["errors"] += 1
                if self._stop.is_set():
                    return
                if self._healthy:
                    logger.warning(
                        "block index %s: Redis unreachable (%s); routing by load only",
                        self._keys.prefix,
                        exc,
                    )
                self._healthy = False
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self._backoff_max_s)

    def _stream_info(self, info: object) -> tuple[bytes, int, int]:
        """(last id, entries-added, length) from an XINFO STREAM reply or error.

        entries-added is -1 before Redis 7 (no trimming check then).
        """
        if isinstance(info, redis.ResponseError):
            if "no such key" in str(info).lower():
                return b"0-0", 0, 0
            raise info
        if isinstance(info, Exception):
            raise info
        assert isinstance(info, dict)
        last = info["last-generated-id"]
        if isinstance(last, str):
            last = last.encode()
        return last, int(info.get("entries-added", -1)), int(info["length"])

    def _rebuild(self) -> None:
        keys = self._keys
        pipe = self._client.pipeline(transaction=False)
        pipe.set(keys.epoch, uuid.uuid4().hex.encode(), nx=True)
        pipe.get(keys.epoch)
        pipe.xinfo_stream(keys.events)
        _, epoch, info = pipe.execute(raise_on_error=False)
        if isinstance(epoch, Exception):
            raise epoch
        pos, added, _ = self._stream_info(info)

        workers: list[str] = []
        plen = len(keys.heartbeat_prefix)
        for key in self._client.scan_iter(match=keys.heartbeat_pattern(), count=1000):
            workers.append(key[plen:].decode() if isinstance(key, bytes) else key[plen:])
        snapshot: dict[str, set[bytes]] = {}
        if workers:
            pipe = self._client.pipeline(transaction=False)
            for w in workers:
                pipe.smembers(keys.blocks(w))
            for w, members in zip(workers, pipe.execute(), strict=True):
                snapshot[w] = members
        self._view.replace_all(snapshot)
        self._epoch = epoch or b""
        self._pos = pos
        self._consumed = added
        self.stats["rebuilds"] += 1

    def _follow(self) -> None:
        next_refresh = time.monotonic() + self._refresh_s
        events_key = self._keys.events
        while not self._stop.is_set():
            block_ms = max(1, int(min(self._block_s, next_refresh - time.monotonic()) * 1000))
            reply = self._client.xread(
                {events_key: self._pos}, count=self._read_count, block=block_ms
            )
            for _stream, entries in reply or ():
                for entry_id, fields in entries:
                    try:
                        event = _event_from_fields(fields)
                    except Exception:
                        logger.exception("block index: bad stream entry %r skipped", entry_id)
                    else:
                        self._view.apply(event)
                        self.stats["events"] += 1
                    self._pos = entry_id
                    self._consumed += 1
            if time.monotonic() >= next_refresh:
                if not self._refresh():
                    return
                next_refresh = time.monotonic() + self._refresh_s

    def _refresh(self) -> bool:
        """Expire dead workers; False when events were lost (rebuild)."""
        keys = self._keys
        workers = sorted(self._view.workers())
        pipe = self._client.pipeline(transaction=False)
        pipe.get(keys.epoch)
        pipe.xinfo_stream(keys.events)
        for w in workers:
            pipe.exists(keys.heartbeat(w))
        epoch, info, *alive = pipe.execute(raise_on_error=False)
        if isinstance(epoch, Exception):
            raise epoch
        if epoch != self._epoch:
            logger.warning("block index %s: Redis lost its data; rebuilding", keys.prefix)
            return False
        _, added, length = self._stream_info(info)
        if (
            self._consumed >= 0
            and added >= 0
            and (added < self._consumed or added - length > self._consumed)
        ):
            logger.warning("block index %s: stream trimmed past us; rebuilding", keys.prefix)
            return False
        for w, present in zip(workers, alive, strict=True):
            if isinstance(present, Exception):
                raise present
            if not present:
                self._view.drop_worker(w)
                self.stats["expired"] += 1
        return True
