"""The verify rule of speculative decoding keeps the target's distribution:
exactly (the identity behind it) and empirically (a seeded chi-square over
whole generated sequences, so it cannot flake), plus prompt lookup."""

from __future__ import annotations

import math

import pytest
import torch

from engine.spec import NgramProposer, acceptance_probs, residual, verify_greedy, verify_sampled
from engine.spec.verify import point_mass

pytestmark = pytest.mark.unit

V = 4  # a tiny vocabulary: every outcome is counted


def _random_dist(gen: torch.Generator, rows: int, zeros: bool = False) -> torch.Tensor:
    x = torch.rand(rows, V, generator=gen) ** 3
    if zeros:
        x[:, 0] = 0.0  # a token this distribution never gives
    return x / x.sum(-1, keepdim=True)


@pytest.mark.parametrize("seed", range(5))
def test_accept_plus_residual_is_exactly_the_target(seed):
    gen = torch.Generator().manual_seed(seed)
    p, q = _random_dist(gen, 1)[0], _random_dist(gen, 1, zeros=seed % 2 == 0)[0]
    accepted = q * acceptance_probs(p, q)  # propose x and accept it
    rejected = 1.0 - accepted.sum()
    total = accepted + rejected * residual(p, q)
    torch.testing.assert_close(total, p, atol=1e-6, rtol=0)
    # A point-mass proposer (prompt lookup) too.
    d = int(torch.randint(V, (1,), generator=gen))
    q1 = point_mass([d], V)[0]
    total = q1 * acceptance_probs(p, q1) + (1 - p[d]) * residual(p, q1)
    torch.testing.assert_close(total, p, atol=1e-6, rtol=0)


def _markov(seed: int) -> torch.Tensor:
    """Next-token distributions given the previous token: [V, V]."""
    return _random_dist(torch.Generator().manual_seed(seed), V)


def _sample_with_speculation(
    target: torch.Tensor, draft: torch.Tensor | None, length: int, k: int, gen: torch.Generator
) -> tuple[int, ...]:
    """``length`` tokens after token 0, generated k proposals at a time."""
    out: list[int] = []
    last = 0
    while len(out) < length:
        proposed, qs = [], []
        context = last
        for _ in range(k):
            if draft is None:  # deterministic proposer: "the next id"
                token = (context + 1) % V
            else:
                qs.append(draft[context])
                token = int(torch.multinomial(draft[context], 1, generator=gen))
            proposed.append(token)
            context = token
        rows = torch.stack([target[t] for t in [last, *proposed]])
        verdict = verify_sampled(rows, proposed, torch.stack(qs) if qs else None, gen)
        out += verdict.token_ids
        last = out[-1]
    return tuple(out[:length])


def _chi_square(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float]) -> float:
    n = sum(counts.values())
    return sum((counts.get(x, 0) - n * p) ** 2 / (n * p) for x, p in probs.items())


def _critical(dof: int, z: float = 4.75) -> float:
    """Chi-square quantile at about 1 - 1e-6 (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["draft", "point_mass"])
def test_sampling_with_speculation_matches_the_target_distribution(proposer):
    target, draft = _markov(1), _markov(2)
    length, k, draws = 3, 2, 12000
    exact = {}
    for x in range(V**length):
        seq = tuple((x // V**i) % V for i in range(length))
        prob, last = 1.0, 0
        for t in seq:
            prob, last = prob * float(target[last, t]), t
        exact[seq] = prob
    gen = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    q = draft if proposer == "draft" else None
    for _ in range(draws):
        seq = _sample_with_speculation(target, q, length, k, gen)
        counts[seq] = counts.get(seq, 0) + 1
    stat = _chi_square(counts, exact)
    assert stat < _critical(len(exact) - 1), stat
    # The same statistic does see a wrong distribution: the draft's own.
    if proposer == "draft":
        wrong = {}
        for seq in exact:
            prob, last = 1.0, 0
            for t in seq:
                prob, last = prob * float(draft[last, t]), t
            wrong[seq] = prob
        assert _chi_square(counts, wrong) > _critical(len(exact) - 1)


def test_greedy_rule_accepts_the_argmax_prefix_and_corrects():
    logits = torch.tensor([[0.0, 5, 0, 0], [0, 0, 5, 0], [9, 0, 0, 0]])
    assert verify_greedy(logits, [1, 2]).token_ids == [1, 2, 0]  # all accepted + bonus
    verdict = verify_greedy(logits, [1, 3])
    assert (verdict.token_ids, verdict.num_accepted) == ([1, 2], 1)
    assert verify_greedy(logits[:1], []).token_ids == [1]


def test_sampled_rule_with_point_masses_accepts_sure_tokens():
    probs = torch.tensor([[0.0, 1, 0, 0], [0, 0, 1, 0], [0.5, 0.5, 0, 0]])
    gen = torch.Generator().manual_seed(0)
    verdict = verify_sampled(probs, [1, 2], None, gen)
    assert verdict.num_accepted == 2 and verdict.token_ids[:2] == [1, 2]
    verdict = verify_sampled(probs, [3], None, gen)  # p(3) = 0: always rejected
    assert verdict.token_ids == [1] and verdict.num_accepted == 0


def test_prompt_lookup_takes_the_latest_longest_match():
    ngram = NgramProposer(ngram_min=1, ngram_max=3)
    tokens = [5, 6, 7, 8, 1, 6, 7, 9, 2, 6, 7]
    # The 3-gram [2, 6, 7] never occurred; [6, 7] did twice: the latest wins.
    assert ngram.lookup(tokens, 2) == [9, 2]
    assert ngram.lookup([1, 2, 3, 1, 2], 5) == [3, 1, 2, 3, 1]  # continues the period
    assert ngram.lookup([9, 1, 2, 3, 1, 2], 2) == [3, 1]
    assert ngram.lookup([1, 2, 3], 4) == []
    assert ngram.lookup([4, 4], 3) == [4, 4, 4]
    assert NgramProposer(2, 3).lookup([1, 2, 3, 4, 5, 1, 3], 2) == []  # no 2-gram match
