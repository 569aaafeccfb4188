"""Test doubles that implement the interfaces of the real pieces."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

from protocol.outputs import TokenLogprobs
from protocol.workers import WorkerStats
from router.backend import GenerateInput, GenerateResult, TokenDelta, WorkerReport


class FakeTokenizer:
    """Byte-level: one token per UTF-8 byte, no special tokens."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        return bytes(token_ids).decode(errors="replace")


class FakeBackend:
    """A ``Backend`` that streams scripted words, one per delta.

    Token i of every request is ``words[i % len(words)]`` with id ``i % vocab``.
    ``gate``, when given, holds every stream before its first delta until it
    is set; ``pause_after`` holds it after that many deltas until ``resume``
    is set; ``start_gate`` holds ``start()``. ``fail_after`` raises after
    that many deltas; ``fail_every`` n makes every n-th request (the n-th,
    2n-th, ...) raise before its first delta. Requests whose stream is closed before it finished
    land in ``aborted``, the others in ``finished``. A resumed request
    (``resume_token_ids``) goes on from token ``len(resume_token_ids)``, as
    the same request uninterrupted would have; ``eos_token_ids`` end nothing
    here (the router checks resumed tokens against them).
    """

    def __init__(
        self,
        *,
        tokenizer: FakeTokenizer | None = None,
        model_name: str = "fake-model",
        max_model_len: int = 64,
        vocab_size: int = 256,
        block_size: int = 16,
        words: tuple[str, ...] = (" alpha", " beta", " gamma", " delta"),
        delay_s: float = 0.005,
        gate: asyncio.Event | None = None,
        pause_after: int | None = None,
        start_gate: asyncio.Event | None = None,
        fail_after: int | None = None,
        fail_every: int | None = None,
        end_without_result: bool = False,
        eos_token_ids: tuple[int, ...] = (),
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.block_size = block_size
        self.eos_token_ids = frozenset(eos_token_ids)
        self.words = words
        self.delay_s = delay_s
        self.gate = gate
        self.pause_after = pause_after
        self.resume = asyncio.Event()
        self.start_gate = start_gate
        self.fail_after = fail_after
        self.fail_every = fail_every
        self.end_without_result = end_without_result
        self.inputs: list[GenerateInput] = []
        self.running: set[str] = set()
        self.finished: list[str] = []
        self.aborted: list[str] = []
        self.started = False
        self.shut_down = False
        self._changed = asyncio.Condition()

    async def start(self) -> None:
        if self.start_gate is not None:
            await self.start_gate.wait()
        self.started = True
        await self._notify()

    async def shutdown(self) -> None:
        self.shut_down = True
        await self._notify()

    async def wait_for(self, predicate, timeout_s: float = 10.0) -> None:
        """Wait until ``predicate(self)`` holds (raises TimeoutError after timeout_s)."""
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()

    def generate(self, inp: GenerateInput) -> AsyncIterator[TokenDelta | GenerateResult]:
        return self._generate(inp)

    async def _generate(self, inp: GenerateInput) -> AsyncIterator[TokenDelta | GenerateResult]:
        rid, params = inp.request_id, inp.params
        self.inputs.append(inp)
        scripted_failure = self.fail_every is not None and len(self.inputs) % self.fail_every == 0
        self.running.add(rid)
        done = False
        try:
            await self._notify()
            if self.gate is not None:
                await self.gate.wait()
            if scripted_failure:
                raise RuntimeError(f"scripted failure (fail_every={self.fail_every})")
            for i in range(len(inp.resume_token_ids), params.max_tokens):
                if i == self.pause_after:
                    await self.resume.wait()
                if self.fail_after is not None and i >= self.fail_after:
                    raise RuntimeError("scripted backend failure")
                await asyncio.sleep(self.delay_s)
                token = i % self.vocab_size
                yield TokenDelta([token], self.words[i % len(self.words)], _logprobs(token, params))
            done = True
            if self.end_without_result:
                return
            yield GenerateResult(
                finish_reason="length",
                prompt_tokens=len(inp.prompt_token_ids),
                cached_tokens=0,
                completion_tokens=params.max_tokens,
                ttft_s=0.01,
                mean_tpot_s=0.002,
                prefill_worker="prefill-0",
                decode_worker="decode-0",
            )
        finally:
            self.running.discard(rid)
            (self.finished if done else self.aborted).append(rid)
            await asyncio.shield(self._notify())


def _logprobs(token: int, params) -> list[TokenLogprobs] | None:
    if params.logprobs is None:
        return None
    top = [(token, -0.25), (token + 1, -1.5), (token + 2, -2.0)][: params.logprobs]
    return [TokenLogprobs(token_id=token, logprob=-0.25, top=top)]


class RouterInThread:
    """A RouterServer over ``backend`` on its own event loop in a thread, for
    code under test that runs its own loop (``asyncio.run``)."""

    def __init__(self, backend: FakeBackend, **server_kwargs) -> None:
        self.backend = backend
        self._server_kwargs = server_kwargs
        self._ready = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)
        self.address = ""
        self.http_url = ""  # with an HTTP front (http=HttpSettings(...))

    async def _main(self) -> None:
        from router.service import RouterServer

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = RouterServer(self.backend, host="127.0.0.1", port=0, **self._server_kwargs)
        await server.start()
        self.address = server.address
        self.http_url = server.http.url if server.http is not None else ""
        self._ready.set()
        await self._stop.wait()
        await server.stop(0)

    def __enter__(self) -> RouterInThread:
        self._thread.start()
        if not self._ready.wait(10):
            raise TimeoutError("the router did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


class FakePools(FakeBackend):
    """A FakeBackend with pools (``ManagedPools``): ``scale`` records each call and
    sets the sizes, or raises ``scale_error`` when one is given. With
    ``placing`` (an asyncio.Event) a scale waits for it before it answers, as
    one that waits for Ray to place workers; ``scaling`` is set once it waits."""

    def __init__(
        self,
        *,
        scale_error: Exception | None = None,
        placing: asyncio.Event | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.sizes = (1, 1)
        self.scale_calls: list[tuple[int | None, int | None, float]] = []
        self.scale_error = scale_error
        self.placing = placing
        self.scaling = asyncio.Event()

    async def scale(
        self, prefill: int | None, decode: int | None, drain_timeout_s: float
    ) -> tuple[int, int]:
        self.scale_calls.append((prefill, decode, drain_timeout_s))
        self.scaling.set()
        if self.placing is not None:
            await self.placing.wait()
        if self.scale_error is not None:
            raise self.scale_error
        old_prefill, old_decode = self.sizes
        self.sizes = (
            old_prefill if prefill is None else prefill,
            old_decode if decode is None else decode,
        )
        return self.sizes

    async def worker_reports(self) -> list[WorkerReport]:
        stats = WorkerStats(
            free_blocks=7,
            total_blocks=8,
            initial_free_blocks=8,
            num_holders=0,
            initial_num_holders=0,
            num_requests=0,
            num_running=0,
            num_waiting=0,
            num_steps=0,
            num_preemptions=0,
        )
        return [WorkerReport("decode-0", "decode", 0, stats)]
