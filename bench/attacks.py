"""Every attack of the attack suite against a deployment started with default
options (one prefill and one decode worker on a local Ray, an HTTP front,
one user key and one admin key in the environment, nothing else set).

    python bench/attacks.py [--hold-s 10]

Each attack runs in a process of its own with no credential
(benchkit/attacker.py, benchkit/attacks.py) while honest users stream
greedy requests; the insider attacks get the generated cluster secret on
their stdin. The NaN attacks need tests/faults.py's poisoned workers,
which a benchmark does not run: their row here is the same request on the
product's workers (answered), and tests/integration/test_attacks.py is
where it meets NaN logits. Prints a markdown table (attack | what it got | as
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

from benchkit.attack_outcome import Outcome
from benchkit.attack_target import cluster_secret, engine_alone, rss_mb, target_of, worker_pids
from benchkit.attacks import (
    ATTACKS,
    FORGE,
    HONEST_PROMPTS,
    INSIDER,
    INSIDER_RESERVE,
    INSIDER_TAKEOVER,
    NAN_ATTACKS,
    RESERVE,
    STOP_FLOODS,
    TAKEOVER,
    Attack,
    reserve_pool,
    run_attacker,
    table,
)
from benchkit.deployment import Deployment
from benchkit.honest_load import HonestLoad
from router.config import ServeConfig

USER_KEY = "sk-bench-attacks-user"
ADMIN_KEY = "sk-bench-attacks-admin"
NAN_UNPOISONED = Attack(
    "the NaN prompt on the product's workers (NaN needs tests/faults.py's hook: test_attacks.py)",
    NAN_ATTACKS[0].args,
    frozenset({"OK"}),
)
"""What a benchmark can run of the NaN attack: without the hook, a plain request."""


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
        secret = cluster_secret(dep)
        attacks = [*ATTACKS, NAN_UNPOISONED, FORGE]
        rows = [(a.name, run_attacker(a.args(target)), a.expected) for a in attacks]
        rows += [(a.name, run_attacker(a.args(target), secret=secret), a.expected) for a in INSIDER]
        decode = target.of_role("decode", "colocated")[0].name
        for reserve, key in ((RESERVE, None), (INSIDER_RESERVE, secret)):
            load.pause()  # the pool's free blocks stay put until the header takes them
            dep.wait_no_leaks(90)
            free = dep.worker_stats()[decode].free_blocks
            first, seen = reserve_pool(
                target, free, args.hold_s, lambda: dep.worker_stats()[decode].free_blocks, key
            )
            free_after = dep.worker_stats()[decode].free_blocks
            load.resume()
            held = f"{seen} blocks free while held, " if seen is not None else ""
            detail = f"{first.detail}; {held}{free_after} of {free} free after it"
            rows.append((reserve.name, Outcome(first.status, detail), reserve.expected))
        pids = worker_pids(dep)
        before = {n: rss_mb(p) for n, p in pids.items()}
        rows += [(f.name, run_attacker(f.args(target)), f.expected) for f in STOP_FLOODS]
        growth = {n: round(rss_mb(p) - before[n], 1) for n, p in pids.items()}
        rows.append((TAKEOVER.name, run_attacker(TAKEOVER.args(target)), TAKEOVER.expected))
        insider = run_attacker(INSIDER_TAKEOVER.args(target), secret=secret)
        rows.append((INSIDER_TAKEOVER.name, insider, INSIDER_TAKEOVER.expected))
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
