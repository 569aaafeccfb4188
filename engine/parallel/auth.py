"""The ranks of a group prove to each other that they hold the engine's secret.

gloo authenticates nobody: while a group is being built, another local user
who sees a rank's listening port (/proc/net/tcp) and guesses a pair's small
sequence number can connect first and take a rank's place in that pair. So
once a group is built, and before a step or a KV block crosses it, its
ranks run a challenge-response over the group's own connections; a rank
that cannot answer makes the group refuse to start (``PeerRefused``).

The secret (``SECRET_BYTES`` random bytes) is rank 0's, made for each
engine; the other ranks get it in their ``RankSpec`` (over the stdin pipe
of a local process, through Ray for an actor), never through the
rendezvous store. An answer is

    HMAC-SHA256(secret, TAG | u16 len(group) | group | u32 sender | u32 receiver | nonce)

from ``sender`` to the rank ``receiver`` that sent ``nonce``. The nonces
are fresh: an answer is no use on another group, in another pair or on
another engine's start; the ranks are in it, in order, so an answer
reflected back at the rank that made it is refused too.

``pairwise`` (gloo) runs over every pair's own connection, since that is
what a stranger takes over: for each pair (a, b), a < b, taken in the same
order on every rank (so no two ranks wait on each other):

    a -> b   nonce_a
    b -> a   nonce_b, answer(b -> a, nonce_a)
    a -> b   answer(a -> b, nonce_b), or zeros when b's answer was wrong

``gathered`` (NCCL) does the same with two all-gathers: torch may run a
single NCCL send or receive on a two-rank communicator of its own, not on
the one that carries the model's all-reduces, which is the one to prove.
(The first all-gather also makes that communicator, while the rendezvous
store, which NCCL's setup reads, is still there.)
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Any

import torch

SECRET_BYTES = 32
NONCE_BYTES = 32
MAC_BYTES = 32  # HMAC-SHA256
TAG = b"tandem-tp-rank\0"
_FIRST_TAG = 0x7A00  # gloo message tags of the challenge: this and the next two
WRONG = (
    "gave a wrong answer to the challenge: it does not hold this engine's secret "
    "(another process in a rank's place?)"
)


class PeerRefused(RuntimeError):
    """A rank of a group did not prove the engine's secret: the group does not start."""


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def answer(secret: bytes, group: str, sender: int, receiver: int, nonce: bytes) -> bytes:
    """``sender``'s answer to the nonce ``receiver`` sent it on ``group``."""
    name = group.encode()
    message = TAG + struct.pack("<H", len(name)) + name + struct.pack("<II", sender, receiver)
    return hmac.new(secret, message + nonce, hashlib.sha256).digest()


def pairwise(pg: Any, group: str, rank: int, size: int, secret: bytes) -> None:
    """Every pair of ranks of ``pg`` (gloo) proves the secret to each other over
    its own connection; raises PeerRefused naming the rank that did not."""
    for a in range(size):
        for b in range(a + 1, size):
            if rank in (a, b):
                _pair(pg, group, rank, b if rank == a else a, secret)


def _pair(pg: Any, group: str, rank: int, peer: int, secret: bytes) -> None:
    nonce = secrets.token_bytes(NONCE_BYTES)
    try:
        if rank < peer:
            _send(pg, peer, 0, nonce)
            got = _recv(pg, peer, 1, NONCE_BYTES + MAC_BYTES)
            their_nonce, their_answer = got[:NONCE_BYTES], got[NONCE_BYTES:]
            good = _good(secret, group, peer, rank, nonce, their_answer)
            mine = answer(secret, group, rank, peer, their_nonce) if good else bytes(MAC_BYTES)
            _send(pg, peer, 2, mine)  # a refused peer learns it, and learns no answer
        else:
            their_nonce = _recv(pg, peer, 0, NONCE_BYTES)
            _send(pg, peer, 1, nonce + answer(secret, group, rank, peer, their_nonce))
            good = _good(secret, group, peer, rank, nonce, _recv(pg, peer, 2, MAC_BYTES))
    except RuntimeError as exc:  # gloo's: the peer hung up, sent another size, or stalled
        why = f"did not answer the challenge ({_first_line(exc)})"
        raise PeerRefused(_refused(group, peer, why)) from exc
    if not good:
        raise PeerRefused(_refused(group, peer, WRONG))


def gathered(pg: Any, group: str, rank: int, size: int, secret: bytes, device: Any) -> None:
    """The same proof over the whole group at once (NCCL): each rank's nonce
    all-gathered, then each rank's answers to all of them."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    nonces = _all_gather(pg, nonce, size, device)
    mine = b"".join(
        bytes(MAC_BYTES) if r == rank else answer(secret, group, rank, r, nonces[r])
        for r in range(size)
    )
    answers = _all_gather(pg, mine, size, device)
    for r in range(size):
        given = answers[r][rank * MAC_BYTES : (rank + 1) * MAC_BYTES]
        if r != rank and not _good(secret, group, r, rank, nonce, given):
            raise PeerRefused(_refused(group, r, WRONG))


def _good(secret: bytes, group: str, sender: int, receiver: int, nonce: bytes, got: bytes) -> bool:
    return hmac.compare_digest(answer(secret, group, sender, receiver, nonce), got)


def _refused(group: str, peer: int, why: str) -> str:
    return f"tensor-parallel group {group!r}: rank {peer} {why}; not starting"


def _send(pg: Any, peer: int, step: int, data: bytes) -> None:
    pg.send([_tensor(data)], peer, _FIRST_TAG + step).wait()


def _recv(pg: Any, peer: int, step: int, size: int) -> bytes:
    out = torch.empty(size, dtype=torch.uint8)
    pg.recv([out], peer, _FIRST_TAG + step).wait()
    return out.numpy().tobytes()


def _all_gather(pg: Any, data: bytes, size: int, device: Any) -> list[bytes]:
    mine = _tensor(data).to(device)
    out = [torch.empty_like(mine) for _ in range(size)]
    pg.allgather([out], [mine]).wait()
    return [t.cpu().numpy().tobytes() for t in out]


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
