"""The Redis tier against a real redis-server (tests/redis_server.py): the KVStore contract
against a dict, one round trip per batch, values checked on every read, the namespace, TTLs,
the shared hash seed, and the faults: down at start, killed, paused (timeouts), a full store
queue, maxmemory evictions. URL parsing and the entry header need no server."""

from __future__ import annotations

import random
import time

import pytest

from hybridkv.connector.offload.entry import encode_header, open_entry
from hybridkv.connector.offload.redis_tier import (
    PASSWORD_ENV,
    SEED_KEY,
    RedisTier,
    parse_remote_url,
    shared_hash_seed,
)
from tests.redis_server import RedisServer, free_port, running_redis

pytest.importorskip("redis")

FP = b"hkv1-layout-a"


@pytest.fixture
def redis_server(tmp_path):
    yield from running_redis(tmp_path)


def tier_for(url: str, fingerprint: bytes = FP, **options) -> RedisTier:
    return RedisTier(parse_remote_url(url), fingerprint, **{"timeout_s": 0.5, **options})


def wait_until(condition, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def value(i: int, size: int = 3000) -> bytearray:
    return bytearray(random.Random(i).randbytes(size))


# ---------------------------------------------------------------- no server needed


@pytest.mark.parametrize(("url", "host", "port", "db"), [
    ("redis://127.0.0.1:6379/0", "127.0.0.1", 6379, 0),
    ("redis://cache.internal", "cache.internal", 6379, 0),
    ("rediss://cache.internal:6380/3", "cache.internal", 6380, 3),
    ("redis://[::1]:7000/", "::1", 7000, 0),
])
def test_urls(url, host, port, db):
    spec = parse_remote_url(url, environ={})
    assert (spec.host, spec.port, spec.db, spec.password) == (host, port, db, None)
    assert spec.where.startswith(spec.scheme + "://")


def test_the_password_comes_from_the_url_or_the_environment_and_is_never_shown():
    spec = parse_remote_url("redis://app:s3cr%40t@h:1/2", environ={PASSWORD_ENV: "other"})
    assert (spec.username, spec.password) == ("app", "s3cr@t")
    assert "s3cr" not in repr(spec) and "s3cr" not in spec.where
    spec = parse_remote_url("redis://h:1/2", environ={PASSWORD_ENV: "from-env"})
    assert spec.password == "from-env" and "from-env" not in repr(spec)


@pytest.mark.parametrize(("url", "says"), [
    ("http://:pw@h:1/0", "scheme 'http'"),
    ("redis://:pw@h:1/zero", "database must be a number"),
    ("redis://:pw@:1/0", "names no host"),
    ("redis://:pw@h:99999/0", "not a valid URL"),
    ("redis://:pw@h:1/0?ttl=3", "no query"),
    (42, "must be a URL string"),
])
def test_bad_urls_are_one_line_and_never_echo_the_password(url, says):
    with pytest.raises(ValueError) as e:
        parse_remote_url(url, environ={})
    assert says in str(e.value) and "\n" not in str(e.value)
    assert "pw" not in str(e.value)


def test_entries_name_their_key_layout_length_and_checksum():
    """The header shared with the disk tier, on plain bytes: only the whole entry of this
    key under this layout opens."""
    payload = bytes(range(256)) * 4
    entry = encode_header(FP, b"key-1", payload) + payload
    assert bytes(open_entry(entry, b"key-1", FP)) == payload
    other = encode_header(FP, b"key-2", payload) + payload
    flipped = bytearray(entry)
    flipped[-1] ^= 1
    for bad in (other, entry[:-1], entry + b"x", bytes(flipped), b"garbage", b""):
        assert open_entry(bad, b"key-1", FP) is None
    assert open_entry(entry, b"key-1", b"hkv1-layout-b") is None


# ---------------------------------------------------------------- a real server


def test_the_tier_against_a_dict(redis_server):
    """Random puts, gets, deletes and exists: what the tier answers is what a dict holds
    (queued stores included: a get of a key still in the queue is served from it)."""
    tier = tier_for(redis_server.url)
    rng = random.Random(0)
    oracle: dict[bytes, bytes] = {}
    keys = [f"key-{i}".encode() for i in range(30)]
    for step in range(300):
        batch = rng.sample(keys, rng.randint(1, 6))
        op = rng.choice(["put", "get", "delete", "exists", "flush"])
        if op == "put":
            items = [(k, value(step * 100 + i, rng.randint(1, 5000)))
                     for i, k in enumerate(batch)]
            assert all(tier.put(items))
            oracle.update((k, bytes(v)) for k, v in items)
        elif op == "get":
            got = tier.get(batch)
            assert [None if g is None else bytes(g) for g in got] == \
                [oracle.get(k) for k in batch]
        elif op == "delete":
            tier.delete(batch)
            for k in batch:
                oracle.pop(k, None)
        elif op == "exists":
            assert tier.exists(batch) == [k in oracle for k in batch]
        else:
            assert tier.flush()
    s = tier.stats
    assert s.errors == s.connection_errors == s.dropped_stores == s.rejected == 0
    tier.close()


def test_one_round_trip_per_batch(redis_server):
    tier = tier_for(redis_server.url)
    keys = [f"k{i}".encode() for i in range(50)]
    tier.put([(k, value(i)) for i, k in enumerate(keys)])
    assert tier.flush()
    trips = []
    pipeline = tier._link.pipeline
    tier._link.pipeline = lambda build: trips.append(1) or pipeline(build)
    assert all(tier.exists(keys))
    assert all(v is not None for v in tier.get(keys))
    assert len(trips) == 2
    tier.close()


@pytest.mark.parametrize("how", ["garbage", "other_key", "truncated", "other_layout"])
def test_bad_values_are_misses_counted_and_deleted(how, redis_server):
    tier = tier_for(redis_server.url)
    tier.put([(b"a", value(1)), (b"b", value(2))])
    assert tier.flush()
    client = redis_server.client()
    name = tier.redis_key(b"a")
    good = client.get(name)
    bad = {"garbage": b"\x80\x04not a block",  # (a pickle opcode, for what it is worth)
           "other_key": client.get(tier.redis_key(b"b")),
           "truncated": good[:-10],
           "other_layout": tier_for(redis_server.url, b"hkv1-layout-b").encode(b"a", value(1)),
           }[how]
    client.set(name, bad)
    assert tier.get([b"a", b"b"])[0] is None
    assert tier.stats.rejected == 1
    assert client.exists(name) == 0  # removed: stored afresh by whoever computes it next
    assert bytes(tier.get([b"b"])[0]) == bytes(value(2))
    tier.close()


def test_namespaces_keep_layouts_apart_and_clear_only_its_own(redis_server):
    a, b = tier_for(redis_server.url, b"layout-a"), tier_for(redis_server.url, b"layout-b")
    a.put([(b"k", value(1))])
    b.put([(b"k", value(2))])
    assert a.flush() and b.flush()
    assert bytes(a.get([b"k"])[0]) == bytes(value(1))
    assert bytes(b.get([b"k"])[0]) == bytes(value(2))
    assert a.clear() == 1
    assert a.get([b"k"]) == [None] and b.get([b"k"])[0] is not None
    a.close()
    b.close()


def test_a_ttl_is_set_on_store_and_refreshed_by_a_hit(redis_server):
    tier = tier_for(redis_server.url, ttl_s=100)
    tier.put([(b"k", value(1))])
    assert tier.flush()
    client = redis_server.client()
    name = tier.redis_key(b"k")
    assert 0 < client.ttl(name) <= 100
    client.expire(name, 5)
    assert tier.get([b"k"])[0] is not None
    assert client.ttl(name) > 5
    tier.close()


def test_processes_agree_on_one_seed_and_a_restarted_redis_gets_it_back(
        redis_server):
    spec = parse_remote_url(redis_server.url)
    first = shared_hash_seed(spec, "seed-one", timeout_s=1)
    assert first == "seed-one"
    assert shared_hash_seed(spec, "seed-two", timeout_s=1) == "seed-one"
    tier = RedisTier(spec, FP, timeout_s=0.5, hash_seed=first)
    redis_server.kill()
    redis_server.restart()  # empty: the seed is gone
    tier.get([b"k"])  # a fault, or a quiet reconnect: either way ...
    assert wait_until(lambda: tier.connected)
    tier.put([(b"k", value(1))])  # ... its next stores write the seed back
    assert tier.flush()
    assert redis_server.client().get(SEED_KEY) == b"seed-one"
    assert shared_hash_seed(spec, "seed-three", timeout_s=1) == "seed-one"
    tier.close()


def test_a_process_whose_seed_is_not_the_stored_one_says_so(redis_server, caplog):
    spec = parse_remote_url(redis_server.url)
    assert shared_hash_seed(spec, "stored", timeout_s=1) == "stored"
    tier = RedisTier(spec, FP, timeout_s=0.5, hash_seed="mine")
    tier.put([(b"k", value(1))])
    assert tier.flush()
    assert sum("shares no blocks" in r.getMessage() for r in caplog.records) == 1
    tier.close()


def test_down_at_start_then_up(tmp_path, caplog):
    port = free_port()
    tier = tier_for(f"redis://127.0.0.1:{port}/0")
    assert not tier.connected
    assert tier.get([b"k"]) == [None]
    assert tier.exists([b"k"]) == [False]
    assert tier.put([(b"k", value(1))]) == [False]
    assert tier.stats.dropped_stores == 1 and tier.stats.connection_errors >= 1
    assert any("unreachable at start" in r.getMessage() for r in caplog.records)
    server = RedisServer.start(tmp_path / "redis", port=port)
    try:
        assert wait_until(lambda: tier.connected)
        assert tier.put([(b"k", value(1))]) == [True]
        assert tier.flush()
        assert bytes(tier.get([b"k"])[0]) == bytes(value(1))
    finally:
        tier.close()
        server.kill()


def test_killed_mid_run_then_restarted(redis_server, caplog):
    tier = tier_for(redis_server.url)
    tier.put([(b"k", value(1))])
    assert tier.flush()
    redis_server.kill()
    assert tier.get([b"k"]) == [None]
    assert not tier.connected
    assert tier.put([(b"j", value(2))]) == [False]
    redis_server.restart()
    assert wait_until(lambda: tier.connected)
    assert tier.get([b"k"]) == [None]  # nothing persisted: a miss, not an error
    tier.put([(b"k", value(1))])
    assert tier.flush()
    assert tier.get([b"k"])[0] is not None
    s = tier.stats
    assert s.connection_errors >= 1 and s.dropped_stores >= 1 and s.rejected == 0
    downs = [r for r in caplog.records if "is unreachable" in r.getMessage()]
    assert len(downs) == 1  # one warning per outage, however many calls it failed
    tier.close()


def test_a_server_that_stops_answering_times_out_and_comes_back(redis_server):
    tier = tier_for(redis_server.url, timeout_s=0.3)
    tier.put([(b"k", value(1))])
    assert tier.flush()
    redis_server.pause()
    try:
        assert tier.get([b"k"]) == [None]  # a timeout, then the breaker: misses at once
        assert not tier.connected
        assert tier.get([b"k"]) == [None]
    finally:
        redis_server.resume()
    assert wait_until(lambda: tier.connected)
    assert tier.get([b"k"])[0] is not None
    assert tier.stats.connection_errors >= 1
    tier.close()


def test_stores_to_a_slow_server_are_dropped_past_the_queue_cap(redis_server):
    """With Redis not answering (and a long timeout) the writer thread is stuck on one batch;
    puts keep returning at once, queue up to the byte cap, then are dropped and counted."""
    size = 10_000
    tier = tier_for(redis_server.url, timeout_s=30, queue_bytes=3 * size + 3000)
    redis_server.pause()
    try:
        tier.put([(b"first", value(0, size))])
        assert wait_until(lambda: not tier._link.queue)  # the writer took it, and waits
        started = time.monotonic()
        accepted = tier.put([(f"k{i}".encode(), value(i, size)) for i in range(10)])
        assert time.monotonic() - started < 5  # never waits on Redis (30 s timeout here)
        assert accepted == [True] * 3 + [False] * 7
        assert tier.stats.dropped_stores == 7
    finally:
        redis_server.resume()
    assert tier.flush()
    assert sum(v is not None for v in tier.get([f"k{i}".encode() for i in range(10)])) == 3
    tier.close()


def test_maxmemory_evictions_are_misses_never_errors(tmp_path):
    server = RedisServer.start(tmp_path / "redis", "--maxmemory", "4mb",
                               "--maxmemory-policy", "allkeys-lru")
    try:
        tier = tier_for(server.url)
        keys = [f"k{i}".encode() for i in range(200)]
        for start in range(0, 200, 20):  # 200 x 100 KB = 5x maxmemory
            tier.put([(k, value(i, 100_000)) for i, k in enumerate(keys[start:start + 20],
                                                                   start)])
            assert tier.flush()
        got = tier.get(keys)
        assert 0 < sum(g is not None for g in got) < len(keys)
        for i, g in enumerate(got):
            assert g is None or bytes(g) == bytes(value(i, 100_000))
        s = tier.stats
        assert s.errors == s.connection_errors == s.rejected == s.dropped_stores == 0
        tier.close()
    finally:
        server.kill()


def test_a_full_redis_that_cannot_evict_refuses_stores_without_errors(tmp_path, caplog):
    """maxmemory with noeviction answers OOM to every SET once full: counted as refused
    stores (a full tier), one warning, reads unaffected."""
    server = RedisServer.start(tmp_path / "redis", "--maxmemory-policy", "noeviction")
    try:
        client = server.client()
        client.config_set("maxmemory", client.info("memory")["used_memory"] + 1_000_000)
        tier = tier_for(server.url)
        for i in range(20):  # 20 x 100 KB, one at a time: the first few fit
            tier.put([(f"k{i}".encode(), value(i, 100_000))])
            assert tier.flush()
        got = tier.get([f"k{i}".encode() for i in range(20)])
        stored = sum(g is not None for g in got)
        assert 0 < stored < 20
        s = tier.stats
        assert s.refused == 20 - stored
        assert s.errors == s.connection_errors == s.rejected == 0
        assert sum("refused a command" in r.getMessage() for r in caplog.records) == 1
        assert tier.connected
        tier.close()
    finally:
        server.kill()


def test_a_password_from_the_environment_and_a_wrong_one(tmp_path, monkeypatch, caplog):
    server = RedisServer.start(tmp_path / "redis", "--requirepass", "pa55word")
    try:
        wrong = tier_for(f"redis://:nope-nope@127.0.0.1:{server.port}/0")
        assert not wrong.connected and wrong.get([b"k"]) == [None]
        wrong.close()
        assert not any("nope-nope" in r.getMessage() for r in caplog.records)
        monkeypatch.setenv(PASSWORD_ENV, "pa55word")
        right = tier_for(server.url)
        assert right.connected
        right.put([(b"k", value(1))])
        assert right.flush() and right.get([b"k"])[0] is not None
        right.close()
        assert not any("pa55word" in r.getMessage() for r in caplog.records)
    finally:
        server.kill()
