"""tandem's engine: a Llama-family model over a paged KV cache.

The model and its cache only: no grpc, redis, ray or sockets. The names
below load on first use, so that torch-free modules of the package
(``engine.hashing``) can be imported without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig, ModelSpec
    from engine.llm import LLM, GenerationOutput
    from engine.llm_engine import KVExport, LLMEngine
    from protocol.outputs import RequestOutput
    from protocol.sampling import SamplingParams

_WHERE = {
    "EngineConfig": "engine.config",
    "ModelSpec": "engine.config",
    "LLM": "engine.llm",
    "GenerationOutput": "engine.llm",
    "KVExport": "engine.llm_engine",
    "LLMEngine": "engine.llm_engine",
    "SamplingParams": "protocol.sampling",  # torch-free, shared with the router
    "RequestOutput": "protocol.outputs",
}

__all__ = [
    "LLM",
    "EngineConfig",
    "GenerationOutput",
    "KVExport",
    "LLMEngine",
    "ModelSpec",
    "RequestOutput",
    "SamplingParams",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
