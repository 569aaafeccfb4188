"""What tensor parallelism costs an offline engine on this machine: output
tokens per second at tensor_parallel_size N against 1, in the same run, on
the same prompts (greedy; the tokens are checked equal).

Each rank is a process with ``--threads`` torch threads; on CPU the ranks
exchange two all-reduces a layer and the step's inputs over gloo on
loopback, so a small model on a few cores measures that overhead, not the
arithmetic a bigger model would split (docs/tensor-parallel.md).

  python bench/tensor_parallel.py [--tp 2] [--streams 8] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # `engine` is the package
os.environ.setdefault("TANDEM_DEFAULT_MODEL", "tandem-tiny-llama")

import argparse
import json
import time

import torch

from engine import LLM
from protocol.sampling import SamplingParams


def run(tp: int, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, list]:
    """Output tokens per second over ``prompts`` at ``tp`` ranks, and the outputs."""
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    options = {"num_kv_blocks": 512, "num_threads": args.threads, "tensor_parallel_size": tp}
    with LLM(args.model, **options) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    return len(prompts) * args.tokens / elapsed, [o.token_ids for o in outs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the tiny model)")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(10, 1000, (args.prompt_tokens,), generator=gen).tolist()
        for _ in range(args.streams)
    ]
    one, one_out = run(1, prompts, args)
    many, many_out = run(args.tp, prompts, args)
    print(f"tp=1: {one:.1f} tok/s   tp={args.tp}: {many:.1f} tok/s")
    result = {
        "tok_s_tp1": round(one, 1),
        f"tok_s_tp{args.tp}": round(many, 1),
        "ratio": round(many / one, 3),
        "tokens_equal": one_out == many_out,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
