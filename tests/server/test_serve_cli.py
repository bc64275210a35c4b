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


def test_serve_without_a_model_serves_the_demo_and_stops_on_sigterm(tmp_path: Path) -> None:
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}
    process = subprocess.Popen(
        [sys.executable, "-m", "hybridkv.cli", "serve", "--port", str(port),
         "--max-model-len", "256", "--kv-cache-memory", "8MiB"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[0]
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
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
