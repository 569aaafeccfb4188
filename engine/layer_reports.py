"""Reports, during a forward pass, of which layers hold a streamed prefill's
KV (LLMEngine.add_request's ``kv_watcher``; kv_transfer/feed.py listens).

On the host a layer is done when the model's code moves past it, so each
report is made then. On a GPU the layer's kernels are only queued by then:
an event is recorded after each layer, and a reporter thread waits for each
event in turn and reports that layer. The engine thread keeps queueing the
next layers meanwhile, and a report is only made once the layer's KV is in
device memory, so a push's copies need not wait for the rest of the pass
(``BlockSource.read_into(computed=True)``). Every report of a pass is made
before the pass returns.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator

import torch

Report = Callable[[int], None]  # layer index -> tell the watchers it is done


@contextlib.contextmanager
def layer_reports(model, report: Report, device: torch.device) -> Iterator[None]:
    """Hook ``report`` after each layer of ``model``'s passes in the block."""
    if device.type != "cuda":
        model.after_layer = report
        try:
            yield
        finally:
            model.after_layer = None
        return
    pending: queue.SimpleQueue = queue.SimpleQueue()
    failed: list[BaseException] = []

    def reporter() -> None:
        while (item := pending.get()) is not None:
            layer, event = item
            event.synchronize()
            if not failed:
                try:
                    report(layer)
                except BaseException as exc:  # raised again on the engine thread
                    failed.append(exc)

    def after_layer(layer: int) -> None:
        event = torch.cuda.Event()
        event.record()
        pending.put((layer, event))

    thread = threading.Thread(target=reporter, name="layer-reports", daemon=True)
    thread.start()
    model.after_layer = after_layer
    try:
        yield
    finally:
        model.after_layer = None
        pending.put(None)
        thread.join()
    if failed:
        raise failed[0]
