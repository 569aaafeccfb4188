"""What the router measures and remembers of one request across its tries:
the tokens streamed so far (a failover resumes after them; a client's resume
starts with those it received), timings, counts."""

from __future__ import annotations

import time

from protocol.outputs import TokenLogprobs
from protos.tandem.v1 import worker_pb2
from router.backend import GenerateInput, GenerateResult, TokenDelta


class Progress:
    def __init__(self, inp: GenerateInput) -> None:
        self.inp = inp
        self.workers = ("", "")
        self.start = inp.received_s
        self.first_time = self.last_time = 0.0
        # Streamed to the client, in order: by an earlier router first (a
        # client's resume, router/resume.py), then by this one.
        self.token_ids: list[int] = list(inp.resume_token_ids)
        self.num_output = len(self.token_ids)
        self.cached: int | None = None  # prompt tokens found cached, by the first try
        self.predicted = 0  # what the index predicted for the try that set `cached`
        self.available = 0  # what the index said the best holder had, for that try
        self.transfer: tuple[int, float] | None = None  # (bytes, seconds) of the last KV push

    def attempt(
        self, prefill_worker: str, decode_worker: str, predicted: int = 0, available: int = 0
    ) -> None:
        """A try starts on these workers; ``predicted``, ``available``: the prefix
        hits the index predicted for it and for the best holder
        (router/prefix_routing.py ``RoutePlan``)."""
        self.workers = (prefill_worker, decode_worker)
        if self.cached is None:  # no try has reported its hit yet
            self.predicted, self.available = predicted, available

    def delta(self, delta: worker_pb2.RequestDelta) -> TokenDelta:
        self._stamp()
        self.token_ids += delta.token_ids
        return TokenDelta(list(delta.token_ids), delta.text, _logprobs(delta))

    def count(self, delta: worker_pb2.RequestDelta) -> None:
        if delta.num_output_tokens:
            self.num_output = delta.num_output_tokens
            if self.cached is None:
                self.cached = delta.num_cached_tokens

    def _stamp(self) -> None:
        now = time.perf_counter()
        self.first_time = self.first_time or now
        self.last_time = now

    def result(self, reason: str | None) -> GenerateResult:
        n = self.num_output
        # Timed here: the tokens this router streamed (not a client's resumed ones).
        new = n - len(self.inp.resume_token_ids)
        tpot = (self.last_time - self.first_time) / (new - 1) if new > 1 else 0.0
        prompt = len(self.inp.prompt_token_ids)
        return GenerateResult(
            finish_reason=reason or "abort",
            prompt_tokens=prompt,
            # A resumed try's worker counts the resumed tokens it found cached
            # too: only the prompt's are the client's cached tokens.
            cached_tokens=min(self.cached or 0, prompt),
            predicted_cached_tokens=min(self.predicted, prompt),
            available_cached_tokens=min(self.available, prompt),
            completion_tokens=n,
            ttft_s=self.first_time - self.start if self.first_time else 0.0,
            mean_tpot_s=tpot,
            prefill_worker=self.workers[0],
            decode_worker=self.workers[1],
            kv_transfer_bytes=self.transfer[0] if self.transfer else 0,
            kv_transfer_s=self.transfer[1] if self.transfer else None,
        )


def _logprobs(delta: worker_pb2.RequestDelta) -> list[TokenLogprobs] | None:
    if not delta.logprobs:
        return None
    return [
        TokenLogprobs(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top_logprobs])
        for lp in delta.logprobs
    ]
