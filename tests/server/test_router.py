"""Two `hybridkv serve` replicas behind a real router process (SGLang's gateway, `smg`, from
PyPI) on free loopback ports, driven with the official openai client: answers arrive through
the router, the fields routers add are accepted, both replicas serve, and the router's
cache-aware policy sends a repeated prompt back to the replica that holds its prefix (the
replica reports the reused tokens)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.connector.vllm_events import free_port
from tests.server.conftest import LiveServer

openai = pytest.importorskip("openai")

SMG = shutil.which("smg") or str(Path(sys.executable).with_name("smg"))
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


@pytest.fixture(scope="module")
def routed(demo_dir: Path) -> Iterator[tuple[str, list[LiveServer]]]:
    """(router URL, the replicas), the router in cache-aware mode."""
    if not Path(SMG).exists():
        pytest.skip("the smg router is not installed (pip install 'smg>=1.13,<2')")
    procs: list[subprocess.Popen[bytes]] = []
    env = {**os.environ, "HYBRIDKV_BLOCK_HASH_SEED": "router-test-seed",
           "OMP_NUM_THREADS": "1"}
    try:
        # Two replicas, as on two machines: one `hybridkv serve` each, one shared seed.
        ports = [free_port(), free_port()]
        for port in ports:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "hybridkv.cli", "serve", str(demo_dir), "--port",
                 str(port), "--kv-cache-memory", "8MiB", "--max-model-len", "256",
                 "--log-level", "warning"], env=env,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        replicas = [LiveServer(f"http://127.0.0.1:{p}", None) for p in ports]
        for replica, proc in zip(replicas, procs, strict=True):
            wait_for(f"{replica.url}/health", proc, "a replica")
        router_port = free_port()
        procs.append(subprocess.Popen(
            [SMG, "launch", "--host", "127.0.0.1", "--port", str(router_port),
             "--worker-urls", *[r.url for r in replicas], "--policy", "cache_aware",
             "--prometheus-port", str(free_port()), "--log-level", "warn",
             "--shutdown-grace-period-secs", "1"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        router = f"http://127.0.0.1:{router_port}"
        wait_for(f"{router}/v1/models", procs[-1], "the router", timeout=60)
        yield router, replicas
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
