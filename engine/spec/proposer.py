"""What proposes tokens for speculative decoding, and prompt lookup.

A proposer sees the sequences to speculate on (each with its own budget
``k``) and returns up to ``k`` tokens for each; an empty proposal is always
allowed (the sequence then decodes one token as usual). ``probs`` carries
the proposer's distribution of each proposed token when it sampled them
(a draft model on a sampled request); None means a point mass, which the
verify rule treats exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from engine.sequence import Sequence


@dataclass
class Proposal:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), V] or None (point masses)


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        """One proposal per sequence, at most ``budgets[i]`` tokens long."""

    def release(self, request_id: str) -> None:
        """The request is gone: drop whatever is kept for it."""


class NgramProposer:
    """Prompt lookup: find the latest earlier occurrence of the sequence's last
    ``n`` tokens (n from ``ngram_max`` down to ``ngram_min``) in its prompt and
    output, and propose the tokens that followed it (repeating them when they
    run into the end: a sequence in a loop gets all k tokens). Costs no model pass; pays
    off when the output repeats its context (editing code, quoting, extraction)."""

    def __init__(self, ngram_min: int, ngram_max: int) -> None:
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        return [
            Proposal(self.lookup(s.all_token_ids(), k)) for s, k in zip(seqs, budgets, strict=True)
        ]

    def lookup(self, tokens: list[int], k: int) -> list[int]:
        if k <= 0:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram_max, len(arr) - 1), self.ngram_min - 1, -1):
            suffix = arr[-n:]
            # Windows that start before the suffix itself: [0, len - n).
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                # The suffix recurs ``period`` tokens later: continue with that
                # period, past the end too (a loop proposes all k tokens).
                period = len(arr) - n - int(hits[-1])
                out = arr[len(arr) - period :][:k].tolist()
                while len(out) < k:
                    out.append(out[len(out) - period])
                return out
        return []

    def release(self, request_id: str) -> None:
        return None
