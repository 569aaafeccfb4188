"""Perplexity of a model on a fixed text the repository generates.

The text: the docstrings of a fixed list of Python standard library modules
(module, class and function docstrings, in source order), read with ``ast``
from this interpreter's sources, so every machine with the same Python builds
the same text. ``perplexity`` cuts its first ``max_tokens`` tokens into
windows of ``window`` tokens and scores each window from its start (no
context carried over), teacher-forced through the engine's own forward.
"""

from __future__ import annotations

import ast
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import PrefillSlice, build_metadata, slice_table
from engine.block_pool import Holder

MODULES = ("textwrap", "json/__init__", "functools", "argparse", "collections/__init__", "heapq")
"""Standard library modules whose docstrings make the text, in this order."""

SCORER = Holder("scratch", "perplexity")


def stdlib_docstrings(modules: tuple[str, ...] = MODULES) -> str:
    """The docstrings of ``modules`` (paths under the standard library, no .py)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts = []
    for name in modules:
        tree = ast.parse((root / f"{name}.py").read_text(encoding="utf-8"))
        nodes = [tree, *ast.walk(tree)]
        for node in nodes:
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node, clean=True)
                if doc and doc not in parts:
                    parts.append(doc)
    return "\n\n".join(parts)


@dataclass(frozen=True)
class Perplexity:
    perplexity: float
    tokens: int  # scored (predicted) tokens
    windows: int


@torch.inference_mode()
def window_logprobs(engine, token_ids: list[int]) -> torch.Tensor:
    """log p(token_ids[i + 1] | token_ids[: i + 1]) for each i, from one prefill
    of ``token_ids`` into blocks borrowed from ``engine``'s pool (given back)."""
    bs = engine.config.block_size
    n = len(token_ids)
    blocks = engine.block_pool.allocate(SCORER, -(-n // bs))
    if blocks is None:
        raise RuntimeError(f"the KV pool has no room for a window of {n} tokens")
    try:
        device = engine.device
        table = slice_table(blocks, device, engine.model.gpu_attention)
        slots = [blocks[p // bs] * bs + p % bs for p in range(n)]
        meta = build_metadata(
            bs, [], [], [PrefillSlice(0, n, 0, table)], slots, device, engine.model.fused,
            row_invariant=engine.config.deterministic, gpu_kernel=engine.model.gpu_attention,
        )  # fmt: skip
        ids = torch.tensor(token_ids, device=device)
        hidden = engine.model.forward(ids, torch.arange(n, device=device), meta, engine.kv_cache)
        logits = engine.model.logits(hidden[:-1])[:, : engine.spec.vocab_size].float()
        return torch.log_softmax(logits, -1).gather(1, ids[1:, None]).squeeze(1).cpu()
    finally:
        engine.block_pool.release(SCORER, blocks)


def perplexity(engine, text: str, max_tokens: int = 4096, window: int = 512) -> Perplexity:
    """exp of the mean negative log-likelihood over ``text``'s first ``max_tokens``
    tokens, in windows of ``window``."""
    ids = list(engine.tokenizer.encode(text))[:max_tokens]
    total, count, windows = 0.0, 0, 0
    for start in range(0, len(ids) - 1, window):
        chunk = ids[start : start + window]
        if len(chunk) < 2:
            break
        lp = window_logprobs(engine, chunk)
        total -= float(lp.double().sum())
        count += len(lp)
        windows += 1
    return Perplexity(math.exp(total / count), count, windows)
