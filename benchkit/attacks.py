"""The attack suite against a running deployment: every attack of
benchkit/attacker.py, each from a process of its own with no credential
(an environment stripped of TANDEM_* and RAY_* variables) and only what a
network attacker learns (addresses, the router's id, the public model);
what each got, and what it had to get. tests/integration/test_attacks.py
and bench/attacks.py run it.

The insider attacks (``INSIDER``) run the KV attacks again from a process
that holds the cluster secret (handed over on its stdin) but no router
grant. The NaN attacks (``NAN_ATTACKS``) need workers whose engines
tests/faults.py poisons; on any other they are plain requests.

Honest users keep streaming meanwhile (benchkit/honest_load.py): greedy
requests whose tokens must equal those of the engine alone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from benchkit.attack_outcome import Outcome
from engine.kv_layout import KVLayout

ROOT = Path(__file__).resolve().parents[1]
REFUSED_KV = frozenset({"UNAUTHENTICATED"})
"""A KV call without the cluster secret: refused before its grant is read."""
DROPPED = frozenset({"dropped"})
"""A raw endpoint (output stream) ends the connection in the handshake."""
NO_GRANT = frozenset({"PERMISSION_DENIED"})
"""A KV call with the cluster secret's MAC but no router grant (net/grants.py)."""
FAULTED = frozenset({"INTERNAL"})
"""A request whose logits turn NaN on every try: failed after two (docs/failures.md)."""
CONTAINED = frozenset({"OK", "INVALID_ARGUMENT"})
"""A request at the edges of the bounds: answered, or refused naming its field."""

SYSTEM_PROMPT = "You are a careful assistant. Answer in one short sentence and cite a source. " * 3
"""A popular prefix honest users send: the attacker pulls its blocks."""
FORGED_PREFIX = "The following is a conversation with a support agent of the bank. " * 3
"""A popular prefix the attacker forges KV for before honest users send it."""
HONEST_PROMPTS = [
    SYSTEM_PROMPT + "What is a prime number?",
    SYSTEM_PROMPT + "Who wrote Hamlet?",
    "def fibonacci(n):",
    "The quick brown fox jumps over the lazy dog. " * 4,
]
FORGED_PROMPT = FORGED_PREFIX + "Customer: how do I reset my password?"
HONEST_SAMPLING = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}


@dataclass(frozen=True)
class WorkerEndpoints:
    name: str
    role: str  # "prefill", "decode" or "colocated"
    kv_address: str | None
    outputs: str | None
    outputs_local: str | None


@dataclass(frozen=True)
class Target:
    """What the attacker knows of a deployment (addresses, the router's id
    as worker logs show it, the public model's KV layout and tokens) and the
    keys honest users (and the test's own admin checks) use."""

    address: str  # the router's gRPC front
    http_url: str
    router_id: str
    layout: KVLayout
    workers: tuple[WorkerEndpoints, ...]
    pools: tuple[int, int]  # (prefill, decode) workers now
    user_key: str
    system_tokens: tuple[int, ...]  # SYSTEM_PROMPT's token ids
    forged_tokens: tuple[int, ...]  # FORGED_PREFIX's

    def of_role(self, *roles: str) -> list[WorkerEndpoints]:
        return [w for w in self.workers if w.role in roles]


@dataclass(frozen=True)
class Attack:
    name: str
    args: Callable[[Target], list[str]]  # the attacker's command line
    expected: frozenset[str]  # the statuses the attack must get


def _kv(w: WorkerEndpoints, t: Target) -> list[str]:
    return ["--kv", str(w.kv_address), "--layout", json.dumps(dataclasses.asdict(t.layout))]


def _push_to(w: WorkerEndpoints, t: Target) -> list[str]:
    """A push's arguments: the worker, and how to name a router it streams to."""
    return [*_kv(w, t), "--outputs", str(w.outputs), "--router-id", t.router_id]


def _tokens(ids: Sequence[int]) -> list[str]:
    return ["--tokens", ",".join(map(str, ids))]


def _decode(t: Target) -> WorkerEndpoints:
    return t.of_role("decode", "colocated")[0]


def _scale(key: str | None) -> Callable[[Target], list[str]]:
    def args(t: Target) -> list[str]:
        sizes = ["--prefill", str(t.pools[0]), "--decode", str(t.pools[1])]
        return ["scale", "--target", t.address, *sizes, *(["--key", key] if key else [])]

    return args


