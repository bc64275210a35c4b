"""vLLM's KV event structs (vllm/distributed/kv_events.py, the fields and struct options of
vLLM 0.28+), declared here with msgspec so the tests decode hybridkv's stream the way vLLM's
own decoder does: a missing required field or a wrong type fails the decode."""

from __future__ import annotations

import socket
import time
from typing import Any

import msgspec
import pytest

zmq = pytest.importorskip("zmq")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def free_port_pair() -> int:
    """A free port whose successor is free too (`--data-parallel-size 2` takes PORT and
    PORT + 1, for HTTP and for KV events alike)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


class Subscriber:
    """A SUB socket connected to a publisher that binds (tcp://*:PORT), decoding with
    vLLM's structs; `seqs` are the sequence numbers received, in order."""

    def __init__(self, port: int, topic: bytes = b"kv-events") -> None:
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(f"tcp://127.0.0.1:{port}")
        self.topic = topic
        self.seqs: list[int] = []
        self.batches: list[KVEventBatch] = []

    def drain(self, until_seq: int, timeout: float = 10.0) -> list[KVEventBatch]:
        """Every batch up to sequence number `until_seq` (inclusive) not yet received."""
        out = []
        deadline = time.monotonic() + timeout
        while (not self.seqs or self.seqs[-1] < until_seq) and time.monotonic() < deadline:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == self.topic
                self.seqs.append(int.from_bytes(seq, "big"))
                batch = DECODER.decode(payload)
                self.batches.append(batch)
                out.append(batch)
        assert self.seqs and self.seqs[-1] >= until_seq, \
            f"batches up to {until_seq} did not arrive (got {self.seqs[-3:]})"
        return out

    def close(self) -> None:
        self.sub.close(linger=0)
