"""Per-request sampling parameters and the batched sampler.

One sampler call turns a ``[B, V]`` logits batch into one token per row.
Per row, in this order:

1. repetition penalty (prompt and output tokens; CTRL style: a positive
   logit is divided by the penalty, a negative one multiplied),
2. frequency and presence penalties (output tokens only; OpenAI style),
3. min_tokens: while the output is shorter than ``min_tokens``, EOS and
   ``stop_token_ids`` are masked out,
4. greedy argmax, or temperature, top-k, top-p and min-p over the whole
   batch at once, then one multinomial draw with the request's generator.

Logprobs are ``log_softmax`` of the raw logits (before any of the above),
as vLLM reports them by default. Stopping (EOS, stop ids, stop strings,
max_tokens) is the caller's job: the sampler only masks for min_tokens.

A row the sampler cannot draw from (non-finite logits: NaN or +-inf from the
model, or nothing left after the masks) does not fail the batch: its
``SampledToken`` carries an ``error`` and the other rows get exactly the
tokens they would get without it.

``SamplingParams`` itself is torch-free and lives in protocol/sampling.py
(the router validates it too); it is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from protocol.sampling import SamplingParams  # re-exported for the engine's users

__all__ = [
    "DRAFT_STREAM",
    "SampleRequest",
    "SampledToken",
    "Sampler",
    "SamplingParams",
    "make_generator",
    "nonfinite_rows",
    "probs_from_logits",
    "seed_for_token",
    "token_seed",
]


def make_generator(
    params: SamplingParams, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """A generator seeded with ``params.seed``, or None (global RNG) when unseeded."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(params.seed)


_MASK64 = (1 << 64) - 1


DRAFT_STREAM = 1
"""``seed_for_token``'s stream of a draft model's draws: independent of the
target's draws for the same position, as the verify rule needs."""


def seed_for_token(
    generator: torch.Generator | None, seed: int, position: int, stream: int = 0
) -> None:
    """Seed ``generator`` (a seeded request's) for its draws of output token
    ``position``; every place that draws with it calls this first."""
    if generator is not None:
        value = token_seed(seed, position)
        generator.manual_seed(value if stream == 0 else token_seed(value, stream))


def token_seed(seed: int, position: int) -> int:
    """The seed of the draw for output token ``position`` of a request seeded
    with ``seed`` (splitmix64 of the pair). Each draw depends on nothing but
    these two numbers, so a seeded request samples the same tokens on any
    worker, after a hand-over from prefill to decode, and after a failover
    that resumes it from its streamed tokens."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class SampleRequest:
    """One row of the logits batch."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    generator: torch.Generator | None  # on the logits' device; None: global RNG


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None  # of token_id, when params.logprobs is not None
    top_logprobs: list[tuple[int, float]] | None  # highest first, when params.logprobs >= 1
    error: str | None = None  # the row could not be sampled: its request fails alone


NONFINITE_LOGITS = "the model produced non-finite logits (NaN or inf) for this request"
NOTHING_TO_SAMPLE = "no token can be sampled: every token is masked or has probability 0"


def nonfinite_rows(x: torch.Tensor) -> list[int]:
    """The rows of ``x`` [N, D] holding a NaN or an infinity. One sum per row
    finds the suspects (a NaN or inf anywhere makes the sum non-finite); each
    suspect is then checked element-wise, so a finite row whose sum merely
    overflows is not taken for a broken one."""
    suspects = (~torch.isfinite(x.sum(dim=-1, dtype=torch.float32))).nonzero().flatten()
    return [i for i in suspects.tolist() if not bool(torch.isfinite(x[i]).all())]


def _truncated_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p, softmax over non-greedy rows.

    logits: [N, V], one row per entry of ``params``; returns probs [N, V].
    """
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    # An extreme penalty or temperature can overflow logits to +inf, and a
    # softmax over two +inf is NaN: clamp, so the highest logits share the draw.
    x = (logits / temps[:, None]).clamp(max=torch.finfo(logits.dtype).max)
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_ps = [p.top_p for p in params]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        x = _top_k_top_p(x, top_ks, top_ps)
    min_ps = [p.min_p for p in params]
    if any(p > 0.0 for p in min_ps):
        # p_i >= min_p * p_max  <=>  x_i >= x_max + log(min_p); the max token always survives
        log_min_p = torch.tensor(
            [math.log(p) if p > 0 else -math.inf for p in min_ps], device=device
        )
        threshold = x.max(dim=-1, keepdim=True).values + log_min_p[:, None].to(x.dtype)
        x = x.masked_fill(x < threshold, -math.inf)
    return torch.softmax(x, dim=-1)


def _top_k_top_p(x: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    """Mask to -inf all but the k highest logits, then all but the top-p nucleus."""
    device, vocab = x.device, x.shape[-1]
    sorted_x, order = x.sort(dim=-1, descending=True, stable=True)  # [N, V]
    positions = torch.arange(vocab, device=device)
    k = torch.tensor(top_ks, device=device)
    sorted_x = sorted_x.masked_fill(positions >= k[:, None], -math.inf)
    if any(p < 1.0 for p in top_ps):
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs  # the first token always has 0 before it
        p = torch.tensor(top_ps, dtype=x.dtype, device=device)[:, None]
        sorted_x = sorted_x.masked_fill((mass_before >= p) & (p < 1.0), -math.inf)
    return torch.full_like(x, -math.inf).scatter(-1, order, sorted_x)


def probs_from_logits(logits_row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a row draws from (penalties excluded): [V] -> [V].

    For greedy params it is the point mass on the argmax.
    """
    if params.greedy:
        return torch.nn.functional.one_hot(logits_row.argmax(), logits_row.shape[-1]).float()
    return _truncated_probs(logits_row[None].float(), [params])[0]


