"""Every host-memory holder outside the KV arena has a cap, stated in the startup log and on
/metrics beside what it holds (server/host_memory.py), on a live server: the CPU tier
holds offloaded blocks up to its budget, the Responses store keeps its last N responses,
the waiting queue is bounded by default."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

pytest.importorskip("torch")

from hybridkv.server.host_memory import DEFAULT_MAX_WAITING  # noqa: E402
from tests.server.conftest import live_server  # noqa: E402
from tests.server.test_concurrency import wait_for_stores  # noqa: E402


def test_holders_are_capped_and_shown(demo_dir: Path, caplog: pytest.LogCaptureFixture
                                      ) -> None:
    body = {"prompt": "the quick brown fox jumps over the lazy dog " * 8, "max_tokens": 2,
            "temperature": 0}
    with caplog.at_level(logging.INFO, logger="hybridkv.server.app"), \
            live_server(demo_dir, max_stored_responses=2,
                        engine={"kv_offload_cpu": "64MiB"}) as live, live.client() as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/reset_prefix_cache").status_code == 200  # blocks to the CPU tier
        http.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
        wait_for_stores(live)
        for i in range(4):  # twice the store's cap
            r = http.post("/v1/responses", json={"model": "test-model", "input": f"hi {i}",
                                                "max_output_tokens": 2, "store": True})
            assert r.status_code == 200, r.text
        metrics = live.metrics()

    def used(holder: str, unit: str) -> float:
        return metrics[f"hybridkv:host_cache_used{{holder={holder},unit={unit}}}"]

    def limit(holder: str, unit: str) -> float:
        return metrics[f"hybridkv:host_cache_limit{{holder={holder},unit={unit}}}"]

    assert limit("kv_offload_cpu", "bytes") == 64 * 2**20
    assert 0 < used("kv_offload_cpu", "bytes") <= limit("kv_offload_cpu", "bytes")
    assert (used("stored_responses", "responses"), limit("stored_responses", "responses")) \
        == (2, 2)
    assert limit("waiting_requests", "requests") == DEFAULT_MAX_WAITING
    assert used("waiting_requests", "requests") == 0

    [line] = [r.getMessage() for r in caplog.records
              if r.getMessage().startswith("host memory outside the KV arena")]
    assert "kv_offload_cpu <= 64.00 MiB (--kv-offload-cpu)" in line
    assert "stored_responses <= 2 responses (--max-stored-responses)" in line
    assert f"waiting_requests <= {DEFAULT_MAX_WAITING} requests (--max-waiting)" in line


def test_kv_events_queue_and_replay_buffer_are_shown(demo_dir: Path) -> None:
    pytest.importorskip("zmq")
    from tests.connector.vllm_events import free_port

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with live_server(demo_dir, engine={"kv_events_endpoint": endpoint}) as live, \
            live.client() as http:
        assert http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2}
                         ).status_code == 200
        metrics = live.metrics()
    assert metrics["hybridkv:host_cache_limit{holder=kv_events_queue,unit=batches}"] == 10_000
    assert metrics["hybridkv:host_cache_limit{holder=kv_events_replay,unit=steps}"] == 10_000
    assert 0 <= metrics["hybridkv:host_cache_used{holder=kv_events_queue,unit=batches}"] \
        <= 10_000
