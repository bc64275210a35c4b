"""The KV event publisher on real ZMQ sockets: vLLM's wire format, replay, drops, endpoints."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from hybridkv.connector.events import (  # noqa: E402
    END_SEQ,
    GroupInfo,
    KVEventPublisher,
    binds,
    check_endpoint,
    external_hash,
    offset_endpoint,
)
from hybridkv.kv.events import AllBlocksCleared, BlocksRemoved, BlocksStored  # noqa: E402
from tests.connector.vllm_events import (  # noqa: E402
    DECODER,
    BlockRemoved,
    BlockStored,
    Subscriber,
    free_port,
)
from tests.connector.vllm_events import AllBlocksCleared as WireCleared  # noqa: E402

GROUPS = [GroupInfo("full_attention", None), GroupInfo("sliding_window", 32)]
H1, H2 = bytes(range(16)), bytes(range(16, 32))


def publisher(port: int, **kwargs: object) -> KVEventPublisher:
    return KVEventPublisher(f"tcp://*:{port}", groups=GROUPS, **kwargs)  # type: ignore[arg-type]


def test_a_batch_decodes_with_vllm_structs_field_for_field() -> None:
    port = free_port()
    pub = publisher(port, data_parallel_rank=0)
    sub = Subscriber(port)
    try:
        time.sleep(0.3)  # the subscription reaches the PUB socket
        pub.publish([BlocksStored(1, (H1, H2), None, tuple(range(32)), 16),
                     BlocksRemoved(0, (H1,)), AllBlocksCleared()])
        [batch] = sub.drain(0)
    finally:
        pub.close()
        sub.close()
    assert batch.data_parallel_rank == 0 and batch.ts > 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        block_hashes=[external_hash(H1), external_hash(H2)], parent_block_hash=None,
        token_ids=list(range(32)), block_size=16, lora_id=None, medium="GPU",
        lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window",
        kv_cache_spec_sliding_window=32)
    assert external_hash(H1) == int.from_bytes(H1[8:], "big")
    assert removed == BlockRemoved(block_hashes=[external_hash(H1)], medium="GPU", group_idx=0)
    assert isinstance(cleared, WireCleared)


def test_replay_returns_the_missed_batches_then_the_end_marker() -> None:
    port, replay_port = free_port(), free_port()
    pub = publisher(port, replay_endpoint=f"tcp://*:{replay_port}")
    try:
        for i in range(5):  # nobody subscribed: all missed
            pub.publish([BlocksRemoved(0, (bytes([i]) * 16,))])
        deadline = time.monotonic() + 5
        while pub.num_published < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart([b"", (2).to_bytes(8, "big")])
        got = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == END_SEQ:
                assert payload == b""
                break
            got.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))
        dealer.close(linger=0)
    finally:
        pub.close()
    assert [seq for seq, _ in got] == [2, 3, 4]
    assert [b.events[0].block_hashes for _, b in got] == [
        [external_hash(bytes([i]) * 16)] for i in (2, 3, 4)]


def test_a_full_queue_drops_and_counts_and_never_blocks() -> None:
    pub = publisher(free_port(), max_queue=2)
    # Each batch takes the publisher thread milliseconds to encode; queuing takes
    # microseconds, so the queue fills.
    big = [BlocksStored(0, (H1,) * 1000, None, tuple(range(16_000)), 16)] * 20
    try:
        start = time.perf_counter()
        for _ in range(200):
            pub.publish(list(big))
        elapsed = time.perf_counter() - start
        assert pub.num_dropped > 0 and pub.num_dropped_events == 20 * pub.num_dropped
        assert elapsed < 0.5, f"publish blocked: {elapsed:.2f} s for 200 batches"
        deadline = time.monotonic() + 30
        while pub.num_published + pub.num_dropped < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.num_published + pub.num_dropped == 200
    finally:
        pub.close()


def test_a_loopback_endpoint_binds_for_subscribers_that_connect() -> None:
    """`tcp://127.0.0.1:PORT` (the interface outside checks use): the port is free, so the
    publisher binds it and a SUB socket connecting there receives the stream."""
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", groups=GROUPS)
    sub = Subscriber(port)
    try:
        time.sleep(0.3)  # the subscription reaches the PUB socket
        pub.publish([AllBlocksCleared()])
        [batch] = sub.drain(0)
        assert [type(e) for e in batch.events] == [WireCleared]
    finally:
        pub.close()
        sub.sub.close(0)


def test_endpoints_bind_or_connect_as_vllm_and_bad_ones_are_one_line() -> None:
    assert binds("tcp://*:5557") and binds("tcp://[::]:5557") and binds("ipc:///tmp/x")
    assert not binds("tcp://127.0.0.1:5557") and not binds("tcp://indexer:5557")
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    for bad in ("5557", "tcp://host", "tcp://host:0", "http://h:1", "tcp://*:99999", 7):
        with pytest.raises(ValueError, match="is not a ZMQ endpoint; accepted") as e:
            check_endpoint(bad)
        assert "\n" not in str(e.value)
    port = free_port()
    first = publisher(port)
    try:
        with pytest.raises(ValueError, match=f"cannot bind tcp://\\*:{port}"):
            publisher(port)
    finally:
        first.close()
