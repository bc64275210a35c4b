"""`hybridkv serve` as a user runs it: a process on a free port, stopped by SIGTERM."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(tmp_path: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "hybridkv.cli", "serve", "--port", str(port),
         "--max-model-len", "256", "--kv-cache-memory", "8MiB", *flags],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if process.poll() is not None:
            raise AssertionError(process.communicate()[0])
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError("the server did not come up")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.1)


def test_serve_without_a_model_serves_the_demo_and_stops_on_sigterm(tmp_path: Path) -> None:
    process, url = start_server(tmp_path)
    try:
        models = httpx.get(f"{url}/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["hybridkv-demo"]
        chat = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hello"}], "max_completion_tokens": 3})
        assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] == 3
    finally:
        process.send_signal(signal.SIGTERM)
        out = process.communicate(timeout=30)[0]
    assert process.returncode == 0, out
    assert "text is noise" in out and "Traceback" not in out


def test_sigterm_with_a_stream_in_flight_ends_it_and_exits_cleanly(tmp_path: Path) -> None:
    """Shutdown stops accepting, gives in-flight requests --shutdown-timeout to finish, then
    ends them; the process exits 0 and no client is left hanging."""
    process, url = start_server(tmp_path, "--shutdown-timeout", "1")
    body = {"prompt": "the", "max_tokens": 250, "ignore_eos": True, "stream": True}
    chunks = 0
    try:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as stream:
            lines = stream.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    chunks += 1
                    if chunks == 3:
                        break
            signalled = time.monotonic()
            process.send_signal(signal.SIGTERM)
            try:
                for _ in lines:  # the rest, until the server ends the stream
                    pass
            except httpx.TransportError:
                pass  # cut off after the timeout: also an end, not a hang
            ended = time.monotonic() - signalled
        out = process.communicate(timeout=30)[0]
    finally:
        if process.poll() is None:
            process.kill()
    assert ended < 15
    assert process.returncode == 0, out
    assert "Traceback" not in out
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=1)
