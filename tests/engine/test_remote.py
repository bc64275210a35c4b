"""The remote (Redis) KV tier end to end, against a real redis-server: a second engine process
reuses the first one's 2,048-token prefix (an attention hybrid, a Mamba hybrid, a KV-sharing
model), and every fault of the store - killed mid-batch, down at start, not answering,
damaged values, evicting under maxmemory - ends in the tokens the engine computes without any
cache, with the tier back by itself once Redis is.

Round 2 of most tests runs after `reset_prefix_cache()`, so its hits can only come from a
tier. Prompt lengths are never multiples of 16 (see tests/engine/test_offload.py).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("redis")

from hybridkv import LLM, SamplingParams  # noqa: E402
from hybridkv.cli import build_parser, main, offload_options  # noqa: E402
from tests.engine.test_offload import (  # noqa: E402
    make_prompts,
    model_builder,
    reference_runner,
    tier_tokens,
    tokens_of,
)
from tests.redis_server import RedisServer, free_port, running_redis  # noqa: E402

GREEDY = SamplingParams(max_tokens=6)
COMMON = dict(dtype="float32", device="cpu", max_model_len=256, kv_cache_memory="4MiB")
LONG = dict(COMMON, max_model_len=2112, kv_cache_memory="24MiB")
LONG_PROMPT = 2048


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """`model(name)`: the tiny model's directory (positions for the 2,048-token prompts)."""
    return model_builder(tmp_path_factory, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def reference(model):
    """`reference(name, prompts, **options)`: the greedy tokens without any cache."""
    return reference_runner(model, COMMON)


def remote_llm(model_dir: Path, url: str, **options) -> LLM:
    return LLM(str(model_dir), **{**COMMON, "kv_remote": url, "kv_offload_store": "fill",
                                  "kv_remote_timeout_s": 0.5, **options})


def flush(llm: LLM) -> None:
    llm.engine.runner.connector.flush()


def remote_tier(llm: LLM):
    chain = llm.engine.connector.chain
    return chain.tiers[chain.names.index("remote")]


def remote_stats(llm: LLM) -> dict:
    return next(t for t in llm.offload_stats()["tiers"] if t["tier"] == "remote")


def wait_connected(llm: LLM, seconds: float = 30.0) -> None:
    """The back-off between probes is at most 10 s; a loaded machine adds to it."""
    tier = remote_tier(llm)
    deadline = time.monotonic() + seconds
    while not tier.connected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.connected, "the remote tier did not come back"


def filled(llm: LLM, prompts: list[list[int]]) -> list:
    """Round 1 (stored as filled), then the device cache dropped: round 2 must use Redis."""
    outputs = llm.generate(prompts, GREEDY)
    flush(llm)
    assert llm.reset_prefix_cache()
    return outputs


# ---------------------------------------------------------------- two processes

SECOND_PROCESS = """
import json, sys
from hybridkv import LLM, SamplingParams
model_dir, url, options, prompts = sys.argv[1:5]
llm = LLM(model_dir, kv_remote=url, **json.loads(options))
outputs = llm.generate(json.loads(prompts), SamplingParams(max_tokens=6))
print(json.dumps({"tokens": [o.token_ids for o in outputs],
                  "remote": [o.cached_tokens_by_tier["remote"] for o in outputs],
                  "errors": [o.error for o in outputs if o.error],
                  "stats": llm.offload_stats()["tiers"][-1]}))
"""


@pytest.mark.parametrize("arch", ["gemma3", "nemotron_h", "gemma3n"])
def test_a_second_process_reuses_the_first_ones_long_prefix(arch, model, reference,
                                                            redis_server, tmp_path):
    """Process 1 computes a 2,048-token prompt and shares its blocks as they fill; process 2,
    knowing nothing of it (no shared seed configured: both take the one kept in Redis),
    gets that prompt plus a follow-up from Redis, with the same tokens."""
    prompt = make_prompts(20, (LONG_PROMPT,))[0]
    follow_up = prompt + make_prompts(21, (7,))[0]
    first = remote_llm(model(arch), redis_server.url, **LONG)
    tokens_of(first.generate([prompt], GREEDY))
    first.close()
    script = tmp_path / "second.py"
    script.write_text(SECOND_PROCESS)
    options = dict(LONG)
    done = subprocess.run(
        [sys.executable, str(script), str(model(arch)), redis_server.url, json.dumps(options),
         json.dumps([follow_up])],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["errors"] == []
    assert result["tokens"] == reference(arch, [follow_up], **LONG)
    # The whole prompt of process 1 (a block boundary, where a state model checkpointed).
    assert result["remote"] == [LONG_PROMPT]
    assert result["stats"]["hits"] > 0 and result["stats"]["rejected"] == 0


@pytest.mark.parametrize("arch", ["llama4_text", "qwen3_next", "jamba"])
def test_every_group_kind_round_trips_through_redis(arch, model, reference, redis_server):
    """Chunked local attention, Gated DeltaNet state, Mamba1 state (the two-process test
    covers sliding, Mamba2 and KV sharing): round 2 is served from Redis alone."""
    prompts = make_prompts(19)
    llm = remote_llm(model(arch), redis_server.url)
    filled(llm, prompts)
    second = llm.generate(prompts, GREEDY)
    assert tokens_of(second) == reference(arch, prompts)
    assert tier_tokens(second, "remote") > 0 and tier_tokens(second, "device") == 0
    assert llm.offload_stats()["blocks_failed"] == 0


# ---------------------------------------------------------------- faults


def test_redis_killed_mid_batch_then_restarted(model, reference, redis_server, caplog):
    arch = "nemotron_h"
    prompts = make_prompts(22, (41, 75, 100, 57, 90, 66))
    expected = reference(arch, prompts)
    llm = remote_llm(model(arch), redis_server.url)
    filled(llm, prompts)
    engine = llm.engine
    worker = engine.runner.connector
    gate = threading.Event()
    fetch = worker._fetch

    def gated_fetch(*args):  # the first read from Redis waits for the kill
        assert gate.wait(timeout=30), "the test never opened the gate"
        return fetch(*args)

    worker._fetch = gated_fetch
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, GREEDY)
    outputs = {}
    for _ in range(20):  # until loads from Redis are queued ...
        for out in engine.step():
            outputs[out.request_id] = out
        if engine.scheduler.loading:
            break
    assert engine.scheduler.loading
    redis_server.kill()  # ... and the store goes away under them
    gate.set()
    with caplog.at_level(logging.WARNING):
        for _ in range(500):
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = out
            if not engine.has_unfinished:
                break
    assert tokens_of([outputs[f"r{i}"] for i in range(len(prompts))]) == expected
    stats = remote_stats(llm)
    assert stats["connection_errors"] >= 1
    assert llm.offload_stats()["blocks_failed"] > 0  # the loads cut off: recomputed
    assert sum("is unreachable" in r.getMessage() for r in caplog.records) == 1
    # Back by itself: new prompts are stored again and served from Redis.
    redis_server.restart()
    wait_connected(llm)
    again = make_prompts(23)
    filled(llm, again)
    second = llm.generate(again, GREEDY)
    assert tokens_of(second) == reference(arch, again)
    assert tier_tokens(second, "remote") > 0


def test_down_at_start_the_engine_runs_and_the_tier_comes_back(model, reference, tmp_path,
                                                               caplog):
    arch = "gemma3"
    port = free_port()
    with caplog.at_level(logging.WARNING):
        llm = remote_llm(model(arch), f"redis://127.0.0.1:{port}/0")
    assert any("does not answer" in r.getMessage() for r in caplog.records)
    prompts = make_prompts(24)
    first = filled(llm, prompts)
    assert tokens_of(first) == reference(arch, prompts)
    assert tokens_of(llm.generate(prompts, GREEDY)) == reference(arch, prompts)
    assert remote_stats(llm)["dropped_stores"] > 0
    server = RedisServer.start(tmp_path / "redis", port=port)
    try:
        wait_connected(llm)
        again = make_prompts(25)
        filled(llm, again)
        second = llm.generate(again, GREEDY)
        assert tokens_of(second) == reference(arch, again)
        assert tier_tokens(second, "remote") > 0
        llm.close()
    finally:
        server.kill()


def test_a_redis_that_stops_answering_costs_a_timeout_not_a_hang(model, reference,
                                                                 redis_server):
    arch = "llama"
    prompts = make_prompts(26)
    llm = remote_llm(model(arch), redis_server.url, kv_remote_timeout_s=0.3)
    filled(llm, prompts)
    redis_server.pause()
    try:
        outputs = llm.generate(prompts, GREEDY)  # lookups time out once, then the breaker
        new = llm.generate(make_prompts(27), GREEDY)  # its stores are dropped
    finally:
        redis_server.resume()
    assert tokens_of(outputs) == reference(arch, prompts)
    assert tokens_of(new) == reference(arch, make_prompts(27))
    assert tier_tokens(outputs, "remote") == 0
    assert remote_stats(llm)["connection_errors"] >= 1
    wait_connected(llm)


@pytest.mark.parametrize("how", ["garbage", "other_key", "truncated"])
def test_damaged_values_are_rejected_counted_and_recomputed(how, model, reference,
                                                            redis_server):
    arch = "gemma3"
    prompts = make_prompts(28)
    llm = remote_llm(model(arch), redis_server.url)
    filled(llm, prompts)
    client = redis_server.client()
    names = sorted(client.scan_iter(match=remote_tier(llm).namespace + b"*"))
    assert names
    values = [client.get(n) for n in names]
    for name, data, other in zip(names, values, values[1:] + values[:1], strict=True):
        client.set(name, {"garbage": os.urandom(len(data)), "other_key": other,
                          "truncated": data[:-9]}[how])
    outputs = llm.generate(prompts, GREEDY)
    assert tokens_of(outputs) == reference(arch, prompts)
    assert tier_tokens(outputs, "remote") == 0
    stats = llm.offload_stats()
    remote = remote_stats(llm)
    assert remote["rejected"] > 0 and remote["hits"] == 0
    assert stats["blocks_failed"] == remote["rejected"]
    # Rejected values were deleted; round 2 stored its blocks afresh, and round 3 hits.
    flush(llm)
    assert llm.reset_prefix_cache()
    third = llm.generate(prompts, GREEDY)
    assert tokens_of(third) == reference(arch, prompts)
    assert tier_tokens(third, "remote") > 0


def test_a_small_maxmemory_with_allkeys_lru_gives_misses_never_errors(model, reference,
                                                                      tmp_path):
    """Redis keeps about 64 blocks of the ~90 the prompts fill; small steps keep each batch
    of stores well under that (a pipeline's query buffer counts against maxmemory too)."""
    arch = "llama"
    options = dict(max_num_batched_tokens=128)
    prompts = make_prompts(29, (41, 75, 100, 57, 90, 66, 83) * 3)
    server = RedisServer.start(tmp_path / "redis", "--maxmemory-policy", "allkeys-lru")
    try:
        llm = remote_llm(model(arch), server.url, **options)
        block = max(g.block_bytes for g in llm.engine.plan.config.groups)
        client = server.client()
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 64 * block)
        filled(llm, prompts)
        outputs = llm.generate(prompts, GREEDY)
        assert tokens_of(outputs) == reference(arch, prompts, **options)
        assert client.info("stats")["evicted_keys"] > 0
        assert client.dbsize() < llm.offload_stats()["blocks_stored"]
        remote = remote_stats(llm)
        assert remote["errors"] == remote["connection_errors"] == remote["rejected"] == 0
        assert remote_tier(llm).connected
        llm.close()
    finally:
        server.kill()


