"""Offline planning of pool sizes: profile the engine (``planner.profile``),
simulate the disaggregated system (``planner.simulator``), search for the
smallest (prefill, decode) pair that meets the SLOs (``planner.search``)."""
