"""What a request's result reports after a client's resume: cached tokens
within the prompt, and the mean TPOT over the tokens this router streamed."""

from __future__ import annotations

import pytest

from engine.sampling import SamplingParams
from protos.tandem.v1 import worker_pb2
from router import progress as progress_mod
from router.backend import GenerateInput
from router.progress import Progress

pytestmark = pytest.mark.unit


def _delta(tokens: list[int], num_output: int, cached: int) -> worker_pb2.RequestDelta:
    return worker_pb2.RequestDelta(
        request_id="r", token_ids=tokens, num_output_tokens=num_output, num_cached_tokens=cached
    )


def test_a_resumed_request_reports_cached_prompt_tokens_and_tpot_of_new_tokens(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(progress_mod.time, "perf_counter", lambda: clock[0])
    prompt, resumed = [1, 2, 3, 4], [10, 11, 12, 13, 14, 15]
    inp = GenerateInput("r", prompt, SamplingParams(max_tokens=9), resume_token_ids=resumed)
    progress = Progress(inp)
    # The worker resumes after 6 tokens: prompt and resumed ones all cached there.
    for i, token in enumerate([16, 17, 18]):
        clock[0] = 101.0 + i  # one token a second, from the first one on
        delta = _delta([token], len(resumed) + i + 1, len(prompt) + len(resumed))
        progress.delta(delta)
        progress.count(delta)
    result = progress.result("length")
    assert result.completion_tokens == 9
    assert result.cached_tokens == len(prompt)
    assert result.mean_tpot_s == pytest.approx(1.0)  # 2 s over the 2 gaps between 3 new tokens
    assert progress.token_ids == [*resumed, 16, 17, 18]