class Sampler:
    """Batched sampler with per-request parameters."""

    def __init__(self, vocab_size: int, eos_token_ids: Collection[int], kernels=None) -> None:
        """``kernels``: engine.kernels.cpu_ops() for a fast row argmax on CPU, or None."""
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.kernels = kernels

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """torch.argmax over the last dim of [B, V] (a fused kernel on CPU
        float32, where ATen's argmax is far slower than its max)."""
        if (
            self.kernels is not None
            and logits.device.type == "cpu"
            and logits.dtype == torch.float32
        ):
            return self.kernels.argmax_rows(logits)
        return logits.argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, requests: list[SampleRequest]) -> list[SampledToken]:
        """logits: [B, V'] with V' >= vocab_size (extra padded columns are ignored)."""
        if logits.shape[0] != len(requests):
            raise ValueError(f"logits has {logits.shape[0]} rows for {len(requests)} requests")
        logits = logits[:, : self.vocab_size].float()
        errors = dict.fromkeys(nonfinite_rows(logits), NONFINITE_LOGITS)
        if errors:  # sample the other rows as usual; these get an error
            logits = logits.clone()
            logits[list(errors)] = 0.0
        if all(self.plain_greedy(r) for r in requests):
            out = [SampledToken(t, None, None) for t in self.argmax(logits).tolist()]
            return _with_errors(out, errors)
        adjusted = self.adjusted_logits(logits, requests)
        token_ids, unsampleable = self._choose(adjusted, requests)
        for i in unsampleable:
            errors.setdefault(i, NOTHING_TO_SAMPLE)
        return _with_errors(self._package(logits, token_ids, requests), errors)

    @staticmethod
    def plain_greedy(r: SampleRequest) -> bool:
        """Whether the row's token is the bare argmax of its logits."""
        p = r.params
        return (
            p.greedy
            and not p.has_penalties
            and len(r.output_token_ids) >= p.min_tokens
            and p.logprobs is None
        )

    def adjusted_logits(self, logits: torch.Tensor, requests: list[SampleRequest]) -> torch.Tensor:
        """A copy of logits [B, vocab_size] with penalties and min_tokens masks applied."""
        out = logits.clone()
        device = logits.device
        for i, r in enumerate(requests):
            p, row = r.params, out[i]
            if p.repetition_penalty != 1.0:
                seen = torch.tensor([*r.prompt_token_ids, *r.output_token_ids], dtype=torch.long)
                seen = seen.to(device)
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
            if (p.frequency_penalty or p.presence_penalty) and r.output_token_ids:
                ids, counts = torch.tensor(r.output_token_ids, dtype=torch.long).unique(
                    return_counts=True
                )
                penalty = p.frequency_penalty * counts.float() + p.presence_penalty
                row[ids.to(device)] -= penalty.to(device)
            if len(r.output_token_ids) < p.min_tokens:
                banned = [*self.eos_token_ids, *p.stop_token_ids]
                row[torch.tensor(banned, dtype=torch.long, device=device)] = -math.inf
        return out

    def _choose(
        self, logits: torch.Tensor, requests: list[SampleRequest]
    ) -> tuple[torch.Tensor, list[int]]:
        """Token ids [B]: argmax for greedy rows, a draw for the others; and the
        rows with nothing to draw from (every token masked), whose ids mean nothing."""
        token_ids = self.argmax(logits)
        unsampleable = (logits.amax(dim=-1) == -math.inf).nonzero().flatten().tolist()
        rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not rows:
            return token_ids, unsampleable
        probs = _truncated_probs(logits[rows], [requests[i].params for i in rows])
        ok = torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)
        if not bool(ok.all()):  # a multinomial draw over such a row raises for the batch
            broken = (~ok).nonzero().flatten().tolist()
            probs[broken] = 1.0
            unsampleable = sorted({*unsampleable, *(rows[j] for j in broken)})
        drawn = torch.empty(len(rows), dtype=torch.long, device=logits.device)
        unseeded = [j for j, i in enumerate(rows) if requests[i].generator is None]
        if unseeded:
            drawn[unseeded] = torch.multinomial(probs[unseeded], 1).squeeze(1)
        for j, i in enumerate(rows):
            if requests[i].generator is not None:
                drawn[j] = torch.multinomial(probs[j], 1, generator=requests[i].generator)[0]
        token_ids[rows] = drawn
        return token_ids, unsampleable

    @staticmethod
    def _package(
        raw: torch.Tensor, token_ids: torch.Tensor, requests: list[SampleRequest]
    ) -> list[SampledToken]:
        ids = token_ids.tolist()
        out = [SampledToken(t, None, None) for t in ids]
        rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        if not rows:
            return out
        logprobs = torch.log_softmax(raw[rows], dim=-1)  # [R, V]
        chosen = logprobs.gather(1, token_ids[rows, None]).squeeze(1).tolist()
        top_n = min(max(requests[i].params.logprobs or 0 for i in rows), raw.shape[-1])
        tops: list[list[tuple[int, float]]] = [[] for _ in rows]
        if top_n:
            vals, idxs = logprobs.topk(top_n, dim=-1)
            tops = [
                list(zip(t, v, strict=True))
                for t, v in zip(idxs.tolist(), vals.tolist(), strict=True)
            ]
        for j, i in enumerate(rows):
            n = requests[i].params.logprobs or 0
            out[i] = SampledToken(ids[i], chosen[j], tops[j][:n] if n else None)
        return out


def _with_errors(out: list[SampledToken], errors: dict[int, str]) -> list[SampledToken]:
    for i, error in errors.items():
        out[i] = SampledToken(out[i].token_id, None, None, error)
    return out