# ---------------------------------------------------------------- tier order


def test_cpu_then_remote_a_remote_hit_is_promoted_into_the_cpu_tier(model, reference,
                                                                    redis_server):
    arch = "qwen3_swa"
    prompts = make_prompts(30)
    llm = remote_llm(model(arch), redis_server.url, kv_offload_cpu="64MiB")
    assert llm.engine.connector.chain.names == ("cpu", "remote")
    llm.generate(prompts, GREEDY)
    flush(llm)
    llm.engine.connector.chain.clear(0)  # only Redis has them now
    assert llm.reset_prefix_cache()
    second = llm.generate(prompts, GREEDY)
    assert tokens_of(second) == reference(arch, prompts)
    assert tier_tokens(second, "remote") > 0 and tier_tokens(second, "cpu") == 0
    cpu, remote = llm.offload_stats()["tiers"]
    assert remote["hits"] > 0 and cpu["promotions"] == remote["hits"]
    assert llm.reset_prefix_cache()
    third = llm.generate(prompts, GREEDY)
    assert tokens_of(third) == reference(arch, prompts)
    assert tier_tokens(third, "cpu") > 0 and tier_tokens(third, "remote") == 0


def test_replicas_with_a_configured_seed_share_and_others_do_not(model, reference,
                                                                 redis_server):
    """A configured block_hash_seed is used as is (and never written to Redis); a process
    with another seed hashes its blocks into another namespace and finds none."""
    arch = "llama"
    prompts = make_prompts(31)
    first = remote_llm(model(arch), redis_server.url, block_hash_seed="fleet-secret")
    first.generate(prompts, GREEDY)
    first.close()
    assert redis_server.client().get(b"hybridkv:block-hash-seed") is None
    same = remote_llm(model(arch), redis_server.url, block_hash_seed="fleet-secret")
    other = remote_llm(model(arch), redis_server.url, block_hash_seed="another")
    assert tier_tokens(same.generate(prompts, GREEDY), "remote") > 0
    outputs = other.generate(prompts, GREEDY)
    assert tier_tokens(outputs, "remote") == 0
    assert tokens_of(outputs) == reference(arch, prompts)


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(("options", "says"), [
    (dict(kv_remote="http://:hunter2@localhost:6379/0"), "kv_remote"),
    (dict(kv_remote="redis://:hunter2@localhost:6379/x"), "kv_remote"),
    (dict(kv_remote="redis://localhost", kv_remote_ttl_s=0), "kv_remote_ttl_s"),
    (dict(kv_remote="redis://localhost", kv_remote_timeout_s=0), "kv_remote_timeout_s"),
    (dict(kv_remote="redis://localhost", kv_remote_queue="lots"), "kv_remote_queue"),
    (dict(kv_remote="redis://localhost", enable_prefix_caching=False),
     "enable_prefix_caching"),
], ids=["scheme", "db", "ttl", "timeout", "queue", "no_prefix_caching"])
def test_bad_remote_configuration_is_one_line(options, says, model):
    with pytest.raises(ValueError) as e:
        LLM(str(model("llama")), **{**COMMON, **options})
    assert says in str(e.value) and "\n" not in str(e.value)
    assert "hunter2" not in str(e.value)


