"""Offline API in the style of vLLM: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from protocol.outputs import TokenLogprobs
from protocol.sampling import SamplingParams

Prompt = str | Seq[int]


@dataclass
class GenerationOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0


class LLM:
    """Runs an engine to completion over a list of prompts."""

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        """``engine_options``: EngineConfig's fields. With tensor_parallel_size N > 1
        the model is split over this process and N - 1 local ones
        (engine/parallel/); ``close`` (or the end of a ``with`` block, or of this
        process) stops them."""
        self.engine = LLMEngine(EngineConfig(model=model, **engine_options))
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def close(self) -> None:
        """Stop the other tensor-parallel ranks and free the second KV tier."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
    ) -> list[GenerationOutput]:
        """One output per prompt, in order. A prompt is text or a list of token ids."""
        batch = _as_batch(prompts)
        if params is None:
            params = SamplingParams()
        per_prompt = [params] * len(batch) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(batch):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(batch)} prompts")
        results: dict[str, GenerationOutput] = {}
        order = []
        for prompt, p in zip(batch, per_prompt, strict=True):
            request_id = f"llm-{self._counter}"
            self._counter += 1
            ids = self._encode(prompt)
            self.engine.add_request(request_id, ids, p)
            results[request_id] = GenerationOutput(
                request_id, prompt if isinstance(prompt, str) else None, ids
            )
            order.append(request_id)
        try:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    r = results[out.request_id]
                    r.token_ids += out.new_token_ids
                    r.text += out.text_delta
                    r.num_cached_tokens = out.num_cached_tokens
                    if out.logprobs is not None:
                        r.logprobs = (r.logprobs or []) + out.logprobs
                    if out.finished:
                        r.finish_reason = out.finish_reason
        except BaseException:
            for request_id in order:
                self.engine.abort(request_id)
            raise
        return [results[r] for r in order]

    def _encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer; pass token ids")
            return list(self.tokenizer.encode(prompt))
        return [int(t) for t in prompt]


def _as_batch(prompts: Prompt | Seq[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    return items
