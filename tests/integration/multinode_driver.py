"""Driver of the multi-node test (tests/integration/test_multinode.py), run in
a process of its own because a process joins one Ray cluster at most.

It joins the cluster at argv[1] from the head's address, starts a router
with a prefill pool pinned by a node label and a decode pool pinned by a
custom resource, and talks to
the test over stdin/stdout, one JSON object a line:

  -> {"phase": "placed", "workers": {...}, "outputs": [[...], ...]}
  <- "go" once the test has stopped the decode worker's node
  -> {"phase": "recovered", "dropped": [...], "workers": {...}, "outputs": [...],
      "leaked": {...}}
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import ray

from benchkit.deployment import Deployment
from router.client import TandemClient
from router.config import PoolsSection, ServeConfig, WorkerResources

HEAD_IP = "127.0.0.2"
MAX_TOKENS = 12


def prompts() -> list[list[int]]:
    return [[10 + (i * 7919 + j * 104729) % 30000 for j in range(24 + 9 * i)] for i in range(4)]


def send(message: dict) -> None:
    print(json.dumps(message), flush=True)


def workers(d: Deployment) -> dict[str, dict]:
    """Each worker's advertised addresses and the node Ray placed its actor on."""
    out = {}
    for w in d.backend.prefill.workers + d.backend.decode.workers:
        actor = ray._private.state.state.actor_table(w.actor._actor_id.hex())
        out[w.name] = {
            "role": w.role,
            "node_ip": actor["Address"]["IPAddress"],
            "kv": w.info.kv_address,
            "outputs": w.info.outputs,
        }
    return out


def generate(d: Deployment) -> list[list[int]]:
    async def run() -> list[list[int]]:
        async with TandemClient(d.address, timeout_s=300) as client:
            outs = [
                await client.complete(p, temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
                for p in prompts()
            ]
        return [o.token_ids for o in outs]

    return asyncio.run(run())


def main() -> None:
    ray.init(address=sys.argv[1], _node_ip_address=HEAD_IP, log_to_driver=False)
    pools = PoolsSection(
        # Prefill pinned by a node label alone, decode by a custom resource.
        prefill_resources=WorkerResources(labels={"pool": "prefill"}),
        decode_resources=WorkerResources(resources={"decode_node": 1}),
        worker_check_interval_s=0.5,
        # No in-place restarts (the chaos tests cover those): a lost node's worker
        # must be replaced by a new one where the pool's resources remain.
        worker_max_restarts=0,
    )
    config = ServeConfig(
        pools=pools, engine={"kv_cache_memory_mb": 16}, limits={"grace_period_s": 2}
    )
    d = Deployment(config)
    try:
        # Taken before the test stops the node: the router may notice the loss
        # (a broken output stream) before this process reads "go".
        before = {w.name for w in d.backend.decode.workers}
        send({"phase": "placed", "workers": workers(d), "outputs": generate(d)})
        if sys.stdin.readline().strip() != "go":
            return
        deadline = time.monotonic() + 180
        while {w.name for w in d.backend.decode.workers} in (before, set()):
            if time.monotonic() > deadline:
                raise TimeoutError("the decode pool did not replace its dead worker")
            time.sleep(0.2)
        send(
            {
                "phase": "recovered",
                "dropped": sorted(before - {w.name for w in d.backend.decode.workers}),
                "workers": workers(d),
                "outputs": generate(d),
                "leaked": d.wait_no_leaks(),
            }
        )
    finally:
        d.stop()
        ray.shutdown()


if __name__ == "__main__":
    main()
