"""The router's Admin service: resize the pools at run time, list workers."""

from __future__ import annotations

import grpc

from protos.tandem.v1 import admin_pb2 as pb
from protos.tandem.v1 import admin_pb2_grpc
from router.backend import ManagedPools

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Admin"].full_name


class AdminService(admin_pb2_grpc.AdminServicer):
    def __init__(self, backend, default_drain_s: float) -> None:
        self.backend = backend
        self.default_drain_s = default_drain_s

    async def Scale(self, request: pb.ScaleRequest, context) -> pb.ScaleReply:
        if not isinstance(self.backend, ManagedPools):
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "this backend cannot be resized")
        prefill = request.prefill if request.HasField("prefill") else None
        decode = request.decode if request.HasField("decode") else None
        drain = (
            request.drain_timeout_s if request.HasField("drain_timeout_s") else self.default_drain_s
        )
        try:
            sizes = await self.backend.scale(prefill, decode, drain)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return pb.ScaleReply(prefill=sizes[0], decode=sizes[1])

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
