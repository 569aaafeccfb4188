"""The simulated model: the engine's forward pass replaced by the time a
profile says the step takes (planner/profile.py), with deterministic tokens.

Everything around it is the real engine: scheduler, block pool, prefix
cache, chunked prefill, KV export and import. The model keeps a tiny KV
cache (SIM_LAYERS x SIM_KV_HEADS x SIM_HEAD_DIM float32 per token, 32 bytes)
and computes each next token from what it reads back from the sequence's
KV blocks, so a block that arrives wrong (a broken transfer, a wrong prefix
hit) changes the output as it would with a real model.

What a token's slot holds, at position p with token t:
  keys   [t, p, h_lo, h_hi]
  values [h_lo, h_hi, t, p]
where h = (h of position p - 1, read from the cache) + mix(t, p), modulo
2**48 (two 24-bit halves, exact in float32): a running hash of the whole
context. The token after position p is mix(h, t, p, D) modulo the
vocabulary, with h, t, p read from the slot of p and D a hash of the keys
in the first slot of every block of the sequence (as attention reads every
block): a zeroed, missing or misplaced block changes it. Never an EOS id, so
outputs run to max_tokens.
Tokens do not depend on the sampling parameters.

Each step waits, asleep, until the profile's time for the step has passed
since the step began (``begin_step`` .. ``pace``): a worker uses no CPU
while it "computes". When a step begins within one step's time of the
previous one's end and the engine had unfinished requests at that end (it
kept busy rather than idling), it begins at that end instead:
the worker's work between two steps (publishing outputs) then overlaps the
step, as a GPU engine's CPU work overlaps its kernels, so back-to-back steps
keep the profile's pace rather than adding this machine's overhead to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import torch

from engine.attention import AttentionMetadata
from engine.kv_cache import KVCache
from engine.sampling import SampledToken, SampleRequest
from planner.profile import Profile

SIM_LAYERS = 1
SIM_KV_HEADS = 1
SIM_HEAD_DIM = 4
_HALF = 24
_LOW = (1 << _HALF) - 1
_MASK = (1 << (2 * _HALF)) - 1
_MULTIPLIERS = (0x9E3779B97F4A, 0xBF58476D1CE4, 0x94D049BB1331)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 48-bit integer hash (int64 arithmetic; wrap-around is modulo 2**64)."""
    for m in _MULTIPLIERS:
        x = (x & _MASK) * m & _MASK
        x = x ^ (x >> 23)
    return x & _MASK


