"""benchkit: metrics on synthetic timestamps, workload generators, reports."""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from benchkit import metrics, report, workload
from benchkit.metrics import FinalInfo, RequestRecord
from router.model_info import ModelInfo

pytestmark = pytest.mark.unit


def rec(send, chunks, end=None, status="OK", final=None) -> RequestRecord:
    if end is None and chunks:
        end = chunks[-1][0]
    return RequestRecord(
        send_time=send, chunks=list(chunks), end_time=end, status=status, final=final
    )


# ---------------------------------------------------------------- metrics


def test_percentile_interpolates_like_numpy():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert metrics.percentile(xs, 50) == 3.0
    assert metrics.percentile(xs, 90) == pytest.approx(4.6)
    assert metrics.percentile(xs, 99) == pytest.approx(4.96)
    assert metrics.percentile([7.0], 99) == 7.0
    rng = np.random.default_rng(0)
    ys = rng.random(101).tolist()
    for q in (50, 90, 99):
        assert metrics.percentile(ys, q) == pytest.approx(float(np.percentile(ys, q)))


def test_ttft_tpot_e2e_of_one_request():
    # Sent at 10.0; tokens at 10.5 (1), 10.7 (1), 11.1 (2); stream ends at 11.2.
    r = rec(10.0, [(10.5, 1), (10.7, 1), (11.1, 2)], end=11.2)
    assert metrics.ttft(r) == pytest.approx(0.5)
    assert metrics.tpot(r) == pytest.approx((11.1 - 10.5) / 3)
    assert metrics.e2e(r) == pytest.approx(1.2)
    assert metrics.output_tokens(r) == 4


def test_itl_splits_a_chunk_gap_evenly_among_its_tokens():
    r = rec(0.0, [(1.0, 1), (1.2, 1), (1.5, 3), (1.6, 0), (2.0, 2)])
    assert metrics.itls(r) == pytest.approx([0.2, 0.1, 0.1, 0.1, 0.25, 0.25])
    # The ITLs add up to last - first and, with a one-token first chunk, average to TPOT.
    assert sum(metrics.itls(r)) == pytest.approx(1.0)
    assert statistics.mean(metrics.itls(r)) == pytest.approx(metrics.tpot(r))


def test_empty_chunks_and_single_token_answers():
    r = rec(0.0, [(0.1, 0), (0.3, 1)], end=0.4)
    assert metrics.ttft(r) == pytest.approx(0.3)  # the text-only chunk is not the first token
    assert metrics.tpot(r) is None
    assert metrics.itls(r) == []
    assert metrics.ttft(rec(0.0, [], end=1.0)) is None


def test_summary_exact_figures_and_goodput():
    slo = {"ttft_ms": 500, "tpot_ms": 50}
    fin = FinalInfo(prompt_tokens=10, cached_tokens=4, completion_tokens=3, ttft_s=0.2)
    records = [
        # good: TTFT 0.2, TPOT 0.04
        rec(0.0, [(0.2, 1), (0.24, 1), (0.28, 1)], final=fin),
        # TTFT too slow: 0.6
        rec(1.0, [(1.6, 1), (1.62, 1), (1.64, 1)], final=fin),
        # TPOT too slow: 0.1
        rec(2.0, [(2.1, 1), (2.2, 1), (2.3, 1)], final=fin),
        # good; one token, so TPOT is undefined and does not fail it
        rec(3.0, [(3.3, 1)], final=FinalInfo(completion_tokens=1, ttft_s=0.25)),
        # failed ones
        rec(3.5, [], end=3.6, status="RESOURCE_EXHAUSTED"),
        rec(3.7, [(3.8, 1)], end=4.0, status="DEADLINE_EXCEEDED"),
        rec(3.9, [], end=3.95, status="RESOURCE_EXHAUSTED"),
    ]
    s = metrics.summarize(records, slo)
    assert s["requests"] == 7 and s["completed"] == 4 and s["failed"] == 3
    assert s["errors"] == {"DEADLINE_EXCEEDED": 1, "RESOURCE_EXHAUSTED": 2}
    assert s["duration_s"] == pytest.approx(4.0)  # first send 0.0, last end 4.0
    assert s["output_tokens"] == 10  # failed requests' tokens do not count
    assert s["request_throughput"] == pytest.approx(4 / 4.0)
    assert s["output_throughput"] == pytest.approx(10 / 4.0)
    assert s["prompt_tokens"] == 30 and s["cached_tokens"] == 12

    ttft = s["ttft_s"]
    assert ttft["count"] == 4
    assert ttft["mean"] == pytest.approx((0.2 + 0.6 + 0.1 + 0.3) / 4)
    assert ttft["p50"] == pytest.approx(0.25)  # sorted 0.1 0.2 0.3 0.6
    assert ttft["p90"] == pytest.approx(0.3 + 0.7 * 0.3)
    assert ttft["p99"] == pytest.approx(0.3 + 0.97 * 0.3)
    tpot = s["tpot_s"]
    assert tpot["count"] == 3
    assert tpot["mean"] == pytest.approx((0.04 + 0.02 + 0.1) / 3)
    assert tpot["p50"] == pytest.approx(0.04)
    assert s["itl_s"]["count"] == 6
    assert s["itl_s"]["max"] == pytest.approx(0.1)
    assert s["e2e_s"]["p50"] == pytest.approx(0.3)  # sorted 0.28 0.3 0.3 0.64
    assert s["server_ttft_s"]["mean"] == pytest.approx((0.2 * 3 + 0.25) / 4)

    g = s["goodput"]
    assert g["good"] == 2
    assert g["share"] == pytest.approx(2 / 7)  # failed requests count against it
    assert g["rate"] == pytest.approx(2 / 4.0)
    assert metrics.summarize(records, slo, duration_s=8.0)["goodput"]["rate"] == 0.25