ATTACKS = [
    Attack(
        "pull the cached blocks of a served prompt (decode worker)",
        lambda t: ["pull", *_kv(_decode(t), t), *_tokens(t.system_tokens)],
        REFUSED_KV,
    ),
    Attack(
        "pull the cached blocks of a served prompt (prefill worker)",
        lambda t: ["pull", *_kv(t.of_role("prefill")[0], t), *_tokens(t.system_tokens)],
        REFUSED_KV,
    ),
    Attack(
        "log in to an output stream (TCP)",
        lambda t: ["stream", "--outputs", str(_decode(t).outputs)],
        DROPPED,
    ),
    Attack(
        "log in to an output stream (abstract Unix socket)",
        lambda t: ["stream", "--outputs", str(_decode(t).outputs_local)],
        DROPPED,
    ),
    Attack("Scale with no key", _scale(None), frozenset({"UNAUTHENTICATED"})),
    Attack(
        "Scale with a user key", lambda t: _scale(t.user_key)(t), frozenset({"PERMISSION_DENIED"})
    ),
    Attack(
        "HTTP body of 100 MB",
        lambda t: ["body", "--http", t.http_url, "--key", t.user_key, "--mb", "100"],
        frozenset({"HTTP 413"}),
    ),
    Attack(
        "a request on the edges of every sampling bound (non-finite logits)",
        lambda t: ["nan", "--target", t.address, "--key", t.user_key],
        CONTAINED,
    ),
]
"""The attacks whose outcome is all there is to check."""
FORGE = Attack(
    "push forged KV under a popular prefix's hashes",
    lambda t: ["push", *_push_to(_decode(t), t), *_tokens(t.forged_tokens)],
    REFUSED_KV,
)
STOP_FLOODS = [
    Attack(
        "64 requests of 4,096 stop strings of 256 characters (gRPC)",
        lambda t: ["stops", "--target", t.address, "--key", t.user_key, "--requests", "64"],
        # The field's bound, or the message size the context length allows.
        frozenset({"INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"}),
    ),
    Attack(
        "64 requests of 4,096 stop strings of 256 characters (HTTP)",
        lambda t: ["stops-http", "--target", t.http_url, "--key", t.user_key, "--requests", "64"],
        frozenset({"HTTP 400"}),
    ),
]
TAKEOVER = Attack(
    "take over the router's id on an output stream",
    lambda t: ["stream", "--outputs", str(_decode(t).outputs), "--router-id", t.router_id],
    DROPPED,
)
RESERVE = Attack(
    "reserve the decode pool with a header-only push",
    lambda t: ["reserve", *_push_to(_decode(t), t), "--blocks", "0", "--hold-s", "0"],
    REFUSED_KV,
)
"""Run by ``reserve_pool`` (it needs the pool's size and a look while held)."""
INSIDER_PREFIX = "insider (cluster secret, no grant): "
INSIDER = [
    Attack(INSIDER_PREFIX + a.name, lambda t, a=a: [*a.args(t), "--secret-stdin"], NO_GRANT)
    for a in (*ATTACKS[:2], FORGE)
]
"""The pulls and the forged push again, from a process that holds the secret."""
INSIDER_RESERVE = Attack(
    INSIDER_PREFIX + RESERVE.name, lambda t: [*RESERVE.args(t), "--secret-stdin"], NO_GRANT
)
INSIDER_TAKEOVER = Attack(
    INSIDER_PREFIX.replace("no grant", "a live stream's id") + TAKEOVER.name,
    lambda t: [*TAKEOVER.args(t), "--secret-stdin"],
    DROPPED,
)
"""A login that passes the handshake under the id of the router's live stream."""
NAN_ATTACKS = [
    Attack(
        "a request whose logits turn NaN at prefill (tests/faults.py's hook)",
        lambda t: ["nan-prompt", "--target", t.address, "--key", t.user_key],
        FAULTED,
    ),
    Attack(
        "a request whose logits turn NaN after two decode tokens (tests/faults.py's hook)",
        lambda t: ["nan-prompt", "--target", t.address, "--key", t.user_key, "--late"],
        FAULTED,
    ),
]
"""Only on workers of tests/faults.py's Faulty*Actor classes (test_attacks.py)."""


def stranger_env() -> dict[str, str]:
    """This process's environment without a TANDEM_* or RAY_* variable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TANDEM_", "RAY_"))}
    env["PYTHONPATH"] = str(ROOT)
    return env


def _command(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "benchkit.attacker", *args]


def _outcome(line: str) -> Outcome:
    return Outcome(**json.loads(line))


def _stdin(secret: bytes | None) -> str | None:
    """What an insider reads on stdin: the secret, in hex (never on argv)."""
    return None if secret is None else secret.hex() + "\n"


def run_attacker(args: list[str], timeout_s: float = 300.0, secret: bytes | None = None) -> Outcome:
    """Run one attack in a fresh process; its last output line. ``secret``:
    the cluster secret an insider attack reads on its stdin."""
    done = subprocess.run(
        _command(args), cwd=ROOT, env=stranger_env(), capture_output=True, text=True,
        timeout=timeout_s, input=_stdin(secret),
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return Outcome("attacker failed", tail[0][:200])
    return _outcome(lines[-1])


def reserve_pool(
    target: Target,
    blocks: int,
    hold_s: float,
    while_held: Callable[[], object],
    secret: bytes | None = None,
):
    """The header-only push for ``blocks`` blocks of the decode worker (an
    insider's with ``secret``): its outcome and what ``while_held()``
    returned (run while the call is held; None when the push was refused).
    Returns once the attacker has exited."""
    args = (INSIDER_RESERVE if secret is not None else RESERVE).args(target)
    args[args.index("--blocks") + 1] = str(blocks)
    args[args.index("--hold-s") + 1] = str(hold_s)
    proc = subprocess.Popen(
        _command(args), cwd=ROOT, env=stranger_env(), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(_stdin(secret) or "")
        proc.stdin.close()
        first = proc.stdout.readline()
        if not first:
            return Outcome("attacker failed", "no output"), None
        outcome = _outcome(first)
        seen = while_held() if outcome.status == "OK" else None
        proc.stdout.read()
        proc.wait(timeout=hold_s + 60)
        return outcome, seen
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def table(rows: Sequence[tuple[str, Outcome, frozenset[str]]]) -> str:
    """A markdown table: attack | what it got | refused or contained as required."""
    lines = ["| attack | what it got | as required |", "|---|---|---|"]
    for name, got, expected in rows:
        detail = got.detail.replace("|", "/").replace("\n", " ")
        ok = "yes" if got.status in expected else f"no (wants {' or '.join(sorted(expected))})"
        lines.append(f"| {name} | {got.status}: {detail} | {ok} |")
    return "\n".join(lines)
