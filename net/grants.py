"""Per-request grants: the router's permission for one KV push or pull.

The router mints a grant when it routes a request; the worker that serves
the transfer checks it before it reserves, pins or looks up any block. A
grant is an HMAC-SHA256, under a key derived from the cluster secret, over

    purpose ("push" / "pull"), the serving worker's KV address,
    the request id, a digest of what it binds, the expiry

each as a length-prefixed field, so no two tuples give the same MAC input.
A push grant binds the request's cache salt, a pull grant the block hashes
asked for. On the wire a grant is ``VERSION | expiry (u64, ms since the
epoch) | MAC``. Expiry is on the wall clock (router and workers are
different processes, often machines) and at most ``GRANT_TTL_S`` ahead.

A serving worker takes each (purpose, request id) once: ``GrantChecker``
remembers the ones used until they expire, so a grant seen on the wire
cannot be replayed for a request already pushed or pulled.

The key is always derived and always checked, from a cluster secret that is
never empty (net/security.py; generated when none is configured): the
cluster secret is what keeps it private (docs/security.md).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import struct
import time
from collections.abc import Callable, Sequence

from engine.hashing import length_prefixed
from net.security import ClusterSecurity

PUSH = "push"
PULL = "pull"
VERSION = b"\x01"
GRANT_TTL_S = 300.0
"""How long a grant is good for: a request's prefill may queue behind others
before its push starts. Its one use is what limits replay, not this."""
MAC_BYTES = 32
GRANT_BYTES = len(VERSION) + 8 + MAC_BYTES
_KEY_LABEL = b"tandem-grant-key-v1"
_MAC_LABEL = b"tandem-grant-v1"
_EXPIRY = struct.Struct(">Q")


class GrantRefused(Exception):
    """A grant that does not allow the transfer asked for; the message says why."""


class GrantUsed(GrantRefused):
    """A valid grant whose transfer has been made already (a replay)."""


def push_digest(cache_salt: bytes) -> bytes:
    """What a push grant binds: the cache salt its blocks are hashed with."""
    return hashlib.sha256(length_prefixed(b"push") + length_prefixed(cache_salt)).digest()


def pull_digest(block_hashes: Sequence[bytes]) -> bytes:
    """What a pull grant binds: the block hashes, in order."""
    h = hashlib.sha256(length_prefixed(b"pull"))
    for block_hash in block_hashes:
        h.update(length_prefixed(block_hash))
    return h.digest()


class GrantMinter:
    """The router's side: mints grants under the cluster secret."""

    def __init__(
        self,
        security: ClusterSecurity,
        ttl_s: float = GRANT_TTL_S,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = _derive_key(security)
        self._ttl_s = ttl_s
        self._clock = clock

    def __repr__(self) -> str:
        return f"GrantMinter(ttl_s={self._ttl_s})"

    def mint(self, purpose: str, target: str, request_id: str, digest: bytes) -> bytes:
        expiry = int((self._clock() + self._ttl_s) * 1000)
        return (
            VERSION
            + _EXPIRY.pack(expiry)
            + _mac(self._key, purpose, target, request_id, digest, expiry)
        )


class GrantChecker:
    """A serving worker's side: checks grants made out to ``target`` (its own
    KV address) and takes each (purpose, request id) once."""

    def __init__(
        self,
        security: ClusterSecurity,
        target: str = "",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._key = _derive_key(security)
        self.target = target
        self._clock = clock
        self._used: dict[tuple[str, str], float] = {}  # (purpose, request id) -> expiry, s
        self._by_expiry: collections.deque[tuple[float, tuple[str, str]]] = collections.deque()

    def __repr__(self) -> str:
        return f"GrantChecker(target={self.target!r})"

    def __len__(self) -> int:
        """How many used grants it remembers: only unexpired ones, once a grant
        is checked after the others expired."""
        return len(self._used)

    def use(self, grant: bytes, purpose: str, request_id: str, digest: bytes) -> None:
        """Raise GrantRefused unless ``grant`` allows this transfer, unused; then
        mark it used."""
        self.take(purpose, request_id, self.check(grant, purpose, request_id, digest))

    def take(self, purpose: str, request_id: str, expiry: float) -> None:
        """Mark the grant ``check`` found good (its ``expiry``) used: what a
        server does once the transfer is sure to start. GrantUsed if it was."""
        self._refuse_used(purpose, request_id)
        key = (purpose, request_id)
        self._used[key] = expiry
        self._by_expiry.append((expiry, key))

    def _refuse_used(self, purpose: str, request_id: str) -> None:
        now = self._clock()
        self._forget_expired(now)
        if self._used.get((purpose, request_id), 0.0) > now:
            raise GrantUsed(f"the {purpose} grant for request {request_id!r} was used already")

    def _forget_expired(self, now: float) -> None:
        """Drop used grants past their expiry (grants are minted with one TTL,
        so they expire about in the order they are used)."""
        while self._by_expiry and self._by_expiry[0][0] <= now:
            expiry, key = self._by_expiry.popleft()
            if self._used.get(key) == expiry:
                del self._used[key]

    def check(self, grant: bytes, purpose: str, request_id: str, digest: bytes) -> float:
        """The grant's expiry (s since the epoch) if it allows this transfer and
        is unused; it stays unused (``take`` marks it)."""
        if not self.target:
            raise GrantRefused("this server has no address to check grants against yet")
        if len(grant) != GRANT_BYTES or grant[:1] != VERSION:
            raise GrantRefused(f"no valid {purpose} grant for request {request_id!r}")
        (expiry,) = _EXPIRY.unpack_from(grant, 1)
        want = _mac(self._key, purpose, self.target, request_id, digest, expiry)
        if not hmac.compare_digest(grant[1 + _EXPIRY.size :], want):
            raise GrantRefused(f"the {purpose} grant does not match request {request_id!r}")
        expiry_s = expiry / 1000
        now = self._clock()
        if expiry_s <= now:
            raise GrantRefused(f"the {purpose} grant for request {request_id!r} has expired")
        if expiry_s > now + 2 * GRANT_TTL_S:
            raise GrantRefused(f"the {purpose} grant for request {request_id!r} lasts too long")
        self._refuse_used(purpose, request_id)
        return expiry_s


def _derive_key(security: ClusterSecurity) -> bytes:
    return hmac.new(security.secret, _KEY_LABEL, hashlib.sha256).digest()


def _mac(
    key: bytes, purpose: str, target: str, request_id: str, digest: bytes, expiry: int
) -> bytes:
    msg = b"".join(
        (
            length_prefixed(_MAC_LABEL),
            length_prefixed(purpose.encode()),
            length_prefixed(target.encode()),
            length_prefixed(request_id.encode()),
            length_prefixed(digest),
            _EXPIRY.pack(expiry),
        )
    )
    return hmac.new(key, msg, hashlib.sha256).digest()
