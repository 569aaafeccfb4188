"""Which of tandem's source files and classes a piece of work runs through,
in every process it touches (the driver with the router, and Ray's worker
processes through ``worker_process_setup_hook``).

With ``TANDEM_TRACE_DIR`` set, ``install()`` profiles the process: each
Python function of the repository (tests and benchmarks left out) called
while the directory's ``epoch`` file names a window is written once per
window to ``<dir>/<pid>.tsv``. Measurement only: slow, never in serving.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

ENV = "TANDEM_TRACE_DIR"
ROOT = str(Path(__file__).resolve().parents[1]) + os.sep
SKIP = tuple(ROOT + d + os.sep for d in ("tests", "bench", "benchkit", ".venv", "protos"))
EPOCH_CHECK_S = 0.05


def install() -> None:
    out = os.environ.get(ENV)
    if not out:
        return
    log = open(Path(out) / f"{os.getpid()}.tsv", "a", buffering=1)  # noqa: SIM115 (lives with the process)
    epoch_file = Path(out) / "epoch"
    seen: set[tuple[str, str]] = set()
    state = {"epoch": "", "checked": 0.0}
    lock = threading.Lock()

    def profile(frame, event, arg) -> None:
        if event != "call":
            return
        code = frame.f_code
        path = code.co_filename
        if not path.startswith(ROOT) or path.startswith(SKIP):
            return
        with lock:
            now = time.monotonic()
            if now - state["checked"] > EPOCH_CHECK_S:
                state["checked"] = now
                try:
                    epoch = epoch_file.read_text().strip()
                except OSError:
                    epoch = ""
                if epoch != state["epoch"]:
                    state["epoch"] = epoch
                    seen.clear()
            key = (path[len(ROOT) :], code.co_qualname)
            if not state["epoch"] or key in seen:
                return
            seen.add(key)
            log.write(f"{state['epoch']}\t{key[0]}\t{key[1]}\n")

    sys.setprofile(profile)
    threading.setprofile(profile)


def classes_of(qualnames: set[str]) -> set[str]:
    """The classes among ``Class.method`` qualnames (nested functions aside)."""
    out = set()
    for name in qualnames:
        head, _, rest = name.partition(".")
        if rest and not rest.startswith("<locals>") and head != "<module>" and head[:1].isupper():
            out.add(head)
    return out


def read(trace_dir: Path, epoch: str) -> dict[str, set[str]]:
    """file -> qualnames called in ``epoch``, over every process."""
    calls: dict[str, set[str]] = {}
    for tsv in trace_dir.glob("*.tsv"):
        for line in tsv.read_text().splitlines():
            parts = line.split("\t")
            if len(parts) == 3 and parts[0] == epoch:
                calls.setdefault(parts[1], set()).add(parts[2])
    return calls
