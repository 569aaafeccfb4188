"""transfer.port_range: a worker's internal listeners bind only ports of the
configured range (so that firewalls can be written), and a full range is an
error that names it."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket

import pytest
from pydantic import ValidationError

from kv_transfer import GrpcKVServer, TransferConfig
from net.security import ClusterSecurity
from net.sockets import listen
from router.config import ServeConfig
from tests.kv_harness import make_store
from worker.output_channel import OutputServer

pytestmark = pytest.mark.unit


def _port_range(size: int = 3) -> tuple[int, int]:
    low = random.randrange(20000, 60000)
    return low, low + size - 1


def _port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def test_listeners_take_the_free_ports_of_the_range_then_fail_naming_it():
    low, high = _port_range()
    taken: list[socket.socket] = []
    try:
        with pytest.raises(OSError, match=f"no free port in {low}-{high}"):
            for _ in range(4):
                taken.append(listen("127.0.0.1", (low, high)))
        ports = [s.getsockname()[1] for s in taken]
        assert len(set(ports)) == len(ports) <= 3
        assert all(low <= p <= high for p in ports)
    finally:
        for s in taken:
            s.close()


def test_a_workers_kv_server_data_channel_and_output_stream_bind_in_the_range():
    low, high = _port_range(16)
    config = TransferConfig(port_range=(low, high))
    outputs = OutputServer("127.0.0.1", config.security, lambda r, ids: None, ports=(low, high))

    async def kv_ports() -> list[int]:
        server = GrpcKVServer(make_store(4), config)
        await server.start()
        try:
            return [_port(server.address), server.data_port]
        finally:
            await server.stop(None)

    try:
        ports = [*asyncio.run(kv_ports()), _port(outputs.address)]
    finally:
        outputs.close()
    assert all(low <= p <= high for p in ports), ports


def test_a_kv_server_moves_past_a_taken_port():
    low, high = _port_range(4)
    with contextlib.closing(listen("127.0.0.1", (low, high))) as first:
        taken = first.getsockname()[1]
        config = TransferConfig(port_range=(low, high), data_channel=False)

        async def port() -> int:
            server = GrpcKVServer(make_store(4), config)
            await server.start()
            try:
                return _port(server.address)
            finally:
                await server.stop(None)

        got = asyncio.run(port())
    assert low <= got <= high and got != taken


@pytest.mark.parametrize("bad", [[80, 90], [5000, 4000], [60000, 70000]])
def test_the_config_refuses_a_range_outside_unprivileged_ports(bad):
    with pytest.raises(ValidationError, match="port_range"):
        ServeConfig(transfer={"port_range": bad})
    assert ServeConfig(transfer={"port_range": [7000, 7099]}).transfer_config().port_range == (
        7000,
        7099,
    )


def test_the_secret_of_a_range_config_is_still_the_deployments():
    config = ServeConfig(transfer={"port_range": [7000, 7099]})
    assert config.transfer_config().security == config.transfer_config().security
    assert isinstance(config.transfer_config().security, ClusterSecurity)
