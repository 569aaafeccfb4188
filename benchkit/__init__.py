"""Benchmark kit behind `tandem bench`: workloads, a load runner, metrics, reports, plots."""
