"""Per-request grants (net/grants.py): only the grant the router minted for
this worker, this request and this digest, unexpired and unused, passes."""

from __future__ import annotations

import pytest

from net.grants import (
    GRANT_BYTES,
    PULL,
    PUSH,
    GrantChecker,
    GrantMinter,
    GrantRefused,
    GrantUsed,
    pull_digest,
    push_digest,
)
from net.security import ClusterSecurity

pytestmark = pytest.mark.unit

SECURITY = ClusterSecurity(b"k" * 32)
D = "10.0.0.7:4100"


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


def _pair(ttl_s: float = 30.0) -> tuple[GrantMinter, GrantChecker, Clock]:
    clock = Clock()
    return GrantMinter(SECURITY, ttl_s, clock), GrantChecker(SECURITY, D, clock), clock


def test_the_right_grant_passes_once():
    minter, checker, _ = _pair()
    grant = minter.mint(PUSH, D, "req#1", push_digest(b""))
    assert len(grant) == GRANT_BYTES
    checker.use(grant, PUSH, "req#1", push_digest(b""))
    with pytest.raises(GrantUsed):
        checker.use(grant, PUSH, "req#1", push_digest(b""))


@pytest.mark.parametrize(
    ("purpose", "request_id", "digest", "why"),
    [
        (PULL, "req#1", push_digest(b""), "another purpose"),
        (PUSH, "req#2", push_digest(b""), "another request"),
        (PUSH, "req#1", push_digest(b"tenant-b"), "another salt"),
    ],
)
def test_a_grant_for_something_else_is_refused(purpose, request_id, digest, why):
    minter, checker, _ = _pair()
    grant = minter.mint(PUSH, D, "req#1", push_digest(b""))
    with pytest.raises(GrantRefused, match="does not match"):
        checker.use(grant, purpose, request_id, digest)


def test_a_grant_for_another_worker_is_refused():
    minter, checker, _ = _pair()
    grant = minter.mint(PUSH, "10.0.0.8:4100", "req#1", push_digest(b""))
    with pytest.raises(GrantRefused, match="does not match"):
        checker.use(grant, PUSH, "req#1", push_digest(b""))


def test_a_pull_grant_binds_the_hashes_asked_for():
    minter, checker, _ = _pair()
    hashes = [b"a" * 16, b"b" * 16]
    grant = minter.mint(PULL, D, "req#1", pull_digest(hashes))
    for other in ([b"a" * 16], [b"a" * 16, b"c" * 16], [*hashes, b"c" * 16]):
        with pytest.raises(GrantRefused, match="does not match"):
            checker.use(grant, PULL, "req#1", pull_digest(other))
    checker.use(grant, PULL, "req#1", pull_digest(hashes))


def test_an_expired_grant_is_refused():
    minter, checker, clock = _pair(ttl_s=30.0)
    grant = minter.mint(PUSH, D, "req#1", push_digest(b""))
    clock.now += 30.0
    with pytest.raises(GrantRefused, match="expired"):
        checker.use(grant, PUSH, "req#1", push_digest(b""))


def test_a_tampered_grant_is_refused():
    minter, checker, _ = _pair()
    grant = minter.mint(PUSH, D, "req#1", push_digest(b""))
    later = bytearray(grant)
    later[5] ^= 1  # the expiry, pushed out
    flipped = bytearray(grant)
    flipped[-1] ^= 1  # the MAC
    for bad in (bytes(later), bytes(flipped), grant[:-1], b"", b"\x02" + grant[1:]):
        with pytest.raises(GrantRefused):
            checker.use(bad, PUSH, "req#1", push_digest(b""))
    checker.use(grant, PUSH, "req#1", push_digest(b""))  # the failures used nothing


def test_a_grant_under_another_secret_is_refused():
    clock = Clock()
    stranger = GrantMinter(ClusterSecurity(b"x" * 32), clock=clock)
    checker = GrantChecker(SECURITY, D, clock)
    with pytest.raises(GrantRefused, match="does not match"):
        checker.use(stranger.mint(PUSH, D, "r", push_digest(b"")), PUSH, "r", push_digest(b""))


def test_a_generated_secret_keys_and_checks_grants():
    """No configured secret: the generated one keys the grants (there is no
    empty secret); a grant under another secret does not pass."""
    clock = Clock()
    generated, keyed = ClusterSecurity.generate(), GrantMinter(SECURITY, clock=clock)
    checker = GrantChecker(generated, D, clock)
    with pytest.raises(GrantRefused):
        checker.use(b"", PUSH, "r", push_digest(b""))
    with pytest.raises(GrantRefused):
        checker.use(keyed.mint(PUSH, D, "r", push_digest(b"")), PUSH, "r", push_digest(b""))
    checker.use(GrantMinter(generated, clock=clock).mint(PUSH, D, "r", push_digest(b"")), PUSH,
                "r", push_digest(b""))  # fmt: skip


def test_a_checker_without_an_address_refuses_everything():
    minter, _, clock = _pair()
    checker = GrantChecker(SECURITY, "", clock)
    with pytest.raises(GrantRefused, match="no address"):
        checker.use(minter.mint(PUSH, "", "r", push_digest(b"")), PUSH, "r", push_digest(b""))


def test_reprs_hold_no_key():
    minter, checker, _ = _pair()
    assert SECURITY.secret.hex() not in repr(minter) + repr(checker)
    assert "k" * 8 not in repr(minter) + repr(checker)


def test_a_used_grant_is_refused_until_it_expires_then_its_id_is_new():
    minter, checker, clock = _pair(ttl_s=30.0)
    first = minter.mint(PUSH, D, "req#1", push_digest(b""))
    checker.use(first, PUSH, "req#1", push_digest(b""))
    clock.now += 29.0
    with pytest.raises(GrantUsed):
        checker.use(first, PUSH, "req#1", push_digest(b""))
    clock.now += 2.0  # the first expired; a new grant for the id is new
    checker.use(minter.mint(PUSH, D, "req#1", push_digest(b"")), PUSH, "req#1", push_digest(b""))


def test_expired_used_grants_are_forgotten_so_memory_stays_bounded():
    minter, checker, clock = _pair(ttl_s=30.0)
    for i in range(100):
        checker.use(minter.mint(PUSH, D, f"req#{i}", push_digest(b"")), PUSH, f"req#{i}",
                    push_digest(b""))  # fmt: skip
    assert len(checker) == 100
    clock.now += 31.0  # all of them expired
    checker.use(minter.mint(PUSH, D, "late", push_digest(b"")), PUSH, "late", push_digest(b""))
    assert len(checker) == 1
