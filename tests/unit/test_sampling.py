"""Sampling parameters and the batched sampler, checked against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampling import (
    SampledToken,
    Sampler,
    SampleRequest,
    make_generator,
    probs_from_logits,
)
from protocol.sampling import SamplingParams

pytestmark = pytest.mark.unit

EOS = 5


def _req(params: SamplingParams, prompt=(), output=(), seeded: bool = True) -> SampleRequest:
    gen = make_generator(params) if seeded else None
    return SampleRequest(params, list(prompt), list(output), gen)


def _logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs])


# ---------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("field", "value", "fragment"),
    [
        ("max_tokens", 0, ">= 1"),
        ("min_tokens", -1, "[0, 16]"),
        ("min_tokens", 17, "[0, 16]"),
        ("temperature", -1.0, "[0, 100]"),
        ("temperature", 100.5, "[0, 100]"),
        ("temperature", math.nan, "[0, 100]"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.01, "(0, 1]"),
        ("top_k", -2, ">= -1"),
        ("min_p", -0.1, "[0, 1]"),
        ("min_p", 1.1, "[0, 1]"),
        ("repetition_penalty", 0.0, "(0, 2]"),
        ("repetition_penalty", 2.5, "(0, 2]"),
        ("frequency_penalty", -2.5, "[-2, 2]"),
        ("frequency_penalty", 2.1, "[-2, 2]"),
        ("presence_penalty", 3, "[-2, 2]"),
        ("presence_penalty", -2.01, "[-2, 2]"),
        ("seed", 2**64, "seed must be in"),
        ("stop", [""], "1 to 256 characters"),
        ("stop", ["x"] * 5000, "at most 4096"),
        ("stop_token_ids", [3, -1], ">= 0"),
        ("logprobs", -1, "[0, 20]"),
        ("logprobs", 21, "[0, 20]"),
    ],
)
def test_out_of_range_value_names_field_and_range(field, value, fragment):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert fragment in str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", "16"),
        ("max_tokens", 16.0),
        ("min_tokens", True),
        ("temperature", "hot"),
        ("top_k", 1.5),
        ("seed", "7"),
        ("stop", [1]),
        ("stop", 7),
        ("stop_token_ids", ["2"]),
        ("stop_token_ids", 2),
        ("ignore_eos", "yes"),
        ("logprobs", 2.0),
        ("skip_special_tokens", None),
    ],
)
def test_wrong_type_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_valid_values_are_kept_and_normalised():
    p = SamplingParams(temperature=0, top_p=1, stop="###", top_k=-1, seed=-3, logprobs=20)
    assert p.stop == ["###"]
    assert isinstance(p.temperature, float) and p.greedy
    assert not SamplingParams(temperature=1e-5).greedy
    assert SamplingParams(temperature=0.5, min_tokens=16, stop=("a", "b")).stop == ["a", "b"]


def test_validate_for_vocab():
    SamplingParams(stop_token_ids=[0, 99]).validate_for_vocab(100)
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[0, 100]).validate_for_vocab(100)


# ---------------------------------------------------------------- distributions


BASE = [0.4, 0.3, 0.2, 0.1]


@pytest.mark.parametrize(
    ("params", "expected"),
    [
        (SamplingParams(), BASE),
        (SamplingParams(temperature=0.5), [16 / 30, 9 / 30, 4 / 30, 1 / 30]),
        (SamplingParams(top_k=2), [4 / 7, 3 / 7, 0, 0]),
        (SamplingParams(top_k=4), BASE),
        (SamplingParams(top_k=10), BASE),
        (SamplingParams(top_p=0.6), [4 / 7, 3 / 7, 0, 0]),
        (SamplingParams(top_p=0.75), [4 / 9, 3 / 9, 2 / 9, 0]),
        (SamplingParams(top_p=0.3), [1, 0, 0, 0]),
        # top-p is taken on the top-k-renormalised distribution: 4/7 > 0.55 already
        (SamplingParams(top_k=2, top_p=0.55), [1, 0, 0, 0]),
        (SamplingParams(top_k=3, top_p=0.8), [4 / 9, 3 / 9, 2 / 9, 0]),
        (SamplingParams(min_p=0.6), [4 / 7, 3 / 7, 0, 0]),  # keep p >= 0.24
        (SamplingParams(min_p=1.0), [1, 0, 0, 0]),
        # min-p after temperature: [16, 9, 4, 1] / 30, keep p >= 0.2 * 16/30
        (SamplingParams(temperature=0.5, min_p=0.2), [16 / 29, 9 / 29, 4 / 29, 0]),
        (SamplingParams(temperature=0.5, top_k=3, top_p=0.9), [16 / 29, 9 / 29, 4 / 29, 0]),
        (SamplingParams(temperature=0), [1, 0, 0, 0]),
    ],
)
def test_probs_from_logits_by_hand(params, expected):
    probs = probs_from_logits(_logits_of(BASE) + 3.0, params)  # a shift must not matter
    torch.testing.assert_close(
        probs, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0
    )


def test_temperature_two_flattens():
    roots = [math.sqrt(p) for p in BASE]
    probs = probs_from_logits(_logits_of(BASE), SamplingParams(temperature=2.0))
    torch.testing.assert_close(probs, torch.tensor(roots) / sum(roots))


def test_empirical_frequencies_match_distribution():
    torch.manual_seed(0)
    logits = torch.randn(6) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5, top_p=0.95, seed=1234)
    expected = probs_from_logits(logits, params)
    assert (expected == 0).sum() >= 1  # truncation is in play
    sampler, gen = Sampler(6, [EOS]), make_generator(params)
    n = 4000
    batch = [SampleRequest(params, [], [], gen) for _ in range(n)]
    drawn = [s.token_id for s in sampler(logits.expand(n, 6).contiguous(), batch)]
    freq = torch.bincount(torch.tensor(drawn), minlength=6).float() / n
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)
    assert all(freq[expected == 0] == 0)


# ---------------------------------------------------------------- sampler


def test_greedy_is_argmax_on_fast_and_slow_paths():
    torch.manual_seed(1)
    logits = torch.randn(8, 50)
    sampler = Sampler(50, [EOS])
    fast = sampler(logits, [_req(SamplingParams(temperature=0)) for _ in range(8)])
    slow = sampler(logits, [_req(SamplingParams(temperature=0, logprobs=0)) for _ in range(8)])
    assert [s.token_id for s in fast] == logits.argmax(-1).tolist()
    assert [s.token_id for s in slow] == logits.argmax(-1).tolist()
    assert fast[0] == SampledToken(fast[0].token_id, None, None)


def test_padded_vocab_columns_are_ignored():
    logits = torch.zeros(2, 12)
    logits[:, 10:] = 100.0  # padding beyond the real vocabulary
    logits[:, 3] = 5.0
    sampler = Sampler(10, [EOS])
    reqs = [_req(SamplingParams(temperature=0)), _req(SamplingParams(seed=3, top_k=1))]
    assert [s.token_id for s in sampler(logits, reqs)] == [3, 3]


def test_same_seed_same_tokens_different_seed_different():
    torch.manual_seed(2)
    logits = torch.randn(1, 64)
    sampler = Sampler(64, [EOS])

    def draws(seed: int) -> list[int]:
        req = _req(SamplingParams(seed=seed))
        return [sampler(logits, [req])[0].token_id for _ in range(40)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)
    assert len(set(draws(7))) > 5  # actually random, not stuck on one token


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    sampler = Sampler(5, [EOS])
    req = _req(SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1, 1, 3])
    out = sampler.adjusted_logits(logits, [req])
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.0, 0.5, 1.5, -2.0]]))
    assert logits[0, 0] == 2.0  # the input is not modified


@pytest.mark.parametrize("seeded", [True, False])
def test_overflowing_penalties_and_temperatures_still_sample(seeded):
    """Found by fuzzing Generate: a denormal repetition penalty divides positive
    logits to +inf; the draw must still pick one of the highest, not raise."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]] * 2)
    sampler = Sampler(5, [EOS])
    tiny = SamplingParams(repetition_penalty=1.4e-45, seed=1)
    cold = SamplingParams(temperature=2e-5, seed=2)
    reqs = [_req(tiny, prompt=[0, 3], seeded=seeded), _req(cold, seeded=seeded)]
    tokens = sampler(logits * torch.tensor([[1.0], [1e34]]), reqs)
    assert tokens[0].token_id in (0, 3)  # both overflowed to +inf
    assert tokens[1].token_id == 3


