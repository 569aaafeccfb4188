"""Benchmark kit behind `tandem bench` and the benchmarks (bench/): workloads, a
load runner, metrics, reports, plots, and the harnesses that start what they
measure (an in-process deployment, `tandem serve` in a subprocess, KV transfer
peers in processes of their own)."""
