"""How the engine keeps a fault with its request (mixed into LLMEngine).

A fault tied to one sequence (non-finite logits, an error in its stop,
detokenize or verify step) fails that request alone: it ends with
finish_reason "error" and a message, its blocks are freed, and the rest of
the batch goes on with exactly the tokens it would have had. A pass of one
sequence that raises is that sequence's fault. A pass of several that
raises is run again one sequence at a time (``_run_alone``): the sequences
that raise alone fail, the others go on; when none runs even alone, the
fault is nobody's in particular: they are aborted (the router tries them
again elsewhere, as after a lost worker) and the step counts against the
worker (``failed_steps``, its health). docs/failures.md has the whole
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
from protocol.workers import FAILING_WINDOW_S

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
    failed_steps: int  # steps in a row that failed for no one request (0 after one that passed)
    last_failed_step_at: float | None  # clock() when the last of them failed
    clock: Callable[[], float]  # seconds, for recent_failed_steps (tests set their own)

    def _run(
        self, batch: list[ScheduledSeq], pool_lock: threading.RLock | None
    ) -> list[RequestOutput]:
        raise NotImplementedError

    def abort(self, request_id: str) -> bool:
        raise NotImplementedError

    def note_failed_step(self) -> None:
        """A step failed for no one request: it counts against the worker."""
        self.failed_steps += 1
        self.last_failed_step_at = self.clock()

    def recent_failed_steps(self) -> int:
        """``failed_steps`` while the last of them is under ``FAILING_WINDOW_S``
        old, else 0: what the worker's health reports (protocol/workers.py)."""
        at = self.last_failed_step_at
        if not self.failed_steps or at is None or self.clock() - at >= FAILING_WINDOW_S:
            return 0
        return self.failed_steps

    def _step_raised(
        self, batch: list[ScheduledSeq], pool_lock: threading.RLock | None, exc: Exception
    ) -> list[RequestOutput]:
        """The outputs of a step whose pass over ``batch`` raised ``exc``."""
        if len(batch) == 1:  # it ran alone: the fault is its own, not the worker's
            seq = batch[0].seq
            log.error("request %s: its step raised", seq.request_id, exc_info=exc)
            return [self._fail(seq, f"its step failed: {_describe(exc)}")]
        log.error("a step of %d sequences raised; running them alone", len(batch), exc_info=exc)
        return self._run_alone(batch, pool_lock)

    def _run_alone(
        self, batch: list[ScheduledSeq], pool_lock: threading.RLock | None
    ) -> list[RequestOutput]:
        """The step again, one sequence per pass. When one pass at least ran,
        the sequences whose pass raised fail (the fault was theirs). When
        none ran, nothing tells whose fault it is: every one is aborted, which
        the router takes as a lost worker (it tries them again elsewhere, and
        charges no fault to them), and the step counts against the worker."""
        outputs: list[RequestOutput] = []
        raised: list[tuple[Sequence, Exception]] = []
        for item in batch:
            try:
                outputs += self._run([item], pool_lock)
            except Exception as exc:  # nothing of it changed: decided below
                log.exception("request %s: its step raised alone", item.seq.request_id)
                raised.append((item.seq, exc))
        if len(raised) < len(batch):
            self.failed_steps = 0
            return outputs + [self._fail(s, f"its step failed: {_describe(e)}") for s, e in raised]
        self.note_failed_step()
        log.error(
            "the step raised for each of its %d sequences alone: aborting them "
            "(%d failed steps in a row)",
            len(batch),
            self.failed_steps,
        )
        for seq, _ in raised:
            self.abort(seq.request_id)
        return [RequestOutput.aborted(seq.request_id) for seq, _ in raised]

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
