"""Every attack of the attack suite against a deployment started with default
options (one prefill and one decode worker on a local Ray, an HTTP front,
one user key and one admin key in the environment, nothing else set).

    python bench/attacks.py [--hold-s 10]

Each attack runs in a process of its own with no credential
(benchkit/attacker.py, benchkit/attacks.py) while honest users stream
greedy requests. Prints a markdown table (attack | what it got | as
required), then what the honest streams got and the blocks left held,
then one JSON line with all of it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchkit.attack_target import engine_alone, rss_mb, target_of, worker_pids
from benchkit.attacker_kv import Outcome
from benchkit.attacks import (
    ATTACKS,
    FORGE,
    HONEST_PROMPTS,
    RESERVE,
    STOP_FLOODS,
    TAKEOVER,
    HonestLoad,
    reserve_pool,
    run_attacker,
    table,
)
from benchkit.deployment import Deployment
from router.config import ServeConfig

USER_KEY = "sk-bench-attacks-user"
ADMIN_KEY = "sk-bench-attacks-admin"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hold-s", type=float, default=10.0, help="how long the reserve holds")
    args = parser.parse_args()
    import ray

    os.environ["TANDEM_API_KEYS"] = USER_KEY
    os.environ["TANDEM_ADMIN_KEYS"] = ADMIN_KEY
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    reference = engine_alone()
    dep = Deployment(ServeConfig(server={"http_port": 0}))
    try:
        target = target_of(dep, USER_KEY, reference)
        load = HonestLoad(dep.address, USER_KEY, {p: reference.outputs[p] for p in HONEST_PROMPTS})
        load.start()
        rows = [(a.name, run_attacker(a.args(target)), a.expected) for a in [*ATTACKS, FORGE]]
        decode = target.of_role("decode", "colocated")[0].name
        load.pause()  # the pool's free blocks stay put until the header takes them
        dep.wait_no_leaks(90)
        free = dep.worker_stats()[decode].free_blocks
        first, seen = reserve_pool(
            target, free, args.hold_s, lambda: dep.worker_stats()[decode].free_blocks
        )
        load.resume()
        if seen is not None:
            first = Outcome(first.status, f"{first.detail}; {seen} blocks free while held")
        rows.append((RESERVE.name, first, RESERVE.expected))
        pids = worker_pids(dep)
        before = {n: rss_mb(p) for n, p in pids.items()}
        rows += [(f.name, run_attacker(f.args(target)), f.expected) for f in STOP_FLOODS]
        growth = {n: round(rss_mb(p) - before[n], 1) for n, p in pids.items()}
        rows.append((TAKEOVER.name, run_attacker(TAKEOVER.args(target)), TAKEOVER.expected))
        load.pause()
        leaks = dep.wait_no_leaks(90)
        load.stop()
    finally:
        dep.stop()
        ray.shutdown()
    print(table(rows))
    print(
        f"\nhonest streams: {load.streams} served, {len(load.mismatches)} with other tokens, "
        f"{len(load.errors)} failed; worker RSS growth over the stop floods (MiB): {growth}; "
        f"blocks left held: {leaks or 'none'}"
    )
    print(
        json.dumps(
            {
                "attacks": [
                    {**dataclasses.asdict(got), "attack": name, "as_required": got.status in want}
                    for name, got, want in rows
                ],
                "honest_streams": load.streams,
                "honest_mismatches": load.mismatches,
                "honest_errors": load.errors,
                "stop_flood_rss_growth_mb": growth,
                "leaked_blocks": leaks,
            }
        )
    )


if __name__ == "__main__":
    main()
