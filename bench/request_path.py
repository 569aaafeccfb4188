"""How many of tandem's source files and classes one request runs through,
in the router's process and the workers' (the structure, not the speed).

  python bench/request_path.py [--mode disaggregated|colocated]

Starts a local Ray cluster on loopback and a deployment (1 prefill + 1
decode worker, or 1 colocated), sends a warm-up request, then one measured
greedy request (a fresh 64-token prompt, 8 output tokens), with every
process profiled by benchkit/trace_calls.py. Prints the files and the
classes the measured request ran through (tests, benchmarks and generated
protobuf code left out), and a JSON line. Runs on older checkouts too.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import importlib
import json
import os
import tempfile
import time

import grpc
import ray

from benchkit import trace_calls
from protos.tandem.v1 import generate_pb2, generate_pb2_grpc


def _first(*candidates: tuple[str, str]):
    for module, name in candidates:
        try:
            return getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError):
            continue
    raise ImportError(f"none of {candidates}")


def _config(mode: str):
    ServeConfig = _first(("router.config", "ServeConfig"), ("tandem_cli.config", "ServeConfig"))
    flat = {"mode": mode, "decode": 1, "prefill": 1 if mode == "disaggregated" else 0}
    try:
        return ServeConfig(**flat)
    except Exception:  # a sectioned config
        return ServeConfig(pools=flat)


def _generate(address: str, prompt: list[int]) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.TandemStub(channel)
        request = generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True
        )
        return [t for r in stub.Generate(request) if r.HasField("chunk") for t in r.chunk.token_ids]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["disaggregated", "colocated"], default="disaggregated")
    args = parser.parse_args()
    trace_dir = Path(tempfile.mkdtemp(prefix="tandem-trace-"))
    os.environ[trace_calls.ENV] = str(trace_dir)
    ray.init(
        num_cpus=4,
        _node_ip_address="127.0.0.2",
        include_dashboard=False,
        runtime_env={
            "worker_process_setup_hook": "benchkit.trace_calls.install",
            "env_vars": {trace_calls.ENV: str(trace_dir)},
        },
    )
    Deployment = _first(
        ("benchkit.deployment", "Deployment"),
        ("tests.deployment", "Deployment"),
        ("tandem_cli.deployment", "Deployment"),
    )
    trace_calls.install()  # the router runs in this process, on a thread started below
    deployment = Deployment(_config(args.mode))
    try:
        _generate(deployment.address, list(range(100, 164)))  # warm-up
        (trace_dir / "epoch").write_text("request")
        time.sleep(0.5)  # every process has seen the window open
        tokens = _generate(deployment.address, list(range(300, 364)))
        time.sleep(1.0)  # the workers' last calls of the request (aborts, cache events)
        (trace_dir / "epoch").write_text("after")
        time.sleep(0.2)
    finally:
        deployment.stop()
        ray.shutdown()
    calls = trace_calls.read(trace_dir, "request")
    classes = sorted(
        {(f, c) for f, names in calls.items() for c in trace_calls.classes_of(names)},
    )
    print(f"mode {args.mode}: {len(tokens)} tokens")
    print(f"{len(calls)} files:")
    for path in sorted(calls):
        print(f"  {path}")
    print(f"{len(classes)} classes:")
    for path, name in classes:
        print(f"  {path}: {name}")
    print(json.dumps({"mode": args.mode, "files": len(calls), "classes": len(classes)}))


if __name__ == "__main__":
    main()
