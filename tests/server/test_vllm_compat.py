"""What routers and schedulers written for vLLM see: vLLM's gauge names (the KV capacity in
blocks of a small hybrid cache too), the fields routers add to requests, KV events from a
live server, and a replica count beyond the cores refused (replicas themselves:
test_replicas.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.server.conftest import LiveServer, live_server


def test_vllm_gauges_and_cache_config_info(server: LiveServer) -> None:
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hello hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert c.get("/v1/models").json()["data"][0]["owned_by"] == "hybridkv"
        assert c.get("/health").status_code == 200
        assert "version" in c.get("/version").json()
    m = server.metrics()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total"):
        assert name in m, name
    assert m["vllm:prefix_cache_queries_total"] == m["hybridkv:prefix_cache_queries_total"] > 0
    [info] = [k for k in m if k.startswith("vllm:cache_config_info{")]
    assert "block_size=16" in info and "num_gpu_blocks=" in info


def test_cache_config_info_counts_the_blocks_of_a_small_hybrid_cache(
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """A Gemma 3 (sliding window + full attention) in 2 MiB at max_model_len 256 with the
    default 2,048-token step budget: a step's prefill chunks could widen the sliding
    windows by 129 blocks, more than the arena holds, but no request widens past its own
    256 tokens, so the capacity is what the arena holds of such requests (it said 0 blocks
    here). That many run at once, none preempted."""
    from concurrent.futures import ThreadPoolExecutor

    from hybridkv.models.demo import demo_shape, write_demo_model

    gemma = write_demo_model(tmp_path_factory.mktemp("gemma3") / "demo", "gemma3",
                             demo_shape("small"))
    options = {"kv_cache_memory": "2MiB", "max_model_len": 256, "max_num_batched_tokens": 2048}
    with live_server(gemma, engine=options) as live:
        [info] = [k for k in live.metrics() if k.startswith("vllm:cache_config_info{")]
        blocks = int(info.split("num_gpu_blocks=")[1].split(",")[0].rstrip("}"))
        plan = live.app.state.server.engine.engine.plan
        assert "num_kv_cache_groups=2" in info and plan.max_concurrency >= 2
        assert blocks == plan.capacity_tokens // 16 >= 2 * 256 // 16
        with live.client() as c:
            def full_request(i: int) -> int:
                body = {"prompt": [4 + i] * 248, "max_tokens": 8, "ignore_eos": True}
                return c.post("/v1/completions", json=body).status_code

            with ThreadPoolExecutor(2) as pool:
                assert list(pool.map(full_request, range(2))) == [200, 200]
        assert live.metrics()["vllm:num_preemptions_total"] == 0


def test_sglang_load_report_for_its_gateway(server: LiveServer) -> None:
    """`GET /v1/loads`, SGLang's load report: smg polls it to balance load under cache-aware
    routing (without it, a burst of new conversations can all go to one replica)."""
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "hello hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        report = c.get("/v1/loads", params={"include": "core,disagg,queues,memory"}).json()
    m = server.metrics()
    [info] = [k for k in m if k.startswith("vllm:cache_config_info{")]
    blocks = int(info.split("num_gpu_blocks=")[1].split(",")[0].rstrip("}"))
    assert report["dp_rank_count"] == 1 and report["timestamp"]
    [rank] = report["loads"]
    assert rank["dp_rank"] == 0 and rank["max_total_num_tokens"] == 16 * blocks > 0
    assert rank["num_running_reqs"] == rank["num_waiting_reqs"] == rank["num_total_reqs"] == 0
    assert rank["max_running_requests"] > 0
    assert rank["token_usage"] == m["vllm:kv_cache_usage_perc"]
    assert 0 <= rank["num_used_tokens"] <= rank["max_total_num_tokens"]
    assert 0 < rank["cache_hit_rate"] <= 1 or m["vllm:prefix_cache_hits_total"] == 0


def test_router_fields_are_accepted_and_meaning_changes_refused(server: LiveServer) -> None:
    # What vllm-router / SGLang's gateway add to a chat request by default.
    router = {"skip_special_tokens": True, "no_stop_trim": False, "include_reasoning": True,
              "separate_reasoning": True, "stream_reasoning": True,
              "return_hidden_states": False, "continue_final_message": False,
              "rid": "r-1"}
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with server.client() as c:
        assert c.post("/v1/chat/completions", json={**body, **router}).status_code == 200
        for field, value in (("no_stop_trim", True), ("lora_path", "adapter"),
                             ("skip_special_tokens", False)):
            r = c.post("/v1/chat/completions", json={**body, field: value})
            assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text
        r = c.post("/v1/chat/completions", json={**body, "bogus_field": 1})
        assert r.status_code == 400 and "bogus_field" in r.text


def test_top_k_minus_one_means_all_tokens(server: LiveServer) -> None:
    """SGLang-era routers send `top_k: -1`, vLLM's "no top-k": sampled with the same seed, it
    gives what top_k 0 (all tokens) gives; below -1 is still refused."""
    from hybridkv import SamplingParams

    assert SamplingParams(top_k=-1) == SamplingParams(top_k=0)
    body = {"prompt": "hello hello", "max_tokens": 8, "temperature": 1.0, "seed": 7}
    with server.client() as c:
        texts = []
        for top_k in (-1, 0, 1):
            r = c.post("/v1/completions", json={**body, "top_k": top_k})
            assert r.status_code == 200, r.text
            texts.append(r.json()["choices"][0]["text"])
        r = c.post("/v1/completions", json={**body, "top_k": -2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "top_k", r.text
    assert texts[0] == texts[1] != texts[2]  # top_k 1 (greedy) draws otherwise


def test_a_live_server_publishes_kv_events(demo_dir: Path) -> None:
    from tests.connector.vllm_events import BlockStored, Subscriber, free_port

    port = free_port()
    sub = Subscriber(port)
    with live_server(demo_dir, engine={"kv_events_endpoint": f"tcp://*:{port}"}) as live:
        time.sleep(0.5)  # the SUB socket connects to the bound endpoint
        with live.client() as c:
            r = c.post("/v1/completions", json={"prompt": [5] * 40, "max_tokens": 2})
            assert r.status_code == 200
        publisher = live.app.state.server.engine.engine.kv_events
        batches = sub.drain(publisher.next_seq - 1)
        assert "hybridkv:kv_events_dropped_total" in live.metrics()
    sub.close()
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert stored and stored[0].token_ids[:16] == [5] * 16 and stored[0].medium == "GPU"


def test_a_replica_count_beyond_the_cores_is_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "hybridkv.cli", "serve", "--data-parallel-size",
                        str(len(os.sched_getaffinity(0)) + 1), "--port", "8000"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "needs at least one core per replica" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
