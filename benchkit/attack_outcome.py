"""What one attack of the attack suite got (benchkit/attacker.py prints it
as a JSON line), in a module of its own: the attacks that do not speak KV
transfer run without importing torch."""

from __future__ import annotations

from dataclasses import dataclass

NO_SECRET = b""
"""The key of the only secret a stranger can guess: none (what a
deployment without a configured secret used to key its MACs with)."""


@dataclass(frozen=True)
class Outcome:
    """What one attack got: ``status`` is a gRPC code name (``OK`` when the
    call went through), ``HTTP <n>``, ``dropped`` (the connection ended
    before any data came back), ``served`` (data came back) or
    ``unreachable`` (nothing listens there: the attack did not run);
    ``detail`` says what, in words."""

    status: str
    detail: str
