"""A request inside one engine: its tokens, blocks and progress.

``RequestOutput`` and ``TokenLogprobs`` (what a step produced) are torch-free
and live in protocol/outputs.py; they are re-exported here.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property

import torch

from engine.block_pool import Holder
from engine.detokenizer import IncrementalDetokenizer
from engine.hashing import BlockHash, hash_blocks
from protocol.outputs import RequestOutput, TokenLogprobs
from protocol.sampling import SamplingParams

__all__ = ["RequestOutput", "SeqStatus", "Sequence", "TokenLogprobs"]


KVWatcher = Callable[[list[int], int, int, int], None]
"""Told during a step where a sequence's KV stands: (its blocks, the tokens
whose KV every layer held before the step, the tokens whose KV layers
[0, ``layers``) hold now, ``layers``). Called on the engine thread, from the
model's forward pass too, while the blocks are the sequence's."""


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREFILLED = "prefilled"  # prefill-only: first token sampled, blocks held for export
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; the youngest is preempted first
    prefill_only: bool = False
    cache_salt: bytes = b""  # its prefix-cache domain: the ``extra`` of every block hash
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # what ``holder`` holds, in order
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full, computed blocks
    _hash_cache: list[BlockHash] = field(default_factory=list)  # of full blocks of its tokens
    num_computed: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    status: SeqStatus = SeqStatus.WAITING
    generator: torch.Generator | None = None
    detokenizer: IncrementalDetokenizer | None = None
    finish_reason: str | None = None
    # Proposed tokens after the last one, verified by this step (engine/spec/);
    # never part of num_tokens and never hashed.
    spec_token_ids: list[int] = field(default_factory=list)
    kv_watcher: KVWatcher | None = None  # a prefill that streams its KV out (LLMEngine.add_request)

    @cached_property
    def holder(self) -> Holder:
        """The holder of its blocks in the pool."""
        return Holder("request", self.request_id)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def full_block_hashes(self, n: int, block_size: int, root: BlockHash) -> list[BlockHash]:
        """Hashes of its first ``n`` full blocks, each computed once (tokens only
        grow, and a preempted sequence keeps them)."""
        have = len(self._hash_cache)
        if have < n:
            parent = self._hash_cache[-1] if have else None
            tokens = self.token_ids(0, n * block_size)
            self._hash_cache += hash_blocks(
                tokens, block_size, root, self.cache_salt, start=have, parent=parent
            )
        return self._hash_cache[:n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids
