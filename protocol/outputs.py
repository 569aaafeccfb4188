"""What a worker streams back to the router for one request, per step.

Torch-free: the engine builds these, the workers send them over their
output streams (worker/output_wire.py), the router reads them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TokenLogprobs:
    """The logprob of one sampled token and the top alternatives, highest first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RequestOutput:
    """What one step produced for one request (deltas, not totals)."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None
    logprobs: list[TokenLogprobs] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int

    @classmethod
    def aborted(cls, request_id: str) -> RequestOutput:
        return cls(request_id, [], "", True, "abort", None, 0, 0, 0)
