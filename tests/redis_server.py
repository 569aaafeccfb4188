"""A throwaway redis-server for tests: own port, no persistence, stoppable.

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        server.stop()      # clients now see connection errors
        server.restart()   # same port, empty data

or, from a test, the ``redis_server`` fixture (import it into the module).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

REDIS_SERVER = "redis-server"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """PING over a raw socket (no redis client needed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith((b"+PONG", b"-NOAUTH"))  # up (and locked)
    except OSError:
        return False


class RedisServer:
    """One redis-server process; ``start()`` (or ``with``) launches it."""

    def __init__(
        self,
        port: int | None = None,
        *,
        host: str = "127.0.0.1",
        executable: str = REDIS_SERVER,
        startup_timeout_s: float = 10.0,
        password: str | None = None,
    ) -> None:
        """``password``: clients must AUTH with it (given on stdin, not argv)."""
        self.password = password
        if shutil.which(executable) is None:
            raise RuntimeError(f"{executable} is not installed")
        self.host = host
        self.port = port
        self._fixed_port = port is not None
        self._executable = executable
        self._startup_timeout_s = startup_timeout_s
        self._dir = Path(tempfile.mkdtemp(prefix="tandem-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> RedisServer:
        if self.running:
            return self
        attempts = 1 if self._fixed_port else 3
        for attempt in range(attempts):
            if not self._fixed_port:
                self.port = free_port(self.host)
            try:
                self._launch()
                self._fixed_port = True  # stop() then start() reuses the port
                return self
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        return self

    def _launch(self) -> None:
        assert self.port is not None
        log = self._dir / f"redis-{self.port}.log"
        # fmt: off
        argv = [
            self._executable,
            *(["-"] if self.password else []),  # config from stdin: requirepass
            "--port", str(self.port),
            "--bind", self.host,
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self._dir),
            "--logfile", str(log),
            "--daemonize", "no",
        ]
        # fmt: on
        stdin = subprocess.PIPE if self.password else subprocess.DEVNULL
        self._proc = subprocess.Popen(
            argv, stdin=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        if self.password and self._proc.stdin is not None:
            quoted = self.password.replace("\\", "\\\\").replace('"', '\\"')
            self._proc.stdin.write(f'requirepass "{quoted}"\n'.encode())
            self._proc.stdin.close()
        deadline = time.monotonic() + self._startup_timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                break
            if _ping(self.host, self.port):
                return
            time.sleep(0.02)
        self.stop()
        text = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{text}")

    def stop(self) -> None:
        """Stop the server (its data is lost: no persistence)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5.0)
        # the port is free once nothing answers there
        deadline = time.monotonic() + 5.0
        while self.port is not None and _ping(self.host, self.port, 0.1):
            if time.monotonic() > deadline:
                break
            time.sleep(0.02)

    def restart(self) -> RedisServer:
        """Stop and start again on the same port, empty."""
        self.stop()
        return self.start()

    def close(self) -> None:
        self.stop()
        with contextlib.suppress(OSError):
            shutil.rmtree(self._dir)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


@pytest.fixture
def redis_server():
    """A fresh redis-server per test; the test may stop and restart it."""
    with RedisServer() as server:
        yield server
