"""Ranks 1..N-1 as child processes of this one (the offline ``LLM``'s, and
any engine built without a launcher of its own).

Each rank is ``python -m engine.parallel.rank`` with its spec pickled on
stdin: a fresh interpreter that imports this process's code (its
``sys.path``), not a fork of a process that may hold threads, and not a
re-run of the caller's main module. A rank ends with this process (Linux:
the parent-death signal; elsewhere when its group's connections close).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

from engine.parallel.rank import RankSpec


class LocalRanks:
    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen] = {}

    def device(self, rank: int, device_type: str) -> str:
        """Rank ``rank``'s device: cuda:<rank> on a GPU machine, else the host."""
        return f"cuda:{rank}" if device_type == "cuda" else "cpu"

    def launch(self, specs: list[RankSpec]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        for spec in specs:
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.parallel.rank"], stdin=subprocess.PIPE, env=env
            )
            self._procs[spec.rank] = proc
            assert proc.stdin is not None
            proc.stdin.write(pickle.dumps(spec))
            proc.stdin.close()

    def pids(self) -> dict[int, int]:
        """Each rank's process id."""
        return {rank: proc.pid for rank, proc in self._procs.items()}

    def lost(self) -> str | None:
        """Which rank has exited, and how; None while all run."""
        for rank, proc in self._procs.items():
            if proc.poll() is not None:
                return f"rank {rank} exited with code {proc.returncode}"
        return None

    def close(self, timeout_s: float) -> None:
        """Wait for the ranks to end (after a stop), then kill what is left."""
        for proc in self._procs.values():
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