def test_summary_without_slo_or_records():
    s = metrics.summarize([])
    assert s["requests"] == 0 and "goodput" not in s
    assert s["ttft_s"]["p99"] is None and s["request_throughput"] is None


def test_parse_slo():
    assert metrics.parse_slo("ttft_ms=500, tpot_ms=50") == {"ttft_ms": 500.0, "tpot_ms": 50.0}
    assert metrics.parse_slo(None) == {}
    for bad in ("ttft=5", "ttft_ms", "ttft_ms=x", "tpot_ms=-1"):
        with pytest.raises(ValueError):
            metrics.parse_slo(bad)


def test_report_table_and_json(tmp_path):
    records = [rec(0.0, [(0.1, 1), (0.2, 1)], final=FinalInfo(completion_tokens=2))]
    doc = {
        "runs": [
            {
                "label": "rate=4",
                "load": {"rate": 4.0},
                "summary": metrics.summarize(records, {"ttft_ms": 500}),
                "requests": report.request_rows(records),
            }
        ]
    }
    text = report.format_report(doc)
    assert "TTFT" in text and "goodput     100.0% of requests" in text
    path = report.write_json(doc, tmp_path / "r" / "report.json")
    back = json.loads(path.read_text())
    assert back["runs"][0]["requests"][0]["ttft_s"] == pytest.approx(0.1)


# ---------------------------------------------------------------- workload


def test_parse_length():
    assert workload.parse_length("256") == workload.LengthRange(256, 256)
    assert workload.parse_length("64:512") == workload.LengthRange(64, 512)
    for bad in ("0", "5:4", "a", "1:b"):
        with pytest.raises(ValueError):
            workload.parse_length(bad)


VOCAB = 8000


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_synthetic_workload_is_seeded():
    def make(seed):
        return _take(
            workload.synthetic_conversations(
                workload.LengthRange(8, 64),
                workload.LengthRange(4, 16),
                vocab_size=VOCAB,
                seed=seed,
                turns=2,
            ),
            20,
        )

    a, b, c = make(1), make(1), make(2)
    assert a == b
    assert a != c
    for conv in a:
        for turn in conv.turns:
            assert 8 <= len(turn.message) <= 64 and 4 <= turn.max_tokens <= 16
            assert all(10 <= t < VOCAB for t in turn.message)
    assert workload.arrival_offsets(50, 3.0, seed=4) == workload.arrival_offsets(50, 3.0, seed=4)
    assert workload.arrival_offsets(50, 3.0, seed=4) != workload.arrival_offsets(50, 3.0, seed=5)


def test_lengths_cover_the_range():
    convs = _take(
        workload.synthetic_conversations(
            workload.LengthRange(3, 5), workload.LengthRange(7, 7), vocab_size=VOCAB, seed=0
        ),
        200,
    )
    assert {len(c.turns[0].message) for c in convs} == {3, 4, 5}
    assert {c.turns[0].max_tokens for c in convs} == {7}


@pytest.mark.parametrize("burstiness", [1.0, 0.25, 4.0])
def test_mean_interarrival_matches_the_rate(burstiness):
    gaps = _take(workload.interarrival_gaps(8.0, burstiness, seed=3), 20000)
    assert statistics.mean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    offsets = workload.arrival_offsets(5, 8.0, burstiness, seed=3)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)


