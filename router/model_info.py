"""What model a router serves and its limits, as both fronts say it.

The gRPC API answers ``GetModelInfo`` with a ``tandem.v1.ModelInfo``; the
HTTP front's ``/v1/models`` adds the same figures to OpenAI's model object
(``max_model_len`` as vLLM does, ``vocab_size``, ``has_tokenizer``,
``block_size``). Clients (``tandem bench``) read either back into a
:class:`ModelInfo`. Light on imports: clients use it without torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from protos.tandem.v1 import generate_pb2 as pb

if TYPE_CHECKING:
    from .backend import Backend


@dataclass(frozen=True)
class ModelInfo:
    name: str  # the served model name (the HTTP front's model id)
    vocab_size: int  # token ids are in [0, vocab_size)
    max_model_len: int  # prompt plus output tokens
    has_tokenizer: bool  # False: token-id prompts only
    block_size: int = 0  # tokens per KV-cache block; 0 when unknown

    @classmethod
    def of(cls, backend: Backend) -> ModelInfo:
        """The figures of a started backend."""
        return cls(
            name=backend.model_name,
            vocab_size=backend.vocab_size,
            max_model_len=backend.max_model_len,
            has_tokenizer=backend.tokenizer is not None,
            block_size=backend.block_size,
        )

    def to_proto(self) -> pb.ModelInfo:
        return pb.ModelInfo(
            name=self.name,
            vocab_size=self.vocab_size,
            max_model_len=self.max_model_len,
            has_tokenizer=self.has_tokenizer,
            block_size=self.block_size,
        )

    @classmethod
    def from_proto(cls, message: pb.ModelInfo) -> ModelInfo:
        return cls(
            name=message.name,
            vocab_size=message.vocab_size,
            max_model_len=message.max_model_len,
            has_tokenizer=message.has_tokenizer,
            block_size=message.block_size,
        )

    def card_fields(self) -> dict[str, Any]:
        """tandem's fields of a /v1/models entry (besides OpenAI's id, object, ...)."""
        return {
            "max_model_len": self.max_model_len,
            "vocab_size": self.vocab_size,
            "has_tokenizer": self.has_tokenizer,
            "block_size": self.block_size,
        }

    @classmethod
    def from_card(cls, card: Mapping[str, Any]) -> ModelInfo:
        """From a /v1/models entry; a figure the server does not give reads as 0
        (another OpenAI-compatible server may give max_model_len only)."""
        return cls(
            name=str(card["id"]),
            vocab_size=int(card.get("vocab_size") or 0),
            max_model_len=int(card.get("max_model_len") or 0),
            has_tokenizer=bool(card.get("has_tokenizer", True)),
            block_size=int(card.get("block_size") or 0),
        )
