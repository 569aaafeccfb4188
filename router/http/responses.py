"""Response bodies of the OpenAI-compatible endpoints (streamed and whole)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from protocol.outputs import TokenLogprobs
from router.backend import GenerateResult, TokenDelta

Kind = Literal["completion", "chat"]


def usage(result: GenerateResult) -> dict:
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.prompt_tokens + result.completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": result.cached_tokens,
            # tandem's extension: the hit the block index predicted (docs/prefix-caching.md)
            "predicted_cached_tokens": result.predicted_cached_tokens,
        },
    }


@dataclass
class Formatter:
    """Builds one request's chunks (``stream=true``) or its whole response."""

    kind: Kind
    request_id: str
    model: str
    tokenizer: Any
    return_token_ids: bool = False
    top_logprobs: bool = False  # whether top alternatives were asked for
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # completions logprobs: text offset of the next token

    @property
    def id(self) -> str:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        return f"{prefix}-{self.request_id}"

    @property
    def _object(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    def _envelope(self, choices: list[dict], stream: bool) -> dict:
        obj = "chat.completion.chunk" if self.kind == "chat" and stream else self._object
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def role_chunk(self) -> dict:
        """Chat streams open with the assistant's role."""
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
        return self._envelope([{**choice, "finish_reason": None}], stream=True)

    def chunk(self, delta: TokenDelta) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {"content": delta.text}
        else:
            choice["text"] = delta.text
        choice["logprobs"] = self.logprobs(delta.logprobs)
        choice["finish_reason"] = None
        if self.return_token_ids:
            choice["token_ids"] = delta.token_ids
        return self._envelope([choice], stream=True)

    def final_chunk(self, result: GenerateResult) -> dict:
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["delta"] = {}
        else:
            choice["text"] = ""
        choice.update(logprobs=None, finish_reason=result.finish_reason)
        return self._envelope([choice], stream=True)

    def usage_chunk(self, result: GenerateResult) -> dict:
        return {**self._envelope([], stream=True), "usage": usage(result)}

    def whole(self, deltas: list[TokenDelta], result: GenerateResult) -> dict:
        text = "".join(d.text for d in deltas)
        lps = [lp for d in deltas for lp in d.logprobs or ()]
        choice: dict[str, Any] = {"index": 0}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = self.logprobs(lps if any(d.logprobs for d in deltas) else None)
        choice["finish_reason"] = result.finish_reason
        if self.return_token_ids:
            choice["token_ids"] = [t for d in deltas for t in d.token_ids]
        return {**self._envelope([choice], stream=False), "usage": usage(result)}

    def logprobs(self, lps: list[TokenLogprobs] | None) -> dict | None:
        if not lps:
            return None
        if self.kind == "chat":
            return {"content": [self._chat_logprob(lp) for lp in lps]}
        tokens = [self._token(lp.token_id) for lp in lps]
        offsets = []
        for tok in tokens:
            offsets.append(self._offset)
            self._offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [
                {self._token(t): v for t, v in lp.top} if self.top_logprobs else None for lp in lps
            ],
            "text_offset": offsets,
        }

    def _chat_logprob(self, lp: TokenLogprobs) -> dict:
        token = self._token(lp.token_id)
        return {
            "token": token,
            "logprob": lp.logprob,
            "bytes": list(token.encode()),
            "top_logprobs": [
                {"token": (t := self._token(i)), "logprob": v, "bytes": list(t.encode())}
                for i, v in lp.top
            ],
        }

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])