def test_burstier_arrivals_vary_more_than_poisson():
    n = 20000
    poisson = _take(workload.interarrival_gaps(4.0, 1.0, seed=1), n)
    bursty = _take(workload.interarrival_gaps(4.0, 0.2, seed=1), n)
    regular = _take(workload.interarrival_gaps(4.0, 5.0, seed=1), n)
    # Gamma(k, 1/(rate*k)) has variance 1/(k*rate^2): Poisson's is 1/16.
    assert statistics.variance(poisson) == pytest.approx(1 / 16, rel=0.1)
    assert statistics.variance(bursty) > 3 * statistics.variance(poisson)
    assert statistics.variance(regular) < statistics.variance(poisson) / 3


def test_infinite_rate_sends_everything_at_once():
    assert workload.arrival_offsets(4, float("inf")) == [0.0] * 4
    with pytest.raises(ValueError):
        next(workload.interarrival_gaps(1.0, 0.0))


def test_shared_prefix_is_identical_across_requests():
    convs = _take(
        workload.synthetic_conversations(
            workload.LengthRange(100, 100),
            workload.LengthRange(8, 8),
            vocab_size=VOCAB,
            seed=0,
            shared_prefix_ratio=0.5,
        ),
        10,
    )
    prompts = [c.turns[0].message for c in convs]
    assert all(len(p) == 100 for p in prompts)
    assert all(p[:50] == prompts[0][:50] for p in prompts)
    assert len({tuple(p[50:]) for p in prompts}) == 10  # suffixes differ

    # With varying lengths the prefixes are prefixes of one shared sequence.
    varied = _take(
        workload.synthetic_conversations(
            workload.LengthRange(40, 200),
            workload.LengthRange(8, 8),
            vocab_size=VOCAB,
            seed=0,
            shared_prefix_ratio=0.5,
        ),
        10,
    )
    shortest = min(round(0.5 * len(c.turns[0].message)) for c in varied)
    heads = {tuple(c.turns[0].message[:shortest]) for c in varied}
    assert len(heads) == 1


def test_no_shared_prefix_by_default():
    convs = _take(
        workload.synthetic_conversations(
            workload.LengthRange(50, 50), workload.LengthRange(8, 8), vocab_size=VOCAB, seed=0
        ),
        5,
    )
    assert len({tuple(c.turns[0].message[:5]) for c in convs}) == 5


def test_multi_turn_prompts_grow_by_answer_and_message():
    conv = next(
        workload.synthetic_conversations(
            workload.LengthRange(16, 16),
            workload.LengthRange(4, 4),
            vocab_size=VOCAB,
            seed=0,
            turns=3,
        )
    )
    answers = [[1, 2, 3, 4], [5, 6, 7, 8]]
    prompts = workload.conversation_prompts(conv, answers)
    assert [len(p) for p in prompts] == [16, 16 + 4 + 16, 16 + 4 + 16 + 4 + 16]
    assert prompts[1] == conv.turns[0].message + answers[0] + conv.turns[1].message
    assert prompts[2] == prompts[1] + answers[1] + conv.turns[2].message
    assert workload.next_turn_prompt("Q1", "A1", "Q2") == "Q1A1Q2"
    with pytest.raises(TypeError):
        workload.next_turn_prompt([1], "text", [2])


def test_jsonl_loading(tmp_path):
    path = tmp_path / "data.jsonl"
    path.write_text(
        '{"prompt": "hello"}\n'
        "\n"
        '{"prompt_token_ids": [5, 6, 7], "max_tokens": 3}\n'
        '{"prompt": "x", "max_tokens": 9, "extra": 1}\n'
    )
    rows = workload.load_jsonl(path)
    assert rows == [
        {"prompt": "hello", "max_tokens": None},
        {"prompt": [5, 6, 7], "max_tokens": 3},
        {"prompt": "x", "max_tokens": 9},
    ]
    convs = _take(workload.dataset_conversations(rows, workload.LengthRange(20, 20), seed=0), 4)
    assert [c.turns[0].message for c in convs] == ["hello", [5, 6, 7], "x", "hello"]
    assert [c.turns[0].max_tokens for c in convs] == [20, 3, 9, 20]


@pytest.mark.parametrize(
    "line", ['{"prompt": 5}', "not json", "[1, 2]", '{"prompt": "a", "max_tokens": 0}', "{}"]
)
def test_jsonl_bad_rows_name_the_line(tmp_path, line):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok"}\n' + line + "\n")
    with pytest.raises(ValueError, match=":2:"):
        workload.load_jsonl(path)


# ---------------------------------------------------------------- served limits


