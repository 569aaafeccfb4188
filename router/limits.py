"""Bounds on what one request may make the router read, parse or hold.

Every bound is checked before the work it bounds: an HTTP body's size
before it is read, a prompt text's UTF-8 length before it is tokenized,
stop strings before their automaton is built, a key's requests in flight
before a new one is admitted. ``limits.*`` in the config sets them
(router/config.py); docs/security.md lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

from .tokenizer import RouterTokenizer

FALLBACK_BYTES_PER_TOKEN = 64
"""Bytes one token may stand for when the tokenizer's vocabulary is not known."""
TRANSPORT_BYTES_PER_TOKEN = 256
"""What the gRPC transport allows per token when it binds, before the tokenizer is
loaded: more than the longest vocabulary entry of the tokenizers we serve."""
TOKEN_ID_WIRE_BYTES = 5
"""The most bytes one ``int32`` token id takes in a packed protobuf field (a varint)."""
MESSAGE_HEADROOM_BYTES = 64 << 10
"""What a GenerateRequest holds besides its prompt and stop strings (ids, numbers, tags)."""


@dataclass(frozen=True)
class RequestLimits:
    """The configured bounds on one request (``limits.*``; the config, router/config.py,
    bounds these values themselves)."""

    max_stop_strings: int = 16
    max_stop_bytes: int = 4096
    max_http_body_bytes: int = 16 << 20
    max_in_flight_per_key: int = 256
    max_unread_output_bytes: int = 1 << 20
    slow_client_timeout_s: float = 60.0

    def stop_error(self, stop: list[str]) -> str | None:
        """Why ``stop`` is refused (the message names the field), else None."""
        if len(stop) > self.max_stop_strings:
            return f"stop: at most {self.max_stop_strings} stop strings, got {len(stop)}"
        total = 0
        for s in stop:
            total += len(s.encode("utf-8", "surrogatepass"))
            if total > self.max_stop_bytes:
                return f"stop: the stop strings may hold at most {self.max_stop_bytes} bytes in all"
        return None


def max_token_bytes(tokenizer: object) -> int:
    """The most UTF-8 bytes of prompt text one token can stand for.

    For a ``RouterTokenizer``, the longest vocabulary entry in UTF-8 bytes:
    byte-level BPE (``Ġ`` for a space), SentencePiece (``▁``) and byte
    fallback (``<0x41>``) spell each text byte with at least one byte, so
    this never undercounts what a token covers.
    """
    if isinstance(tokenizer, RouterTokenizer):
        return tokenizer.max_token_bytes
    return FALLBACK_BYTES_PER_TOKEN


def prompt_byte_limit(tokenizer: object, max_model_len: int) -> int:
    """The longest prompt text (UTF-8 bytes) that max_model_len tokens could encode."""
    return max(max_model_len, 1) * max_token_bytes(tokenizer)


def generate_message_limit(
    max_model_len: int, bytes_per_token: int, limits: RequestLimits, cap_bytes: int
) -> int:
    """The largest GenerateRequest (bytes) that a servable request can need: a
    prompt of max_model_len tokens (as text of ``bytes_per_token`` bytes a token,
    or as ids), the stop strings, and headroom for the other fields; never more
    than ``cap_bytes``."""
    prompt = max_model_len * max(bytes_per_token, TOKEN_ID_WIRE_BYTES)
    stops = limits.max_stop_bytes + limits.max_stop_strings * 4  # + a tag and length each
    return min(cap_bytes, prompt + stops + MESSAGE_HEADROOM_BYTES)
