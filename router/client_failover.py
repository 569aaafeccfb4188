"""The client's side of a lost router: which failures it survives, and the
resumed request it sends to the next router.

A ``Generate`` stream that breaks (the router went away: UNAVAILABLE, a reset
connection, a drain that cut the call, CANCELLED not by the caller, or a
stream that ends without its final message) is sent again to the next router
with the same request (request id, sampling parameters, seed) and, as
``resume_token_ids``, every token received so far: that router generates
after them (router/resume.py), so the caller sees one stream with no token
lost or repeated. A request that failed before its first token is sent again
the same way, with no resumed tokens. Refusals (INVALID_ARGUMENT,
UNAUTHENTICATED, DEADLINE_EXCEEDED, RESOURCE_EXHAUSTED, INTERNAL, ...) are
the request's own: they end it at once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from protos.tandem.v1 import generate_pb2 as pb

RETRY_BACKOFF_S = 0.1
"""Wait before a router is tried a second time (doubling each round, at most 2 s)."""

_LOST = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class RoutersFailed(grpc.aio.AioRpcError):
    """Every try of a request failed: ``code()`` is the last router's status and
    ``details()`` lists what each router answered, in order."""

    def __init__(self, answers: Sequence[tuple[str, grpc.StatusCode, str]]) -> None:
        self.answers = list(answers)
        listed = "; ".join(f"{t}: {code.name}: {why}" for t, code, why in self.answers)
        super().__init__(
            self.answers[-1][1],
            details=f"the request failed on {len(self.answers)} tries ({listed})",
        )


def router_lost(error: grpc.aio.AioRpcError, resumed: bool) -> bool:
    """True when ``error`` means the router (or the way to it) was lost, not
    that the request was refused. ``resumed``: the call was a resume, whose
    ALREADY_EXISTS is the broken call's own request still ending there."""
    if error.code() in _LOST:
        return True
    return resumed and error.code() == grpc.StatusCode.ALREADY_EXISTS


@dataclass
class Resume:
    """One request across routers: what the caller has received so far."""

    request: pb.GenerateRequest
    max_attempts: int

    def __post_init__(self) -> None:
        self.received: list[int] = list(self.request.resume_token_ids)
        self.answers: list[tuple[str, grpc.StatusCode, str]] = []

    @property
    def resumed(self) -> bool:
        return bool(self.answers)

    def next_request(self) -> pb.GenerateRequest:
        """The request for the next try: the tokens received so far as resumed."""
        request = pb.GenerateRequest()
        request.CopyFrom(self.request)
        del request.resume_token_ids[:]
        request.resume_token_ids.extend(self.received)
        return request

    def failed(self, target: str, code: grpc.StatusCode, why: str) -> bool:
        """Record a try that failed; True when another one may follow."""
        self.answers.append((target, code, why))
        return len(self.answers) < self.max_attempts

    def error(self) -> grpc.aio.AioRpcError:
        return RoutersFailed(self.answers)

    def backoff_s(self, n_targets: int) -> float:
        """Wait before the next try: none before a router not tried yet."""
        rounds = len(self.answers) // n_targets
        return 0.0 if rounds == 0 or len(self.answers) % n_targets else _delay(rounds)


def _delay(rounds: int) -> float:
    return min(RETRY_BACKOFF_S * 2 ** (rounds - 1), 2.0)
