"""Many concurrent streams, some clients leaving mid-stream: the finished ones equal the
offline outputs, and afterwards nothing runs and the KV cache is free again; /metrics
counts what was served."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx

from tests.server.conftest import LiveServer, greedy, live_server

NUM_STREAMS = 64  # as many clients as the issue asks for; a third leave mid-stream
MAX_TOKENS = 24


async def one_stream(http: httpx.AsyncClient, prompt: list[int], leave_after: int | None
                     ) -> tuple[str, list[str]]:
    """(text, finish reasons) of a stream; leaving after `leave_after` chunks."""
    text, reasons, num_chunks = "", [], 0
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line.removeprefix("data: "))["choices"][0]
            text += choice["text"]
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
            num_chunks += 1
            if leave_after is not None and num_chunks >= leave_after:
                return text, ["left"]
    return text, reasons


async def run_all(url: str, prompts: list[list[int]]) -> list[tuple[str, list[str]]]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        return await asyncio.gather(*(
            one_stream(http, p, 3 if i % 3 == 0 else None) for i, p in enumerate(prompts)))


def test_concurrent_streams_with_disconnects(demo_dir: Any, offline: Any) -> None:
    from hybridkv import SamplingParams

    prompts = [[10 + i, 20 + i % 5, 30, 40 + i, 50, 60 + 2 * i] * (1 + i % 3)
               for i in range(NUM_STREAMS)]
    expected = offline.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                                        ignore_eos=True))
    with live_server(demo_dir) as live:
        results = asyncio.run(run_all(live.url, prompts))
        left = [i for i in range(NUM_STREAMS) if i % 3 == 0]
        for i, (text, reasons) in enumerate(results):
            if i in left:
                assert reasons == ["left"]
            else:
                assert reasons == ["length"] and text == expected[i].text, i
        metrics = settled(live, len(prompts))
        assert metrics["hybridkv:num_requests_running"] == 0
        assert metrics["hybridkv:num_requests_waiting"] == 0
        assert metrics["hybridkv:kv_cache_usage_perc"] == 0
        finished = NUM_STREAMS - len(left)
        assert metrics["hybridkv:request_success_total{finished_reason=length}"] == finished
        assert metrics["hybridkv:request_success_total{finished_reason=abort}"] == len(left)
        assert metrics["hybridkv:e2e_request_latency_seconds_count"] == NUM_STREAMS


def settled(live: LiveServer, num_requests: int) -> dict[str, float]:
    """/metrics once every request has ended (aborts land when the server notices)."""
    deadline = time.monotonic() + 10
    while True:
        metrics = live.metrics()
        ended = sum(v for k, v in metrics.items()
                    if k.startswith("hybridkv:request_success_total"))
        if (ended == num_requests and not metrics["hybridkv:num_requests_running"]) \
                or time.monotonic() > deadline:
            return metrics
        time.sleep(0.05)


def test_metrics_count_what_was_served(demo_dir: Any, offline: Any) -> None:
    prompts = ["the quick brown fox", "one, two, three", "a good engine keeps every byte"]
    expected = greedy(offline, prompts, 7)
    with live_server(demo_dir) as live, live.client() as http:
        usage = http.post("/v1/completions", json={"prompt": prompts, "max_tokens": 7,
                                                   "temperature": 0}).json()["usage"]
        chat = http.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5,
            "temperature": 0}).json()["usage"]
        metrics = settled(live, 4)
    assert usage["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in expected)
    assert metrics["hybridkv:prompt_tokens_total"] == \
        usage["prompt_tokens"] + chat["prompt_tokens"]
    assert metrics["hybridkv:generation_tokens_total"] == \
        usage["completion_tokens"] + chat["completion_tokens"] == 3 * 7 + 5
    assert metrics["hybridkv:request_success_total{finished_reason=length}"] == 4
    assert metrics["hybridkv:time_to_first_token_seconds_count"] == 4
    assert metrics["hybridkv:inter_token_latency_seconds_count"] == 3 * 6 + 4
    assert metrics["hybridkv:request_queue_time_seconds_count"] == 4
    assert metrics["hybridkv:prefix_cache_queries_total"] >= usage["prompt_tokens"]
    assert metrics["hybridkv:num_preemptions_total"] == 0
    assert "hybridkv:kv_cache_usage_perc_per_group{group=full}" in metrics


def test_offload_tiers_have_their_metrics_and_reset_moves_hits_to_the_cpu(
        demo_dir: Any) -> None:
    prompt = "the quick brown fox jumps over the lazy dog " * 8
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0}
    with live_server(demo_dir, engine={"kv_offload_cpu": "64MiB"}) as live, \
            live.client() as http:
        first = http.post("/v1/completions", json=body).json()
        # While a request runs the reset is refused; idle, it drops the device cache and
        # (store policy "evict") hands its blocks to the CPU tier.
        with http.stream("POST", "/v1/completions", json={
                "prompt": "x", "max_tokens": 300, "ignore_eos": True, "stream": True}):
            wait_for_running(live)
            busy = http.post("/reset_prefix_cache")
            assert busy.status_code == 409 and busy.json()["error"]["code"] == 409
        settled(live, 2)
        assert http.post("/reset_prefix_cache").status_code == 200
        # The next step hands the blocks over; let the tier writes land, so that the load
        # below reads the CPU tier (not the connector's queue of blocks still on their way).
        http.post("/v1/completions", json={"prompt": "y", "max_tokens": 1})
        wait_for_stores(live)
        again = http.post("/v1/completions", json=body).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached > 0
        metrics = settled(live, 3)
    assert metrics["hybridkv:kv_offload_hit_tokens_total{tier=cpu}"] == cached
    assert metrics["hybridkv:kv_offload_hits_total{tier=cpu}"] > 0
    assert metrics["hybridkv:kv_offload_bytes_stored_total{tier=cpu}"] > 0
    assert metrics["hybridkv:kv_offload_bytes_loaded_total{tier=cpu}"] > 0
    assert metrics["hybridkv:kv_offload_connector_blocks_loaded_total"] > 0


def wait_for_running(live: LiveServer) -> None:
    deadline = time.monotonic() + 30
    while live.metrics()["hybridkv:num_requests_running"] < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)


def wait_for_stores(live: LiveServer) -> None:
    """Until the CPU tier's stored bytes stop growing (and some were stored)."""
    key = "hybridkv:kv_offload_bytes_stored_total{tier=cpu}"
    deadline = time.monotonic() + 30
    last = -1.0
    while True:
        stored = live.metrics()[key]
        if stored > 0 and stored == last:
            return
        assert time.monotonic() < deadline
        last = stored
        time.sleep(0.2)