class SimulatedModel:
    """Stands in for LlamaModel in the engine: ``forward`` takes the same
    arguments (metadata built with ``fused=True``) and returns each row's
    next token in place of hidden states; ``sample`` picks them."""

    fused = True
    gpu_attention = False
    screen_head = None

    def __init__(
        self,
        profile: Profile,
        vocab_size: int,
        eos_token_ids: Collection[int],
        block_size: int,
    ) -> None:
        self.profile = profile
        self.vocab_size = vocab_size
        self.eos = sorted(eos_token_ids)
        self.block_size = block_size
        self.clock: Callable[[], float] = time.perf_counter
        self.sleep: Callable[[float], None] = time.sleep
        self._started = self.clock()
        self._deadline = float("-inf")  # when the previous step's time was up
        self.step_s = 0.0  # the profile's time for the step in flight (then the last one)

    # ---- timing -----------------------------------------------------------

    def begin_step(self, work_left: bool) -> None:
        """``work_left``: the engine had unfinished requests when the previous
        step ended (it went straight on to this one rather than idling)."""
        now = self.clock()
        busy = work_left and now - self._deadline <= self.step_s  # right after the previous step
        self._started = self._deadline if busy else now

    def pace(self) -> None:
        """Sleep until the profile's time for this step has passed since it
        began (no wait when the step really took longer)."""
        self._deadline = self._started + self.step_s
        left = self._deadline - self.clock()
        if left > 0:
            self.sleep(left)
        else:
            self._deadline = self.clock()

    def _step_time(self, meta: AttentionMetadata) -> float:
        lengths = [p.num_tokens for p in meta.prefills]
        contexts = [p.context_len for p in meta.prefills]
        n = meta.num_decode
        ctx = float(meta.decode_lens.float().mean()) if n and meta.decode_lens is not None else 0.0
        return self.profile.step_s(lengths, contexts, n, ctx)

    # ---- tokens ------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,  # [N] long
        positions: torch.Tensor,  # [N] long
        meta: AttentionMetadata,
        cache: KVCache,
    ) -> torch.Tensor:
        """Write each token's slot, then read the slots back: [N] next tokens."""
        self.step_s = self._step_time(meta)
        kv = cache.flat(0)  # [2, slots, kv_heads, head_dim]
        gains = _mix(input_ids * 0x100000 + positions + 1)
        h = gains.clone()
        n = meta.num_decode
        if n:
            h[:n] += self._previous_h(kv, self._decode_prev_slots(meta, positions[:n]))
        for p in meta.prefills:
            rows = slice(p.start, p.start + p.num_tokens)
            prev = torch.zeros(1, dtype=torch.long)
            if p.context_len > 0:
                prev = self._previous_h(kv, self._slot(p.block_table, p.context_len - 1)[None])
            h[rows] = torch.cumsum(gains[rows], 0) + prev
        h &= _MASK
        self._write(kv, meta.slots, input_ids, positions, h)
        return self._next_tokens(kv, meta.slots, self._digests(kv, meta, positions))

    def _slot(self, table: torch.Tensor, pos: int | torch.Tensor) -> torch.Tensor:
        bs = self.block_size
        return table[pos // bs] * bs + pos % bs

    def _decode_prev_slots(self, meta: AttentionMetadata, pos: torch.Tensor) -> torch.Tensor:
        """Slot of each one-token row's previous position (-1 at position 0)."""
        assert meta.decode_tables is not None
        prev = (pos - 1).clamp(min=0)
        bs = self.block_size
        rows = torch.arange(len(pos))
        slots = meta.decode_tables[rows, prev // bs] * bs + prev % bs
        return torch.where(pos > 0, slots, torch.full_like(slots, -1))

    def _digests(
        self, kv: torch.Tensor, meta: AttentionMetadata, positions: torch.Tensor
    ) -> torch.Tensor:
        """Per row: a hash of the first slot of every block of its sequence up
        to the row's position, for the rows that end their sequence's tokens
        this step (the others, never sampled, get 0)."""
        out = torch.zeros_like(positions)
        n = meta.num_decode
        if n:
            assert meta.decode_tables is not None
            out[:n] = self._block_digest(kv, meta.decode_tables, positions[:n])
        for p in meta.prefills:
            last = p.start + p.num_tokens - 1
            out[last] = self._block_digest(kv, p.block_table[None], positions[last : last + 1])[0]
        return out

    def _block_digest(
        self,
        kv: torch.Tensor,
        tables: torch.Tensor,  # [rows, width] long, padded
        pos: torch.Tensor,  # [rows] long
    ) -> torch.Tensor:
        bs = self.block_size
        j = torch.arange(tables.shape[1])
        used = j[None, :] <= (pos // bs)[:, None]
        keys = kv[0, tables * bs, 0, :2].long()  # [rows, width, (t, p)]
        mixed = _mix(keys[..., 0] * 0x100000 + keys[..., 1] * 64 + j + 7)
        return (mixed * used).sum(1) & _MASK

    @staticmethod
    def _previous_h(kv: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """h stored at ``slots`` (0 where a slot is -1: nothing before)."""
        values = kv[1, slots.clamp(min=0), 0, :2].long()  # [h_lo, h_hi]
        h = values[:, 0] | (values[:, 1] << _HALF)
        return torch.where(slots >= 0, h, torch.zeros_like(h))

    @staticmethod
    def _write(kv, slots, tokens, positions, h) -> None:
        lo, hi = h & _LOW, h >> _HALF
        kv[0, slots, 0] = torch.stack([tokens, positions, lo, hi], 1).float()
        kv[1, slots, 0] = torch.stack([lo, hi, tokens, positions], 1).float()

    def _next_tokens(
        self, kv: torch.Tensor, slots: torch.Tensor, digests: torch.Tensor
    ) -> torch.Tensor:
        keys = kv[0, slots, 0].long()  # [t, p, ...]
        values = kv[1, slots, 0].long()  # [h_lo, h_hi, ...]
        h = values[:, 0] | (values[:, 1] << _HALF)
        nxt = _mix(h ^ _mix(keys[:, 0] * 0x10000 + keys[:, 1]) ^ digests) % self.vocab_size
        for eos in self.eos:  # never an EOS: the next id instead
            nxt = torch.where(nxt == eos, (nxt + 1) % self.vocab_size, nxt)
        return nxt

    def sample(
        self, next_tokens: torch.Tensor, requests: list[SampleRequest]
    ) -> list[SampledToken]:
        """The rows' tokens, whatever the sampling parameters (probability 1)."""
        out = []
        for token, req in zip(next_tokens.tolist(), requests, strict=True):
            want = req.params.logprobs
            top = [(token, 0.0)] if want else None
            out.append(SampledToken(token, 0.0 if want is not None else None, top))
        return out
