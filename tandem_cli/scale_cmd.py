"""`tandem scale`: resize a running deployment's pools (drains removed workers).

Sends the admin key in ``$TANDEM_ADMIN_KEY`` (never a flag: it would show in ``ps``)."""

from __future__ import annotations

import argparse
import asyncio
import sys

import grpc

from protos.tandem.v1 import admin_pb2, admin_pb2_grpc
from router.auth import CLIENT_ADMIN_KEY_ENV, client_metadata
from router.client import open_channel
from tandem_cli.tls_ca import add_tls_ca, read_tls_ca


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scale", help="resize the prefill and decode pools of a running router")
    p.add_argument("--prefill", type=int, metavar="N", help="prefill workers wanted")
    p.add_argument("--decode", type=int, metavar="M", help="decode (or colocated) workers wanted")
    p.add_argument("--target", default="127.0.0.1:50051", metavar="HOST:PORT")
    p.add_argument(
        "--drain-timeout", type=float, metavar="S", help="longest a removed worker may drain"
    )
    add_tls_ca(p)


def command(args: argparse.Namespace) -> int:
    if args.prefill is None and args.decode is None:
        print("tandem: error: give --prefill and/or --decode", file=sys.stderr)
        return 2
    request = admin_pb2.ScaleRequest(prefill=args.prefill, decode=args.decode)
    if args.drain_timeout is not None:
        request.drain_timeout_s = args.drain_timeout
    try:
        reply = asyncio.run(_scale(args.target, request, read_tls_ca(args.tls_ca)))
    except grpc.aio.AioRpcError as e:
        print(f"tandem: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    print(f"tandem: prefill {reply.prefill}, decode {reply.decode}")
    return 0


async def _scale(
    target: str, request: admin_pb2.ScaleRequest, ca: bytes | None
) -> admin_pb2.ScaleReply:
    limits = [("grpc.max_receive_message_length", 4 << 20)]  # replies are small
    async with open_channel(target, ca, limits) as channel:
        metadata = client_metadata(env_name=CLIENT_ADMIN_KEY_ENV)
        return await admin_pb2_grpc.AdminStub(channel).Scale(request, metadata=metadata)
