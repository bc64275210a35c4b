"""A real `redis-server` for tests: on a free loopback port, no persistence, stopped after.

    server = RedisServer.start(tmp_path)  # or a fixture over `running_redis`
    server.url                            # redis://127.0.0.1:PORT/0
    server.kill(); server.restart()       # the same port, empty (nothing is persisted)
    server.pause(); server.resume()       # SIGSTOP / SIGCONT: a server that stops answering

Tests skip (with the install command) when redis-server is not installed; `.ci/run` and the
README's test command install it first, so CI runs them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

INSTALL = "apt-get install -y redis-server"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    def __init__(self, port: int, workdir: Path, extra: tuple[str, ...] = ()) -> None:
        self.port = port
        self.workdir = workdir
        self.extra = extra
        self.process: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, workdir: Path, *extra: str, port: int | None = None) -> RedisServer:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.skip(f"redis-server is not installed ({INSTALL})")
        server = cls(port or free_port(), workdir, extra)
        server.restart()
        return server

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        """Start (again) on the same port, empty."""
        assert self.process is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", str(self.workdir),
             "--protected-mode", "no", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited at start ({self.process.returncode})")
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", self.port), timeout=0.2) as s:
                s.sendall(b"PING\r\n")
                if s.recv(16).startswith((b"+PONG", b"-NOAUTH")):  # up (with a password)
                    return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: gone at once, with everything it held."""
        if self.process is not None:
            self.resume()
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def pause(self) -> None:
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.process is not None:
            os.kill(self.process.pid, signal.SIGCONT)

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)


def running_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """The body of a `redis_server` fixture: a fresh server per test, killed after."""
    server = RedisServer.start(tmp_path / "redis")
    try:
        yield server
    finally:
        server.kill()
