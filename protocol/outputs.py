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
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None
    logprobs: list[TokenLogprobs] | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    error: str | None = None
    """Why the request failed, with finish_reason "error" (a fault tied to it:
    non-finite logits, its stop or detokenize step, its sampling); else None."""

    @classmethod
    def aborted(cls, request_id: str) -> RequestOutput:
        return cls(request_id, [], "", True, "abort", None, 0, 0, 0)

    @classmethod
    def failed(cls, request_id: str, error: str, num_output_tokens: int = 0) -> RequestOutput:
        """The request failed alone (its fault); the rest of its batch goes on."""
        return cls(request_id, [], "", True, "error", None, 0, 0, num_output_tokens, error)


class RequestFailed(RuntimeError):
    """A worker call failed because of a fault tied to its request (a
    RequestOutput with finish_reason "error"): the router counts it against
    the request (router/failover.py ``RequestFault``), not the worker."""
