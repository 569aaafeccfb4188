"""The router's Admin service: resize the pools at run time, list workers.

Every call needs an admin key (router/auth.py checks it before a handler
runs). ``Scale`` checks its sizes against ``pools.max_workers`` before it
touches the backend; a scale whose new workers Ray does not place and start
within ``pools.placement_timeout_s`` fails with DEADLINE_EXCEEDED (the
router gave up waiting; the cause may be a cluster with no room as well as
a slow start), after the workers not started were removed.
"""

from __future__ import annotations

import grpc

from protos.tandem.v1 import admin_pb2 as pb
from protos.tandem.v1 import admin_pb2_grpc
from router.backend import ManagedPools, PlacementTimeout, ReconcilesIndex
from router.config import pool_size_error

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name
MAX_POOL_WORKERS = 64
"""Default of ``pools.max_workers``."""
MAX_DRAIN_TIMEOUT_S = 86_400.0


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(
        self, backend, default_drain_s: float, max_pool_workers: int = MAX_POOL_WORKERS
    ) -> None:
        self.backend = backend
        self.default_drain_s = default_drain_s
        self.max_pool_workers = max_pool_workers

    def _bad_field(self, request: pb.ScaleRequest) -> str | None:
        """What is wrong with a field of ``request``, naming it; None: nothing."""
        for name in ("prefill", "decode"):
            if request.HasField(name):
                why = pool_size_error(name, getattr(request, name), self.max_pool_workers)
                if why is not None:
                    return why
        drain = request.drain_timeout_s
        if request.HasField("drain_timeout_s") and not 0 <= drain <= MAX_DRAIN_TIMEOUT_S:
            return f"drain_timeout_s must be between 0 and {MAX_DRAIN_TIMEOUT_S:g}, got {drain}"
        return None

    async def Scale(self, request: pb.ScaleRequest, context) -> pb.ScaleReply:
        if not isinstance(self.backend, ManagedPools):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this backend cannot be resized")
        if (bad := self._bad_field(request)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, bad)
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        drain = (
            request.drain_timeout_s if request.HasField("drain_timeout_s") else self.default_drain_s
        )
        try:
            sizes = await self.backend.scale(prefill, decode, drain)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except PlacementTimeout as exc:
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        return pb.ScaleReply(prefill=sizes[0], decode=sizes[1])

    async def ReconcileIndex(
        self, request: pb.ReconcileIndexRequest, context
    ) -> pb.ReconcileIndexReply:
        if not isinstance(self.backend, ReconcilesIndex):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this backend has no block index")
        try:
            r = await self.backend.reconciler.run()
        except Exception as exc:  # no index yet, or Redis unreachable
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"reconcile failed: {exc}")
        return pb.ReconcileIndexReply(
            checked_workers=r.checked_workers,
            checked_entries=r.checked_entries,
            stale_entries=r.stale_entries,
            missing_entries=r.missing_entries,
            unreachable=list(r.unreachable),
            stale_by_worker=r.stale_by_worker,
        )

    async def Status(self, request: pb.StatusRequest, context) -> pb.StatusReply:
        if not isinstance(self.backend, ManagedPools):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this backend has no workers")
        return pb.StatusReply(
            workers=[
                pb.WorkerStatus(
                    name=r.name,
                    role=r.role,
                    in_flight=r.in_flight,
                    free_blocks=r.stats.free_blocks,
                    total_blocks=r.stats.total_blocks,
                )
                for r in await self.backend.worker_reports()
            ]
        )
