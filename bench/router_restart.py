"""How long until a restarted router serves again: attaching to a named
deployment's running pools against a cold start (a new deployment), same
config, the embedded tiny model.

    python bench/router_restart.py [--restarts 3] [--cold-starts 1]

Each cold start is `tandem serve --deployment NEW` (a new local Ray cluster,
new workers, the model loaded, caches empty). Each restart SIGKILLs that
router and runs `tandem serve --deployment NAME` again: it finds the
cluster from its state file and attaches to the workers left running. A
start is timed from the process's spawn to the first completed request;
before each kill the router serves one prompt, and the restarted router's
answer to it says how many of its tokens came from the cache (warm caches).
`tandem down` removes every deployment at the end. The state files live in
a temporary XDG_STATE_HOME. Prints one line per start, the ratio, and last a
JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The embedded tiny model, as the figures in docs/benchmarks.md were measured
# (and in the `tandem serve` this starts); TANDEM_DEFAULT_MODEL=... measures another.
os.environ.setdefault("TANDEM_DEFAULT_MODEL", "tandem-tiny-llama")
sys.path.insert(0, str(ROOT))

from router.client import generate_sync

CONFIG = """\
engine: {kv_cache_memory_mb: 64}
limits: {grace_period_s: 5}
"""
SERVING = re.compile(r"tandem: serving .* on (\S+:\d+)")
PROMPT = "def fibonacci(n):\n    " * 8  # several KV blocks: a cache hit is visible
START_TIMEOUT_S = 600.0


@dataclass
class Start:
    kind: str  # "cold" or "attach"
    deployment: str
    serving_s: float  # spawn to the "serving" line
    first_response_s: float  # spawn to the first completed request
    cached_tokens: int  # of PROMPT, on the first request


def _env(state_home: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env.pop("RAY_ADDRESS", None)
    env.update(XDG_STATE_HOME=state_home, PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    return env


def _tandem(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandem_cli.main", *args]


def start_router(
    name: str, config: str, env: dict[str, str]
) -> tuple[subprocess.Popen, str, float]:
    """`tandem serve --deployment name` until it prints its address."""
    t0 = time.monotonic()
    cmd = _tandem("serve", "--config", config, "--deployment", name, "--port", "0")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    while time.monotonic() - t0 < START_TIMEOUT_S:
        line = proc.stdout.readline()
        match = SERVING.search(line)
        if match:
            return proc, match.group(1), time.monotonic() - t0
        if not line and proc.poll() is not None:
            raise RuntimeError(f"tandem serve --deployment {name} exited with {proc.returncode}")
    proc.kill()
    raise TimeoutError(f"tandem serve --deployment {name} did not serve in {START_TIMEOUT_S:g} s")


def timed_start(
    kind: str, name: str, config: str, env: dict[str, str]
) -> tuple[subprocess.Popen, Start]:
    t0 = time.monotonic()
    proc, address, serving_s = start_router(name, config, env)
    done = generate_sync(address, PROMPT, timeout_s=120, max_tokens=4, temperature=0)
    first_s = time.monotonic() - t0
    return proc, Start(kind, name, serving_s, first_s, done.usage.cached_tokens)


def kill(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)


def down(name: str, env: dict[str, str]) -> None:
    done = subprocess.run(
        _tandem("down", "--deployment", name, "--drain-timeout", "5"),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if done.returncode != 0:
        print(f"tandem down --deployment {name}: {done.stderr.strip()}", file=sys.stderr)


def run(restarts: int, cold_starts: int) -> dict:
    state_home = tempfile.mkdtemp(prefix="tandem-bench-state-")
    env = _env(state_home)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        f.write(CONFIG)
    tag = secrets.token_hex(3)
    names = [f"bench-restart-{tag}-{i}" for i in range(cold_starts)]
    starts: list[Start] = []
    try:
        for i, name in enumerate(names):
            proc, cold = timed_start("cold", name, f.name, env)
            starts.append(cold)
            print(
                f"cold start {name}: serving {cold.serving_s:.2f} s, "
                f"answered {cold.first_response_s:.2f} s"
            )
            if i == 0:  # restarts run on the first deployment
                for _ in range(restarts):
                    kill(proc)
                    proc, again = timed_start("attach", name, f.name, env)
                    starts.append(again)
                    print(
                        f"restart {name}: serving {again.serving_s:.2f} s, answered "
                        f"{again.first_response_s:.2f} s, "
                        f"{again.cached_tokens} prompt tokens cached"
                    )
            kill(proc)
    finally:
        for name in names:
            down(name, env)
        os.unlink(f.name)
        shutil.rmtree(state_home, ignore_errors=True)
    cold_s = statistics.median(s.first_response_s for s in starts if s.kind == "cold")
    attach = [s for s in starts if s.kind == "attach"]
    attach_s = statistics.median(s.first_response_s for s in attach) if attach else None
    ratio = cold_s / attach_s if attach_s else None
    if ratio is not None:
        print(f"cold start {cold_s:.2f} s / attach {attach_s:.2f} s = {ratio:.1f}x")
    return {
        "bench": "router_restart",
        "cold_start_s": cold_s,
        "attach_s": attach_s,
        "ratio": ratio,
        "attach_cached_tokens": [s.cached_tokens for s in attach],
        "starts": [asdict(s) for s in starts],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--restarts", type=int, default=3, help="router restarts (attach)")
    parser.add_argument("--cold-starts", type=int, default=1, help="new deployments")
    args = parser.parse_args()
    if args.cold_starts < 1 or args.restarts < 0:
        parser.error("--cold-starts must be at least 1 and --restarts at least 0")
    print(json.dumps(run(args.restarts, args.cold_starts)))


if __name__ == "__main__":
    main()