def test_frequency_and_presence_penalties_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    sampler = Sampler(5, [EOS])
    freq = _req(SamplingParams(frequency_penalty=0.5), prompt=[0, 2], output=[1, 1, 3])
    pres = _req(SamplingParams(presence_penalty=-0.25), prompt=[0, 2], output=[1, 1, 3])
    both = _req(
        SamplingParams(repetition_penalty=0.5, frequency_penalty=1.0, presence_penalty=1.0),
        prompt=[0],
        output=[1, 3, 3],
    )
    out = sampler.adjusted_logits(logits.expand(3, 5), [freq, pres, both])
    expected = torch.tensor(
        [
            [2.0, -2.0, 0.5, 2.5, -2.0],  # counts: token 1 twice, token 3 once
            [2.0, -0.75, 0.5, 3.25, -2.0],  # prompt tokens untouched
            [4.0, -0.5 - 2.0, 0.5, 6.0 - 3.0, -2.0],  # repetition first, then counts
        ]
    )
    torch.testing.assert_close(out, expected)


def test_repetition_penalty_flips_greedy_choice():
    sampler = Sampler(3, [EOS])
    pos = torch.tensor([[2.0, 1.9, 0.0]])
    neg = torch.tensor([[-1.0, -1.1, -5.0]])
    strong, weak = (
        SamplingParams(temperature=0, repetition_penalty=1.2),
        SamplingParams(temperature=0, repetition_penalty=1.04),
    )
    assert sampler(pos, [_req(strong, prompt=[0])])[0].token_id == 1  # 2.0 / 1.2 < 1.9
    assert sampler(pos, [_req(weak, prompt=[0])])[0].token_id == 0  # 2.0 / 1.04 > 1.9
    assert sampler(neg, [_req(strong, output=[0])])[0].token_id == 1  # -1.0 * 1.2 < -1.1


