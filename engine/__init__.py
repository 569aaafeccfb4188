"""tandem's engine: a Llama-family model over a paged KV cache.

Shared by the prefill and decode pools; it imports nothing of Ray or of
the serving layers.
"""

from engine.config import EngineConfig, ModelSpec
from engine.llm import LLM, GenerationOutput
from engine.llm_engine import KVExport, LLMEngine
from engine.sampling import SamplingParams
from engine.sequence import RequestOutput

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
