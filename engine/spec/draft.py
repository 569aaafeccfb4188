"""The draft-model proposer: a smaller model sharing the target's tokenizer
proposes k tokens, one batched pass of its own per token.

The draft keeps its own block pool and KV cache, and per request the tokens
whose KV its cache holds; a request's draft blocks are held by a "draft"
holder of that pool, released with the request. Each round it first catches up on the tokens it
has not seen (the whole context the first time, e.g. after a KV transfer
from a prefill worker; then the tokens the target accepted or corrected),
which also gives the first proposal, then feeds back its own proposals.
Proposals the target rejects stay in the draft cache only until the next
round, which overwrites them: the common prefix with the sequence is what
counts as cached.

A greedy request gets the draft's argmax tokens (a point mass); a sampled
one gets tokens drawn from the draft's distribution under the request's
temperature/top-k/top-p/min-p, which are returned for the verify rule.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from engine.block_pool import BlockPool, Holder
from engine.config import EngineConfig, ModelSpec
from engine.device import resolve_device
from engine.gpu.paged_attention import use_kernel as use_gpu_kernel
from engine.kernels import select as select_kernels
from engine.kv_cache import KVCache, KVLayout
from engine.loader import load_hf_config, load_weights, model_fingerprint, resolve_model_dir
from engine.models.llama import LlamaModel
from engine.sampling import DRAFT_STREAM, probs_from_logits, seed_for_token
from engine.sequence import Sequence

from .proposer import Proposal
from .runner import Chunk, last_token_logits


@dataclass
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)  # tokens whose KV the draft cache holds


class DraftProposer:
    def __init__(
        self,
        config: EngineConfig,
        draft_model: str,
        target: ModelSpec,
        max_len: int,
        num_blocks: int,
    ) -> None:
        draft_config = dataclasses.replace(config, model=draft_model, speculative=None)
        model_dir = resolve_model_dir(draft_model)
        hf_config = load_hf_config(model_dir)
        self.spec = spec = ModelSpec.from_hf_config(hf_config)
        if spec.vocab_size != target.vocab_size:
            raise ValueError(
                f"draft model vocab_size {spec.vocab_size} differs from the target's "
                f"{target.vocab_size}: the draft must share the target's tokenizer"
            )
        self.device = device = resolve_device(config.device)
        dtype = getattr(torch, config.dtype)
        state = load_weights(draft_config, model_dir, spec, hf_config)
        gpu_attention = use_gpu_kernel(config.attention, device, config.deterministic)
        kernels = None if gpu_attention else select_kernels(config.cpu_kernels, device, dtype)
        # The draft proposes from its logits (argmax or probabilities) and never
        # calls greedy_tokens: no screen copy of its head.
        self.model = LlamaModel(
            spec, state, hf_config, max_len, dtype, device, kernels,
            greedy_screen=False, gpu_attention=gpu_attention,
        )  # fmt: skip
        del state
        layout = KVLayout(
            model_fingerprint=model_fingerprint(
                model_dir, hf_config, config.load_format, config.seed
            ),
            dtype=config.dtype,
            num_layers=spec.num_layers,
            block_size=config.block_size,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
        )
        self.block_size = config.block_size
        self.pool = BlockPool(num_blocks, config.block_size)
        self.cache = KVCache(layout, num_blocks, device)
        self._states: dict[str, _DraftState] = {}

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[Proposal]:
        proposals = [Proposal([]) for _ in seqs]
        active: list[int] = []
        chunks: list[Chunk] = []
        for i, (seq, k) in enumerate(zip(seqs, budgets, strict=True)):
            chunk = self._catch_up(seq, k) if k > 0 else None
            if chunk is not None:
                active.append(i)
                chunks.append(chunk)
        probs: dict[int, list[torch.Tensor]] = {i: [] for i in active}
        for i in active:  # the k draft draws of each seeded request: one stream of its own
            seq = seqs[i]
            seed_for_token(seq.generator, seq.params.seed, len(seq.output_token_ids), DRAFT_STREAM)
        for step in range(max((budgets[i] for i in active), default=0)):
            logits = last_token_logits(self.model, self.cache, chunks, self.device)
            chunks_next: list[Chunk] = []
            active_next: list[int] = []
            for row, i in enumerate(active):
                seq = seqs[i]
                token = self._choose(logits[row, : self.spec.vocab_size], seq, probs[i])
                proposals[i].token_ids.append(token)
                if step + 1 < budgets[i]:
                    state = self._states[seq.request_id]
                    position = len(state.cached)
                    state.cached.append(token)
                    chunks_next.append(Chunk(state.block_table, position, [token]))
                    active_next.append(i)
            chunks, active = chunks_next, active_next
            if not chunks:
                break
        for i, rows in probs.items():
            if rows:
                proposals[i].probs = torch.stack(rows)
        return proposals

    def release(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None and state.block_table:
            self.pool.release(_holder(request_id))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def _catch_up(self, seq: Sequence, k: int) -> Chunk | None:
        """The chunk that feeds the draft what it has not seen of ``seq``, with
        blocks for that and the k - 1 proposals fed back; None if the draft
        pool is full (no proposal this step)."""
        state = self._states.setdefault(seq.request_id, _DraftState())
        tokens = seq.all_token_ids()
        same = _common_prefix(state.cached, tokens)
        same = min(same, len(tokens) - 1)  # the last token is fed: its logits propose
        positions = len(tokens) + k - 1  # positions [0, T - 1 + k - 1] get KV this round
        need = -(-positions // self.block_size) - len(state.block_table)
        if need > 0:
            blocks = self.pool.allocate(_holder(seq.request_id), need)
            if blocks is None:
                self.release(seq.request_id)
                return None
            state.block_table += blocks
        feed = tokens[same:]
        state.cached = tokens[:]
        return Chunk(state.block_table, same, feed)

    def _choose(self, logits: torch.Tensor, seq: Sequence, rows: list[torch.Tensor]) -> int:
        params = seq.params
        if params.greedy:
            return int(logits.argmax())
        q = probs_from_logits(logits, params)
        rows.append(q)
        return int(torch.multinomial(q, 1, generator=seq.generator))


def _holder(request_id: str) -> Holder:
    return Holder("draft", request_id)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