def test_min_tokens_masks_eos_and_stop_token_ids():
    logits = torch.tensor([[0.0, 1.0, 8.0, 3.0, 0.0, 9.0]])  # eos (5) best, stop id 2 next
    sampler = Sampler(6, [EOS])
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sampler(logits, [_req(params, output=[1])])[0].token_id == 3
    assert sampler(logits, [_req(params, output=[1, 1])])[0].token_id == EOS
    ignore = SamplingParams(temperature=0, ignore_eos=True)
    assert sampler(logits, [_req(ignore, output=[])])[0].token_id == EOS  # not masked
    hot = SamplingParams(temperature=5.0, min_tokens=1, stop_token_ids=[2], seed=0)
    req = _req(hot)
    drawn = {sampler(logits, [req])[0].token_id for _ in range(200)}
    assert drawn.isdisjoint({2, EOS}) and len(drawn) >= 3


def test_logprobs_are_raw_log_softmax_with_ordered_top_n():
    torch.manual_seed(3)
    logits = torch.randn(2, 30)
    raw = torch.log_softmax(logits, dim=-1)
    sampler = Sampler(30, [EOS])
    reqs = [
        _req(SamplingParams(seed=5, logprobs=4, repetition_penalty=1.8, temperature=0.7), [1, 2]),
        _req(SamplingParams(temperature=0, logprobs=0)),
    ]
    first, second = sampler(logits, reqs)
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-6)
    assert [t for t, _ in first.top_logprobs] == raw[0].argsort(descending=True)[:4].tolist()
    top_values = [lp for _, lp in first.top_logprobs]
    assert top_values == sorted(top_values, reverse=True)
    assert top_values == pytest.approx(raw[0].sort(descending=True).values[:4].tolist())
    assert second.top_logprobs is None
    assert second.logprob == pytest.approx(raw[1].max().item(), abs=1e-6)
    plain = sampler(logits[:1], [_req(SamplingParams(seed=5))])[0]
    assert plain.logprob is None and plain.top_logprobs is None


def test_mixed_batch_equals_rows_alone():
    torch.manual_seed(4)
    vocab = 40
    logits = torch.randn(5, vocab + 8)  # padded
    sampler = Sampler(vocab, [EOS])
    specs = [
        (SamplingParams(temperature=0), [1, 2], [3]),
        (SamplingParams(temperature=0.9, top_k=10, top_p=0.9, seed=11, logprobs=3), [4], []),
        (SamplingParams(temperature=0, repetition_penalty=1.5, frequency_penalty=0.7), [0], [9]),
        (SamplingParams(temperature=1.3, min_p=0.05, presence_penalty=1.0, seed=12), [], [2, 2]),
        (SamplingParams(temperature=0.7, min_tokens=3, stop_token_ids=[7], seed=13), [], [1]),
    ]

    def fresh() -> list[SampleRequest]:
        return [_req(p, prompt, out) for p, prompt, out in specs]

    for _ in range(3):
        batch = sampler(logits, fresh())
        alone = [sampler(logits[i : i + 1], [r])[0] for i, r in enumerate(fresh())]
        assert batch == alone
        logits = torch.randn(5, vocab + 8)


def test_unseeded_rows_use_global_rng():
    logits = torch.zeros(3, 100)
    sampler = Sampler(100, [EOS])
    reqs = [_req(SamplingParams(), seeded=False) for _ in range(3)]
    with torch.random.fork_rng():
        torch.manual_seed(9)
        first = sampler(logits, reqs)
        torch.manual_seed(9)
        again = sampler(logits, reqs)
    assert first == again
    assert len({s.token_id for s in first}) > 1


def test_row_count_mismatch_is_an_error():
    with pytest.raises(ValueError, match="rows"):
        Sampler(4, [EOS])(torch.zeros(2, 4), [_req(SamplingParams())])
