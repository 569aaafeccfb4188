"""What a prefill worker's push carries for the decode worker, in two parts.

``DecodeStart`` travels in the push's header (``TransferHeader.decode_start``):
what the decode worker checks before it reserves a block (the router whose
output stream gets the tokens, the prompt's length, the sampling
parameters). ``FirstToken`` travels in the commit (``Commit.first_token``):
the token the prefill sampled, known only once the prefill is done, which
the decode worker sends as the first frame of the router's output stream.
A push that streams the KV while the prompt is computed sends the header
before the first token exists.

JSON on the wire; decoding validates every field, so a malformed start
refuses the push before any block is reserved, and a malformed first token
fails the commit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from protocol.outputs import RequestOutput, TokenLogprobs
from protocol.sampling import SamplingParams

FINISH_REASONS = (None, "stop", "length")  # a first token never carries "abort"


class BadStart(ValueError):
    """A decode start or first token that does not parse or validate."""


@dataclass(frozen=True)
class DecodeStart:
    router_id: str  # whose output stream the request's tokens go to
    num_prompt_tokens: int  # the push's tokens are the prompt, then outputs
    params: SamplingParams

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> DecodeStart:
        try:
            raw = json.loads(data)
            start = cls(
                router_id=_typed(raw["router_id"], str),
                num_prompt_tokens=_typed(raw["num_prompt_tokens"], int),
                params=SamplingParams(**raw["params"]),
            )
            if start.num_prompt_tokens < 1:
                raise ValueError("a start has prompt tokens")
            return start
        except (ValueError, TypeError, KeyError) as exc:
            raise BadStart(f"malformed decode start: {exc}") from None


@dataclass(frozen=True)
class FirstToken:
    text: str  # text of the token the prefill sampled
    logprobs: list[TokenLogprobs] | None
    num_cached_tokens: int  # prompt tokens the prefill found cached
    num_output_tokens: int  # output tokens so far, the first (sampled) one included
    finish_reason: str | None = None  # set when the first token ends the request

    def encode(self) -> bytes:
        return json.dumps(dataclasses.asdict(self)).encode()

    @classmethod
    def decode(cls, data: bytes) -> FirstToken:
        try:
            raw = json.loads(data)
            logprobs = raw["logprobs"]
            first = cls(
                text=_typed(raw["text"], str),
                logprobs=None
                if logprobs is None
                else [
                    TokenLogprobs(int(lp["token_id"]), float(lp["logprob"]), _top(lp["top"]))
                    for lp in logprobs
                ],
                num_cached_tokens=_typed(raw["num_cached_tokens"], int),
                num_output_tokens=_typed(raw["num_output_tokens"], int),
                finish_reason=raw.get("finish_reason"),
            )
            first._check()
            return first
        except (ValueError, TypeError, KeyError) as exc:
            raise BadStart(f"malformed first token: {exc}") from None

    def _check(self) -> None:
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason {self.finish_reason!r}")
        if self.num_output_tokens < 1 or self.num_cached_tokens < 0:
            raise ValueError("a first token counts itself, and no negative cached tokens")
        self.text.encode()  # lone surrogates cannot go on the output stream

    def output(
        self, request_id: str, token_ids: list[int], num_prompt_tokens: int
    ) -> RequestOutput:
        """The first frame of the request's stream: the prefill's token."""
        return RequestOutput(
            request_id,
            token_ids,
            self.text,
            self.finish_reason is not None,
            self.finish_reason,
            self.logprobs,
            num_prompt_tokens,
            self.num_cached_tokens,
            self.num_output_tokens,
        )


def _typed(value: object, kind: type) -> object:
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ValueError(f"expected {kind.__name__}, got {type(value).__name__}")
    return value


def _top(pairs: list) -> list[tuple[int, float]]:
    return [(int(t), float(p)) for t, p in pairs]
