"""A router's routes, admitted by KV room: the glue between prefix routing
(router/prefix_routing.py) and admission (router/admission.py).

A try asks ``admit`` for its route: a decode worker (and a prefill worker,
disaggregated) where the request's longest length fits the room that
worker reported, less what this router has promised it since. No worker has
room: the request waits in the admission queue until a report (``on_room``)
or a worker leaving routing wakes it. A request longer than the largest
decode worker's whole pool could ever hold fails at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from protos.tandem.v1 import worker_pb2
from router.admission import Admitted, Room, blocks_for, fits_room, longest_blocks
from router.backend import GenerateInput
from router.failover import NoWorkerAvailable
from router.messages import RequestError
from router.pool_manager import WorkerHandle
from router.prefix_routing import RoutePlan

if TYPE_CHECKING:
    from router.ray_backend import RayBackend


class RouteAdmission:
    def __init__(self, backend: RayBackend) -> None:
        self.backend = backend

    def on_room(self, worker: WorkerHandle, room: worker_pb2.KVRoom) -> None:
        """A decode worker reported its KV room: waiting requests may fit now."""
        self.backend.admission.report(worker.name, Room(room.free_blocks, room.total_blocks))

    async def admit(
        self, inp: GenerateInput, tokens: list[int], avoid: set[WorkerHandle]
    ) -> Admitted[RoutePlan]:
        """A route to a decode worker with KV room for the request, once one
        has it (router/admission.py); INVALID_ARGUMENT if none ever could."""
        backend = self.backend
        bs = backend.block_size
        rooms = backend.admission.rooms
        totals = [rooms.total(w.name) for w in backend.decode.workers]
        largest = max((t for t in totals if t is not None), default=None)
        if largest is not None and blocks_for(len(tokens) + 1, bs) > largest:
            raise RequestError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the request needs {blocks_for(len(tokens) + 1, bs)} KV blocks; the largest "
                f"decode worker holds {largest} (engine.kv_cache_memory_mb)",
            )
        longest = longest_blocks(
            len(inp.prompt_token_ids), inp.params.max_tokens, backend.max_model_len, bs
        )

        def fits(w: WorkerHandle, cached: int) -> bool:
            return fits_room(longest, rooms.total(w.name), rooms.free(w.name))[0]

        def route() -> Admitted[RoutePlan] | None:
            plan = self.plan(tokens, inp.cache_salt, avoid, fits)
            if plan is None:
                return None
            d = plan.decode
            blocks = fits_room(longest, rooms.total(d.name), rooms.free(d.name))[1]
            rooms.promise(d.name, blocks)
            return Admitted(plan, d.name, blocks)

        return await backend.admission.admit(route, inp.priority)

    def plan(
        self,
        tokens: list[int],
        salt: bytes,
        avoid: set[WorkerHandle],
        fits: Callable[[WorkerHandle, int], bool] | None = None,
    ) -> RoutePlan | None:
        """Route among workers in routing, preferring those no failed try used
        (but taking an avoided decode worker with room over waiting for a
        preferred one); None: the request ``fits`` on no decode worker now."""
        backend = self.backend
        assert backend.routing is not None, "backend not started"
        pools = [backend.prefill.workers, backend.decode.workers]
        if (not backend.colocated and not pools[0]) or not pools[1]:
            raise NoWorkerAvailable("no worker of a pool is in routing")
        prefill, decode = ([w for w in ws if w not in avoid] or ws for ws in pools)
        plan = backend.routing.plan(tokens, prefill, decode, backend.colocated, salt, fits)
        if plan is None and len(decode) < len(pools[1]):
            plan = backend.routing.plan(tokens, prefill, pools[1], backend.colocated, salt, fits)
        return plan
