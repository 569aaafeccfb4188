"""The autoscaler against fixed pool splits on a rate step (2x, 8x, back to
2x) on the simulated engine (benchkit/autoscale_scenario.py): SLO
attainment autoscaled and with a fixed split of the autoscaled run's mean
worker count, both measured in this run on one deployment, and the
autoscaled run's worker-seconds over those of the cheapest fixed split the
planner finds meeting the targets on the same trace.

    python bench/autoscale.py [--unit-rps 2.5] [--ttft-ms 6000] [--tpot-ms 120]

Prints the figures, and last a JSON object with ``autoscaled_attainment``,
``fixed_attainment`` and ``worker_seconds_ratio``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    from benchkit.autoscale_scenario import Scenario, run

    defaults = Scenario()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--unit-rps", type=float, default=defaults.unit_rps, help="x (req/s)")
    parser.add_argument("--ttft-ms", type=float, default=defaults.ttft_ms)
    parser.add_argument("--tpot-ms", type=float, default=defaults.tpot_ms)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args()
    scenario = dataclasses.replace(
        defaults, unit_rps=args.unit_rps, ttft_ms=args.ttft_ms, tpot_ms=args.tpot_ms, seed=args.seed
    )

    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=8, _node_ip_address="127.0.0.2", include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as workdir:
            out = run(scenario, Path(workdir))
    finally:
        ray.shutdown()
    figures = out.figures(scenario)
    fixed = out.fixed
    assert fixed is not None
    print(
        f"trace: {figures['requests']} requests, x = {scenario.unit_rps:g} req/s, phases "
        f"{scenario.phases_s} s; SLO ttft {scenario.ttft_ms:g} ms, tpot {scenario.tpot_ms:g} ms"
    )
    print(
        f"autoscaled: attainment {figures['autoscaled_attainment']:.3f}, mean "
        f"{figures['autoscaled_mean_workers']:.1f} workers, peak "
        f"{figures['autoscaled_peak_workers']}, {figures['decisions']} decisions, "
        f"{figures['autoscaled_failed']} failed; back at the minimum "
        f"{out.at_minimum_after_s} s after the load"
    )
    print(
        f"fixed {fixed.split}: attainment {figures['fixed_attainment']:.3f}; cheapest "
        f"fixed meeting the SLO (planner) {fixed.cheapest}: worker-seconds ratio "
        f"{figures['worker_seconds_ratio']:.2f}"
    )
    if out.autoscaled.tokens != fixed.replay.tokens:
        print("outputs differ between the autoscaled and the fixed replay")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