@pytest.mark.parametrize("seed", [None, "fleet-secret"], ids=["seed_exchange", "own_seed"])
def test_a_database_the_server_lacks_is_one_line(seed, model, redis_server, capsys):
    """A live Redis with the default 16 databases: /99 is refused at start with the URL and
    what is accepted, not a ResponseError traceback (from the seed exchange, or from the
    tier's first PING when the seed is configured)."""
    url = redis_server.url.removesuffix("/0") + "/99"
    with pytest.raises(ValueError) as e:
        remote_llm(model("llama"), url, block_hash_seed=seed)
    message = str(e.value)
    assert "\n" not in message
    assert f"kv_remote {url}: the server has no database 99" in message
    assert "accepted: a database number from 0 to 15 on this server" in message
    capsys.readouterr()
    argv = ["generate", str(model("llama")), "--prompt", "hi", "--dtype", "float32",
            "--kv-cache-memory", "4MiB", "--kv-remote", url]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"error: kv_remote {url}: the server has no database 99" in err


def test_the_cli_flags_reach_the_engine_options():
    args = build_parser().parse_args(["generate", "m", "--prompt", "x", "--kv-remote",
                                      "redis://127.0.0.1:6379/1", "--kv-remote-ttl", "600",
                                      "--kv-remote-timeout", "0.25"])
    options = offload_options(args)
    assert (options["kv_remote"], options["kv_remote_ttl_s"],
            options["kv_remote_timeout_s"]) == ("redis://127.0.0.1:6379/1", 600, 0.25)
