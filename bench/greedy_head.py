"""The greedy screens of the LM head against the full float32 logits, same run.

For the default model's head shape (or --hidden/--vocab) and random rows, it
times cpu_ops' greedy_head_i8 (engine.kernels.Int8Head), greedy_head_f16
(HalfHead) and the full logits with a row argmax, interleaved, on one
thread, at 1, 16 and 64 rows; it also checks that all three give the same
tokens (an unsettled row, -1, counts as a match: the engine then computes
that row's logits in full). The last line is one JSON object: medians in ms.

  python bench/greedy_head.py [--hidden 256] [--vocab 32000] [--rounds 7]
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as `python bench/<name>.py`: the repository root first on the path, so
# `engine` is the package and not bench/engine.py.
sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import statistics
import time

import torch

from engine import kernels


def _time(fn, repeats: int) -> float:
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    ops = kernels.cpu_ops(required=True)
    if not hasattr(ops, "greedy_head_i8"):
        raise SystemExit("this CPU has no AVX2/F16C/FMA: no screen to measure")
    gen = torch.Generator().manual_seed(0)
    head = kernels.PackedWeight.pack(torch.randn(args.hidden, args.vocab, generator=gen) * 0.02)
    int8, half = kernels.Int8Head.of(head), kernels.HalfHead.of(head)
    assert int8 is not None and half is not None
    n = args.vocab

    def full(x):
        return ops.argmax_rows(ops.linear(x, head.panels, n)[:, :n].contiguous())

    ways = {
        "int8": lambda x: int8.tokens(ops, x, head, n, 64),
        "float16": lambda x: half.tokens(ops, x, head, n, 64),
        "full": full,
    }
    results = {}
    for rows in (1, 16, 64):
        x = torch.randn(rows, args.hidden, generator=gen) * 3
        expected = full(x)
        for name, fn in ways.items():
            got = fn(x)
            ok = (got == expected) | (got < 0)
            assert bool(ok.all()), f"{name} disagrees with the full logits"
        times: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):
            for name, fn in ways.items():
                times[name].append(_time(lambda fn=fn, x=x: fn(x), 10))
        results[f"rows_{rows}"] = {k: round(statistics.median(v), 3) for k, v in times.items()}
        print(rows, results[f"rows_{rows}"], flush=True)
    print(json.dumps({"hidden": args.hidden, "vocab": args.vocab, **results}))


if __name__ == "__main__":
    main()
