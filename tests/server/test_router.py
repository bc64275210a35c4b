"""Two `hybridkv serve` replicas behind a real router process (SGLang's gateway, `smg`, from
PyPI) on free loopback ports, driven with the official openai client: answers arrive through
the router, the fields routers add are accepted, both replicas serve, and the router's
cache-aware policy sends a repeated prompt back to the replica that holds its prefix (the
replica reports the reused tokens); the outputs are token for token those of one server alone.
With a real redis-server as the replicas' shared tier, one replica is SIGKILLed while requests
stream: the router routes around it, no request hangs, and the survivor loads the dead
replica's prefixes from Redis."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.connector.vllm_events import free_port, free_port_pair
from tests.redis_server import RedisServer, running_redis
from tests.server.conftest import LiveServer

openai = pytest.importorskip("openai")

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
VLLM_ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
# The fields SGLang's gateway / vllm-router put into requests (their defaults).
ROUTER_FIELDS = {"skip_special_tokens": True, "no_stop_trim": False, "include_reasoning": True,
                 "separate_reasoning": True, "stream_reasoning": True,
                 "return_hidden_states": False}


def wait_for(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"{what} exited: {proc.stdout.read().decode()[-2000:]}"  # type: ignore[union-attr]
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline, f"{what} did not come up at {url}"
        time.sleep(0.3)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


REPLICA_ENV = {**os.environ, "HYBRIDKV_BLOCK_HASH_SEED": "router-test-seed",
               "OMP_NUM_THREADS": "1"}


def start_replicas(demo_dir: Path, procs: list[subprocess.Popen[bytes]], *extra: str,
                   n: int = 2) -> list[LiveServer]:
    """n replicas, as on n machines: one `hybridkv serve` each, one shared seed (appended to
    procs, in order, as they start)."""
    ports = [free_port() for _ in range(n)]
    started = []
    for port in ports:
        started.append(subprocess.Popen(
            [sys.executable, "-m", "hybridkv.cli", "serve", str(demo_dir), "--port", str(port),
             "--kv-cache-memory", "8MiB", "--max-model-len", "256", "--log-level", "warning",
             *extra], env=REPLICA_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        procs.append(started[-1])
    replicas = [LiveServer(f"http://127.0.0.1:{p}", None) for p in ports]
    for replica, proc in zip(replicas, started, strict=True):
        wait_for(f"{replica.url}/health", proc, "a replica")
    return replicas


def start_router(replicas: list[LiveServer], procs: list[subprocess.Popen[bytes]],
                 *extra: str) -> str:
    port = free_port()
    procs.append(subprocess.Popen(
        [SMG, "launch", "--host", "127.0.0.1", "--port", str(port),
         "--worker-urls", *[r.url for r in replicas], "--policy", "cache_aware",
         "--prometheus-port", str(free_port()), "--log-level", "warn",
         "--shutdown-grace-period-secs", "1", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    router = f"http://127.0.0.1:{port}"
    wait_for(f"{router}/v1/models", procs[-1], "the router", timeout=60)
    return router


def need_smg() -> None:
    if not Path(SMG).exists():
        pytest.skip("the smg router is not installed (pip install 'smg>=1.13,<2')")


@pytest.fixture(scope="module")
def routed(demo_dir: Path) -> Iterator[tuple[str, list[LiveServer]]]:
    """(router URL, the replicas), the router in cache-aware mode."""
    need_smg()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        replicas = start_replicas(demo_dir, procs)
        yield start_router(replicas, procs), replicas
    finally:
        for proc in reversed(procs):
            stop(proc)


def prompt_tokens(replica: LiveServer) -> float:
    return replica.metrics().get("hybridkv:prompt_tokens_total", 0.0)


def test_chat_and_completions_through_the_router(routed: tuple[str, list[LiveServer]]
                                                ) -> None:
    router, _ = routed
    assert httpx.get(f"{router}/health", timeout=10).status_code == 200  # k8s readiness
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", timeout=60)
    [model] = [m.id for m in client.models.list().data]
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
        temperature=0, extra_body=ROUTER_FIELDS)
    assert chat.choices[0].message.content and chat.usage is not None
    assert chat.usage.completion_tokens == 4
    text = client.completions.create(model=model, prompt="Once upon a time", max_tokens=3,
                                     temperature=0, extra_body={"no_stop_trim": False})
    assert text.choices[0].text and text.usage is not None and text.usage.completion_tokens == 3
    streamed = "".join(
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4,
            temperature=0, stream=True, extra_body=ROUTER_FIELDS)
        if chunk.choices)
    assert streamed == chat.choices[0].message.content
    # A field that would change the meaning is still refused, through the router too.
    with pytest.raises(openai.BadRequestError, match="stop strings kept in the output"):
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            extra_body={"no_stop_trim": True})


def test_cache_aware_routing_sends_a_repeat_where_its_prefix_is(
        routed: tuple[str, list[LiveServer]]) -> None:
    router, replicas = routed
    client = openai.OpenAI(base_url=f"{router}/v1", api_key="unused", timeout=60)
    [model] = [m.id for m in client.models.list().data]
    before = [prompt_tokens(r) for r in replicas]
    topics = ["apples", "rivers", "engines", "violins", "glaciers", "lanterns"]
    prompts = [f"{t}: " + " ".join(f"{t[:3]}{i}" for i in range(40)) for t in topics]
    cached = []
    for prompt in prompts:  # each prompt twice in a row
        for _ in range(2):
            out = client.completions.create(model=model, prompt=prompt, max_tokens=2,
                                            temperature=0)
            assert out.usage is not None and out.usage.prompt_tokens > 32
            details = out.usage.prompt_tokens_details
            cached.append(details.cached_tokens if details is not None else 0)
    # Every first sending is new to both replicas, every repeat reuses its prefix: the
    # router sent it to the replica that served it first (round robin would alternate).
    assert cached[0::2] == [0] * len(prompts)
    assert all(c >= 32 for c in cached[1::2]), cached
    # New prefixes were spread over both replicas.
    after = [prompt_tokens(r) for r in replicas]
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_bench_conversations_through_the_router_reports_each_replica(
        routed: tuple[str, list[LiveServer]], capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from hybridkv.cli import main

    router, replicas = routed
    assert main(["bench", "serve", "--workload", "conversations", "--url", router,
                 "--replica-urls", *[r.url for r in replicas], "--users", "2", "--turns", "2",
                 "--system-tokens", "60", "--answer-tokens", "4", "--json"]) == 0
    [run] = json.loads(capsys.readouterr().out)["runs"]
    assert run["completed"] == 4 and run["failed"] == 0  # the model named from /v1/models
    by_replica = run["replicas"]
    assert [r["url"] for r in by_replica] == [r.url for r in replicas]
    # Every request reached a replica, and the turns after the first reused their prefix
    # there (the router kept each conversation where its prefix is).
    assert sum(r["requests"] for r in by_replica) == 4
    assert sum(r["prompt_tokens"] for r in by_replica) == run["total_input_tokens"]
    assert sum(r["hit_tokens"] for r in by_replica) >= 60
    assert all(r["ttft_mean_ms"] > 0 for r in by_replica if r["requests"])


def greedy_answer(url: str, model: str, prompt: str, max_tokens: int) -> tuple[str, list[str]]:
    """(text, the tokens one by one) of a greedy completion."""
    reply = httpx.post(f"{url}/v1/completions", timeout=60, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "ignore_eos": True, "logprobs": 1})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    return choice["text"], choice["logprobs"]["tokens"]


def test_outputs_through_the_router_are_those_of_one_server_alone(
        routed: tuple[str, list[LiveServer]], server: LiveServer) -> None:
    router, _ = routed
    [model] = [m["id"] for m in httpx.get(f"{router}/v1/models", timeout=10).json()["data"]]
    prompts = ["The weather today", "Counting: one two three",
               "lanterns: " + " ".join(f"lan{i}" for i in range(30))]
    for prompt in prompts:  # twice: the second one is a prefix hit on its replica
        alone = greedy_answer(server.url, "test-model", prompt, 12)
        for _ in range(2):
            assert greedy_answer(router, model, prompt, 12) == alone, prompt


def stream_through(router: str, model: str, prompt: str, max_tokens: int,
                   first_chunk: threading.Event, deadline_s: float = 30) -> dict[str, Any]:
    """One streamed completion: {"outcome": "ok"} when it ended with a finish reason and
    [DONE], else {"outcome": "error", "error": what the client saw} - and how long it took."""
    import json

    start = time.monotonic()
    result: dict[str, Any] = {"outcome": "error", "error": "the stream ended early"}
    finish, done, tokens = None, False, 0
    try:
        with httpx.stream("POST", f"{router}/v1/completions", timeout=deadline_s, json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True}) as response:
            if response.status_code != 200:
                result["error"] = f"HTTP {response.status_code}: {response.read()[:300]!r}"
            else:
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        result["error"] = f"error event: {chunk['error']}"
                        continue
                    first_chunk.set()
                    for choice in chunk.get("choices", []):
                        tokens += 1
                        finish = choice.get("finish_reason") or finish
                if done and finish is not None:
                    result = {"outcome": "ok", "finish_reason": finish, "chunks": tokens}
    except httpx.HTTPError as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = time.monotonic() - start
    return result


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    yield from running_redis(tmp_path)


def remote_hit_tokens(replica: LiveServer) -> float:
    return replica.metrics().get("hybridkv:kv_offload_hit_tokens_total{tier=remote}", 0.0)


def test_a_killed_replica_is_routed_around_and_its_prefixes_come_from_redis(
        demo_dir: Path, redis_server: RedisServer) -> None:
    need_smg()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        # "fill": a block reaches Redis as soon as a step has computed it.
        replicas = start_replicas(demo_dir, procs, "--kv-remote", redis_server.url,
                                  "--kv-offload-store", "fill")
        router = start_router(replicas, procs, "--health-check-interval-secs", "1",
                              "--health-failure-threshold", "1")
        doomed, survivor = replicas
        doomed_proc = procs[0]
        [model] = [m["id"] for m in httpx.get(f"{router}/v1/models", timeout=10).json()["data"]]
        # Prefixes only the doomed replica ever computes: sent to it directly.
        primed = [f"{t}: " + " ".join(f"{t[:3]}{i}" for i in range(25))
                  for t in ("apples", "rivers", "engines")]
        for prompt in primed:
            greedy_answer(doomed.url, model, prompt, 2)
        assert redis_server.client().dbsize() > 0

        # Requests stream through the router (spread over both replicas); the doomed one is
        # SIGKILLed once all of them are under way.
        results: list[dict[str, Any]] = []
        started = [threading.Event() for _ in range(8)]
        threads = [threading.Thread(target=lambda i=i: results.append(stream_through(
            router, model, f"stream {i}: " + " ".join(f"s{i}w{j}" for j in range(12)), 180,
            started[i])), daemon=True) for i in range(8)]
        for thread in threads:
            thread.start()
        assert all(event.wait(30) for event in started), "a stream never started"
        running = doomed.metrics().get("vllm:num_requests_running", 0.0)
        assert running > 0, "the router sent the doomed replica no stream"
        doomed_proc.send_signal(signal.SIGKILL)
        # More requests right after the kill, before the router's health check noticed.
        late = [threading.Thread(target=lambda i=i: results.append(stream_through(
            router, model, f"late {i}: " + " ".join(f"l{i}w{j}" for j in range(12)), 20,
            threading.Event())), daemon=True) for i in range(4)]
        for thread in late:
            thread.start()
        for thread in threads + late:
            thread.join(40)
            assert not thread.is_alive(), "a request hung after the replica was killed"
        assert len(results) == 12
        errors = [r for r in results if r["outcome"] != "ok"]
        # The streams cut by the kill end with the router's error event at once; every other
        # request, the late ones included, finishes on the survivor.
        assert all(r["error"] and r["seconds"] < 30 for r in errors), errors
        assert 1 <= len(errors) <= running, results

        # The router has stopped sending to the dead replica: everything succeeds, on the
        # survivor, which loads the dead replica's prefixes from Redis.
        before = remote_hit_tokens(survivor)
        time.sleep(2)
        for prompt in primed:
            reply = httpx.post(f"{router}/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert reply.status_code == 200, reply.text
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32
        assert remote_hit_tokens(survivor) - before >= 3 * 32
    finally:
        for proc in reversed(procs):
            stop(proc)


def block_size(replica: LiveServer) -> int:
    """The block size a replica's KV events use (vllm:cache_config_info's label)."""
    [info] = [k for k in replica.metrics() if k.startswith("vllm:cache_config_info{")]
    return int(info.split("block_size=")[1].split(",")[0].rstrip("}"))


def test_vllm_routers_kv_aware_policy_routes_by_hybridkvs_kv_events(demo_dir: Path) -> None:
    """vllm-router's `kv_aware` policy knows nothing of a replica's cache but what its KV
    events say (it recomputes block keys from the events' token ids, and tokenizes requests
    through each replica's /tokenize): every prompt lands where its blocks are. The replicas
    come from one `--data-parallel-size 2`, as docs/deployment.md runs them: the router files
    a batch's blocks under the rank the batch names, so the second replica's must say 0."""
    if not Path(VLLM_ROUTER).exists():
        pytest.skip("vllm-router is not installed (pip install 'vllm-router>=0.1.17,<0.2')")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("--data-parallel-size 2 needs 2 cores")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        http_port, event_port = free_port_pair(), free_port_pair()
        # vllm-router subscribes with the empty topic; replica i binds event_port + i.
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "hybridkv.cli", "serve", str(demo_dir),
             "--port", str(http_port), "--data-parallel-size", "2",
             "--kv-cache-memory", "8MiB", "--max-model-len", "256", "--log-level", "warning",
             "--kv-events-endpoint", f"tcp://127.0.0.1:{event_port}", "--kv-events-topic", ""],
            env=REPLICA_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        replicas = [LiveServer(f"http://127.0.0.1:{http_port + i}", None) for i in range(2)]
        for replica in replicas:
            wait_for(f"{replica.url}/health", procs[-1], "a replica")
        [model] = [m["id"] for m in
                   httpx.get(f"{replicas[0].url}/v1/models", timeout=10).json()["data"]]
        port, metrics_port = free_port(), free_port()
        sources = [arg for i, r in enumerate(replicas)
                   for arg in ("--kv-event-source", f"{r.url}=tcp://127.0.0.1:{event_port + i}")]
        procs.append(subprocess.Popen(
            [VLLM_ROUTER, "--host", "127.0.0.1", "--port", str(port),
             "--worker-urls", *[r.url for r in replicas], "--policy", "kv_aware", *sources,
             "--kv-event-model", model, "--kv-event-block-size", str(block_size(replicas[0])),
             "--prometheus-port", str(metrics_port)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{port}"
        wait_for(f"{router}/v1/models", procs[-1], "vllm-router", timeout=60)
        time.sleep(1)  # the router's subscribers connect after it serves

        topics = ["apples", "rivers", "engines", "violins", "glaciers", "lanterns"]
        prompts = [f"{t}: " + " ".join(f"{t[:3]}{i}" for i in range(40)) for t in topics]
        # Each prefix computed on one replica, sent to it directly (the router sees only
        # the events), alternating: a router without them would send each prompt to the
        # same replica and miss half.
        for i, prompt in enumerate(prompts):
            greedy_answer(replicas[i % 2].url, model, prompt, 2)
        time.sleep(1.0)  # the steps' events reach the router (it shows no count of them)
        cached = []
        for prompt in prompts:
            reply = httpx.post(f"{router}/v1/completions", timeout=60, json={
                "model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
            assert reply.status_code == 200, reply.text
            cached.append(reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        assert all(c >= 32 for c in cached), cached
        # The router found those blocks in the index it built from the events.
        counters = LiveServer(f"http://127.0.0.1:{metrics_port}", None).metrics()
        hits = counters.get("vllm_router_kv_placement_lookups_total{result=hit}", 0.0)
        assert hits >= len(prompts), counters
    finally:
        for proc in reversed(procs):
            stop(proc)
