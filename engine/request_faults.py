"""How the engine keeps a fault with its request (mixed into LLMEngine).

A fault tied to one sequence (non-finite logits, an error in its stop,
detokenize or verify step) fails that request alone: it ends with
finish_reason "error" and a message, its blocks are freed, and the rest of
the batch goes on with exactly the tokens it would have had. A pass that
raises is run again one sequence at a time (``_run_alone``): the sequences
that raise alone fail, the others go on. docs/failures.md has the whole
picture, from the engine to the client.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.sampling import NONFINITE_LOGITS, nonfinite_rows
from engine.sequence import SeqStatus, Sequence
from protocol.outputs import RequestOutput

if TYPE_CHECKING:
    import threading

    from engine.block_pool import BlockPool
    from engine.config import ModelSpec
    from engine.scheduler import ScheduledSeq, Scheduler
    from engine.spec import SpecDecoder

log = logging.getLogger(__name__)


class RequestFaults:
    """LLMEngine's handling of faults tied to one request."""

    _seqs: dict[str, Sequence]
    scheduler: Scheduler
    block_pool: BlockPool
    speculator: SpecDecoder | None
    spec: ModelSpec

    def _run(
        self, batch: list[ScheduledSeq], pool_lock: threading.RLock | None
    ) -> list[RequestOutput]:
        raise NotImplementedError

    def _run_alone(
        self, batch: list[ScheduledSeq], pool_lock: threading.RLock | None
    ) -> tuple[list[RequestOutput], bool]:
        """The step again, one sequence per pass; a sequence whose pass raises
        fails. Also returns whether any pass ran (the fault was then the
        failed sequences', not the worker's)."""
        outputs: list[RequestOutput] = []
        ran = False
        for item in batch:
            try:
                outputs += self._run([item], pool_lock)
                ran = True
            except Exception as exc:
                log.exception("request %s: its step raised", item.seq.request_id)
                outputs.append(self._fail(item.seq, f"its step failed: {_describe(exc)}"))
        return outputs, ran

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        """The speculator's verify, one sequence at a time (a fault fails it alone)."""
        assert self.speculator is not None
        outputs: list[RequestOutput] = []
        row = 0
        for seq in seqs:
            n = len(seq.spec_token_ids) + 1
            rows = logits[row : row + n]
            row += n
            if seq.request_id not in self._seqs:
                continue
            if nonfinite_rows(rows[:, : self.spec.vocab_size]):
                outputs.append(self._fail(seq, NONFINITE_LOGITS, suspect_kv=True))
            else:
                outputs += self._guarded(seq, lambda s=seq, r=rows: self.speculator.accept([s], r))
        return outputs

    def _guarded(self, seq: Sequence, fn: Callable[[], list[RequestOutput]]) -> list[RequestOutput]:
        """``fn()``'s outputs; if it raises, ``seq`` fails alone."""
        try:
            return fn()
        except Exception as exc:
            log.exception("request %s failed in its step's bookkeeping", seq.request_id)
            return [self._fail(seq, f"its step failed: {_describe(exc)}")]

    def _fail(self, seq: Sequence, error: str, suspect_kv: bool = False) -> RequestOutput:
        """End ``seq`` with finish_reason "error", wherever it is, and free its
        blocks. ``suspect_kv``: its blocks also leave the prefix cache (a block
        it read may be what broke its logits)."""
        if self._seqs.get(seq.request_id) is seq:
            del self._seqs[seq.request_id]
        for queue in (self.scheduler.waiting, self.scheduler.running):
            if seq in queue:
                queue.remove(seq)
        if suspect_kv:
            self.block_pool.forget(seq.block_table)
        self.scheduler.free_blocks(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = "error"
        if self.speculator is not None:
            self.speculator.release(seq.request_id)
        log.warning("request %s failed: %s", seq.request_id, error)
        return RequestOutput.failed(seq.request_id, error, len(seq.output_token_ids))


def _describe(exc: BaseException) -> str:
    """An exception in a line, for a failed request's message (no traceback)."""
    text = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
