"""How much the bare engine's decode step slows down when another core reads
memory: the shared last-level cache, not the decode core, is what the router
and the client take from a decode worker bound to a core of its own.

The default model's 1-stream step reads about 20 MB of weights (float32
layers, the int8 greedy head): on a machine whose last-level cache holds
them, every line another core evicts comes back from DRAM. This process runs
the bare engine on the core `tandem serve` would give a decode worker
(worker/cpu_binding.py); a subprocess on the shared cores sweeps an array of
SWEEP_MB, sleeping SLEEP_S between sweeps (0: without a pause). The loads
alternate round by round; medians over ROUNDS of each load's mean step.

  python bench/cache_interference.py [--streams 1] [--rounds 4]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Run as `python bench/<name>.py`: the repository root first on the path, so
# `engine` is the package and not bench/engine.py.
sys.path[0] = str(Path(__file__).resolve().parents[1])

# Figures in docs/benchmarks.md are of the random tiny model: keep it the default here
# (and in the `tandem serve` this starts); TANDEM_DEFAULT_MODEL=... measures another.
os.environ.setdefault("TANDEM_DEFAULT_MODEL", "tandem-tiny-llama")

import argparse
import json
import statistics
import subprocess
import time

from benchkit.bare_engine import decode_step_times, random_prompts
from engine import EngineConfig, LLMEngine
from worker.cpu_binding import available_cores, bind_process, plan_layout
from worker.heap import freeze_startup_heap

OUT_TOKENS = 256
LOADS = {  # name: (SWEEP_MB, SLEEP_S); None: nothing runs on the shared cores
    "idle": None,
    "4MB_every_0.5ms": (4, 0.0005),
    "16MB_every_0.5ms": (16, 0.0005),
    "16MB_nonstop": (16, 0.0),
}
SWEEPER = """
import os, time
import numpy as np
os.sched_setaffinity(0, {cores})
a = np.ones({mb} << 17)  # float64: 8 bytes each
while True:
    a.sum()
    if {sleep_s}:
        time.sleep({sleep_s})
"""


def mean_step_ms(engine: LLMEngine, streams: int, seed: int) -> float:
    batch = random_prompts(streams, 64, seed)
    return statistics.mean(decode_step_times(engine, batch, OUT_TOKENS, str(seed))) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    layout = plan_layout(available_cores(), decode_workers=1, threads=1)
    if layout is None:
        sys.exit("needs at least two cores: one for the engine, one for the load")
    bind_process(layout.decode[0])
    print("cpu binding:", layout.describe(), flush=True)
    engine = LLMEngine(EngineConfig(num_threads=1, kv_cache_memory_bytes=256 << 20))
    freeze_startup_heap()
    mean_step_ms(engine, args.streams, seed=0)  # warm up
    steps: dict[str, list[float]] = {name: [] for name in LOADS}
    for r in range(args.rounds):
        names = list(LOADS) if r % 2 == 0 else list(reversed(LOADS))
        for name in names:
            load = LOADS[name]
            sweeper = None
            if load is not None:
                mb, sleep_s = load
                code = SWEEPER.format(cores=set(layout.shared), mb=mb, sleep_s=sleep_s)
                sweeper = subprocess.Popen([sys.executable, "-c", code])
                time.sleep(1.0)  # numpy imported, the array touched
            try:
                steps[name].append(mean_step_ms(engine, args.streams, seed=1 + r))
            finally:
                if sweeper is not None:
                    sweeper.kill()
                    sweeper.wait()
        print(r, {n: round(v[-1], 3) for n, v in steps.items()}, flush=True)
    idle = statistics.median(steps["idle"])
    results = {
        name: {
            "mean_step_ms": round(statistics.median(v), 3),
            "over_idle": round(statistics.median(v) / idle, 3),
        }
        for name, v in steps.items()
    }
    print(json.dumps({"streams": args.streams, **results}))


if __name__ == "__main__":
    main()
