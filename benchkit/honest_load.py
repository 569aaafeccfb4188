"""Honest users' greedy streams beside the attack suite (benchkit/attacks.py):
round after round of the same prompts, each stream's tokens checked against
the engine alone's."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

from benchkit.attacks import HONEST_SAMPLING


@dataclass
class HonestLoad:
    """Honest users' greedy streams, round after round in a thread of their
    own until ``stop``; each stream's tokens are checked against
    ``reference`` (prompt -> the engine alone's tokens)."""

    address: str
    key: str
    reference: dict[str, list[int]]
    streams: int = 0
    mismatches: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._paused = threading.Event()
        self._idle = threading.Event()  # set between rounds while paused
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def start(self) -> HonestLoad:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=300)

    def pause(self) -> None:
        """Returns once the round in flight has finished; none starts until ``resume``."""
        self._idle.clear()
        self._paused.set()
        self._idle.wait(timeout=300)

    def resume(self) -> None:
        self._paused.clear()

    async def _run(self) -> None:
        from router.client import TandemClient

        async with TandemClient(self.address, timeout_s=120, api_key=self.key) as client:
            while not self._stop.is_set():
                if self._paused.is_set():
                    self._idle.set()
                    await asyncio.sleep(0.05)
                    continue
                await asyncio.gather(*(self._one(client, p) for p in self.reference))

    async def _one(self, client, prompt: str) -> None:
        try:
            done = await client.complete(prompt, **HONEST_SAMPLING)
        except Exception as e:  # every failure is a finding
            self.errors.append(f"{prompt[:30]!r}: {type(e).__name__}: {e}"[:300])
            return
        self.streams += 1
        if done.token_ids != self.reference[prompt]:
            self.mismatches.append(f"{prompt[:30]!r}: {done.token_ids}")
