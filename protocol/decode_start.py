"""What a prefill worker's push carries for the decode worker: everything it
needs to start the request once the push commits, and to send the first
token as the first frame of the router's output stream.

JSON on the wire (``TransferHeader.decode_start``); decoding validates every
field, so a malformed start refuses the push before any block is reserved.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from protocol.outputs import RequestOutput, TokenLogprobs
from protocol.sampling import SamplingParams

FINISH_REASONS = (None, "stop", "length")  # a start never carries "abort"


class BadStart(ValueError):
    """A decode start that does not parse or validate."""


@dataclass(frozen=True)
class DecodeStart:
    router_id: str  # whose output stream the request's tokens go to
    num_prompt_tokens: int  # the push's tokens are the prompt, then outputs
    params: SamplingParams
    first_text: str  # text of the token the prefill sampled
    first_logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int  # prompt tokens the prefill found cached
    num_output_tokens: int  # output tokens so far, the first (sampled) one included
    finish_reason: str | None = None  # set when the first token ends the request

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> DecodeStart:
        try:
            raw = json.loads(data)
            logprobs = raw["first_logprobs"]
            start = cls(
                router_id=_typed(raw["router_id"], str),
                num_prompt_tokens=_typed(raw["num_prompt_tokens"], int),
                params=SamplingParams(**raw["params"]),
                first_text=_typed(raw["first_text"], str),
                first_logprobs=None
                if logprobs is None
                else [
                    TokenLogprobs(int(lp["token_id"]), float(lp["logprob"]), _top(lp["top"]))
                    for lp in logprobs
                ],
                num_cached_tokens=_typed(raw["num_cached_tokens"], int),
                num_output_tokens=_typed(raw["num_output_tokens"], int),
                finish_reason=raw.get("finish_reason"),
            )
            start._check()
            return start
        except (ValueError, TypeError, KeyError) as exc:
            raise BadStart(f"malformed decode start: {exc}") from None

    def _check(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r}")
        if self.num_prompt_tokens < 1 or self.num_output_tokens < 1:
            raise ValueError("a start has prompt tokens and at least the first output token")
        self.first_text.encode()  # lone surrogates cannot go on the output stream

    def first_output(self, request_id: str, token_ids: list[int]) -> RequestOutput:
        """The first frame of the request's stream: the prefill's token."""
        return RequestOutput(
            request_id,
            token_ids,
            self.first_text,
            self.finish_reason is not None,
            self.finish_reason,
            self.first_logprobs,
            self.num_prompt_tokens,
            self.num_cached_tokens,
            self.num_output_tokens,
        )


def _typed(value: object, kind: type) -> object:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _top(pairs: list) -> list[tuple[int, float]]:
    return [(int(t), float(p)) for t, p in pairs]
