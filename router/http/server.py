"""Runs the HTTP front's app with uvicorn on the router's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from .app import FrontState, create_app

START_TIMEOUT_S = 30.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # `tandem serve` owns SIGINT/SIGTERM (drain first, then stop)


class HttpFront:
    """The OpenAI-compatible HTTP API and /metrics, beside the gRPC API."""

    def __init__(
        self,
        state: FrontState,
        host: str,
        port: int,
        tls_cert: Path | None = None,
        tls_key: Path | None = None,
    ) -> None:
        """With ``tls_cert`` and ``tls_key`` (PEM files) the port serves HTTPS only."""
        self.state = state
        self.host = host
        self.port = port
        """The bound port (the chosen one once started, when 0 was asked for)."""
        self.tls = (tls_cert, tls_key) if tls_cert is not None and tls_key is not None else None
        self._server: _Server | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    async def start(self) -> None:
        config = uvicorn.Config(
            create_app(self.state),
            host=self.host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=5,
            ssl_certfile=str(self.tls[0]) if self.tls else None,
            ssl_keyfile=str(self.tls[1]) if self.tls else None,
        )
        self._server = server = _Server(config)
        self._task = asyncio.create_task(_serve(server))
        async with asyncio.timeout(START_TIMEOUT_S):
            while not server.started:
                if self._task.done():  # e.g. the port is taken
                    self._task.result()  # raises what ended it
                    raise OSError(f"the HTTP front stopped while starting on {self.url}")
                await asyncio.sleep(0.01)
        self.port = server.servers[0].sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        server, task = self._server, self._task
        self._server = self._task = None
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), 10)
        except TimeoutError:
            server.force_exit = True
            with contextlib.suppress(Exception):
                await task
        except Exception:  # it failed to start; start() raised that already
            pass


async def _serve(server: _Server) -> None:
    try:
        await server.serve()
    except SystemExit:  # uvicorn exits when it cannot bind; never let that end the router
        raise OSError(
            f"the HTTP front could not start on {server.config.host}:{server.config.port}"
        ) from None
