"""Speculative decoding inside the engine's continuous batching.

A step with speculation (``LLMEngine.step``):

1. ``propose``: every running sequence that is decoding (all but its last
   token computed) and eligible gets up to k proposed tokens in
   ``seq.spec_token_ids``. k is cut so the request cannot pass max_tokens or
   max_model_len, and so the extra blocks fit in the pool's spare blocks:
   speculation never preempts anyone.
2. The scheduler schedules ``1 + len(spec_token_ids)`` tokens for such a
   sequence; the target computes them in the same batched pass as every
   other sequence, as a prefill-like chunk over the paged cache, and
   returns logits for all ``k + 1`` positions. (If the token budget cut the
   chunk, ``fit`` drops the proposals that did not fit.)
3. ``accept``: the verify rule (verify.py) picks the emitted tokens; they
   are appended one at a time, so eos, stop token ids, stop strings,
   max_tokens and max_model_len end the request exactly where plain decoding
   would, and the tokens after are dropped. Only the accepted positions
   count as computed; blocks that hold nothing but rejected positions are
   released by the request at once, and only full blocks of accepted tokens enter
   the prefix cache.

Back-off: a sequence whose proposals were all rejected skips speculation
for 1, 2, 4, ... (at most ``MAX_BACKOFF_STEPS``) steps, doubling while it keeps
missing, and resets on any accepted token, so text that does not repeat
itself stops paying for the k + 1-token verification. (Whether a step
speculates never changes the distribution of what it emits.)

Eligibility: requests with repetition, frequency or presence penalties, and
requests still below min_tokens, decode without speculation (their logits
depend on every token emitted before them); prefill-only requests never
speculate. Logprobs are reported for every emitted token, from the raw
target logits as in plain decoding.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.config import SpeculativeConfig
from engine.sampling import SampledToken, probs_from_logits, seed_for_token
from engine.scheduler import ScheduledSeq
from engine.sequence import Sequence
from protocol.outputs import RequestOutput, TokenLogprobs

from .proposer import NgramProposer, Proposal, Proposer
from .verify import Verdict, verify_greedy, verify_sampled

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

MAX_BACKOFF_STEPS = 16


class SpecDecoder:
    def __init__(self, engine: LLMEngine, config: SpeculativeConfig) -> None:
        self.engine = engine
        self.config = config
        self.proposer: Proposer
        if config.method == "ngram":
            self.proposer = NgramProposer(config.ngram_min, config.ngram_max)
        else:
            from .draft import DraftProposer

            assert config.draft_model is not None
            self.proposer = DraftProposer(
                engine.config,
                config.draft_model,
                engine.spec,
                engine.max_model_len,
                config.draft_num_kv_blocks or engine.block_pool.num_blocks,
            )
        self._draft_probs: dict[str, torch.Tensor] = {}
        self._misses: dict[str, int] = {}  # request id -> all-rejected steps in a row
        self._skip: dict[str, int] = {}  # request id -> steps left without speculation
        self.num_proposed = 0  # proposed tokens the target verified
        self.num_accepted = 0  # of those, accepted
        self.num_emitted = 0  # tokens emitted by speculative steps (accepted + 1 each)

    # ---- before the schedule --------------------------------------------

    def propose(self, running: list[Sequence]) -> None:
        engine = self.engine
        bs = engine.config.block_size
        spare = engine.block_pool.num_free
        for seq in running:  # what plain steps need comes first (at most every known token)
            spare -= max(0, -(-seq.num_tokens // bs) - len(seq.block_table))
        seqs: list[Sequence] = []
        budgets: list[int] = []
        for seq in running:
            seq.spec_token_ids = []
            self._draft_probs.pop(seq.request_id, None)
            k = self._budget(seq)
            if k <= 0 or self._backing_off(seq.request_id):
                continue
            plain = max(len(seq.block_table), -(-seq.num_tokens // bs))
            extra = -(-(seq.num_tokens + k) // bs) - plain
            if extra > spare:  # only what fits in the blocks plain decoding has
                k = min(k, plain * bs - seq.num_tokens)
                extra = 0
            if k <= 0:
                continue
            spare -= extra
            seqs.append(seq)
            budgets.append(k)
        if not seqs:
            return
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, budgets), strict=True):
            seq.spec_token_ids = proposal.token_ids
            if not proposal.token_ids:  # nothing to verify: back off as after a miss
                self._track(seq.request_id, 0)
            if proposal.probs is not None:
                self._draft_probs[seq.request_id] = proposal.probs

    def _backing_off(self, request_id: str) -> bool:
        left = self._skip.get(request_id, 0)
        if left:
            self._skip[request_id] = left - 1
        return left > 0

    def _track(self, request_id: str, num_accepted: int) -> None:
        if num_accepted:
            self._misses.pop(request_id, None)
            return
        misses = self._misses.get(request_id, 0) + 1
        self._misses[request_id] = misses
        self._skip[request_id] = min(2 ** (misses - 1), MAX_BACKOFF_STEPS)

    def _budget(self, seq: Sequence) -> int:
        p = seq.params
        if seq.prefill_only or seq.num_computed != seq.num_tokens - 1:
            return 0
        if p.has_penalties or len(seq.output_token_ids) < p.min_tokens:
            return 0
        left = p.max_tokens - len(seq.output_token_ids) - 1
        room = self.engine.max_model_len - 1 - seq.num_tokens
        return min(self.config.num_speculative_tokens, left, room)

    # ---- after the schedule ---------------------------------------------

    def fit(self, batch: list[ScheduledSeq]) -> None:
        """Drop proposals the token budget did not schedule."""
        scheduled = {id(item.seq) for item in batch}
        for seq in self.engine.scheduler.running:
            if id(seq) not in scheduled:
                seq.spec_token_ids = []
        for item in batch:
            seq = item.seq
            if seq.spec_token_ids:
                kept = seq.num_computed + item.num_tokens - seq.num_tokens
                del seq.spec_token_ids[max(0, kept) :]
                probs = self._draft_probs.get(seq.request_id)
                if probs is not None:
                    self._draft_probs[seq.request_id] = probs[: max(0, kept)]

    # ---- after the forward pass -----------------------------------------

    def accept(self, seqs: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        """logits: [sum(len(spec) + 1), V'], each sequence's rows in order."""
        vocab = self.engine.spec.vocab_size
        outputs = []
        row = 0
        for seq in seqs:
            k = len(seq.spec_token_ids)
            rows = logits[row : row + k + 1, :vocab].float()
            row += k + 1
            verdict = self._verify(seq, rows)
            self.num_proposed += k
            self.num_accepted += verdict.num_accepted
            self.num_emitted += len(verdict.token_ids)
            self._track(seq.request_id, verdict.num_accepted)
            outputs.append(self._emit(seq, verdict, rows))
        return outputs

    def _verify(self, seq: Sequence, rows: torch.Tensor) -> Verdict:
        proposed = seq.spec_token_ids
        draft_probs = self._draft_probs.pop(seq.request_id, None)
        if seq.params.greedy:
            return verify_greedy(rows, proposed)
        target = torch.stack([probs_from_logits(r, seq.params) for r in rows])
        seed_for_token(seq.generator, seq.params.seed, len(seq.output_token_ids))
        return verify_sampled(target, proposed, draft_probs, seq.generator)

    def _emit(self, seq: Sequence, verdict: Verdict, rows: torch.Tensor) -> RequestOutput:
        """Append the tokens one by one, as plain decoding would have, and give
        back the blocks past the last accepted position."""
        engine = self.engine
        start = seq.num_computed  # the position of the last token before this step
        seq.spec_token_ids = []
        logprobs = torch.log_softmax(rows, dim=-1) if seq.params.logprobs is not None else None
        merged: RequestOutput | None = None
        for i, token in enumerate(verdict.token_ids):
            seq.num_computed = start + 1 + i  # the last token and i accepted proposals
            engine._cache_full_blocks(seq)
            out = engine._append_token(seq, _sampled(token, logprobs, i, seq.params.logprobs))
            merged = out if merged is None else _merge(merged, out)
            if out.finished:
                return merged
        keep = -(-seq.num_computed // engine.config.block_size)
        engine.block_pool.release(seq.holder, seq.block_table[keep:])
        del seq.block_table[keep:]
        assert merged is not None
        return merged

    # ---- bookkeeping ------------------------------------------------------

    def release(self, request_id: str) -> None:
        self._draft_probs.pop(request_id, None)
        self._misses.pop(request_id, None)
        self._skip.pop(request_id, None)
        self.proposer.release(request_id)


def spec_stats(decoder: SpecDecoder | None) -> dict[str, int]:
    """Acceptance counters for a worker's stats (zeros without speculation)."""
    if decoder is None:
        return {"spec_proposed_tokens": 0, "spec_accepted_tokens": 0, "spec_emitted_tokens": 0}
    return {
        "spec_proposed_tokens": decoder.num_proposed,
        "spec_accepted_tokens": decoder.num_accepted,
        "spec_emitted_tokens": decoder.num_emitted,
    }


def _sampled(
    token: int, logprobs: torch.Tensor | None, row: int, num_top: int | None
) -> SampledToken:
    if logprobs is None:
        return SampledToken(token, None, None)
    top = None
    if num_top:
        vals, idxs = logprobs[row].topk(num_top)
        top = list(zip(idxs.tolist(), vals.tolist(), strict=True))
    return SampledToken(token, float(logprobs[row, token]), top)


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    logprobs: list[TokenLogprobs] | None = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return RequestOutput(
        request_id=a.request_id,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        text_delta=a.text_delta + b.text_delta,
        finished=b.finished,
        finish_reason=b.finish_reason,
        logprobs=logprobs,
        num_prompt_tokens=b.num_prompt_tokens,
        num_cached_tokens=b.num_cached_tokens,
        num_output_tokens=b.num_output_tokens,
    )


__all__ = ["Proposal", "SpecDecoder", "spec_stats"]
