"""The verify rule of speculative decoding (Leviathan et al. 2023; Chen et al.
2023), which keeps the target model's output distribution exactly.

For one sequence the target scored ``k + 1`` positions in one pass: row ``j``
of ``target_probs`` is the target's next-token distribution ``p_j`` after the
proposed tokens ``d_1 .. d_j``. Proposed token ``d_{j+1}`` was drawn from
the proposer's distribution ``q_j`` (a point mass for a deterministic
proposer such as prompt lookup, or a greedy draft). Walking ``j = 0 .. k-1``:

* accept ``d_{j+1}`` with probability ``min(1, p_j(d) / q_j(d))``;
* on the first rejection emit one token drawn from the residual
  ``max(p_j - q_j, 0)`` (normalised) and stop;
* if all ``k`` are accepted, emit a bonus token drawn from ``p_k``.

Every emitted token is then distributed as the target alone would have
sampled it: ``q(x) min(1, p(x)/q(x)) + P(reject) * residual(x) = p(x)``
(``acceptance_probs`` and ``residual`` expose the pieces, and the tests
check this identity). A greedy request has ``p_j`` a point mass on the
argmax: a proposed token is accepted exactly when it equals the argmax,
and the emitted tokens are those of plain greedy decoding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Verdict:
    """What one sequence's verification emits."""

    token_ids: list[int]  # accepted proposals, then one corrected or bonus token
    num_accepted: int  # how many of the proposals were accepted


def acceptance_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, p / q) per token, where q > 0 (the tokens q can propose): [.., V]."""
    return torch.where(q > 0, torch.clamp(p / q.clamp_min(1e-30), max=1.0), torch.zeros_like(p))


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution a rejection draws from: max(p - q, 0), normalised: [V] -> [V].

    When p == q (nothing to correct; a rejection then has probability 0) it is p.
    """
    r = torch.clamp(p - q, min=0.0)
    total = r.sum()
    return r / total if total > 0 else p


def point_mass(token_ids: list[int], vocab_size: int) -> torch.Tensor:
    """q of a deterministic proposer: [k, V], one-hot rows."""
    q = torch.zeros(len(token_ids), vocab_size)
    q[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.long)] = 1.0
    return q


def verify_greedy(target_logits: torch.Tensor, proposed: list[int]) -> Verdict:
    """The rule for point-mass target rows: accept while a proposal equals the argmax.

    target_logits: [k + 1, V] (penalty-free greedy rows).
    """
    best = target_logits.argmax(dim=-1).tolist()
    m = 0
    while m < len(proposed) and proposed[m] == best[m]:
        m += 1
    return Verdict([*proposed[:m], best[m]], m)


def verify_sampled(
    target_probs: torch.Tensor,
    proposed: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> Verdict:
    """The rejection rule for sampled rows.

    target_probs: [k + 1, V]; draft_probs: [k, V], or None for point masses on
    ``proposed``. Random numbers come from ``generator`` (the request's seed)
    or the global RNG.
    """
    k = len(proposed)
    device = target_probs.device
    if draft_probs is None:
        draft_probs = point_mass(proposed, target_probs.shape[-1]).to(device)
    uniforms = torch.rand(k, generator=generator, device=device).tolist() if k else []
    for j, token in enumerate(proposed):
        p_j, q_j = target_probs[j], draft_probs[j]
        accept = float(acceptance_probs(p_j[token], q_j[token]))
        if uniforms[j] < accept:
            continue
        corrected = torch.multinomial(residual(p_j, q_j), 1, generator=generator)
        return Verdict([*proposed[:j], int(corrected)], j)
    bonus = torch.multinomial(target_probs[k], 1, generator=generator)
    return Verdict([*list(proposed), int(bonus)], k)