def test_token_range_stays_within_the_vocabulary():
    assert workload.TokenRange.for_vocab(8000) == workload.TokenRange(10, 8000)
    assert workload.TokenRange.for_vocab(20) == workload.TokenRange(10, 20)
    assert workload.TokenRange.for_vocab(19) == workload.TokenRange(0, 19)  # no room to skip
    with pytest.raises(ValueError):
        workload.TokenRange.for_vocab(0)
    for vocab in (5, 300, 8000):
        convs = workload.synthetic_conversations(
            workload.LengthRange(200, 200),
            workload.LengthRange(1, 1),
            vocab_size=vocab,
            seed=0,
            shared_prefix_ratio=0.5,
        )
        ids = [t for c in _take(convs, 20) for t in c.turns[0].message]
        low = workload.TokenRange.for_vocab(vocab).low
        assert low <= min(ids) and max(ids) < vocab
        assert max(ids) >= 0.9 * vocab - 1  # the whole vocabulary is drawn from


def test_synthetic_fit_problem_counts_every_turn():
    inp, out = workload.LengthRange(64, 256), workload.LengthRange(32, 64)
    assert workload.synthetic_fit_problem(inp, out, 1, 320) is None
    assert workload.synthetic_fit_problem(inp, out, 1, 0) is None  # unknown: no check
    problem = workload.synthetic_fit_problem(inp, out, 1, 319)
    assert "320 tokens" in problem and "max_model_len of 319" in problem
    assert "--turns" not in problem
    assert workload.synthetic_fit_problem(inp, out, 2, 639) is not None  # 2 x (256 + 64)
    assert "--turns" in workload.synthetic_fit_problem(inp, out, 2, 639)
    assert workload.synthetic_fit_problem(inp, out, 2, 640) is None


def test_dataset_fit_problem_names_the_row():
    model = ModelInfo("m", vocab_size=100, max_model_len=16, has_tokenizer=False)
    out = workload.LengthRange(4, 4)
    fine = [{"prompt": [1, 2, 3], "max_tokens": None}, {"prompt": [99] * 12, "max_tokens": 4}]
    assert workload.dataset_fit_problem(fine, out, 1, model) is None
    cases = [
        ({"prompt": [5, 100], "max_tokens": None}, "token id 100 is outside"),
        ({"prompt": [5] * 13, "max_tokens": None}, "13 prompt tokens plus max_tokens 4"),
        ({"prompt": "text", "max_tokens": None}, "no tokenizer"),
    ]
    for row, expected in cases:
        problem = workload.dataset_fit_problem([*fine, row], out, 1, model)
        assert problem.startswith("dataset row 3: ") and expected in problem
    # Several turns grow the prompt with answers: the length check is left to the server.
    assert (
        workload.dataset_fit_problem([{"prompt": [5] * 13, "max_tokens": 4}], out, 2, model) is None
    )


def test_summary_and_table_show_the_first_error_of_each_status():
    records = [
        rec(2.0, [], end=2.1, status="INVALID_ARGUMENT"),
        rec(0.0, [(0.1, 1)], final=FinalInfo(completion_tokens=1)),
        rec(1.0, [], end=1.1, status="INVALID_ARGUMENT"),
        rec(1.5, [], end=1.6, status="INTERNAL"),
    ]
    records[0].error = "prompt_token_ids[0] = 9000 is outside the vocabulary [0, 8000)"
    records[2].error = "prompt_token_ids[3] = 12345 is outside the vocabulary [0, 8000)"
    records[3].error = "request failed:\n" + "x" * 500
    s = metrics.summarize(records)
    assert s["errors"] == {"INTERNAL": 1, "INVALID_ARGUMENT": 2}
    assert s["first_errors"] == {  # the earliest sent of each status
        "INTERNAL": records[3].error,
        "INVALID_ARGUMENT": records[2].error,
    }
    doc = {"model": {"name": "m", "vocab_size": 8000, "max_model_len": 4096}}
    doc["runs"] = [{"label": "rate=4", "summary": s}]
    text = report.format_report(doc)
    assert text.startswith("model m: vocab_size 8000, max_model_len 4096")
    assert "errors      INTERNAL: 1, INVALID_ARGUMENT: 2" in text
    assert f"  first INVALID_ARGUMENT: {records[2].error}" in text.splitlines()
    internal = next(line for line in text.splitlines() if "first INTERNAL" in line)
    assert internal.startswith("  first INTERNAL: request failed: xxx") and internal.endswith("...")
    assert len(internal) == len("  first INTERNAL: ") + report.MAX_ERROR_CHARS
    assert "first" not in report.format_run({"label": "x", "summary": metrics.summarize([])})
