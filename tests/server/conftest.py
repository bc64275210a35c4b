"""Live servers on free loopback ports, each in a thread of the test process with its own
event loop, and the offline `LLM` the server's outputs are compared with."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("torch")

ENGINE_OPTIONS: dict[str, Any] = dict(max_model_len=512, kv_cache_memory="16MiB",
                                      max_num_seqs=16, max_num_batched_tokens=256)


@dataclass
class LiveServer:
    url: str
    app: Any

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=30, **kwargs)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, e.g. 'hybridkv:x_total{a=b}'."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        samples = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())
                                  if k != "model_name")
                samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return samples


@contextmanager
def live_server(model_dir: Path, *, name: str = "test-model", **config: Any
                ) -> Iterator[LiveServer]:
    import uvicorn

    from hybridkv.config import EngineConfig
    from hybridkv.engine.engine import LLMEngine
    from hybridkv.server.app import ServerConfig, build_app

    options = {**ENGINE_OPTIONS, **config.pop("engine", {})}
    engine = LLMEngine.from_model_dir(str(model_dir), EngineConfig.from_kwargs(options))
    app = build_app(engine, ServerConfig(model_name=name, model_dir=str(model_dir), **config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", app)
    finally:
        server.should_exit = True
        thread.join(15)
        assert not thread.is_alive(), "the server did not stop"


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small demo Llama with a tokenizer and a chat template."""
    from hybridkv.models.demo import demo_shape, write_demo_model

    return write_demo_model(tmp_path_factory.mktemp("server") / "demo", "llama",
                            demo_shape("small"))


@pytest.fixture(scope="session")
def offline(demo_dir: Path) -> Any:
    from hybridkv import LLM

    return LLM(str(demo_dir), **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def server(demo_dir: Path) -> Iterator[LiveServer]:
    with live_server(demo_dir) as live:
        yield live


def greedy(offline: Any, prompts: list[Any], max_tokens: int) -> list[Any]:
    from hybridkv import SamplingParams

    return offline.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
